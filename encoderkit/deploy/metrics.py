"""The Prometheus metrics of one ``encoderkit serve`` app, rendered at ``GET /metrics``: requests by path and
status with their latency (recorded by :class:`encoderkit.deploy.guard.RequestGuard`), and per batched model call
its items, padded tokens and queue waits (recorded by the app's micro-batchers); and :class:`RefusalLog`, the one
summary line in which the service logs what it refused (connections over a limit, full queues, cut requests)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from encoderkit.deploy.batching import BatchStats

SUMMARY_EVERY_S = 10.0

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    """Prometheus metrics of one app (its own registry, so two apps in a process never mix counts):
    requests by path and status, request latency, and per model call its items, padded tokens and
    the time its requests waited in the queue."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("encoderkit_requests", "HTTP requests by path and status.", ["path", "status"],
                                registry=r)
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


class RefusalLog:
    """Counts refusals by reason and client address and logs them as one WARNING line at most every ``every_s``
    seconds (the first at once), so a flood of refused connections or requests costs a line, not a line each."""

    def __init__(self, logger: logging.Logger | None = None, every_s: float = SUMMARY_EVERY_S) -> None:
        self.logger = logger or logging.getLogger("uvicorn.error")
        self.every_s = every_s
        self.reasons: Counter[str] = Counter()
        self.clients: Counter[str] = Counter()
        self.total: Counter[str] = Counter()  # since start, for tests and benches
        self._last = -float("inf")
        self._flush: asyncio.TimerHandle | None = None
        self._flush_loop: asyncio.AbstractEventLoop | None = None

    def note(self, reason: str, client: str | None = None) -> None:
        self.reasons[reason] += 1
        self.total[reason] += 1
        if client:
            self.clients[client] += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self.flush()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a direct call): the next note writes the line
            return
        if self._flush is None or self._flush_loop is not loop:  # none yet, or on a server's loop since stopped
            self._flush, self._flush_loop = loop.call_later(self._last + self.every_s - now, self.flush), loop

    def flush(self) -> None:
        """Log what was refused since the last line (nothing when nothing was)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self.reasons:
            return
        since = time.monotonic() - self._last
        span = f" in the last {since:.0f} s" if since < 10 * self.every_s else ""
        what = ", ".join(f"{n} {reason}" for reason, n in self.reasons.most_common())
        top = ", ".join(f"{c} ({n})" for c, n in self.clients.most_common(3))
        self.logger.warning("refused%s: %s%s", span, what, f"; most from {top}" if top else "")
        self.reasons.clear()
        self.clients.clear()
        self._last = time.monotonic()


REFUSALS = RefusalLog()  # the process's summary: serve's connection protocol and its app both report here
