"""``POST /v1/search`` for ``encoderkit serve --index [name=]DIR``.

    {"query": "...", "k": 10?, "index": "name"?, "first_stage": "binary"?, "rescore": "int8"?,
     "rescore_multiplier": 0?, "bm25": false?, "rerank_top": 0?, "rerank_fuse": false?}
    -> {"index": name, "hits": [{"doc_id", "score", "text", "passage_id"}], "truncated": bool}

The route uses the service's own bearer-token check and text limits (handed in by
``deploy.serve.create_app``), so it answers errors as the other routes do: 401 for a wrong token,
404 for an unknown index, 422 for bad settings, an empty or over-long query.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from encoderkit.config import named_folders
from encoderkit.errors import EncoderkitError
from encoderkit.retrieval.page import add_search_page
from encoderkit.retrieval.search import Searcher, SearchSettings

MAX_K = 1000


class SearchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: StrictStr = Field(..., description="The query text (truncated to the model's maximum length, said in 'truncated').")
    k: StrictInt = Field(10, ge=1, le=MAX_K, description="Documents to return.")
    index: StrictStr | None = Field(None, description="Served index name; needed when several are served.")
    first_stage: StrictStr = Field("binary", description="binary, int8 or float.")
    rescore: StrictStr = Field("int8", description="int8, float or none.")
    rescore_multiplier: StrictInt = Field(0, ge=0, le=100, description="Candidates rescored per result (0: the index's default).")
    bm25: StrictBool = Field(False, description="Fuse BM25 by reciprocal rank.")
    rerank_top: StrictInt = Field(0, ge=0, le=MAX_K, description="Documents the index's cross-encoder reorders (0: off).")
    rerank_fuse: StrictBool = Field(False, description="Fuse the cross-encoder's order with the order it reranked.")


class _Error(HTTPException):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status_code=status, detail=message)
        self.code = code


def search_routes(specs: list[str], runtime: str | None = None, threads: int | None = None, rerank: str | None = None
                  ) -> Callable[[FastAPI, Callable, Callable], None]:
    """Open the indexes now (a bad one fails at start-up) and return the hook that adds ``/v1/search`` and the
    search page (``GET /search``, ``retrieval/page.py``)."""
    searchers = {name: Searcher.open(folder, runtime=runtime, rerank=rerank, threads=threads)
                 for name, folder in named_folders(specs, "index").items()}

    def hook(app: FastAPI, check_texts: Callable[..., None]) -> None:
        add_search_route(app, searchers, check_texts)
        add_search_page(app, searchers, check_texts, _Error, MAX_K)

    return hook


def add_search_route(app: FastAPI, searchers: dict[str, Searcher], check_texts: Callable[..., None]) -> None:
    """``POST /v1/search`` over ``searchers``; the service's outermost layer checks the token before this runs."""
    @app.post("/v1/search")
    async def search(body: SearchBody) -> dict[str, Any]:
        check_texts("query", [body.query])
        if body.index is not None and body.index not in searchers:
            raise _Error(404, "unknown_index", f"no index named {body.index!r}; served: {', '.join(searchers)}")
        if body.index is None and len(searchers) > 1:
            raise _Error(422, "index_required", f"several indexes are served ({', '.join(searchers)}); name one in 'index'")
        name = body.index or next(iter(searchers))
        settings = SearchSettings(body.k, body.first_stage, body.rescore, body.rescore_multiplier, body.bm25, body.rerank_top,
                                  rerank_fuse=body.rerank_fuse)
        try:
            result = (await run_in_threadpool(searchers[name].search, [body.query], settings))[0]
        except EncoderkitError as e:
            raise _Error(422, "invalid_request", str(e)) from e
        return {"index": name, "hits": [asdict(h) for h in result.hits], "truncated": result.truncated}
