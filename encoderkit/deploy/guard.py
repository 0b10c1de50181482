"""The request guard of ``encoderkit serve``: what every HTTP request passes before any route runs.

:class:`RequestGuard`, the app's outermost ASGI layer, checks the bearer token before any of the body is read, so
an unauthenticated client learns nothing of the schema; then the body's size and pace; and it records metrics.
Once the body has arrived it watches the connection: a client that disconnects before its answer has its request
cancelled (the micro-batcher then drops its queued items, :mod:`~encoderkit.deploy.batching`), and a request that
the server's graceful-shutdown deadline cuts is answered 503 with Retry-After, not uvicorn's 500. It also names the
client's address as the request's client (:data:`~encoderkit.deploy.batching.current_client`), the key of its fair
share, and the connection as its turn within that share.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from encoderkit.deploy.batching import current_client, current_connection
from encoderkit.deploy.metrics import REFUSALS, Metrics
from encoderkit.deploy.openai_api import error_type
from encoderkit.web.auth import token_ok


@dataclass
class Limits:
    """Per-request limits and the optional bearer token."""

    max_body_bytes: int = 32_000_000
    max_texts: int = 2048
    max_chars: int = 1_000_000
    token: str | None = None
    body_timeout_s: float = 30.0


# /search: the search page's shell (a form, no data); its results come from /search/results, behind the token
PUBLIC_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/search"})


def too_large(limit: int) -> str:
    return f"request body is over the {limit}-byte limit (the server's --max-body-bytes; or send fewer texts per call)"


class ApiError(HTTPException):
    """A client error with a JSON body; an HTTPException so FastAPI's body parsing passes it through."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.code = code


def error_body(code: str, message: str, status: int) -> dict[str, Any]:
    """Every error's body: encoderkit's ``code`` and ``message`` plus OpenAI's ``type`` and ``param``, so a client of
    either shape (the openai client included) reads errors raised before any route runs (401, 408, 413) too."""
    return {"error": {"code": code, "message": message, "type": error_type(status), "param": None}}


class RequestGuard:
    """Outermost ASGI layer: the bearer token (401; :data:`PUBLIC_PATHS` need none), body-size limit (413), body
    read timeout (408: a client that sends its headers and stalls), and request metrics (path, status, latency)."""

    def __init__(self, app, limits: Limits, metrics: Metrics, known_paths: set[str]) -> None:
        self.app, self.limits, self.metrics, self.known = app, limits, metrics, known_paths
        self.token = limits.token.encode() if limits.token else None
        self.cancelled_for_disconnect = 0  # requests dropped because their client went away (tests, benches)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        path = scope["path"] if scope["path"] in self.known else "other"
        limit = self.limits.max_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        client = scope.get("client")
        # the client's address: one fair share each, however many connections it opens; its connections take turns
        # within it (the clients behind one reverse proxy share its address)
        current_client.set(client[0] if client else None)
        current_connection.set(tuple(client) if client else None)
        task = asyncio.current_task()
        started, gone, watcher = [False], [False], [None]

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                started[0] = True
            await send(message)

        async def watch() -> None:
            """After the body, uvicorn's receive returns only at a disconnect (or once the response is sent)."""
            message = await receive()
            if message["type"] == "http.disconnect" and not started[0] and task is not None:
                gone[0] = True
                task.cancel()

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
            if body_done and message["type"] == "http.request" and watcher[0] is None:
                watcher[0] = asyncio.get_running_loop().create_task(watch())
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ApiError(413, "body_too_large", too_large(limit))
            return message

        try:
            if self.token and scope["path"] not in PUBLIC_PATHS and not token_ok(headers, self.token):
                refusal = JSONResponse(error_body("unauthorized", "missing or wrong bearer token (header "
                                                  "'Authorization: Bearer <token>'; the server's token is in the "
                                                  "variable --token-env names; OpenAI clients: api_key=<token>)", 401),
                                       status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await refusal(scope, receive, send_and_record)
                return
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                await JSONResponse(error_body("body_too_large", too_large(limit), 413),
                                   status_code=413)(scope, receive, send_and_record)
                return
            await self.app(scope, limited_receive, send_and_record)
        except asyncio.CancelledError:
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()  # handled here: the request ends now, answered or not
            if gone[0]:
                status[0] = 499  # nginx's "client closed request": nobody to answer
                self.cancelled_for_disconnect += 1
            elif not started[0]:  # the server's shutdown deadline: the client may retry on another instance
                REFUSALS.note("requests cut by the shutdown deadline (503)", client[0] if client else None)
                await JSONResponse(error_body("shutting_down", "the server is shutting down and stopped this "
                                              "request; retry it", 503), status_code=503,
                                   headers={"Retry-After": "1", "Connection": "close"})(scope, receive, send_and_record)
        finally:
            if watcher[0] is not None:
                watcher[0].cancel()
            self.metrics.observe_request(path, status[0], time.perf_counter() - start)
