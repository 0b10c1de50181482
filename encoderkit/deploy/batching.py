"""Micro-batching: concurrent requests share one model call, within a token budget, oldest first.

Each request hands its items (texts, pairs...) to :meth:`MicroBatcher.submit` with each item's
token count, and awaits its own results. One worker task forms batches from the head of a FIFO
queue: it takes items in arrival order while the batch stays within ``max_batch`` items and
``max_batch_tokens`` padded tokens (the longest item's tokens x the number of items, as the
peers' max-batch-tokens), waiting at most ``max_wait_ms`` for more when the queue runs dry. A
request larger than one batch is cut over consecutive batches; its results are joined in order.
The batch runs in a worker thread (the event loop keeps accepting requests meanwhile), and every
caller gets the slice of results that belongs to its items.

A batch whose call raises is split in two at a request boundary and each half retried, down to
one request, so only the request that makes the call fail gets the error (its own exception),
never the neighbours it happened to share a batch with. The worker keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

OFFLOAD_CHARS = 20_000  # requests with more characters are token-counted off the event loop


@dataclass
class _Job:
    items: list[Any]
    costs: list[int]  # tokens per item
    future: asyncio.Future
    enqueued: float  # loop time of submit
    taken: int = 0  # items already placed in a batch
    results: list[Any] = field(default_factory=list)
    failed: bool = False


@dataclass
class _Part:
    """A run of one job's items inside a batch: ``job.items[start:end]``."""

    job: _Job
    start: int
    end: int


@dataclass
class BatchStats:
    """What one model call held, for metrics: items, padded tokens (longest x items) and, for each
    request that started in it, the seconds it waited in the queue."""

    items: int
    tokens: int
    waits: list[float]


def _chars(item: Any) -> int:
    """Characters of a text or of the texts in a tuple (other items: 0)."""
    if isinstance(item, str):
        return len(item)
    return sum(len(x) for x in item if isinstance(x, str)) if isinstance(item, (tuple, list)) else 0


def token_counts(tokenizer, items: Sequence[Any], max_length: int) -> list[int]:
    """Tokens per item (special tokens included, truncated to ``max_length``) with a HF fast tokenizer;
    items are texts or (text, text_pair) tuples. Without a tokenizer, each item counts 1."""
    if tokenizer is None or not items:
        return [1] * len(items)
    kw = {"truncation": True, "max_length": max_length, "return_attention_mask": False,
          "return_token_type_ids": False}
    if all(isinstance(x, str) for x in items):
        enc = tokenizer(list(items), **kw)
    else:
        enc = tokenizer([x[0] for x in items], [x[1] for x in items], **kw)
    return [len(ids) for ids in enc["input_ids"]]


class MicroBatcher:
    """Groups items of concurrent :meth:`submit` calls into calls of ``fn(items) -> results``.

    ``fn`` must return one result per item, in order. ``cost(items) -> tokens per item`` is used
    when :meth:`submit` is not given the counts (default: 1 per item). ``on_batch(BatchStats)`` is
    called after each model call (for metrics). ``max_batch_tokens=None`` leaves only ``max_batch``.
    """

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]], max_batch: int = 32, max_wait_ms: float = 5.0,
                 on_batch: Callable[[BatchStats], None] | None = None, name: str = "batcher",
                 max_batch_tokens: int | None = None, cost: Callable[[list[Any]], list[int]] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.fn, self.max_batch, self.max_wait = fn, max_batch, max(0.0, max_wait_ms) / 1000.0
        self.max_batch_tokens, self.cost = max_batch_tokens, cost
        self.on_batch, self.name = on_batch, name
        self._queue: deque[_Job] = deque()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closing = False

    async def start(self) -> None:
        """Start the worker on the running event loop."""
        self._wake = asyncio.Event()
        self._worker = asyncio.get_running_loop().create_task(self._work(), name=self.name)

    async def submit(self, items: Sequence[Any], costs: Sequence[int] | None = None) -> list[Any]:
        """Results for ``items`` (one per item, in order), computed in shared batches; ``costs`` are
        the items' token counts (computed with ``cost`` when not given)."""
        if self._wake is None or self._closing:
            raise RuntimeError(f"{self.name} is not running")
        if not items:
            return []
        items = list(items)
        if costs is None:
            costs = await self.costs(items)
        if len(costs) != len(items):
            raise ValueError(f"{len(costs)} token counts for {len(items)} items")
        loop = asyncio.get_running_loop()
        job = _Job(items, [max(1, int(c)) for c in costs], loop.create_future(), loop.time())
        self._queue.append(job)
        self._wake.set()
        return await job.future

    async def costs(self, items: list[Any]) -> list[int]:
        """Token counts of ``items`` with ``cost``; a large request is counted in a thread, so tokenizing a
        few hundred kilobytes does not hold up the event loop (and every other request) meanwhile."""
        if self.cost is None:
            return [1] * len(items)
        if sum(_chars(x) for x in items) > OFFLOAD_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, self.cost, items)
        return self.cost(items)

    async def close(self) -> None:
        """Finish every request already submitted, then stop the worker."""
        if self._wake is None or self._closing:
            return
        self._closing = True
        self._wake.set()
        if self._worker is not None:
            await self._worker
        self._executor.shutdown(wait=True)

    # -- batch formation -----------------------------------------------------------------------
    def _fits(self, count: int, longest: int) -> bool:
        return count <= self.max_batch and (self.max_batch_tokens is None or count * longest <= self.max_batch_tokens)

    def _take(self, parts: list[_Part], count: int, longest: int) -> tuple[int, int, bool]:
        """Add items from the head of the queue to ``parts`` while they fit; True when the batch is full."""
        while self._queue:
            job = self._queue[0]
            if job.failed or job.future.done():  # failed in an earlier batch, or its caller went away
                self._queue.popleft()
                continue
            start = job.taken
            while job.taken < len(job.items):
                c = job.costs[job.taken]
                if not self._fits(count + 1, max(longest, c)):
                    if count == 0:  # one item over the budget runs alone rather than never
                        count, longest = 1, c
                        job.taken += 1
                    break
                count, longest = count + 1, max(longest, c)
                job.taken += 1
            if job.taken > start:
                parts.append(_Part(job, start, job.taken))
            if job.taken < len(job.items):
                return count, longest, True
            self._queue.popleft()
        return count, longest, False

    async def _collect(self) -> list[_Part]:
        """The next batch: the oldest waiting items, topped up for at most ``max_wait`` while it has room."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        parts: list[_Part] = []
        count, longest, full = self._take(parts, 0, 0)
        deadline = loop.time() + self.max_wait
        while not full and not self._closing and count < self.max_batch:
            timeout = deadline - loop.time()
            if timeout <= 0:
                break
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):  # two classes before Python 3.11
                await asyncio.wait_for(self._wake.wait(), timeout)
            count, longest, full = self._take(parts, count, longest)
        return parts

    # -- running -------------------------------------------------------------------------------
    async def _call(self, parts: list[_Part]) -> None:
        """Run ``parts`` as one call; on failure, bisect at job boundaries until the failing job is alone."""
        loop = asyncio.get_running_loop()
        items = [x for p in parts for x in p.job.items[p.start:p.end]]
        started = loop.time()
        try:
            results = await loop.run_in_executor(self._executor, self.fn, items)
            if len(results) != len(items):
                raise RuntimeError(f"{self.name}: batched call returned {len(results)} results for {len(items)} items")
        except Exception as e:  # noqa: BLE001 -- goes to the one request that causes it, see below
            if len(parts) == 1:  # one request (a job has one run of items per batch): the error is its own
                job = parts[0].job
                job.failed = True
                if not job.future.done():
                    job.future.set_exception(e)
                return
            cut = len(parts) // 2
            for half in (parts[:cut], parts[cut:]):
                await self._call(half)
            return
        self._report(parts, items, started)
        pos = 0
        for p in parts:
            n = p.end - p.start
            p.job.results.extend(results[pos:pos + n])
            pos += n
            if len(p.job.results) == len(p.job.items) and not p.job.future.done():
                p.job.future.set_result(p.job.results)

    def _report(self, parts: list[_Part], items: list[Any], started: float) -> None:
        if self.on_batch is None:
            return
        longest = max(c for p in parts for c in p.job.costs[p.start:p.end])
        waits = [started - p.job.enqueued for p in parts if p.start == 0]
        with contextlib.suppress(Exception):
            self.on_batch(BatchStats(len(items), longest * len(items), waits))

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue:
                if self._closing:
                    break
                self._wake.clear()
                await self._wake.wait()
                continue
            parts = await self._collect()
            if parts:
                await self._call(parts)
