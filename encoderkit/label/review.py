"""``encoderkit audit review``: fill a sheet's gold column in the terminal.

One keystroke per line (Enter/``a`` accept, ``1``-``9`` pick a label, ``s`` skip, ``u`` undo, ``q`` quit); the
sheet is rewritten atomically after every answer, so a dropped SSH connection loses nothing. ``--web`` reviews
the same sheet in a browser (``label/web.py``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.label.records import parse_labels
from encoderkit.label.sheet import VERDICTS, read_sheet, write_sheet


@dataclass
class ReviewConfig(StageConfig):
    """Review a sheet in the terminal: accept, correct or skip each label."""

    sheet: str = arg(help="Sheet (CSV) from `audit sample`; its gold column is filled in place.", required=True)
    labels: str = arg("", help="The label set, comma-separated (default: the labels seen in the sheet, sorted).")
    web: bool = arg(False, help="Review in a browser instead (several reviewers at once; see docs/label.md).")
    host: str = arg("127.0.0.1", help="With --web: address to listen on (0.0.0.0 exposes the sheet to the network).")
    port: int = arg(8001, help="With --web: TCP port.")
    token: str = arg("", help="With --web: bearer token every request for the sheet must carry (default: the "
                              "variable named by --token-env; unset = no token).")
    token_env: str = arg("ENCODERKIT_TOKEN", help="With --web: environment variable holding the token when "
                                                  "--token is not given (keeps it out of `ps`).")
    lease_s: float = arg(600.0, help="With --web: seconds a row shown to one reviewer is kept from the others "
                                     "(the open page renews it every minute).")

    def validate(self) -> None:
        check(0 < self.port < 65536, f"--port {self.port} is not a TCP port")
        check(self.lease_s >= 120, "--lease-s must be at least 120 (the page renews its hold every minute)")


@dataclass
class ReviewResult:
    sheet: Path
    reviewed: int
    total: int
    corrected: int

    def summary(self) -> dict[str, Any]:
        return {"sheet": str(self.sheet), "reviewed": self.reviewed, "total": self.total, "corrected": self.corrected}

    @classmethod
    def of(cls, path: Path, rows: list[dict[str, str]]) -> ReviewResult:
        return cls(path, sum(1 for x in rows if x["gold"]), len(rows),
                   sum(1 for x in rows if x["gold"] and x["gold"] != x["label"]))


class _Keys:
    """Single keystrokes from a terminal (cbreak mode), else the first character of each line."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream, self.saved = stream, None
        if stream.isatty():
            import termios  # noqa: PLC0415 - POSIX only; piped input works without it
            import tty  # noqa: PLC0415 - POSIX only, as termios

            self.saved = termios.tcgetattr(stream.fileno())
            tty.setcbreak(stream.fileno())

    def read(self) -> str:
        if self.saved is not None:
            ch = self.stream.read(1)
            if ch == "":
                return "q"
            return "a" if ch in ("\r", "\n") else ch
        line = self.stream.readline()
        if line == "":
            return "q"
        return line.strip()[:1] or "a"

    def close(self) -> None:
        if self.saved is not None:
            import termios  # noqa: PLC0415 - POSIX only; piped input works without it

            termios.tcsetattr(self.stream.fileno(), termios.TCSADRAIN, self.saved)


def review(path: Path, rows: list[dict[str, str]], labels: list[str], keys_in: IO[str], out: IO[str]) -> ReviewResult:
    """The review loop over ``rows`` (read from ``path``, rewritten there after each answer)."""
    todo = [i for i, r in enumerate(rows) if not r["gold"]]
    menu = "  ".join(f"{n}) {name}" for n, name in enumerate(labels, 1))
    keys = _Keys(keys_in)
    done: list[int] = []
    pos = 0
    try:
        while pos < len(todo):
            i = todo[pos]
            r = rows[i]
            filled = sum(1 for x in rows if x["gold"])
            extra = "".join(f", {k} {r[k]}" for k in ("confidence", "suspicion") if r.get(k))
            shown = f"query: {r['query']}\n  passage: {r['text']}" if "query" in r else r["text"]
            out.write(f"\n[{filled + 1}/{len(rows)}] {shown}\n  labeller: {r['label']}{extra}\n"
                      f"  Enter/a accept  {menu}  s skip  u undo  q quit > ")
            out.flush()
            key = keys.read()
            if key == "q":
                break
            if key == "s":
                pos += 1
                continue
            if key == "u":
                if done:
                    last = done.pop()
                    rows[last]["gold"] = ""
                    write_sheet(path, rows)
                    pos = todo.index(last)
                continue
            if key == "a":
                gold = r["label"]
            elif key.isdigit() and 1 <= int(key) <= len(labels):
                gold = labels[int(key) - 1]
            else:
                out.write(f"\n  (unknown key {key!r})")
                continue
            r["gold"] = gold
            write_sheet(path, rows)
            out.write(f"{gold}\n")
            done.append(i)
            pos += 1
    finally:
        keys.close()
    result = ReviewResult.of(path, rows)
    out.write(f"\n{result.reviewed}/{len(rows)} reviewed, {result.corrected} corrected; saved to {path}\n")
    out.flush()
    return result


def sheet_labels(path: Path, rows: list[dict[str, str]], given: str) -> list[str]:
    """The label set: ``given`` (comma-separated) or the labels seen in the sheet, sorted; every label must be in it."""
    if given:
        labels = parse_labels(given)
    elif rows and "query" in rows[0]:  # a pairs sheet: does the passage answer the query?
        labels = list(VERDICTS)
    else:
        labels = sorted({r["label"] for r in rows if r["label"]} | {r["gold"] for r in rows if r["gold"]})
        if len(labels) < 2:
            raise EncoderkitError(f"{path}: fewer than two labels in the sheet; give the label set with --labels")
    outside = [r["label"] for r in rows if r["label"] and r["label"] not in labels]
    if outside:
        raise EncoderkitError(f"{path}: label {outside[0]!r} is not in --labels ({', '.join(labels)})")
    return labels


def run(cfg: ReviewConfig) -> ReviewResult:
    """Review the sheet interactively (stdin/stdout), or with --web in a browser until Ctrl-C."""
    path = Path(cfg.sheet)
    rows = read_sheet(path)
    labels = sheet_labels(path, rows, cfg.labels)
    if not cfg.web:
        return review(path, rows, labels, sys.stdin, sys.stdout)

    try:
        from encoderkit.label.web import serve_review  # noqa: PLC0415 - optional: FastAPI (the deploy extra)
    except ImportError as e:
        raise EncoderkitError(f"--web needs FastAPI and uvicorn ({e}); pip install 'encoderkit[deploy]'") from e
    serve_review(path, labels, cfg.host, cfg.port, cfg.token or os.environ.get(cfg.token_env) or None, cfg.lease_s)
    return ReviewResult.of(path, read_sheet(path))
