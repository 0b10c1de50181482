"""``encoderkit serve``: an HTTP service over one or more task models, with micro-batching.

Endpoints (JSON in, JSON out; OpenAPI page at ``/docs``):

* ``POST /v1/classify`` ``{"texts": [...], "text_pairs": [...]?}`` -> ``{"results": [{label, score, scores}]}``
* ``POST /v1/extract``  ``{"texts": [...]}`` -> ``{"results": [[{entity, label, start, end, score}]]}``
* ``POST /v1/answer``   ``{"questions": [...], "contexts": [...]}`` -> ``{"results": [{answer, start, end, score}]}``
* ``POST /v1/rerank``   ``{"query": "...", "passages": [...], "top_k": n?}`` -> ``{"results": [{index, score}]}``
* ``POST /v1/embed``    ``{"texts": [...], "dim": n?, "normalize": bool?}`` -> ``{"embeddings": [[...]]}``
* ``GET /health``, ``GET /metrics`` (Prometheus text format).

Every body may name a ``model`` (needed when several served models do the same task). Bad input
gets a 4xx JSON ``{"error": {"code", "message"}}``, never a 5xx: invalid JSON or UTF-8 (400), a
wrong or missing token (401), an unknown task or model (404), a body over ``max_body_bytes`` (413),
wrong types, empty strings, too many texts or too long texts (422).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from encoderkit.config import StageConfig, arg, check
from encoderkit.deploy.batching import MicroBatcher
from encoderkit.deploy.runtime import BACKENDS, Predictor, describe, finish_embeddings
from encoderkit.errors import EncoderkitError

ENDPOINT_TASK = {"classify": "classify", "extract": "ner", "answer": "qa", "rerank": "rerank", "embed": "embed"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Limits:
    """Per-request limits and the optional bearer token."""

    max_body_bytes: int = 1_000_000
    max_texts: int = 256
    max_chars: int = 20_000
    token: str | None = None


class ApiError(HTTPException):
    """A client error with a JSON body; an HTTPException so FastAPI's body parsing passes it through."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status_code=status, detail=message)
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


class RerankBody(_Body):
    query: StrictStr
    passages: list[StrictStr]
    top_k: StrictInt | None = Field(None, ge=1, description="Return only the best k passages.")


class EmbedBody(_Body):
    texts: list[StrictStr]
    dim: StrictInt | None = Field(None, ge=1, description="Keep the first dim dimensions (Matryoshka), then renormalise.")
    normalize: StrictBool | None = Field(None, description="L2-normalise (default: the model's setting).")


# -- metrics -----------------------------------------------------------------------------------
class Metrics:
    """Request counts, latency and batch-size histograms, written as Prometheus text by hand."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.latency: dict[str, list[int]] = {}
        self.latency_sum: dict[str, float] = {}
        self.batches: dict[str, list[int]] = {}
        self.batch_sum: dict[str, int] = {}

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1
            counts = self.latency.setdefault(path, [0] * (len(LATENCY_BUCKETS) + 1))
            counts[sum(seconds > b for b in LATENCY_BUCKETS)] += 1
            self.latency_sum[path] = self.latency_sum.get(path, 0.0) + seconds

    def observe_batch(self, model: str, size: int) -> None:
        with self._lock:
            counts = self.batches.setdefault(model, [0] * (len(BATCH_BUCKETS) + 1))
            counts[sum(size > b for b in BATCH_BUCKETS)] += 1
            self.batch_sum[model] = self.batch_sum.get(model, 0) + size

    @staticmethod
    def _histogram(name: str, label: str, key: str, counts: list[int], total: float, buckets: tuple) -> list[str]:
        lines, cum = [], 0
        for b, c in zip(buckets, counts, strict=False):
            cum += c
            lines.append(f'{name}_bucket{{{label}="{key}",le="{b}"}} {cum}')
        cum += counts[-1]
        lines += [f'{name}_bucket{{{label}="{key}",le="+Inf"}} {cum}', f'{name}_sum{{{label}="{key}"}} {total}',
                  f'{name}_count{{{label}="{key}"}} {cum}']
        return lines

    def render(self) -> str:
        with self._lock:
            out = ["# HELP encoderkit_requests_total HTTP requests by path and status.",
                   "# TYPE encoderkit_requests_total counter"]
            out += [f'encoderkit_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())]
            out += ["# HELP encoderkit_request_seconds Request latency in seconds.",
                    "# TYPE encoderkit_request_seconds histogram"]
            for p, counts in sorted(self.latency.items()):
                out += self._histogram("encoderkit_request_seconds", "path", p, counts, self.latency_sum[p], LATENCY_BUCKETS)
            out += ["# HELP encoderkit_batch_size Items per batched model call.", "# TYPE encoderkit_batch_size histogram"]
            for m, counts in sorted(self.batches.items()):
                out += self._histogram("encoderkit_batch_size", "model", m, counts, self.batch_sum[m], BATCH_BUCKETS)
        return "\n".join(out) + "\n"


class _Guard:
    """Outermost ASGI layer: body-size limit (413) and request metrics (path, status, latency)."""

    def __init__(self, app, limits: Limits, metrics: Metrics, known_paths: set[str]) -> None:
        self.app, self.limits, self.metrics, self.known = app, limits, metrics, known_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        path = scope["path"] if scope["path"] in self.known else "other"
        limit = self.limits.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ApiError(413, "body_too_large", f"request body is over the {limit}-byte limit")
            return message

        try:
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                await JSONResponse(_error_body("body_too_large", f"request body is over the {limit}-byte limit"),
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


def _error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


@dataclass
class _Served:
    name: str
    predictor: Predictor
    batcher: MicroBatcher


def _batched_fn(p: Predictor):
    """The per-item function the batcher calls for ``p``'s task (items: texts or tuples)."""
    if p.task == "classify":
        return lambda items: p.classify(items)
    if p.task == "ner":
        return lambda items: p.extract(items)
    if p.task == "qa":
        return lambda items: p.answer([q for q, _ in items], [c for _, c in items])
    if p.task == "rerank":
        return lambda items: p.score_pairs([q for q, _ in items], [d for _, d in items]).tolist()
    return lambda items: list(p.embed_raw(items))


def create_app(models: dict[str, Predictor], limits: Limits | None = None, max_batch: int = 32,
               max_wait_ms: float = 5.0, extra_routes: tuple = ()) -> FastAPI:
    """The ASGI app serving ``models`` (name -> Predictor); wrap-free, ready for uvicorn. Each of
    ``extra_routes`` is called as ``add(app, check_token, check_texts)`` (e.g. /v1/search)."""
    limits = limits or Limits()
    metrics = Metrics()
    served: dict[str, _Served] = {}
    for name, p in models.items():
        served[name] = _Served(name, p, MicroBatcher(_batched_fn(p), max_batch, max_wait_ms,
                                                     on_batch=lambda n, m=name: metrics.observe_batch(m, n), name=name))

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
        return JSONResponse(_error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(_error_body("invalid_json", "the request body is not valid JSON"), status_code=400)
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]]
        return JSONResponse(_error_body("invalid_request", "; ".join(parts)), status_code=422)

    def check_token(request: Request) -> None:
        if not limits.token:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), limits.token.encode()):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token (header 'Authorization: Bearer <token>')")

    def pick(endpoint: str, name: str | None) -> _Served:
        task = ENDPOINT_TASK[endpoint]
        able = [s for s in served.values() if s.predictor.task == task]
        accepted = ", ".join(f"/v1/{e} (model {s.name})" for s in served.values()
                             for e, t in ENDPOINT_TASK.items() if t == s.predictor.task)
        if name is not None:
            if name not in served:
                raise ApiError(404, "unknown_model", f"no model named {name!r}; served: {accepted}")
            if served[name].predictor.task != task:
                raise ApiError(404, "wrong_task", f"model {name!r} does not do {task}; it accepts: {accepted}")
            return served[name]
        if not able:
            raise ApiError(404, "task_not_served", f"no served model does {task}; this server accepts: {accepted}")
        if len(able) > 1:
            raise ApiError(422, "model_required", f"several models do {task} ({', '.join(s.name for s in able)}); "
                                                  f"name one in the 'model' field")
        return able[0]

    def check_texts(field: str, texts: list[str], allow_empty_list: bool = False) -> None:
        if not texts and not allow_empty_list:
            raise ApiError(422, "invalid_request", f"{field}: give at least one text")
        if len(texts) > limits.max_texts:
            raise ApiError(422, "too_many_texts", f"{field}: {len(texts)} texts, more than the limit of {limits.max_texts}")
        for i, t in enumerate(texts):
            if not t.strip():
                raise ApiError(422, "empty_text", f"{field}[{i}] is empty")
            if len(t) > limits.max_chars:
                raise ApiError(422, "text_too_long", f"{field}[{i}] has {len(t)} characters, over the limit of {limits.max_chars}")

    async def run_batch(s: _Served, items: list[Any]) -> list[Any]:
        try:
            return await s.batcher.submit(items)
        except EncoderkitError as e:
            raise ApiError(422, "invalid_request", str(e)) from e

    @app.post("/v1/classify")
    async def classify(body: ClassifyBody, request: Request) -> dict[str, Any]:
        check_token(request)
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
    async def extract(body: ExtractBody, request: Request) -> dict[str, Any]:
        check_token(request)
        s = pick("extract", body.model)
        check_texts("texts", body.texts)
        return {"model": s.name, "results": await run_batch(s, list(body.texts))}

    @app.post("/v1/answer")
    async def answer(body: AnswerBody, request: Request) -> dict[str, Any]:
        check_token(request)
        s = pick("answer", body.model)
        check_texts("questions", body.questions)
        check_texts("contexts", body.contexts)
        if len(body.questions) != len(body.contexts):
            raise ApiError(422, "invalid_request", f"{len(body.questions)} questions but {len(body.contexts)} contexts")
        return {"model": s.name, "results": await run_batch(s, list(zip(body.questions, body.contexts, strict=True)))}

    @app.post("/v1/rerank")
    async def rerank(body: RerankBody, request: Request) -> dict[str, Any]:
        check_token(request)
        s = pick("rerank", body.model)
        check_texts("query", [body.query])
        check_texts("passages", body.passages)
        scores = await run_batch(s, [(body.query, d) for d in body.passages])
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_k]
        return {"model": s.name, "results": [{"index": i, "score": float(scores[i])} for i in ranked]}

    @app.post("/v1/embed")
    async def embed(body: EmbedBody, request: Request) -> JSONResponse:
        check_token(request)
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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": {n: describe(s.predictor) for n, s in served.items()}}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_page(request: Request) -> PlainTextResponse:
        check_token(request)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    for add in extra_routes:
        add(app, check_token, check_texts)
    known = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(_Guard, limits=limits, metrics=metrics, known_paths=known)
    app.state.metrics = metrics
    return app


def parse_models(specs: list[str]) -> dict[str, Path]:
    """``["DIR", "name=DIR"]`` -> {name: folder}; a bare DIR is named after its folder."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep:
            name, folder = Path(spec).name or "model", spec
        if not name or name in out:
            raise EncoderkitError(f"--model {spec!r}: model names must be unique and non-empty (use name=DIR)")
        out[name] = Path(folder)
    return out


@dataclass
class ServeConfig(StageConfig):
    """Settings of ``encoderkit serve``."""

    model: list[str] = arg(help="Model folders, as DIR or name=DIR; repeat for several.", required=True)
    host: str = arg("127.0.0.1", help="Address to listen on (0.0.0.0 exposes the service to the network).")
    port: int = arg(8000, help="TCP port.")
    backend: str = arg("auto", help="Inference backend for every model.", choices=BACKENDS)
    max_body_bytes: int = arg(1_000_000, help="Largest accepted request body (413 above).")
    max_texts: int = arg(256, help="Most texts per request (422 above).")
    max_chars: int = arg(20_000, help="Most characters per text (422 above).")
    token_env: str = arg("ENCODERKIT_TOKEN", help="Environment variable holding the bearer token; unset = no auth.")
    max_batch: int = arg(32, help="Most texts per batched model call.", speed=True)
    max_wait_ms: float = arg(5.0, help="How long a batch waits for more requests.", speed=True)
    threads: int | None = arg(None, help="onnxruntime intra-op threads per model.", speed=True)
    index: list[str] = arg([], help="Search index folders (encoderkit index), as DIR or name=DIR: POST /v1/search.")
    access_log: bool = arg(False, help="Log one line per request (off by default: it costs CPU per request, and "
                                       "/metrics counts requests by path and status).")

    def validate(self) -> None:
        check(0 < self.port < 65536, f"--port {self.port} is not a TCP port")
        check(self.max_batch >= 1 and self.max_texts >= 1 and self.max_chars >= 1 and self.max_body_bytes >= 1,
              "--max-batch, --max-texts, --max-chars and --max-body-bytes must be positive")


def load_models(specs: list[str], backend: str = "auto", threads: int | None = None, max_batch: int = 32) -> dict[str, Predictor]:
    return {name: Predictor.load(folder, backend=backend, threads=threads, max_batch=max_batch, spin=False)
            for name, folder in parse_models(specs).items()}


def run(cfg: ServeConfig) -> None:
    """Serve task models over HTTP (classify/extract/answer/rerank/embed, /health, /metrics, /docs).

    Example: ENCODERKIT_TOKEN=secret encoderkit serve --model sst2=runs/sst2 --model embed=runs/minilm --port 8000
    """
    import uvicorn

    models = load_models(cfg.model, cfg.backend, cfg.threads, cfg.max_batch)
    limits = Limits(cfg.max_body_bytes, cfg.max_texts, cfg.max_chars, os.environ.get(cfg.token_env) or None)
    extra = ()
    if cfg.index:
        from encoderkit.retrieval.http import search_routes

        extra = (search_routes(cfg.index, threads=cfg.threads),)
    app = create_app(models, limits, cfg.max_batch, cfg.max_wait_ms, extra)
    for name, p in models.items():
        print(f"serving {name}: {p.task} from {p.folder} on {p.backend}")
    # loop/http "auto": uvloop and httptools when installed (uvicorn[standard]), else asyncio and h11
    uvicorn.run(app, host=cfg.host, port=cfg.port, timeout_graceful_shutdown=30, log_level="info",
                access_log=cfg.access_log, loop="auto", http="auto")


class BackgroundServer:
    """A real uvicorn server on 127.0.0.1 in a thread (tests, benchmarks): ``with BackgroundServer(app) as url:``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=10))
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

