"""The routes clients of the serving peers already call: OpenAI ``POST /v1/embeddings`` and ``GET /v1/models``,
Cohere v1 / Jina rerank (``POST /v1/rerank``, ``/rerank``, which also take encoderkit's own rerank body) and Cohere
v2 rerank (``POST /v2/rerank``, ``cohere.ClientV2``'s shape).

Errors come in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: a bad field is a 400 on
``/v1/embeddings`` (as OpenAI) and a 422 on rerank (as the rest of encoderkit).

These shapes have no per-input error, so a request succeeds or fails whole; what would fail one input is made not
to: an empty text is embedded (or scored) as the empty text, and a text longer than the model reads is truncated,
listed by index in the response's ``truncated`` (a field the peers' clients ignore). Only a text that is not text (a
lone surrogate) or over ``--max-chars`` fails its request. Token ids (what LangChain's ``OpenAIEmbeddings`` sends
by default, ``check_embedding_ctx_length=True``) are decoded back to text with the tiktoken encoding the client
used for that model name (``cl100k_base`` for a name tiktoken does not know), when tiktoken is installed.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
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

from encoderkit.deploy.text_checks import EMBED_CLIENTS, RERANK_CLIENTS, count_problem, text_problem
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
                    status = (invalid_status if exc.status_code in (400, 422) and code != "invalid_json"
                              else exc.status_code)
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
        ..., description="A text or a list of texts, or tiktoken token ids of them (decoded back to text).")
    model: StrictStr | None = Field(None, description="A served embed model's name (GET /v1/models).")
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32.")
    dimensions: StrictInt | None = Field(None, ge=1,
                                         description="Keep the first dimensions (Matryoshka), renormalised.")
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
    rank_fields: list[StrictStr] | None = Field(None, description="Cohere v1: accepted; documents are ranked by text.")
    max_chunks_per_doc: StrictInt | None = Field(None, description="Cohere v1: accepted; a document longer than the "
                                                                    "model reads is truncated.")


class RerankV2Body(BaseModel):
    """Cohere's ``ClientV2.rerank`` body."""

    model_config = ConfigDict(extra="ignore")  # priority, relevant_spans: Cohere's own service settings
    model: StrictStr | None = Field(None, description="Served rerank model; needed when several do rerank.")
    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt | None = Field(None, ge=1, description="Return only the best n documents.")
    max_tokens_per_doc: StrictInt | None = Field(None, ge=1, description="Truncate each document to this many "
                                                                          "tokens (at most what the model reads).")


def openai_router(served: Mapping[str, Any], authorize: Callable[[Request], None] | None = None, max_texts: int = 2048,
                  max_chars: int = 1_000_000) -> APIRouter:
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
                                       f"a {endpoint} model ({', '.join(able) or 'none served'})", "wrong_task",
                                 "model")
            return served[name]
        if len(able) != 1:
            raise OpenAIError(400 if able else 404,
                              f"name the model: {route} models served: {', '.join(able) or 'none'}",
                              "model_required" if able else "task_not_served", "model")
        return served[able[0]]

    def check_texts(param: str, texts: list[str], clients: str = "", allow_empty: bool = True) -> None:
        problem = text_problem(param, texts, max_texts, max_chars, clients=clients, allow_empty=allow_empty)
        if problem is not None:
            raise OpenAIError(400, problem.message, problem.code, problem.param)

    async def run(s: Any, items: list[Any], limit: int | None = None) -> tuple[list[Any], int, list[int]]:
        """Results for ``items`` from ``s``'s batcher, their token count, and the indices of the items longer than
        the model reads (or than ``limit`` tokens), which it reads truncated."""
        limit = min(limit or s.predictor.max_length, s.predictor.max_length)
        try:  # counts: up to one token more than the model reads (more means truncated), from the model call's
            # own tokenizing (MicroBatcher.submit_counted)
            results, counts = await s.batcher.submit_counted(items, limit)
        except EncoderkitError as e:
            raise OpenAIError(400, str(e), "invalid_value") from e
        read = [min(c, limit) for c in counts]
        return results, int(sum(read)), [i for i, c in enumerate(counts) if c > limit]

    decoders: dict[str, Any] = {}

    def decode_ids(ids: list[list[int]], model: str | None) -> list[str]:
        """Texts from the tiktoken token ids an OpenAI client sent, with the encoding it used for ``model``."""
        try:
            import tiktoken
        except ImportError:
            raise OpenAIError(400, "input as token ids needs tiktoken on the server (pip install tiktoken); or send "
                                   "the texts (LangChain: OpenAIEmbeddings(..., check_embedding_ctx_length=False))",
                              "unsupported_input", "input") from None
        name = model or ""
        if name not in decoders:
            try:
                try:
                    decoders[name] = tiktoken.encoding_for_model(name)
                except KeyError:  # as the client does for a model name tiktoken does not know
                    decoders[name] = tiktoken.get_encoding("cl100k_base")
            except Exception as e:  # noqa: BLE001 -- tiktoken downloads its files once; offline it cannot
                raise OpenAIError(400, f"input as token ids: the server could not load tiktoken's encoding ({e}); "
                                       "send the texts (LangChain: OpenAIEmbeddings(..., "
                                       "check_embedding_ctx_length=False)), or let the server fetch the encoding "
                                       "once (TIKTOKEN_CACHE_DIR)", "unsupported_input", "input") from None
        encoding = decoders[name]
        try:
            return [encoding.decode(row, errors="replace") for row in ids]
        except Exception as e:  # noqa: BLE001 -- an id outside the encoding's vocabulary
            raise OpenAIError(400, f"input: token ids that are not of tiktoken's {encoding.name} ({e}); send the "
                                   "texts (LangChain: OpenAIEmbeddings(..., check_embedding_ctx_length=False))",
                              "invalid_value", "input") from None

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsBody) -> Response:
        s = pick("embed", body.model, "/v1/embeddings")
        texts: list[Any] = [body.input] if isinstance(body.input, str) else body.input
        if texts and isinstance(texts[0], int):  # one text as token ids
            texts = [texts]
        if texts and isinstance(texts[0], list):
            problem = count_problem("input", texts, max_texts, clients=EMBED_CLIENTS)  # before decoding
            if problem is not None:
                raise OpenAIError(400, problem.message, problem.code, problem.param)
            texts = decode_ids(texts, body.model)
        check_texts("input", texts, EMBED_CLIENTS)
        raw, tokens, truncated = await run(s, list(texts))
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
               "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
               "truncated": truncated}
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
        check_texts("query", [body.query], allow_empty=False)
        check_texts(field, docs, RERANK_CLIENTS)
        scores, tokens, truncated = await run(s, [(body.query, d) for d in docs])
        scores = np.asarray(scores, dtype=np.float64)
        ranked = np.argsort(-scores, kind="stable")[: (body.top_n if cohere else body.top_k)]
        if not cohere:
            return {"model": s.name, "results": [{"index": int(i), "score": float(scores[i])} for i in ranked],
                    "truncated": truncated}
        relevance = scores if body.raw_scores else 1.0 / (1.0 + np.exp(-scores))
        results = [{"index": int(i), "relevance_score": float(relevance[i])}
                   | ({"document": {"text": docs[i]}} if body.return_documents else {}) for i in ranked]
        return {"id": str(uuid.uuid4()), "object": "rerank", "model": s.name, "results": results,
                "usage": {"total_tokens": tokens}, "meta": {"billed_units": {"search_units": 1}},
                "truncated": truncated}

    async def rerank_v2(body: RerankV2Body) -> dict[str, Any]:
        """Cohere v2: ``{"model", "query", "documents": [str], "top_n", "max_tokens_per_doc"}`` -> ``{"id",
        "results": [{"index", "relevance_score"}], "meta"}``."""
        s = pick("rerank", body.model, "/v2/rerank")
        check_texts("query", [body.query], allow_empty=False)
        check_texts("documents", body.documents, RERANK_CLIENTS)
        scores, tokens, truncated = await run(s, [(body.query, d) for d in body.documents], body.max_tokens_per_doc)
        scores = np.asarray(scores, dtype=np.float64)
        relevance = 1.0 / (1.0 + np.exp(-scores))
        ranked = np.argsort(-scores, kind="stable")[: body.top_n]
        return {"id": str(uuid.uuid4()), "model": s.name,
                "results": [{"index": int(i), "relevance_score": float(relevance[i])} for i in ranked],
                "meta": {"billed_units": {"search_units": 1}, "tokens": {"input_tokens": tokens}},
                "truncated": truncated}

    router.add_api_route("/v1/rerank", rerank, methods=["POST"], summary="Rerank (Cohere v1/Jina or encoderkit shape)")
    router.add_api_route("/rerank", rerank, methods=["POST"], summary="Rerank (alias of /v1/rerank)")
    router.add_api_route("/v2/rerank", rerank_v2, methods=["POST"], summary="Rerank (Cohere v2 shape, ClientV2)")
    return router


def _model_card(name: str, s: Any, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "encoderkit", "task": s.predictor.task}
