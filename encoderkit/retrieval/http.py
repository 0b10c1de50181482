"""``POST /v1/search`` for ``encoderkit serve --index [name=]DIR``.

    {"query": "...", "k": 10?, "index": "name"?, "first_stage": "binary"?, "rescore": "int8"?,
     "rescore_multiplier": 0?, "bm25": false?, "rerank_top": 0?, "rerank_fuse": false?, "rerank_model": "name"?}
    -> {"index": name, "hits": [{"doc_id", "score", "text", "passage_id"}], "truncated": bool}

The route uses the service's own bearer-token check and text limits (handed in by
``deploy.serve.create_app``), so it answers errors as the other routes do: 401 for a wrong token,
404 for an unknown index, 422 for bad settings, an empty or over-long query.

The served indexes follow their updates (:class:`LiveSearchers`): after ``encoderkit index`` writes a new
generation, the service switches to it whole, without a restart and without failing a request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from encoderkit.config import named_folders
from encoderkit.errors import EncoderkitError
from encoderkit.inference.policy import recorded
from encoderkit.inference.predictor import Predictor
from encoderkit.retrieval.page import add_search_page
from encoderkit.retrieval.search import Searcher, SearchSettings
from encoderkit.retrieval.store import current_folder, open_generation

MAX_K = 1000
POLL_S = 1.0  # how often (at most) a served index's CURRENT pointer is looked at, on the requests that use it
log = logging.getLogger("uvicorn.error")


class SearchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: StrictStr = Field(..., description="The query text (truncated to the model's maximum length, said in "
                                              "'truncated').")
    k: StrictInt = Field(10, ge=1, le=MAX_K, description="Documents to return.")
    index: StrictStr | None = Field(None, description="Served index name; needed when several are served.")
    first_stage: StrictStr = Field("binary", description="binary, int8 or float.")
    rescore: StrictStr = Field("int8", description="int8, float or none.")
    rescore_multiplier: StrictInt = Field(0, ge=0, le=100,
                                          description="Candidates rescored per result (0: the index's default).")
    bm25: StrictBool = Field(False, description="Fuse BM25 by reciprocal rank.")
    rerank_top: StrictInt = Field(0, ge=0, le=MAX_K,
                                  description="Documents the cross-encoder reorders (0: off; serve --rerank).")
    rerank_fuse: StrictBool = Field(False, description="Fuse the cross-encoder's order with the order it reranked.")
    rerank_model: StrictStr | None = Field(None, description="The served rerank model rerank_top reorders with "
                                                             "(serve --rerank NAME=DIR); needed when several are.")


class _Error(HTTPException):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status_code=status, detail=message)
        self.code = code


class LiveSearchers(dict):
    """name -> the :class:`Searcher` of each served index, following the index's updates. A lookup
    (``searchers[name]``) looks at the index's ``CURRENT`` pointer at most every ``poll_s`` seconds; when it names a
    new generation, that one is opened in a background thread (``opener(old)``) and swapped in whole once ready, so
    a request uses one generation from start to end and never waits for the switch. Until then, or when the new one
    cannot be opened (a newer update removed it meanwhile, say), requests keep the searcher they have. A searcher
    in use survives its generation's folder being removed: its arrays are in memory or memory-mapped."""

    def __init__(self, searchers: dict[str, Searcher], opener: Callable[[Searcher], Searcher],
                 poll_s: float = POLL_S) -> None:
        super().__init__(searchers)
        self.opener, self.poll_s = opener, poll_s
        self._checked: dict[str, float] = {}
        self._loading: set[str] = set()
        self._lock = threading.Lock()
        self.switches = 0  # generations switched to (tests)

    def __getitem__(self, name: str) -> Searcher:
        searcher = super().__getitem__(name)
        now = time.monotonic()
        if now - self._checked.get(name, -math.inf) >= self.poll_s:
            self._checked[name] = now
            self._follow(name, searcher)
        return searcher

    def _follow(self, name: str, searcher: Searcher) -> None:
        try:
            live = current_folder(searcher.root)
        except (OSError, EncoderkitError):
            return  # mid-write or damaged: the next look decides
        if live is None or searcher.gen.folder is None or live.name == searcher.gen.folder.name:
            return
        with self._lock:
            if name in self._loading:
                return
            self._loading.add(name)
        threading.Thread(target=self._switch, args=(name, searcher), name=f"index-{name}", daemon=True).start()

    def _switch(self, name: str, old: Searcher) -> None:
        try:
            new = self.opener(old)
            dict.__setitem__(self, name, new)  # one reference replaced: atomic for the requests that look it up
            self.switches += 1
            log.info("index %s: now serving %s (was %s)", name, new.gen.folder.name if new.gen.folder else "?",
                     old.gen.folder.name if old.gen.folder else "?")
        except (OSError, ValueError, KeyError, EncoderkitError) as e:
            log.warning("index %s: its new generation could not be opened (%s); still serving %s", name, e,
                        old.gen.folder.name if old.gen.folder else "the previous one")
        finally:
            with self._lock:
                self._loading.discard(name)


def reopen(old: Searcher, backend: str = "auto", rerank: str | None = None, threads: int | None = None) -> Searcher:
    """A searcher over the live generation of ``old``'s index: the same query model (and cross-encoder) when the
    generation records the same model and engine, else opened afresh as at start-up."""
    gen = open_generation(old.root)
    if (old.milvus is None and gen.manifest["model"] == old.gen.manifest["model"]
            and recorded(gen.manifest) == recorded(old.gen.manifest)):
        return Searcher(gen, old.root, old.predictor, old.reranker)
    return Searcher.open(old.root, backend=backend, rerank=rerank, threads=threads, milvus=old.milvus)


def search_routes(specs: list[str], backend: str = "auto", threads: int | None = None, rerank: str | None = None,
                  rerankers: Mapping[str, Predictor] | None = None,
                  poll_s: float = POLL_S) -> Callable[[FastAPI, Callable, Callable], None]:
    """Open the indexes now (a bad one fails at start-up), their queries embedded on ``backend`` (serve's
    ``--backend``; ``auto``: each index's recorded engine), and return the hook that adds ``/v1/search`` and the
    search page (``GET /search``, ``retrieval/page.py``). ``rerankers``: the served cross-encoders (name ->
    Predictor) a request's ``rerank_top`` reorders with. Each index follows its updates (:class:`LiveSearchers`,
    looking every ``poll_s`` seconds at most)."""
    searchers = LiveSearchers({name: Searcher.open(folder, backend=backend, rerank=rerank, threads=threads)
                               for name, folder in named_folders(specs, "index").items()},
                              lambda old: reopen(old, backend, rerank, threads), poll_s)

    def hook(app: FastAPI, check_texts: Callable[..., None]) -> None:
        add_search_route(app, searchers, check_texts, rerankers or {})
        add_search_page(app, searchers, check_texts, _Error, MAX_K)

    return hook


def pick_reranker(body: SearchBody, searcher: Searcher, rerankers: Mapping[str, Predictor]) -> Predictor | None:
    """The cross-encoder ``body.rerank_top`` reorders with: the one it names, else the index's own, else the one
    served; None when it does not rerank."""
    if body.rerank_model is not None:
        if body.rerank_model not in rerankers:
            raise _Error(404, "unknown_model", f"no rerank model named {body.rerank_model!r}; served: "
                                               f"{', '.join(rerankers) or 'none (serve --rerank NAME=DIR)'}")
        return rerankers[body.rerank_model]
    if not body.rerank_top or searcher.reranker is not None:
        return None
    if not rerankers:
        raise _Error(422, "rerank_not_served", "rerank_top needs a cross-encoder: start the server with "
                                               "--rerank NAME=DIR (a rerank model folder)")
    if len(rerankers) > 1:
        raise _Error(422, "model_required", f"several rerank models are served ({', '.join(rerankers)}); name one "
                                            "in 'rerank_model'")
    return next(iter(rerankers.values()))


def add_search_route(app: FastAPI, searchers: dict[str, Searcher], check_texts: Callable[..., None],
                     rerankers: Mapping[str, Predictor] | None = None) -> None:
    """``POST /v1/search`` over ``searchers``; the service's outermost layer checks the token before this runs."""
    rerankers = rerankers or {}

    @app.post("/v1/search")
    async def search(body: SearchBody) -> dict[str, Any]:
        check_texts("query", [body.query])
        if body.index is not None and body.index not in searchers:
            raise _Error(404, "unknown_index", f"no index named {body.index!r}; served: {', '.join(searchers)}")
        if body.index is None and len(searchers) > 1:
            raise _Error(422, "index_required",
                         f"several indexes are served ({', '.join(searchers)}); name one in 'index'")
        name = body.index or next(iter(searchers))
        settings = SearchSettings(body.k, body.first_stage, body.rescore, body.rescore_multiplier, body.bm25,
                                  body.rerank_top,
                                  rerank_fuse=body.rerank_fuse)
        cross = pick_reranker(body, searchers[name], rerankers)
        try:
            result = (await run_in_threadpool(searchers[name].search, [body.query], settings, cross))[0]
        except EncoderkitError as e:
            raise _Error(422, "invalid_request", str(e)) from e
        return {"index": name, "hits": [asdict(h) for h in result.hits], "truncated": result.truncated}
