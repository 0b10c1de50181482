"""The connection protocol of ``encoderkit serve``: uvicorn's HTTP/1.1 with a deadline and a size limit for each
request head, plus keep-alive, a cap on open connections and a cap per client address, so slow, idle or greedy
clients cannot hold the server.

A new connection that has not sent a complete request head (it has not authenticated either: the token is a
header) is closed after ``head_timeout_s``. Connections over ``max_per_client`` from one address, or over
``max_connections`` in all, get a 503 with Retry-After and are closed; but at the global cap the connection that
has waited longest for a head is closed first to make room, so idle sockets cannot lock out working clients. A
refused connection is held, unread, for ``refuse_delay_s`` (the Retry-After) before its 503, as HAProxy's tarpit
does: a client that reconnects the moment it is refused then costs the server (and the machine) one accept and one
503 a second per socket rather than a loop as fast as it can; at most a quarter of ``max_connections`` are held
so (each is a file descriptor), others are refused at once.
Refusals are counted in :data:`~encoderkit.deploy.metrics.REFUSALS` (one summary line, not a line each).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from encoderkit.deploy.guard import error_body
from encoderkit.deploy.metrics import REFUSALS, RefusalLog


def _refusal(message: str) -> bytes:
    body = orjson.dumps(error_body("too_many_connections", message, 503))
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_protocol(head_timeout_s: float, max_head_bytes: int, max_connections: int | None = None,
                     max_per_client: int | None = None, keep_alive_s: float = 0.0,
                     refusals: RefusalLog = REFUSALS, refuse_delay_s: float = 1.0) -> type:
    """uvicorn's HTTP/1.1 protocol (httptools or h11) closing a connection that does not send a complete request
    head within ``head_timeout_s`` of connecting (``max(head_timeout_s, keep_alive_s)`` of its previous response),
    in at most ``max_head_bytes``; and limiting open connections to ``max_connections`` and ``max_per_client`` per
    client address (None or 0: no limit), a refused connection held ``refuse_delay_s`` before its 503. uvicorn's
    keep-alive timer alone lets a client that trickles its headers hold a connection for ever, and its own
    concurrency limit counts idle, unauthenticated sockets as clients."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    by_client: dict[str, set[Any]] = {}
    waiting: dict[Any, None] = {}  # connections waiting for a request head, longest-waiting first
    held: set[Any] = set()  # refused connections waiting for their 503 (the tarpit)
    max_held = max(16, (max_connections or 1000) // 4)  # a held socket is a file descriptor too
    per_client_full = _refusal(f"too many connections from this address (limit {max_per_client}); close idle ones "
                               "or retry later")
    all_full = _refusal(f"the server has its limit of {max_connections} connections open; retry later")

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        _in_body = False  # the parser is inside a request body (httptools), which may outlive an early response
        _served = False  # a complete request head has arrived on this connection
        _admitted = False
        _host = ""

        def _in_request(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is not None and not cycle.response_complete

        def _arm(self, timeout: float) -> None:
            self._disarm()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(timeout, self._head_timeout)
            waiting[self] = None

        def _disarm(self) -> None:
            waiting.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _close(self, reason: str | None = None) -> None:
            if not self.transport.is_closing():
                self.transport.close()
                if reason:
                    refusals.note(reason, self._host)
            self._release()

        def _release(self) -> None:
            waiting.pop(self, None)
            if self._admitted:
                self._admitted = False
                peers = by_client.get(self._host)
                if peers is not None:
                    peers.discard(self)
                    if not peers:
                        del by_client[self._host]

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self._in_request():
                self._close(None if self._served else "connections that sent no request head in time")

        def _refuse(self, answer: bytes, reason: str) -> None:
            refusals.note(reason, self._host)
            if refuse_delay_s > 0 and len(held) < max_held:
                held.add(self)
                self.transport.pause_reading()  # nothing it sends is parsed
                self._head_timer = self.loop.call_later(refuse_delay_s, self._answer_refusal, answer)
                return
            self._answer_refusal(answer)

        def _answer_refusal(self, answer: bytes) -> None:
            self._head_timer = None
            held.discard(self)
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

        def _evict_idle(self) -> bool:
            """Close the connection that has waited longest for a request head; False when none is waiting."""
            for other in list(waiting):
                if other is not self and not other._in_request():
                    other._close("idle connections closed to make room for new ones")
                    return True
            return False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._host = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
            if max_per_client and len(by_client.get(self._host, ())) >= max_per_client:
                return self._refuse(per_client_full, "connections over the per-client limit (503)")
            if max_connections and sum(len(s) for s in by_client.values()) >= max_connections \
                    and not self._evict_idle():
                return self._refuse(all_full, "connections over --max-connections (503)")
            self._admitted = True
            by_client.setdefault(self._host, set()).add(self)
            self._arm(head_timeout_s)
            return None

        def data_received(self, data: bytes) -> None:
            if self in held:  # refused, waiting for its 503: what it sends is never parsed
                return
            in_body = self._in_body
            super().data_received(data)
            if self._in_request():
                self._disarm()
            elif not in_body:  # the rest of a body answered early (413) is no request head
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self._close("request heads over the size limit")

        def on_headers_complete(self) -> None:  # httptools' parser callbacks
            self._served = True
            self._in_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(max(head_timeout_s, keep_alive_s))

        def connection_lost(self, exc) -> None:
            held.discard(self)
            self._disarm()
            self._release()
            super().connection_lost(exc)

    return GuardedHTTPProtocol


def server_options(head_timeout_s: float = 3.0, keep_alive_s: float = 5.0, max_connections: int = 1000,
                   max_head_bytes: int = 65_536, max_connections_per_client: int = 100,
                   refuse_delay_s: float = 1.0) -> dict[str, Any]:
    """The uvicorn settings that bound what slow or idle clients can hold (for ``uvicorn.run`` / ``Config``):
    head timeout and size, keep-alive, and the connection limits (:func:`guarded_protocol`; 503 above them, after
    ``refuse_delay_s``)."""
    return {"http": guarded_protocol(head_timeout_s, max_head_bytes, max_connections, max_connections_per_client,
                                     keep_alive_s, refuse_delay_s=refuse_delay_s),
            "timeout_keep_alive": keep_alive_s, "h11_max_incomplete_event_size": max_head_bytes}
