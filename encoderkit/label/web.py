"""``encoderkit audit review --web``: the review sheet in a browser, for several reviewers at once.

The same sheet as the terminal review. No answer is lost between reviewers: each answer rewrites the sheet
atomically under a lock (a thread lock and ``flock``), a row shown to a tab is leased to it, and an answer to a
row that changed since it was shown (its text's sha256, the label shown) is refused with 409, nothing written.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.exceptions import HTTPException

from encoderkit.label.sheet import read_sheet, write_sheet
from encoderkit.label.web_pages import card_html, done_html, review_page
from encoderkit.web.auth import token_ok


class Conflict(Exception):
    """The answer cannot be written as asked (409): the row changed, was answered, or is held by another tab."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class InvalidAnswer(ValueError):
    """A gold label outside the label set (422)."""


def text_sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class _Lease:
    tab: str
    who: str
    until: float


@dataclass
class _Tab:
    who: str = "reviewer"
    skipped: set[str] = field(default_factory=set)  # sheet `row` values this tab skipped
    answered: list[tuple[str, str]] = field(default_factory=list)  # (row, gold) in order, for undo


class ReviewDesk:
    """The shared state of a web review over one sheet: leases, per-tab skips and undo stacks.

    Every method re-reads the sheet under the lock, so an answer written by another tab, another
    process or a hand edit is seen; the returned dicts are what the page shows."""

    def __init__(self, sheet: str | Path, labels: list[str], lease_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.labels, self.lease_s, self.clock = Path(sheet), list(labels), lease_s, clock
        self.lock = threading.Lock()
        self.leases: dict[str, _Lease] = {}  # sheet `row` value -> holder
        self.tabs: dict[str, _Tab] = {}
        self.answered_by: dict[str, str] = {}  # sheet `row` value -> who answered it here (for 409 messages)

    # -- locking and lookup -------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[dict[str, str]]]:
        with self.lock, open(self.path.parent / f".{self.path.name}.lock", "a") as lock_file:
            with contextlib.suppress(ImportError):
                import fcntl  # noqa: PLC0415 - POSIX only: where it is missing, the ImportError is suppressed

                fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
            yield read_sheet(self.path)

    def _tab(self, tab: str, who: str | None) -> _Tab:
        t = self.tabs.setdefault(tab, _Tab())
        if who:
            t.who = who
        return t

    def _find(self, rows: list[dict[str, str]], row: str) -> tuple[int, dict[str, str]]:
        for i, r in enumerate(rows):
            if r["row"] == row:
                return i, r
        raise Conflict("sheet_changed", f"{self.path}: row {row} is no longer in the sheet (edited by hand?); "
                                        "nothing was written; the page shows the next row")

    def _check_shown(self, rows: list[dict[str, str]], row: str, sha: str, label: str) -> tuple[int, dict[str, str]]:
        i, r = self._find(rows, row)
        where = f"{self.path}:{i + 2}"
        if text_sha(r["text"]) != sha:
            raise Conflict("sheet_changed", f"{where}: the text of row {row} is not the text shown (the sheet was "
                                            "edited by hand while the page was open); nothing was written; "
                                            "the page shows the row as it is now")
        if r["label"] != label:
            raise Conflict("sheet_changed", f"{where}: row {row}'s label is now {r['label']!r}, not the {label!r} "
                                            "shown (edited by hand?); nothing was written")
        if r["gold"]:
            by = self.answered_by.get(row)
            raise Conflict("already_answered", f"{where}: row {row} was already answered {r['gold']!r}"
                                               f"{f' by {by}' if by else ''} (another tab, or in the sheet); "
                                               "nothing was written")
        return i, r

    def _holder(self, row: str, tab: str) -> _Lease | None:
        """The live lease on ``row`` held by another tab, if any."""
        lease = self.leases.get(row)
        if lease is None or lease.tab == tab or lease.until <= self.clock():
            return None
        return lease

    def _release(self, tab: str) -> None:
        for row in [r for r, lease in self.leases.items() if lease.tab == tab]:
            del self.leases[row]

    # -- what the page shows ------------------------------------------------------------------
    def _view(self, rows: list[dict[str, str]], tab: str, message: str = "") -> dict[str, Any]:
        """Hand ``tab`` its row: the one it holds if still open, else the first open row nobody else holds."""
        t = self.tabs[tab]
        now = self.clock()
        self.leases = {r: lease for r, lease in self.leases.items() if lease.until > now}
        open_rows = [r for r in rows if not r["gold"]]
        held = [r for r in open_rows if (lease := self.leases.get(r["row"])) and lease.tab == tab]
        pick = held[0] if held else next((r for r in open_rows if r["row"] not in t.skipped
                                          and self._holder(r["row"], tab) is None), None)
        self._release(tab)
        filled = [r for r in rows if r["gold"]]
        agree = sum(1 for r in filled if r["gold"] == r["label"])
        progress = {"filled": len(filled), "total": len(rows), "agree": agree,
                    "accuracy": round(agree / len(filled), 4) if filled else None}
        view: dict[str, Any] = {"progress": progress, "message": message, "labels": self.labels, "done": pick is None}
        if pick is None:
            others = sum(1 for r in open_rows if self._holder(r["row"], tab) is not None)
            skipped = sum(1 for r in open_rows if r["row"] in t.skipped)
            view["html"] = done_html(progress, skipped, others)
            return view
        self.leases[pick["row"]] = _Lease(tab, t.who, now + self.lease_s)
        view.update(row=pick["row"], text_sha=text_sha(pick["text"]), label=pick["label"],
                    html=card_html(pick, self.labels, progress, self.path.name))
        return view

    def next(self, tab: str, who: str | None = None) -> dict[str, Any]:
        with self._locked() as rows:
            self._tab(tab, who)
            return self._view(rows, tab)

    def answer(self, tab: str, row: str, sha: str, label: str, gold: str, who: str | None = None) -> dict[str, Any]:
        """Write ``gold`` into ``row`` (shown with text ``sha`` and ``label``); :class:`Conflict` if it changed."""
        if gold not in self.labels:
            raise InvalidAnswer(f"gold {gold!r} is not one of the labels ({', '.join(self.labels)})")
        with self._locked() as rows:
            t = self._tab(tab, who)
            i, r = self._check_shown(rows, row, sha, label)
            holder = self._holder(row, tab)
            if holder is not None:
                raise Conflict("held", f"{self.path}:{i + 2}: row {row} is held by {holder.who} (this tab's hold "
                                       f"ran out after {self.lease_s:g} s); nothing was written")
            r["gold"] = gold
            write_sheet(self.path, rows)
            t.answered.append((row, gold))
            self.answered_by[row] = t.who
            self.leases.pop(row, None)
            return self._view(rows, tab, f"saved row {row}: {gold}")

    def skip(self, tab: str, row: str, who: str | None = None) -> dict[str, Any]:
        with self._locked() as rows:
            t = self._tab(tab, who)
            t.skipped.add(row)
            if (lease := self.leases.get(row)) and lease.tab == tab:
                del self.leases[row]
            return self._view(rows, tab, f"row {row} skipped")

    def revisit(self, tab: str, who: str | None = None) -> dict[str, Any]:
        """Forget this tab's skips (the rows it skipped are offered again)."""
        with self._locked() as rows:
            self._tab(tab, who).skipped.clear()
            return self._view(rows, tab)

    def undo(self, tab: str, who: str | None = None) -> dict[str, Any]:
        """Empty the gold of this tab's last answer and show that row again (held by this tab)."""
        with self._locked() as rows:
            t = self._tab(tab, who)
            if not t.answered:
                return self._view(rows, tab, "nothing to undo")
            row, gold = t.answered[-1]
            i, r = self._find(rows, row)
            if r["gold"] != gold:
                raise Conflict("sheet_changed", f"{self.path}:{i + 2}: row {row}'s gold is now {r['gold']!r}, not "
                                                f"the {gold!r} this tab wrote (changed since); not undone")
            t.answered.pop()
            r["gold"] = ""
            write_sheet(self.path, rows)
            self.answered_by.pop(row, None)
            t.skipped.discard(row)
            self._release(tab)
            self.leases[row] = _Lease(tab, t.who, self.clock() + self.lease_s)
            return self._view(rows, tab, f"row {row}: answer {gold!r} undone")


class Tab(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tab: StrictStr = Field(..., min_length=8, max_length=64, description="The page's random tab id.")
    who: StrictStr | None = Field(None, max_length=64, description="The reviewer's name, for messages.")


class Skip(Tab):
    row: StrictStr = Field(..., max_length=32)


class Answer(Skip):
    text_sha: StrictStr = Field(..., max_length=64, description="sha256 of the text shown.")
    label: StrictStr = Field(..., max_length=1000, description="The labeller's label shown.")
    gold: StrictStr = Field(..., max_length=1000)


class _Unauthorized(Exception):
    pass


def create_review_app(desk: ReviewDesk, token: str | None = None) -> FastAPI:
    """The FastAPI app: ``GET /`` the page (no data in it), ``/api/*`` the desk (bearer token when ``token``)."""
    secret = token.encode() if token else None

    def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)

    def require_token(request: Request) -> None:
        if secret is not None and not token_ok(dict(request.scope.get("headers") or []), secret):
            raise _Unauthorized

    app = FastAPI(title="encoderkit audit review", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        return error(401, "unauthorized", "missing or wrong bearer token (header 'Authorization: Bearer <token>')",
                     {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(Conflict)
    async def conflict(request: Request, exc: Conflict) -> JSONResponse:
        return error(409, exc.code, str(exc))

    @app.exception_handler(InvalidAnswer)
    async def bad_value(request: Request, exc: InvalidAnswer) -> JSONResponse:
        return error(422, "invalid_request", str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                 for e in exc.errors()[:5]]
        return error(422, "invalid_request", "; ".join(parts))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, "http_error", str(exc.detail))

    guarded = [Depends(require_token)]

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(review_page(token_required=secret is not None))

    # plain `def` routes run in the threadpool: the desk's lock serialises them
    @app.post("/api/next", dependencies=guarded)
    def next_row(body: Tab) -> dict[str, Any]:
        return desk.next(body.tab, body.who)

    @app.post("/api/answer", dependencies=guarded)
    def answer(body: Answer) -> dict[str, Any]:
        return desk.answer(body.tab, body.row, body.text_sha, body.label, body.gold, body.who)

    @app.post("/api/skip", dependencies=guarded)
    def skip(body: Skip) -> dict[str, Any]:
        return desk.skip(body.tab, body.row, body.who)

    @app.post("/api/undo", dependencies=guarded)
    def undo(body: Tab) -> dict[str, Any]:
        return desk.undo(body.tab, body.who)

    @app.post("/api/revisit", dependencies=guarded)
    def revisit(body: Tab) -> dict[str, Any]:
        return desk.revisit(body.tab, body.who)

    return app


def serve_review(sheet: Path, labels: list[str], host: str, port: int, token: str | None, lease_s: float) -> None:
    """Run the review page until interrupted (Ctrl-C)."""
    import uvicorn

    app = create_review_app(ReviewDesk(sheet, labels, lease_s), token)
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        print(f"warning: {host} exposes the sheet to the network without a token; pass --token")
    print(f"reviewing {sheet} at http://{host}:{port}/ (Ctrl-C stops; every answer is already saved)")
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=5, timeout_graceful_shutdown=10)
