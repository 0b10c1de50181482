"""The routes clients of the serving peers already call: OpenAI embeddings, Cohere/Jina rerank, the model list.

* ``POST /v1/embeddings`` (OpenAI): ``{"input": str | [str], "model", "encoding_format": "float"|"base64",
  "dimensions"}`` -> ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
  "usage": {"prompt_tokens", "total_tokens"}}``. ``dimensions`` keeps the first dimensions
  (Matryoshka) and re-normalises; ``base64`` is little-endian float32, as the ``openai`` client decodes it.
* ``POST /v1/rerank`` and ``POST /rerank``: the Cohere/Jina shape ``{"query", "documents": [str |
  {"text"}], "top_n", "return_documents"}`` -> ``{"results": [{"index", "relevance_score", "document"?}]}``
  (``relevance_score`` in [0, 1], a sigmoid of the model's logit; ``raw_scores`` for the logit), and
  encoderkit's own ``{"query", "passages", "top_k"}`` -> ``{"results": [{"index", "score"}]}`` (logits).
* ``GET /v1/models`` (OpenAI list shape) and ``GET /v1/models/{id}``.

Errors on these routes come in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad field on ``/v1/embeddings`` (as OpenAI), 422 on rerank (as the rest of encoderkit),
401 without the bearer token (checked before the body is read), 404 for an unknown model.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from encoderkit.deploy.text_checks import text_problem
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import finish_embeddings
from encoderkit.tasks import get_task

log = logging.getLogger(__name__)
ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error"}


class OpenAIError(HTTPException):
    """A client error in OpenAI's shape."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(status_code=status, detail=message)
        self.code, self.param = code, param


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status (every error body of the service carries it)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_response(status: int, message: str, code: str | None, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type(status), "param": param, "code": code}},
                        status_code=status, headers=dict(headers or {}))


def _route_class(authorize: Callable[[Request], None] | None) -> type[APIRoute]:
    """An APIRoute that checks the token before the body is parsed and answers every error in OpenAI's shape
    (a bad field: 400 on the OpenAI routes, as OpenAI; 422 on rerank, as the rest of encoderkit)."""

    class _Route(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()
            invalid_status = 422 if self.path.endswith("/rerank") else 400

            async def guarded(request: Request) -> Response:
                try:
                    if authorize is not None:
                        authorize(request)
                    return await handler(request)
                except RequestValidationError as exc:
                    errors = exc.errors()
                    if any(e.get("type") == "json_invalid" for e in errors):
                        return error_response(400, "the request body is not valid JSON", "invalid_json")
                    loc = [x for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
                    param = str(loc[0]) if loc else None  # the top-level field, as OpenAI names it
                    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                             for e in errors[:5]]
                    return error_response(invalid_status, "; ".join(parts), "invalid_value", param)
                except HTTPException as exc:
                    code = getattr(exc, "code", None) or ("invalid_json" if exc.status_code == 400 else None)
                    status = invalid_status if exc.status_code in (400, 422) and code != "invalid_json" else exc.status_code
                    return error_response(status, str(exc.detail), code, getattr(exc, "param", None), exc.headers)
                except EncoderkitError as exc:
                    return error_response(invalid_status, str(exc), "invalid_value")
                except Exception:  # a 500 of this request's own, in the same shape; the traceback goes to the log
                    log.exception("%s %s failed", request.method, request.url.path)
                    return error_response(500, "the server failed on this request; see its log", "internal_error")

            return guarded

    return _Route


# -- request bodies ---------------------------------------------------------------------------
class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients may send fields a peer ignores
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        ..., description="A text or a list of texts (token ids are refused: they belong to another tokenizer).")
    model: StrictStr | None = Field(None, description="A served embed model's name (GET /v1/models).")
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32.")
    dimensions: StrictInt | None = Field(None, ge=1, description="Keep the first dimensions (Matryoshka), renormalised.")
    user: StrictStr | None = None


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: StrictStr


class RerankBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(None, description="Served rerank model; needed when several do rerank.")
    query: StrictStr
    documents: list[StrictStr | Document] | None = Field(None, description="Cohere/Jina shape: texts or {text}.")
    top_n: StrictInt | None = Field(None, ge=1, description="Return only the best n documents.")
    return_documents: StrictBool = Field(False, description="Echo each document in its result.")
    raw_scores: StrictBool = Field(False, description="relevance_score as the model's logit, not its sigmoid.")
    passages: list[StrictStr] | None = Field(None, description="encoderkit shape: the texts to rank.")
    top_k: StrictInt | None = Field(None, ge=1, description="encoderkit shape: return only the best k passages.")


def openai_router(served: Mapping[str, Any], authorize: Callable[[Request], None] | None = None, max_texts: int = 256,
                  max_chars: int = 20_000) -> APIRouter:
    """The routes above for ``served`` (name -> object with ``predictor`` and ``batcher``, as serve.py
    builds them); ``authorize(request)``, if given, raises an HTTPException for a wrong or missing token (serve.py
    passes none: its outermost layer checks the token before any route runs)."""
    created = int(time.time())
    router = APIRouter(route_class=_route_class(authorize))

    def pick(endpoint: str, name: str | None, route: str) -> Any:
        """The served model for ``route``: one whose task object's ``endpoint`` is ``endpoint`` (``embed``,
        ``rerank``: each named after the task it serves, as the messages say)."""
        able = [n for n, s in served.items() if get_task(s.predictor.task).endpoint == endpoint]
        if name is not None:
            if name not in served:
                raise OpenAIError(404, f"the model {name!r} does not exist; served: {', '.join(served)} "
                                       f"(GET /v1/models)", "model_not_found", "model")
            if name not in able:
                raise OpenAIError(404, f"model {name!r} is a {served[name].predictor.task} model; {route} needs "
                                       f"a {endpoint} model ({', '.join(able) or 'none served'})", "wrong_task", "model")
            return served[name]
        if len(able) != 1:
            raise OpenAIError(400 if able else 404, f"name the model: {route} models served: {', '.join(able) or 'none'}",
                              "model_required" if able else "task_not_served", "model")
        return served[able[0]]

    def check_texts(param: str, texts: list[str]) -> None:
        problem = text_problem(param, texts, max_texts, max_chars)
        if problem is not None:
            raise OpenAIError(400, problem.message, problem.code, problem.param)

    async def run(s: Any, items: list[Any]) -> tuple[list[Any], int]:
        """Results for ``items`` from ``s``'s batcher, and their token count."""
        counts = await s.batcher.costs(items)
        try:
            return await s.batcher.submit(items, counts), int(sum(counts))
        except EncoderkitError as e:
            raise OpenAIError(400, str(e), "invalid_value") from e

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsBody) -> Response:
        s = pick("embed", body.model, "/v1/embeddings")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if texts and not isinstance(texts[0], str):
            raise OpenAIError(400, "input as token ids is not supported: ids from another tokenizer mean nothing to "
                                   "this model; send the texts (LangChain: OpenAIEmbeddings(..., "
                                   "check_embedding_ctx_length=False))", "unsupported_input", "input")
        check_texts("input", texts)  # type: ignore[arg-type]
        raw, tokens = await run(s, list(texts))
        raw = np.stack(raw)
        if body.dimensions is not None and body.dimensions > raw.shape[1]:
            raise OpenAIError(400, f"dimensions={body.dimensions} is over the model's {raw.shape[1]} dimensions",
                              "invalid_value", "dimensions")
        vectors = finish_embeddings(raw, body.dimensions, s.predictor.info.normalize or body.dimensions is not None)
        if body.encoding_format == "base64":
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            data = list(vectors)  # orjson writes float32 rows directly, in float32's shortest form
        out = {"object": "list", "model": s.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
               "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)]}
        return Response(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(n, s, created) for n, s in served.items()]}

    @router.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in served:
            raise OpenAIError(404, f"the model {model_id!r} does not exist; served: {', '.join(served)}",
                              "model_not_found", "model")
        return _model_card(model_id, served[model_id], created)

    async def rerank(body: RerankBody) -> dict[str, Any]:
        cohere = body.documents is not None
        if cohere == (body.passages is not None):
            raise OpenAIError(422, "give either 'documents' (Cohere/Jina shape) or 'passages' (encoderkit shape)",
                              "invalid_value", "documents")
        if (body.top_k if cohere else body.top_n) is not None:
            raise OpenAIError(422, "top_n goes with 'documents', top_k with 'passages'", "invalid_value",
                              "top_k" if cohere else "top_n")
        s = pick("rerank", body.model, "/v1/rerank")
        docs = [d if isinstance(d, str) else d.text for d in body.documents] if cohere else list(body.passages or [])
        field = "documents" if cohere else "passages"
        check_texts("query", [body.query])
        check_texts(field, docs)
        scores, tokens = await run(s, [(body.query, d) for d in docs])
        scores = np.asarray(scores, dtype=np.float64)
        ranked = np.argsort(-scores, kind="stable")[: (body.top_n if cohere else body.top_k)]
        if not cohere:
            return {"model": s.name, "results": [{"index": int(i), "score": float(scores[i])} for i in ranked]}
        relevance = scores if body.raw_scores else 1.0 / (1.0 + np.exp(-scores))
        results = [{"index": int(i), "relevance_score": float(relevance[i])}
                   | ({"document": {"text": docs[i]}} if body.return_documents else {}) for i in ranked]
        return {"object": "rerank", "model": s.name, "results": results, "usage": {"total_tokens": tokens}}

    router.add_api_route("/v1/rerank", rerank, methods=["POST"], summary="Rerank (Cohere/Jina or encoderkit shape)")
    router.add_api_route("/rerank", rerank, methods=["POST"], summary="Rerank (alias of /v1/rerank)")
    return router


def _model_card(name: str, s: Any, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "encoderkit", "task": s.predictor.task}
