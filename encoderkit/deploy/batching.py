"""Micro-batching: concurrent requests share one model call.

Each request hands its items (texts, pairs...) to :meth:`MicroBatcher.submit` and awaits its own
results. One worker task takes the first waiting request, then keeps collecting requests until
``max_batch`` items are gathered or ``max_wait_ms`` has passed, runs the batched function once in
a worker thread (so the event loop keeps accepting requests meanwhile), and hands every caller
the slice of results that belongs to its items, in order. A request with more items than
``max_batch`` runs alone (the function batches internally). An exception in the batched call
is passed to every caller of that batch; the worker keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class _Job:
    items: Sequence[Any]
    future: asyncio.Future


class MicroBatcher:
    """Groups items of concurrent :meth:`submit` calls into calls of ``fn(items) -> results``.

    ``fn`` must return one result per item, in order. ``on_batch(n_items)`` is called after each
    batched call (for metrics).
    """

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]], max_batch: int = 32, max_wait_ms: float = 5.0,
                 on_batch: Callable[[int], None] | None = None, name: str = "batcher") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.fn, self.max_batch, self.max_wait = fn, max_batch, max(0.0, max_wait_ms) / 1000.0
        self.on_batch, self.name = on_batch, name
        self._queue: asyncio.Queue[_Job | None] | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closing = False
        self._pending: _Job | None = None  # a job that did not fit the last batch

    async def start(self) -> None:
        """Start the worker on the running event loop."""
        self._queue = asyncio.Queue()
        self._worker = asyncio.get_running_loop().create_task(self._work(), name=self.name)

    async def submit(self, items: Sequence[Any]) -> list[Any]:
        """Results for ``items`` (one per item, in order), computed in a shared batch."""
        if self._queue is None or self._closing:
            raise RuntimeError(f"{self.name} is not running")
        if not items:
            return []
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Job(list(items), future))
        return await future

    async def close(self) -> None:
        """Finish every request already submitted, then stop the worker."""
        if self._queue is None or self._closing:
            return
        self._closing = True
        await self._queue.put(None)
        if self._worker is not None:
            await self._worker
        self._executor.shutdown(wait=True)

    async def _collect(self, first: _Job) -> tuple[list[_Job], bool]:
        """``first`` plus the jobs that arrive within ``max_wait`` while fewer than ``max_batch`` items are held."""
        assert self._queue is not None
        jobs, count, stop = [first], len(first.items), False
        deadline = asyncio.get_running_loop().time() + self.max_wait
        while count < self.max_batch:
            try:  # take what is already waiting without sleeping
                job = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                timeout = deadline - asyncio.get_running_loop().time()
                if timeout <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), timeout)
                except (TimeoutError, asyncio.TimeoutError):  # two classes before Python 3.11
                    break
            if job is None:
                stop = True
                break
            if count + len(job.items) > self.max_batch:
                # would overflow: run it first in the next batch
                self._pending = job
                break
            jobs.append(job)
            count += len(job.items)
        return jobs, stop

    async def _work(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        stop = False
        while True:
            if self._pending is not None:
                first, self._pending = self._pending, None
            elif stop:
                break
            else:
                first = await self._queue.get()
                if first is None:
                    break
            jobs, stop_now = await self._collect(first)
            stop = stop or stop_now
            items = [x for job in jobs for x in job.items]
            try:
                results = await loop.run_in_executor(self._executor, self.fn, items)
                if len(results) != len(items):
                    raise RuntimeError(f"{self.name}: batched call returned {len(results)} results for {len(items)} items")
            except Exception as e:  # noqa: BLE001 -- every caller of this batch gets the error; the worker goes on
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(e)
            else:
                pos = 0
                for job in jobs:
                    if not job.future.done():  # a caller that went away has a cancelled future
                        job.future.set_result(list(results[pos:pos + len(job.items)]))
                    pos += len(job.items)
            if self.on_batch is not None:
                with contextlib.suppress(Exception):
                    self.on_batch(len(items))
