"""``encoderkit serve``: an HTTP service over one or more task models, with micro-batching.

Routes: ``POST /v1/`` classify, extract, answer, rerank, embed and embed_sparse (bodies below; OpenAPI at
``/docs``), the peers' routes of :mod:`~encoderkit.deploy.openai_api`, ``/health`` and ``/metrics``. Bad input gets
a 4xx JSON ``{"error": {"code", "message"}}``, never a 5xx, before it joins a batch shared with other requests.
Token and body limits are :mod:`~encoderkit.deploy.guard`'s, connection limits :mod:`~encoderkit.deploy.protocol`'s.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from encoderkit import hardware
from encoderkit.config import StageConfig, arg, check, named_folders
from encoderkit.deploy.batching import MicroBatcher, QueueFull, TokenTap, token_counts
from encoderkit.deploy.guard import ApiError, Limits, RequestGuard, error_body
from encoderkit.deploy.metrics import REFUSALS, Metrics
from encoderkit.deploy.openai_api import openai_router
from encoderkit.deploy.protocol import server_options
from encoderkit.deploy.text_checks import count_problem, item_problem, text_problem
from encoderkit.errors import EncoderkitError
from encoderkit.inference.policy import AUTO_HELP
from encoderkit.inference.predictor import BACKENDS, Predictor, describe, finish_embeddings
from encoderkit.retrieval.http import search_routes
from encoderkit.tasks import TASKS, get_task


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
    dim: StrictInt | None = Field(None, ge=1,
                                  description="Keep the first dim dimensions (Matryoshka), then renormalise.")
    normalize: StrictBool | None = Field(None, description="L2-normalise (default: the model's setting).")


class SparseBody(_Body):
    texts: list[StrictStr]
    top_k: StrictInt | None = Field(None, ge=1, description="Keep each text's top_k heaviest terms (default: all).")
    threshold: float = Field(0.0, ge=0,
                             description="Keep terms whose weight is over this (default 0: every non-zero one).")


class FastJSONResponse(JSONResponse):
    """JSONResponse rendered by orjson: the same JSON values as ``json.dumps`` (floats in shortest round-trip
    form, so every number parses back to the same float), at a small fraction of the CPU on long float lists."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class JsonBody:
    """ASGI layer: a request body is read as JSON whatever content type the client declares. Every route takes JSON,
    and ``curl -d`` (as many clients) sends ``application/x-www-form-urlencoded``, which FastAPI would otherwise
    read as form fields and refuse."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


@dataclass
class _Served:
    name: str
    predictor: Predictor
    batcher: MicroBatcher


def _counted_call(p: Predictor, items: list[Any]) -> tuple[list[Any], list[int | None]]:
    """The task's batched call on ``p`` and each item's token count as the call's own tokenizing found it (None
    where it did not show: a task that reads windows): each text is tokenized once, by the call that computes it."""
    tokenizer = getattr(p, "tokenizer", None)
    if tokenizer is None:
        return get_task(p.task).serve(p, items), [None] * len(items)
    tap = TokenTap(tokenizer)
    results = get_task(p.task).serve(_Tapped(p, tap), items)
    return results, [tap.counts.get(x if isinstance(x, str) else tuple(x)) for x in items]


class _Tapped:
    """``p`` as the task's runner, with ``tap`` as its tokenizer (everything else is ``p``'s own)."""

    def __init__(self, p: Predictor, tap: TokenTap) -> None:
        self._p, self.tokenizer = p, tap

    def __getattr__(self, name: str) -> Any:
        return getattr(self._p, name)


WARM_ROWS, WARM_LENGTH = 16, 64  # the short lane's engine is warmed on batches up to this size (:func:`_warm`)


def lanes(p: Predictor) -> tuple[Predictor, Callable[[], Predictor]] | None:
    """MicroBatcher's ``short_lane`` and ``long_lane`` for ``p``: ``p`` on an engine of its own with all but one of its
    threads, and a maker of ``p`` on a one-thread engine (made in the long lane's thread, whose priority its threads
    inherit), where the engine opens such sessions (``lane``) and has 2 threads or more; else None (one call at a time
    on every thread). The short lane's engine is warmed in the background (:func:`_warm`)."""
    engine = getattr(p, "engine", None)
    lane = getattr(engine, "lane", None)
    width = getattr(engine, "threads", None) or hardware.usable_threads()
    if lane is None or width < 2:
        return None
    short = copy.copy(p)
    short.engine = lane(width - 1)
    threading.Thread(target=_warm, args=(short.engine,), name="lane-warm", daemon=True).start()

    def long() -> Predictor:
        runner = copy.copy(p)
        runner.engine = lane(1)
        return runner

    return short, long


def _warm(engine: Any, rows: int = WARM_ROWS, length: int = WARM_LENGTH) -> None:
    """Run ``engine`` once on each batch shape of up to ``rows`` texts of up to ``length`` tokens: an engine that
    prepares kernels per input shape (``length_step``: OpenVINO's) then has the short batches' shapes ready before
    long texts first send them to it. At the service's own priority: a call of the short lane that comes meanwhile
    waits for one warm-up call (the engine's lock), which a low priority would make long on a busy machine."""
    step = int(getattr(engine, "length_step", 0))
    if step <= 1:
        return
    with contextlib.suppress(Exception):  # a warm-up only: a real call reports its own errors
        for n in range(step, length + 1, step):
            for b in range(1, rows + 1):
                ones = np.ones((b, n), dtype=np.int64)
                engine.run({"input_ids": ones, "attention_mask": ones})


def create_app(models: dict[str, Predictor], limits: Limits | None = None, max_batch: int = 32,
               max_wait_ms: float = 5.0, max_batch_tokens: int | None = 16384, extra_routes: tuple = (), *,
               max_queue_texts: int | None = None, max_queue_wait_s: float | None = None,
               fair_tokens: int = 256, long_lane: bool = True) -> FastAPI:
    """The ASGI app serving ``models`` (name -> Predictor); wrap-free, ready for uvicorn. A model call
    holds at most ``max_batch`` items and ``max_batch_tokens`` padded tokens (longest item x items). Each of
    ``extra_routes`` is called as ``add(app, check_texts)`` (e.g. /v1/search); the outermost layer has already
    checked the token of every request that reaches a route. Each model's queue holds at most ``max_queue_texts``
    texts and ``max_queue_wait_s`` seconds of waiting (503 with Retry-After above), shared between clients with
    ``fair_tokens`` of credit per batch each (:mod:`~encoderkit.deploy.batching`); with ``long_lane``, long texts
    run beside the short ones' batches on a thread of their own where the engine can (:func:`lanes`)."""
    limits = limits or Limits()
    metrics = Metrics()
    served: dict[str, _Served] = {}
    for name, p in models.items():
        # the batched call, serve(p, items): the task's own, on items as its route parses them (texts or tuples),
        # with each item's token count from its own tokenizing
        pair = lanes(p) if long_lane else None
        batcher = MicroBatcher(partial(_counted_call, p), max_batch, max_wait_ms, name=name, counted=True,
                               max_batch_tokens=max_batch_tokens, max_queue_items=max_queue_texts,
                               max_queue_wait_s=max_queue_wait_s, fair_tokens=fair_tokens,
                               on_batch=lambda stats, m=name: metrics.observe_batch(m, stats),
                               # what the call did not count (a stand-in tokenizer at its cut), counted up to one
                               # token past what the model reads: more means truncated
                               cost=lambda items, p=p: token_counts(getattr(p, "tokenizer", None), items,
                                                                    p.max_length + 1),
                               short_lane=pair and partial(_counted_call, pair[0]),
                               long_lane=pair and (lambda make=pair[1]: partial(_counted_call, make())))
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
        return JSONResponse(error_body(code, str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(QueueFull)
    async def _busy(request: Request, exc: QueueFull) -> JSONResponse:
        client = request.client.host if request.client else None
        REFUSALS.note("requests refused by a full queue (503)", client)
        return JSONResponse(error_body("overloaded", str(exc), 503), status_code=503,
                            headers={"Retry-After": str(max(1, min(60, math.ceil(exc.retry_after))))})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(error_body("invalid_json", "the request body is not valid JSON", 400), status_code=400)
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                 for e in errors[:5]]
        return JSONResponse(error_body("invalid_request", "; ".join(parts), 422), status_code=422)

    # a route serves its tasks' models
    endpoint_of = {s.name: get_task(s.predictor.task).endpoint for s in served.values()}
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

    def sort_out(columns: dict[str, list[str]]) -> tuple[list[int], list[dict[str, Any]]]:
        """The request's item count checked (--max-texts), then each item's texts: the indices of the items to run,
        and an error entry for each other one. One bad item fails alone; when every item is bad, the request does."""
        for field, texts in columns.items():
            problem = count_problem(field, texts, limits.max_texts)
            if problem is not None:
                raise ApiError(422, "invalid_request" if problem.code == "empty_input" else problem.code,
                               problem.message)
        ok: list[int] = []
        errors: list[dict[str, Any]] = []
        for i in range(len(next(iter(columns.values())))):
            problem = next((q for f, texts in columns.items()
                            if (q := item_problem(f, i, texts[i], limits.max_chars)) is not None), None)
            if problem is None:
                ok.append(i)
            else:
                errors.append({"index": i, "param": problem.param, "code": problem.code, "message": problem.message})
        if not ok:
            more = f" (and {len(errors) - 1} more items)" if len(errors) > 1 else ""
            raise ApiError(422, errors[0]["code"], errors[0]["message"] + more)
        return ok, errors

    async def answer(s: _Served, items: list[Any], ok: list[int], exact: bool = True) -> tuple[list[Any], list[int]]:
        """Results of ``items[i]`` for ``i`` in ``ok`` in their places (None elsewhere), and the indices of the items
        longer than the model reads (truncated to it; ``exact=False``: not needed, never counted again)."""
        run = [items[i] for i in ok]
        limit = s.predictor.max_length
        try:  # tokenized once, by the model call (MicroBatcher.submit_counted)
            got, counts = await s.batcher.submit_counted(run, limit, exact)
        except EncoderkitError as e:
            raise ApiError(422, "invalid_request", str(e)) from e
        out: list[Any] = [None] * len(items)
        for i, r in zip(ok, got, strict=True):
            out[i] = r
        return out, [i for i, c in zip(ok, counts, strict=True) if c > limit]

    @app.post("/v1/classify")
    async def classify(body: ClassifyBody) -> dict[str, Any]:
        """``results[i]``: text i's labels (None for a bad item, described in ``errors``); ``truncated``: the items
        longer than the model reads, cut to it."""
        s = pick("classify", body.model)
        columns = {"texts": body.texts}
        items: list[Any] = list(body.texts)
        if body.text_pairs is not None:
            if len(body.text_pairs) != len(body.texts):
                raise ApiError(422, "invalid_request", f"{len(body.text_pairs)} text_pairs for {len(body.texts)} texts")
            columns["text_pairs"] = body.text_pairs
            items = list(zip(body.texts, body.text_pairs, strict=True))
        ok, errors = sort_out(columns)
        results, truncated = await answer(s, items, ok)
        return {"model": s.name, "results": results, "truncated": truncated, "errors": errors}

    @app.post("/v1/extract")
    async def extract(body: ExtractBody) -> dict[str, Any]:
        """Long texts are read in overlapping windows, never truncated."""
        s = pick("extract", body.model)
        ok, errors = sort_out({"texts": body.texts})
        results, _ = await answer(s, list(body.texts), ok, exact=False)
        return {"model": s.name, "results": results, "errors": errors}

    @app.post("/v1/answer")
    async def answer_route(body: AnswerBody) -> dict[str, Any]:
        """Long contexts are read in overlapping windows, never truncated."""
        s = pick("answer", body.model)
        if len(body.questions) != len(body.contexts):
            raise ApiError(422, "invalid_request", f"{len(body.questions)} questions but {len(body.contexts)} contexts")
        ok, errors = sort_out({"questions": body.questions, "contexts": body.contexts})
        results, _ = await answer(s, list(zip(body.questions, body.contexts, strict=True)), ok, exact=False)
        return {"model": s.name, "results": results, "errors": errors}

    @app.post("/v1/embed")
    async def embed(body: EmbedBody) -> JSONResponse:
        """``embeddings[i]``: text i's vector (None for a bad item, described in ``errors``); ``truncated``: the
        texts longer than the model reads, cut to it."""
        s = pick("embed", body.model)
        ok, errors = sort_out({"texts": body.texts})
        rows, truncated = await answer(s, list(body.texts), ok)
        raw = np.stack([rows[i] for i in ok])
        if body.dim is not None and body.dim > raw.shape[1]:
            raise ApiError(422, "invalid_request", f"dim={body.dim} is over the model's {raw.shape[1]} dimensions")
        normalize = s.predictor.info.normalize if body.normalize is None else body.normalize
        vectors: list[Any] = [None] * len(body.texts)
        for i, v in zip(ok, finish_embeddings(raw, body.dim, normalize).tolist(), strict=True):
            vectors[i] = v
        # a ready response skips FastAPI's per-float jsonable_encoder walk, and orjson writes the floats far faster
        # than json.dumps
        return FastJSONResponse({"model": s.name, "dim": body.dim or int(raw.shape[1]), "embeddings": vectors,
                                 "truncated": truncated, "errors": errors})

    @app.post("/v1/embed_sparse")
    async def embed_sparse(body: SparseBody) -> JSONResponse:
        """Learned sparse vectors (a ``--task sparse`` model) as ``{token: weight}`` per text, heaviest first (None
        for a bad item, described in ``errors``)."""
        s = pick("embed_sparse", body.model)
        ok, errors = sort_out({"texts": body.texts})
        rows, truncated = await answer(s, list(body.texts), ok)
        terms = get_task(s.predictor.task).terms(s.predictor, [rows[i] for i in ok], body.top_k or 0, body.threshold)
        results: list[Any] = [None] * len(body.texts)
        for i, t in zip(ok, terms, strict=True):
            results[i] = t
        return FastJSONResponse({"model": s.name, "results": results, "truncated": truncated, "errors": errors})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # no folder: an unauthenticated caller learns nothing of the host's file system
        return {"status": "ok", "models": {n: {k: v for k, v in describe(s.predictor).items() if k != "folder"}
                                           for n, s in served.items()}}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_page() -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    peer_routes = openai_router(served, None, limits.max_texts, limits.max_chars)  # RequestGuard checked the token
    app.include_router(peer_routes)
    for add in extra_routes:
        add(app, check_texts)
    known = {r.path for r in [*app.routes, *peer_routes.routes] if hasattr(r, "path")}
    app.add_middleware(JsonBody)  # inside the guard: the token is checked first
    app.add_middleware(RequestGuard, limits=limits, metrics=metrics, known_paths=known)
    app.state.metrics = metrics
    return app


def parse_models(specs: list[str]) -> dict[str, Path]:
    """``["DIR", "name=DIR"]`` -> {name: folder}; a bare DIR is named after its folder."""
    return named_folders(specs, "model")


@dataclass
class ServeConfig(StageConfig):
    """Settings of ``encoderkit serve``."""

    model: list[str] = arg(help="Model folders, as DIR or name=DIR; repeat for several.", required=True)
    host: str = arg("127.0.0.1", help="Address to listen on (0.0.0.0 exposes the service to the network).")
    port: int = arg(8000, help="TCP port.")
    backend: str = arg("auto", help="Inference backend for every model, and for the queries of every --index (auto: "
                                    "the engine the index was built with); " + AUTO_HELP, choices=BACKENDS)
    max_body_bytes: int = arg(32_000_000, help="Largest accepted request body (413 above): a guard of memory.")
    max_texts: int = arg(2048, help="Most texts per request (OpenAI's own limit; 4xx above); a request is split into "
                                    "model calls of --max-batch texts.")
    max_chars: int = arg(1_000_000, help="Most characters per text: a guard of memory only (that text alone fails "
                                         "above it). Longer texts than the model reads are truncated, and the "
                                         "response lists them in 'truncated'.")
    token_env: str = arg("ENCODERKIT_TOKEN", help="Environment variable holding the bearer token; unset = no auth.")
    max_batch: int = arg(32, help="Most texts per batched model call.", speed=True)
    max_wait_ms: float = arg(5.0, help="How long a batch waits for more requests.", speed=True)
    max_batch_tokens: int = arg(16384, help="Most padded tokens (longest text x texts) per batched model call; "
                                            "requests are batched oldest first within it.", speed=True)
    threads: int | None = arg(None, help="onnxruntime intra-op threads per model.", speed=True)
    head_timeout_s: float = arg(3.0, help="Seconds a new connection has to send a complete request head (until "
                                          "then it has not authenticated either); then it is closed. After a "
                                          "response the next head has the larger of this and --keep-alive-s.")
    body_timeout_s: float = arg(30.0, help="Seconds to wait for each part of a request body; a stalled body gets 408.")
    keep_alive_s: float = arg(5.0, help="Seconds an idle keep-alive connection stays open between requests.")
    max_connections: int = arg(1000, help="Most open connections; at the limit the connection that has waited "
                                          "longest for a request head is closed to make room, else a new one gets "
                                          "503.")
    max_connections_per_client: int = arg(100, help="Most open connections from one client address (503 above; 0: "
                                                    "no limit). Behind a reverse proxy every client has the proxy's "
                                                    "address: raise it to --max-connections there.")
    max_queue_texts: int = arg(8192, help="Most texts waiting in each model's queue, counted as the fair scheduler "
                                          "serves them (other clients' queues up to this request's size): above, a "
                                          "request gets 503 with Retry-After at once.")
    max_queue_wait_s: float = arg(10.0, help="Most seconds a request may wait in its model's queue, estimated at "
                                             "arrival from the model's recent speed (503 with Retry-After at once "
                                             "above), and enforced: one not started by then gets 503.")
    fair_tokens: int = arg(256, help="Tokens of batch credit each client address gets per model call while "
                                     "several are active (deficit round robin; its connections take turns within "
                                     "it), and the most tokens of one client's long texts run between two batches: "
                                     "smaller favours small requests' latency over large ones' throughput.",
                           speed=True)
    max_head_bytes: int = arg(65_536, help="Largest request head (request line and headers); a longer one is closed.")
    index: list[str] = arg([], help="Search index folders (encoderkit index), as DIR or name=DIR: POST /v1/search.")
    rerank: list[str] = arg([], help="Cross-encoder (rerank) folders, as DIR or name=DIR: served like --model, and "
                                     "what /v1/search's rerank_top reorders with (the request's 'rerank_model' "
                                     "names one when several rerank models are served).")
    long_lane: bool = arg(True, help="Run long texts (128 tokens or more) beside a batch of short ones, on a thread "
                                     "of their own (the batch on the others), where the engine can (OpenVINO, "
                                     "ONNX Runtime; 2 threads or more): a short request never waits for a long "
                                     "text's call.", speed=True)
    access_log: bool = arg(False, help="Log one line per request (off by default: it costs CPU per request, and "
                                       "/metrics counts requests by path and status).")

    def validate(self) -> None:
        check(0 < self.port < 65536, f"--port {self.port} is not a TCP port")
        check(self.max_batch_tokens >= 1, "--max-batch-tokens must be positive")
        check(self.max_batch >= 1 and self.max_texts >= 1 and self.max_chars >= 1 and self.max_body_bytes >= 1,
              "--max-batch, --max-texts, --max-chars and --max-body-bytes must be positive")
        check(self.max_queue_texts >= self.max_texts and self.max_queue_wait_s > 0 and self.fair_tokens >= 1
              and self.max_connections_per_client >= 0,
              "--max-queue-texts must be at least --max-texts, --max-queue-wait-s and --fair-tokens positive, and "
              "--max-connections-per-client 0 or more")
        check(min(self.head_timeout_s, self.body_timeout_s, self.keep_alive_s) > 0
              and self.max_connections >= 1 and self.max_head_bytes >= 1024,
              "--head-timeout-s, --body-timeout-s and --keep-alive-s must be positive, --max-connections at least 1 "
              "and --max-head-bytes at least 1024")


def load_models(specs: list[str], backend: str = "auto", threads: int | None = None,
                max_batch: int = 32) -> dict[str, Predictor]:
    return {name: Predictor.load(folder, backend=backend, threads=threads, max_batch=max_batch, spin=False)
            for name, folder in parse_models(specs).items()}


def _freeze_startup_heap() -> None:
    """Move every object alive after loading (transformers, onnxruntime, tokenizers, the app) out of the cyclic
    garbage collector's view: left in, each full collection under load walks them all and stalls the event loop
    and the batch worker, and every request in flight waits (docs/results/deploy-log.md, issue 37). Only
    ``serve``'s own process does this; it owns the process, as the CLI does threads."""
    gc.collect()
    gc.freeze()


def run(cfg: ServeConfig) -> None:
    """Serve task models over HTTP (classify/extract/answer/rerank/embed, /health, /metrics, /docs).

    Example: ENCODERKIT_TOKEN=secret encoderkit serve --model sst2=runs/sst2 --model embed=runs/minilm --port 8000
    """
    import uvicorn

    # one thread per tokenizer call (the model call's, a large request's count): Rust's thread pool would take every
    # core the model calls need; set before the tokenizers are loaded, as the process is serve's alone
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    models = load_models(cfg.model, cfg.backend, cfg.threads, cfg.max_batch)
    cross = load_models(cfg.rerank, cfg.backend, cfg.threads, cfg.max_batch) if cfg.rerank else {}
    for name, p in cross.items():
        if name in models:
            raise EncoderkitError(f"--rerank {name}=...: the name {name!r} is already a --model's; name it otherwise")
        if not get_task(p.task).scores_pairs:
            raise EncoderkitError(f"--rerank {p.folder} is a {p.task!r} model, not a cross-encoder (a rerank model)")
    models.update(cross)
    limits = Limits(cfg.max_body_bytes, cfg.max_texts, cfg.max_chars, os.environ.get(cfg.token_env) or None,
                    cfg.body_timeout_s)
    extra = ()
    if cfg.index:  # queries on --backend too; rerank_top with a served rerank model (--rerank, or a --model)
        extra = (search_routes(cfg.index, backend=cfg.backend, threads=cfg.threads,
                               rerankers={n: p for n, p in models.items()
                                          if n in cross or get_task(p.task).endpoint == "rerank"}),)
    app = create_app(models, limits, cfg.max_batch, cfg.max_wait_ms, cfg.max_batch_tokens, extra,
                     max_queue_texts=cfg.max_queue_texts, max_queue_wait_s=cfg.max_queue_wait_s,
                     fair_tokens=cfg.fair_tokens, long_lane=cfg.long_lane)
    for name, p in models.items():
        print(f"serving {name}: {p.task} from {p.folder} on {p.backend} ({p.backend_reason})")
    _freeze_startup_heap()
    # loop "auto": uvloop when installed (uvicorn[standard]); the protocol is uvicorn's auto choice (httptools,
    # else h11) with the head deadline added (encoderkit.deploy.protocol)
    uvicorn.run(app, host=cfg.host, port=cfg.port, timeout_graceful_shutdown=30, log_level="info",
                access_log=cfg.access_log, loop="auto",
                **server_options(cfg.head_timeout_s, cfg.keep_alive_s, cfg.max_connections, cfg.max_head_bytes,
                                 cfg.max_connections_per_client))


class BackgroundServer:
    """A real uvicorn server on 127.0.0.1 in a thread (tests, benchmarks): ``with BackgroundServer(app) as url:``.
    ``options``: uvicorn settings, by default :func:`server_options`'s and a 10 s graceful-shutdown deadline."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        options = {"timeout_graceful_shutdown": 10, **server_options(), **options}
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **options))
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

