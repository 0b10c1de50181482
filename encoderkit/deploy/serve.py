"""``encoderkit serve``: an HTTP service over one or more task models, with micro-batching.

Endpoints (JSON in, JSON out; OpenAPI page at ``/docs``):

* ``POST /v1/classify`` ``{"texts": [...], "text_pairs": [...]?}`` -> ``{"results": [{label, score, scores}]}``
* ``POST /v1/extract``  ``{"texts": [...]}`` -> ``{"results": [[{entity, label, start, end, score}]]}``
* ``POST /v1/answer``   ``{"questions": [...], "contexts": [...]}`` -> ``{"results": [{answer, start, end, score}]}``
* ``POST /v1/rerank``   ``{"query": "...", "passages": [...], "top_k": n?}`` -> ``{"results": [{index, score}]}``, or the
  Cohere/Jina shape ``{"query", "documents", "top_n"}`` (also at ``/rerank``; see ``openai_api.py``)
* ``POST /v1/embed``    ``{"texts": [...], "dim": n?, "normalize": bool?}`` -> ``{"embeddings": [[...]]}``
* ``POST /v1/embed_sparse`` ``{"texts": [...], "top_k": n?, "threshold": x?}`` -> ``{"results": [{token: weight}]}``
  (a ``--task sparse`` model; TEI's route name)
* ``POST /v1/embeddings`` (OpenAI), ``GET /v1/models``: see ``encoderkit/deploy/openai_api.py``.
* ``GET /health``, ``GET /metrics`` (Prometheus text format).

Every body may name a ``model`` (needed when several served models do the same task). Bad input
gets a 4xx JSON ``{"error": {"code", "message"}}``, never a 5xx: a wrong or missing token (401,
checked before any of the body is read), invalid JSON or UTF-8 (400), an unknown task or model (404),
a body that stalls (408), a body over ``max_body_bytes`` (413), wrong types, empty strings, too many
or too long texts, and texts the tokenizer cannot take (a lone surrogate: 422 naming ``field[i]``,
before the text joins a batch shared with other requests). A connection must send its request head
within ``--head-timeout-s``; ``--max-connections`` bounds open connections (503 above).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from encoderkit.config import StageConfig, arg, check, named_folders
from encoderkit.deploy.batching import BatchStats, MicroBatcher, token_counts
from encoderkit.deploy.openai_api import error_type, openai_router
from encoderkit.deploy.text_checks import text_problem
from encoderkit.errors import EncoderkitError
from encoderkit.inference.engines import AUTO_HELP
from encoderkit.inference.predictor import BACKENDS, Predictor, describe, finish_embeddings
from encoderkit.tasks import TASKS, get_task
from encoderkit.web.auth import token_ok as _token_ok

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


@dataclass
class Limits:
    """Per-request limits and the optional bearer token."""

    max_body_bytes: int = 1_000_000
    max_texts: int = 256
    max_chars: int = 20_000
    token: str | None = None
    body_timeout_s: float = 30.0


# /search: the search page's shell (a form, no data); its results come from /search/results, behind the token
PUBLIC_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/search"})


class ApiError(HTTPException):
    """A client error with a JSON body; an HTTPException so FastAPI's body parsing passes it through."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.code = code


# -- request bodies (strict types: a number where a string belongs is a 422, not a coercion) -----------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(None, description="Served model name; needed when several do this task.")


class ClassifyBody(_Body):
    texts: list[StrictStr] = Field(..., description="Texts to classify.")
    text_pairs: list[StrictStr] | None = Field(None, description="Second texts of sentence pairs, one per text.")


class ExtractBody(_Body):
    texts: list[StrictStr] = Field(..., description="Texts to tag; entities come with character offsets.")


class AnswerBody(_Body):
    questions: list[StrictStr]
    contexts: list[StrictStr] = Field(..., description="One context per question.")


class EmbedBody(_Body):
    texts: list[StrictStr]
    dim: StrictInt | None = Field(None, ge=1, description="Keep the first dim dimensions (Matryoshka), then renormalise.")
    normalize: StrictBool | None = Field(None, description="L2-normalise (default: the model's setting).")


class SparseBody(_Body):
    texts: list[StrictStr]
    top_k: StrictInt | None = Field(None, ge=1, description="Keep each text's top_k heaviest terms (default: all).")
    threshold: float = Field(0.0, ge=0, description="Keep terms whose weight is over this (default 0: every non-zero one).")


# -- metrics -----------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics of one app (its own registry, so two apps in a process never mix counts):
    requests by path and status, request latency, and per model call its items, padded tokens and
    the time its requests waited in the queue."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("encoderkit_requests", "HTTP requests by path and status.", ["path", "status"], registry=r)
        self.latency = Histogram("encoderkit_request_seconds", "Request latency in seconds.", ["path"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("encoderkit_batch_size", "Items per batched model call.", ["model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram("encoderkit_batch_tokens", "Padded tokens (longest item x items) per batched "
                                      "model call.", ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue = Histogram("encoderkit_queue_seconds", "Seconds a request waited in the queue for its first "
                               "model call.", ["model"], buckets=LATENCY_BUCKETS, registry=r)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        self.requests.labels(path, str(status)).inc()
        self.latency.labels(path).observe(seconds)

    def observe_batch(self, model: str, stats: BatchStats) -> None:
        self.batch_size.labels(model).observe(stats.items)
        self.batch_tokens.labels(model).observe(stats.tokens)
        queue = self.queue.labels(model)
        for w in stats.waits:
            queue.observe(w)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _Guard:
    """Outermost ASGI layer: the bearer token (401 before any of the body is read or parsed, so an unauthenticated
    client learns nothing of the schema), body-size limit (413), body read timeout (408: a client that sends its
    headers and stalls), and request metrics (path, status, latency)."""

    def __init__(self, app, limits: Limits, metrics: Metrics, known_paths: set[str]) -> None:
        self.app, self.limits, self.metrics, self.known = app, limits, metrics, known_paths
        self.token = limits.token.encode() if limits.token else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        path = scope["path"] if scope["path"] in self.known else "other"
        limit = self.limits.max_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        received, body_done = 0, False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # a later receive waits for the disconnect, for as long as the request runs
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.limits.body_timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(408, "request_timeout", f"the request body did not arrive within "
                                                       f"{self.limits.body_timeout_s:g} s", {"Connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ApiError(413, "body_too_large", f"request body is over the {limit}-byte limit")
            return message

        try:
            if self.token and scope["path"] not in PUBLIC_PATHS and not _token_ok(headers, self.token):
                await JSONResponse(_error_body("unauthorized", "missing or wrong bearer token (header "
                                               "'Authorization: Bearer <token>')", 401),
                                   status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send_and_record)
                return
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                await JSONResponse(_error_body("body_too_large", f"request body is over the {limit}-byte limit", 413),
                                   status_code=413)(scope, receive, send_and_record)
                return
            await self.app(scope, limited_receive, send_and_record)
        finally:
            self.metrics.observe_request(path, status[0], time.perf_counter() - start)


class FastJSONResponse(JSONResponse):
    """JSONResponse rendered by orjson: the same JSON values as ``json.dumps`` (floats in shortest round-trip
    form, so every number parses back to the same float), at a small fraction of the CPU on long float lists."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _error_body(code: str, message: str, status: int) -> dict[str, Any]:
    """Every error's body: encoderkit's ``code`` and ``message`` plus OpenAI's ``type`` and ``param``, so a client of
    either shape (the openai client included) reads errors raised before any route runs (401, 408, 413) too."""
    return {"error": {"code": code, "message": message, "type": error_type(status), "param": None}}


@dataclass
class _Served:
    name: str
    predictor: Predictor
    batcher: MicroBatcher


def create_app(models: dict[str, Predictor], limits: Limits | None = None, max_batch: int = 32,
               max_wait_ms: float = 5.0, max_batch_tokens: int | None = 16384, extra_routes: tuple = ()) -> FastAPI:
    """The ASGI app serving ``models`` (name -> Predictor); wrap-free, ready for uvicorn. A model call
    holds at most ``max_batch`` items and ``max_batch_tokens`` padded tokens (longest item x items). Each of
    ``extra_routes`` is called as ``add(app, check_texts)`` (e.g. /v1/search); the outermost layer has already
    checked the token of every request that reaches a route."""
    limits = limits or Limits()
    metrics = Metrics()
    served: dict[str, _Served] = {}
    for name, p in models.items():
        # the batched call, serve(p, items): the task's own, on items as its route parses them (texts or tuples)
        batcher = MicroBatcher(partial(get_task(p.task).serve, p), max_batch, max_wait_ms, name=name, max_batch_tokens=max_batch_tokens,
                               on_batch=lambda stats, m=name: metrics.observe_batch(m, stats),
                               cost=lambda items, p=p: token_counts(getattr(p, "tokenizer", None), items, p.max_length))
        served[name] = _Served(name, p, batcher)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for s in served.values():
            await s.batcher.start()
        yield
        for s in served.values():  # uvicorn has finished the requests in flight; drain what is queued
            await s.batcher.close()

    app = FastAPI(title="encoderkit", version="1", lifespan=lifespan,
                  description="Encoder models: " + ", ".join(f"{n} ({p.task})" for n, p in models.items()))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = getattr(exc, "code", None) or {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "error")
        return JSONResponse(_error_body(code, str(exc.detail), exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(_error_body("invalid_json", "the request body is not valid JSON", 400), status_code=400)
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]]
        return JSONResponse(_error_body("invalid_request", "; ".join(parts), 422), status_code=422)

    endpoint_of = {s.name: get_task(s.predictor.task).endpoint for s in served.values()}  # a route serves its tasks' models
    accepted = ", ".join(f"/v1/{endpoint_of[s.name]} (model {s.name})" for s in served.values())  # for error messages

    def pick(endpoint: str, name: str | None) -> _Served:
        task = " or ".join(t for t in TASKS if get_task(t).endpoint == endpoint)  # what the route's models do
        able = [s for s in served.values() if endpoint_of[s.name] == endpoint]
        if name is not None:
            if name not in served:
                raise ApiError(404, "unknown_model", f"no model named {name!r}; served: {accepted}")
            if endpoint_of[name] != endpoint:
                raise ApiError(404, "wrong_task", f"model {name!r} does not do {task}; it accepts: {accepted}")
            return served[name]
        if not able:
            raise ApiError(404, "task_not_served", f"no served model does {task}; this server accepts: {accepted}")
        if len(able) > 1:
            raise ApiError(422, "model_required", f"several models do {task} ({', '.join(s.name for s in able)}); "
                                                  f"name one in the 'model' field")
        return able[0]

    def check_texts(field: str, texts: list[str], allow_empty_list: bool = False) -> None:
        problem = text_problem(field, texts, limits.max_texts, limits.max_chars, allow_empty_list)
        if problem is not None:
            raise ApiError(422, "invalid_request" if problem.code == "empty_input" else problem.code, problem.message)

    async def run_batch(s: _Served, items: list[Any]) -> list[Any]:
        try:
            return await s.batcher.submit(items)
        except EncoderkitError as e:
            raise ApiError(422, "invalid_request", str(e)) from e

    @app.post("/v1/classify")
    async def classify(body: ClassifyBody) -> dict[str, Any]:
        s = pick("classify", body.model)
        check_texts("texts", body.texts)
        items: list[Any] = list(body.texts)
        if body.text_pairs is not None:
            check_texts("text_pairs", body.text_pairs)
            if len(body.text_pairs) != len(body.texts):
                raise ApiError(422, "invalid_request", f"{len(body.text_pairs)} text_pairs for {len(body.texts)} texts")
            items = list(zip(body.texts, body.text_pairs, strict=True))
        return {"model": s.name, "results": await run_batch(s, items)}

    @app.post("/v1/extract")
    async def extract(body: ExtractBody) -> dict[str, Any]:
        s = pick("extract", body.model)
        check_texts("texts", body.texts)
        return {"model": s.name, "results": await run_batch(s, list(body.texts))}

    @app.post("/v1/answer")
    async def answer(body: AnswerBody) -> dict[str, Any]:
        s = pick("answer", body.model)
        check_texts("questions", body.questions)
        check_texts("contexts", body.contexts)
        if len(body.questions) != len(body.contexts):
            raise ApiError(422, "invalid_request", f"{len(body.questions)} questions but {len(body.contexts)} contexts")
        return {"model": s.name, "results": await run_batch(s, list(zip(body.questions, body.contexts, strict=True)))}

    @app.post("/v1/embed")
    async def embed(body: EmbedBody) -> JSONResponse:
        s = pick("embed", body.model)
        check_texts("texts", body.texts)
        import numpy as np

        raw = np.stack(await run_batch(s, list(body.texts)))
        if body.dim is not None and body.dim > raw.shape[1]:
            raise ApiError(422, "invalid_request", f"dim={body.dim} is over the model's {raw.shape[1]} dimensions")
        normalize = s.predictor.info.normalize if body.normalize is None else body.normalize
        vectors = finish_embeddings(raw, body.dim, normalize)
        # a ready response skips FastAPI's per-float jsonable_encoder walk, and orjson writes 384 floats per text
        # ~20x faster than json.dumps (which was ~40% of the app's CPU per one-text request)
        return FastJSONResponse({"model": s.name, "dim": int(vectors.shape[1]), "embeddings": vectors.tolist()})

    @app.post("/v1/embed_sparse")
    async def embed_sparse(body: SparseBody) -> JSONResponse:
        """Learned sparse vectors (a ``--task sparse`` model) as ``{token: weight}`` per text, heaviest first."""
        s = pick("embed_sparse", body.model)
        check_texts("texts", body.texts)
        rows = await run_batch(s, list(body.texts))
        terms = get_task(s.predictor.task).terms(s.predictor, rows, body.top_k or 0, body.threshold)
        return FastJSONResponse({"model": s.name, "results": terms})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # no folder: an unauthenticated caller learns nothing of the host's file system
        return {"status": "ok", "models": {n: {k: v for k, v in describe(s.predictor).items() if k != "folder"}
                                           for n, s in served.items()}}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_page() -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    peer_routes = openai_router(served, None, limits.max_texts, limits.max_chars)  # _Guard checked the token
    app.include_router(peer_routes)
    for add in extra_routes:
        add(app, check_texts)
    known = {r.path for r in [*app.routes, *peer_routes.routes] if hasattr(r, "path")}
    app.add_middleware(_Guard, limits=limits, metrics=metrics, known_paths=known)
    app.state.metrics = metrics
    return app


def guarded_protocol(head_timeout_s: float, max_head_bytes: int) -> type:
    """uvicorn's HTTP/1.1 protocol (httptools when installed, else h11) with what it lacks: a connection must
    send a complete request head within ``head_timeout_s`` of connecting (or of its previous response), in at
    most ``max_head_bytes``, or it is closed. Without this a client that connects and sends nothing, or trickles
    its headers, holds its connection (and a slot of ``limit_concurrency``) for ever; uvicorn's keep-alive timer
    only runs between requests and any byte cancels it."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def _in_request(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is not None and not cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self._in_request() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._disarm()
            else:
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes and not self.transport.is_closing():
                    self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHTTPProtocol


def server_options(head_timeout_s: float = 10.0, keep_alive_s: float = 5.0, max_connections: int = 1000,
                   max_head_bytes: int = 65_536) -> dict[str, Any]:
    """The uvicorn settings that bound what slow or idle clients can hold (for ``uvicorn.run`` / ``Config``):
    head timeout and size (:func:`guarded_protocol`), keep-alive, and a connection limit (503 above it)."""
    return {"http": guarded_protocol(head_timeout_s, max_head_bytes), "timeout_keep_alive": keep_alive_s,
            "limit_concurrency": max_connections, "h11_max_incomplete_event_size": max_head_bytes}


def parse_models(specs: list[str]) -> dict[str, Path]:
    """``["DIR", "name=DIR"]`` -> {name: folder}; a bare DIR is named after its folder."""
    return named_folders(specs, "model")


@dataclass
class ServeConfig(StageConfig):
    """Settings of ``encoderkit serve``."""

    model: list[str] = arg(help="Model folders, as DIR or name=DIR; repeat for several.", required=True)
    host: str = arg("127.0.0.1", help="Address to listen on (0.0.0.0 exposes the service to the network).")
    port: int = arg(8000, help="TCP port.")
    backend: str = arg("auto", help="Inference backend for every model; " + AUTO_HELP, choices=BACKENDS)
    max_body_bytes: int = arg(1_000_000, help="Largest accepted request body (413 above).")
    max_texts: int = arg(256, help="Most texts per request (422 above).")
    max_chars: int = arg(20_000, help="Most characters per text (422 above).")
    token_env: str = arg("ENCODERKIT_TOKEN", help="Environment variable holding the bearer token; unset = no auth.")
    max_batch: int = arg(32, help="Most texts per batched model call.", speed=True)
    max_wait_ms: float = arg(5.0, help="How long a batch waits for more requests.", speed=True)
    max_batch_tokens: int = arg(16384, help="Most padded tokens (longest text x texts) per batched model call; "
                                            "requests are batched oldest first within it.", speed=True)
    threads: int | None = arg(None, help="onnxruntime intra-op threads per model.", speed=True)
    head_timeout_s: float = arg(10.0, help="Seconds a connection has to send a complete request head (after "
                                           "connecting, or after its previous response); then it is closed.")
    body_timeout_s: float = arg(30.0, help="Seconds to wait for each part of a request body; a stalled body gets 408.")
    keep_alive_s: float = arg(5.0, help="Seconds an idle keep-alive connection stays open between requests.")
    max_connections: int = arg(1000, help="Most open connections (and requests in progress); more get 503.")
    max_head_bytes: int = arg(65_536, help="Largest request head (request line and headers); a longer one is closed.")
    index: list[str] = arg([], help="Search index folders (encoderkit index), as DIR or name=DIR: POST /v1/search.")
    access_log: bool = arg(False, help="Log one line per request (off by default: it costs CPU per request, and "
                                       "/metrics counts requests by path and status).")

    def validate(self) -> None:
        check(0 < self.port < 65536, f"--port {self.port} is not a TCP port")
        check(self.max_batch_tokens >= 1, "--max-batch-tokens must be positive")
        check(self.max_batch >= 1 and self.max_texts >= 1 and self.max_chars >= 1 and self.max_body_bytes >= 1,
              "--max-batch, --max-texts, --max-chars and --max-body-bytes must be positive")
        check(min(self.head_timeout_s, self.body_timeout_s, self.keep_alive_s) > 0
              and self.max_connections >= 1 and self.max_head_bytes >= 1024,
              "--head-timeout-s, --body-timeout-s and --keep-alive-s must be positive, --max-connections at least 1 "
              "and --max-head-bytes at least 1024")


def load_models(specs: list[str], backend: str = "auto", threads: int | None = None, max_batch: int = 32) -> dict[str, Predictor]:
    return {name: Predictor.load(folder, backend=backend, threads=threads, max_batch=max_batch, spin=False)
            for name, folder in parse_models(specs).items()}


def _freeze_startup_heap() -> None:
    """Move every object alive after loading (transformers, onnxruntime, tokenizers, the app: ~240k objects
    with MiniLM) out of the cyclic garbage collector's view. Left in, each full (gen-2) collection under
    load walks them all and stops the event loop and the batch worker for 0.3-2 s (measured on 2 shared
    cores): every request in flight waits, which was the long tail (p99 ~7x p50 at 64 clients). Only
    ``serve``'s own process does this; it owns the process, as the CLI does threads."""
    import gc

    gc.collect()
    gc.freeze()


def run(cfg: ServeConfig) -> None:
    """Serve task models over HTTP (classify/extract/answer/rerank/embed, /health, /metrics, /docs).

    Example: ENCODERKIT_TOKEN=secret encoderkit serve --model sst2=runs/sst2 --model embed=runs/minilm --port 8000
    """
    import uvicorn

    models = load_models(cfg.model, cfg.backend, cfg.threads, cfg.max_batch)
    limits = Limits(cfg.max_body_bytes, cfg.max_texts, cfg.max_chars, os.environ.get(cfg.token_env) or None,
                    cfg.body_timeout_s)
    extra = ()
    if cfg.index:
        from encoderkit.retrieval.http import search_routes

        extra = (search_routes(cfg.index, threads=cfg.threads),)
    app = create_app(models, limits, cfg.max_batch, cfg.max_wait_ms, cfg.max_batch_tokens, extra)
    for name, p in models.items():
        print(f"serving {name}: {p.task} from {p.folder} on {p.backend} ({p.backend_reason})")
    _freeze_startup_heap()
    # loop "auto": uvloop when installed (uvicorn[standard]); the protocol is uvicorn's auto choice (httptools, else h11)
    uvicorn.run(app, host=cfg.host, port=cfg.port, timeout_graceful_shutdown=30, log_level="info",
                access_log=cfg.access_log, loop="auto",
                **server_options(cfg.head_timeout_s, cfg.keep_alive_s, cfg.max_connections, cfg.max_head_bytes))


class BackgroundServer:
    """A real uvicorn server on 127.0.0.1 in a thread (tests, benchmarks): ``with BackgroundServer(app) as url:``.
    ``options``: uvicorn settings, by default :func:`server_options`'s."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=10, **{**server_options(), **options}))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

