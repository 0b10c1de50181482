"""Micro-batching: concurrent requests share one model call, within a token budget, fairly between clients.

A batch holds at most ``max_batch`` items and ``max_batch_tokens`` padded tokens (longest item x items) and runs
in a worker thread. A batch whose call raises is bisected at request boundaries and retried, so only the request
that makes the call fail gets the error, never the neighbours it happened to share a batch with.

Each client (``submit``'s ``client``, by default :data:`current_client`: serve sets it to the connection) has its
own queue. While one client alone is active its requests are batched oldest first, in full batches. While several
are (queued, or submitted within :data:`FAIR_WINDOW_S`), batches are formed by deficit round robin: each batch
gives every waiting client ``fair_tokens`` more tokens of credit and takes its items while the credit lasts, so a
client looping maximum-size requests adds about ``fair_tokens`` to each batch and the small requests of others
are never queued behind its backlog. A request whose caller has gone (its task cancelled: serve cancels it when
the client disconnects) is dropped from the queue, and the items it had not yet placed are never computed.

A batch that holds an item of :data:`LONG_TOKENS` or more runs as up to two model calls: its short requests first
(:func:`_short_first`), then, between later batches, the long items it took, one client's a call; so a small
request waits for one client's long items at most, however many clients send long ones. A large request
(:meth:`MicroBatcher.submit_counted`) is queued at a bound from its bytes (:func:`token_bounds`) and tokenized only
once computed: one refused, or abandoned before its turn, costs no tokenizing.

The queue is bounded: ``max_queue_items`` texts and ``max_queue_wait_s`` seconds of waiting, both counted as this
scheduler serves, i.e. the work ahead of a new request is each other client's queue up to the size of the new
one. Beyond either, :meth:`MicroBatcher.submit` raises :class:`QueueFull` at once (serve answers 503 with
Retry-After), so a flood of large requests is refused while a small request still gets in; and a request that
has not started within ``max_queue_wait_s`` gets :class:`QueueFull` then.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# the client a request comes from (serve's RequestGuard sets it per request): the key of its fair share
current_client: contextvars.ContextVar[Any] = contextvars.ContextVar("encoderkit_client", default=None)
FAIR_WINDOW_S = 1.0  # a client answered or submitting this recently still counts as active (between requests)
RATE_SMOOTHING = 0.2  # weight of the latest model call in the tokens-per-second estimate


class QueueFull(Exception):
    """A request refused because its model's queue is over a bound; ``retry_after``: seconds to wait."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


OFFLOAD_CHARS = 20_000  # requests with more characters are token-counted off the event loop, and only once computed
SHORT_FIRST = 2  # a batch's requests whose items are at most 1/SHORT_FIRST of its longest run first, in their own call
LONG_TOKENS = 128  # ... when that longest item has this many tokens or more (a call of short texts only stays one)


@dataclass
class _Job:
    items: list[Any]
    costs: list[int]  # tokens per item
    future: asyncio.Future
    enqueued: float  # loop time of submit
    taken: int = 0  # items already placed in a batch
    results: list[Any] = field(default_factory=list)
    failed: bool = False
    client: Any = None

    @property
    def gone(self) -> bool:
        """Failed in an earlier batch, answered, or its caller went away (cancelled)."""
        return self.failed or self.future.done()


@dataclass
class _Flow:
    """One client's queue and its deficit-round-robin credit (tokens)."""

    jobs: deque[_Job] = field(default_factory=deque)
    credit: int = 0
    round: int = -1  # the batch in which it last got its quantum
    seen: float = 0.0  # loop time of its latest submit or answer (a client between requests is still active)
    in_ring: bool = False
    deferred: bool = False  # its long items of the last batch wait in MicroBatcher._later: no turn until they ran

    def waiting(self) -> tuple[int, int]:
        """Items and tokens not yet placed in a batch."""
        items = tokens = 0
        for j in self.jobs:
            if not j.gone:
                items += len(j.items) - j.taken
                tokens += sum(j.costs[j.taken:])
        return items, tokens


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


def _short_first(parts: list[_Part], long_tokens: int) -> list[list[_Part]]:
    """A batch as its model calls: when its longest item has ``long_tokens`` or more, the requests whose items are
    all short beside it first, then the others. The engine would pad them apart anyway (rows are grouped by
    length), and the short ones are answered without waiting for a long text's rows: beside a client looping
    maximum-size texts, a small request waits for one long row at most, not for two. A batch of texts of like
    lengths, or of short ones only, stays one call."""
    longest = [max(p.job.costs[p.start:p.end]) for p in parts]
    top = max(longest, default=0)
    short = [SHORT_FIRST * n <= top for n in longest] if top >= long_tokens else [True] * len(parts)
    if all(short) or not any(short):
        return [parts] if parts else []
    return [[p for p, s in zip(parts, short) if s], [p for p, s in zip(parts, short) if not s]]


def _chars(item: Any) -> int:
    """Characters of a text or of the texts in a tuple (other items: 0)."""
    if isinstance(item, str):
        return len(item)
    return sum(len(x) for x in item if isinstance(x, str)) if isinstance(item, (tuple, list)) else 0


def token_bounds(items: Sequence[Any], max_length: int) -> list[int]:
    """Tokens per item as the queue counts them before any tokenizing: the item's UTF-8 bytes plus room for special
    tokens, at most ``max_length``. A WordPiece, byte-level BPE or Unigram token covers at least one byte, so this
    is rarely below the tokenizer's count and, for most texts, above it: the queue's bounds and fair shares are then
    on the safe side, and a request is admitted or refused without the CPU of tokenizing it (the model call
    tokenizes what is computed; :func:`token_counts` is the exact count)."""
    return [min(max_length, 4 + sum(len(x.encode("utf-8", "surrogatepass")) for x in
                                    ((item,) if isinstance(item, str) else item) if isinstance(x, str)))
            for item in items]


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
    ``max_queue_items`` / ``max_queue_wait_s`` bound the queue (None: unbounded); ``fair_tokens`` is the credit
    each active client gets per batch while several are active (see the module docstring).
    """

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]], max_batch: int = 32, max_wait_ms: float = 5.0,
                 on_batch: Callable[[BatchStats], None] | None = None, name: str = "batcher",
                 max_batch_tokens: int | None = None, cost: Callable[[list[Any]], list[int]] | None = None,
                 max_queue_items: int | None = None, max_queue_wait_s: float | None = None,
                 fair_tokens: int = 256) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if fair_tokens < 1:
            raise ValueError(f"fair_tokens must be >= 1, got {fair_tokens}")
        self.fn, self.max_batch, self.max_wait = fn, max_batch, max(0.0, max_wait_ms) / 1000.0
        self.max_batch_tokens, self.cost = max_batch_tokens, cost
        self.max_queue_items, self.max_queue_wait_s, self.fair_tokens = max_queue_items, max_queue_wait_s, fair_tokens
        self.on_batch, self.name = on_batch, name
        self._flows: dict[Any, _Flow] = {}
        self._ring: deque[Any] = deque()  # clients with queued jobs, in round-robin order
        self._later: deque[list[_Part]] = deque()  # long items taken in a batch, one client's a call (_short_first)
        self._round = 0  # batches formed so far: a client's quantum is granted once per batch
        self._rate: float | None = None  # tokens per second of recent model calls
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closing = False

    async def start(self) -> None:
        """Start the worker on the running event loop."""
        self._wake = asyncio.Event()
        self._worker = asyncio.get_running_loop().create_task(self._work(), name=self.name)

    async def submit(self, items: Sequence[Any], costs: Sequence[int] | None = None, client: Any = None) -> list[Any]:
        """Results for ``items`` (one per item, in order), computed in shared batches; ``costs`` are
        the items' token counts (computed with ``cost`` when not given). ``client``: whose fair share the request
        takes (default: :data:`current_client`). Raises :class:`QueueFull` when the queue is over a bound."""
        if self._wake is None or self._closing:
            raise RuntimeError(f"{self.name} is not running")
        if not items:
            return []
        items = list(items)
        if costs is None:
            costs = await self.costs(items)
        if len(costs) != len(items):
            raise ValueError(f"{len(costs)} token counts for {len(items)} items")
        key = current_client.get() if client is None else client
        loop = asyncio.get_running_loop()
        job = _Job(items, [max(1, int(c)) for c in costs], loop.create_future(), loop.time(), client=key)
        self._admit(key, job)
        flow = self._flows.setdefault(key, _Flow())
        if not flow.in_ring:
            flow.in_ring = True
            self._ring.append(key)
        flow.jobs.append(job)
        flow.seen = job.enqueued
        self._wake.set()
        return await job.future  # cancelling the caller cancels the future: the job is dropped (see _take)

    def _admit(self, key: Any, job: _Job) -> None:
        """Raise :class:`QueueFull` when the work ahead of ``job``, as the round robin serves it, is over a bound:
        each other client's waiting texts (tokens) up to the new request's size plus its client's own queue."""
        if self.max_queue_items is None and self.max_queue_wait_s is None:
            return
        waiting = {k: self._flows[k].waiting() for k in self._ring}
        own_items, own_tokens = waiting.pop(key, (0, 0))
        if not any(i for i, _ in waiting.values()) and not own_items:
            return  # an idle model takes any request
        n, t = len(job.items), sum(job.costs)
        items_ahead = own_items + sum(min(i, own_items + n) for i, _ in waiting.values())
        tokens_ahead = own_tokens + sum(min(k, own_tokens + t) for _, k in waiting.values())
        total_tokens = own_tokens + sum(k for _, k in waiting.values())
        drain = total_tokens / self._rate if self._rate else 1.0
        if self.max_queue_items is not None and items_ahead + n > self.max_queue_items:
            raise QueueFull(f"model {self.name} is busy: {items_ahead} texts are ahead of this request's {n}, over "
                            f"the queue's {self.max_queue_items}; retry later, or send fewer texts", drain)
        if self.max_queue_wait_s is not None and self._rate:
            wait = tokens_ahead / self._rate
            if wait > self.max_queue_wait_s:
                raise QueueFull(f"model {self.name} is busy: this request would wait about {wait:.1f} s, over the "
                                f"queue's {self.max_queue_wait_s:g} s; retry later, or send fewer texts", wait)

    async def submit_counted(self, items: list[Any], limit: int) -> tuple[list[Any], list[int]]:
        """:meth:`submit` ``items`` at their token counts cut to ``limit``; the results and those counts (uncut, as
        ``cost`` gives them). A small request is counted at once (on the event loop: microseconds). A large one is
        queued at :func:`token_bounds` and counted only once it is computed: a large request that is refused, or
        whose client leaves before its turn, costs no tokenizing, and nothing tokenizes hundreds of kilobytes on the
        CPU the model calls need before the fair order says so."""
        if self.cost is None or sum(_chars(x) for x in items) > OFFLOAD_CHARS:
            results = await self.submit(items, token_bounds(items, limit))
            return results, await self.costs(items)
        counts = self.cost(items)
        return await self.submit(items, [min(c, limit) for c in counts]), counts

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

    def _contended(self, now: float) -> bool:
        """More than one client active (queued, or submitted within FAIR_WINDOW_S); forgets the others."""
        active = 0
        for key in list(self._flows):
            flow = self._flows[key]
            if flow.in_ring or now - flow.seen < FAIR_WINDOW_S:
                active += 1
            else:
                del self._flows[key]
        return active > 1

    def _expire(self, job: _Job, now: float) -> None:
        """Fail a job that has waited past ``max_queue_wait_s`` without starting."""
        if (self.max_queue_wait_s is not None and job.taken == 0 and not job.gone
                and now - job.enqueued > self.max_queue_wait_s):
            job.failed = True
            job.future.set_exception(QueueFull(
                f"model {self.name} is busy: this request waited {now - job.enqueued:.1f} s without starting, over "
                f"the queue's {self.max_queue_wait_s:g} s; retry later", self.max_queue_wait_s))

    def _take(self, parts: list[_Part], count: int, longest: int, now: float) -> tuple[int, int, bool]:
        """Add waiting items to ``parts`` while they fit, one client's turn after another (each within its credit
        while several clients are active); True when the batch is full."""
        fair = self._contended(now)
        for _ in range(len(self._ring)):
            key = self._ring[0]
            flow = self._flows[key]
            while flow.jobs:
                self._expire(flow.jobs[0], now)
                if not flow.jobs[0].gone:
                    break
                flow.jobs.popleft()
            if not flow.jobs:  # nothing waits: it leaves the ring, and its credit goes (deficit round robin)
                self._ring.popleft()
                flow.in_ring, flow.credit = False, 0
                continue
            if flow.deferred:  # its long items of an earlier batch have not run yet
                self._ring.rotate(-1)
                continue
            if not fair:
                flow.credit = 0  # credit counts only while clients share
            elif flow.round != self._round:
                flow.round, flow.credit = self._round, flow.credit + self.fair_tokens
            count, longest, full = self._take_from(flow, parts, count, longest, fair)
            if full:
                return count, longest, True
            self._ring.rotate(-1)  # its turn is over: the next client's comes first
        return count, longest, False

    def _take_from(self, flow: _Flow, parts: list[_Part], count: int, longest: int,
                   fair: bool) -> tuple[int, int, bool]:
        """One client's turn: its oldest items while they fit in the batch (and in its credit, when ``fair``)."""
        while flow.jobs:
            job = flow.jobs[0]
            if job.gone:
                flow.jobs.popleft()
                continue
            start = job.taken
            while job.taken < len(job.items):
                c = job.costs[job.taken]
                if fair and c > flow.credit:
                    break
                if not self._fits(count + 1, max(longest, c)):
                    if count == 0:  # one item over the budget runs alone rather than never
                        count, longest = 1, c
                        job.taken += 1
                        flow.credit -= c if fair else 0
                    break
                count, longest = count + 1, max(longest, c)
                job.taken += 1
                flow.credit -= c if fair else 0
            if job.taken > start:
                parts.append(_Part(job, start, job.taken))
            if job.taken < len(job.items):
                return count, longest, not (fair and job.costs[job.taken] > flow.credit)
            flow.jobs.popleft()
        return count, longest, False

    async def _collect(self) -> list[_Part]:
        """The next batch: waiting items taken in turn, topped up for at most ``max_wait`` while it has room."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        parts: list[_Part] = []
        count, longest, full = self._take(parts, 0, 0, loop.time())
        while count == 0 and self._ready():  # every waiting item is over its client's credit: another round
            self._round += 1
            count, longest, full = self._take(parts, 0, 0, loop.time())
        deadline = loop.time() + self.max_wait
        while not full and not self._closing and count < self.max_batch:
            timeout = deadline - loop.time()
            if timeout <= 0:
                break
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):  # two classes before Python 3.11
                await asyncio.wait_for(self._wake.wait(), timeout)
            count, longest, full = self._take(parts, count, longest, loop.time())
        self._round += 1
        return [p for p in parts if not p.job.gone]  # a caller gone while the batch was topped up is not computed

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
        seconds = loop.time() - started
        if seconds > 0:
            rate = sum(c for p in parts for c in p.job.costs[p.start:p.end]) / seconds
            self._rate = rate if self._rate is None else (1 - RATE_SMOOTHING) * self._rate + RATE_SMOOTHING * rate
        pos = 0
        for p in parts:
            n = p.end - p.start
            p.job.results.extend(results[pos:pos + n])
            pos += n
            if len(p.job.results) == len(p.job.items) and not p.job.future.done():
                p.job.future.set_result(p.job.results)
                if (flow := self._flows.get(p.job.client)) is not None:
                    flow.seen = loop.time()

    def _report(self, parts: list[_Part], items: list[Any], started: float) -> None:
        if self.on_batch is None:
            return
        longest = max(c for p in parts for c in p.job.costs[p.start:p.end])
        waits = [started - p.job.enqueued for p in parts if p.start == 0]
        with contextlib.suppress(Exception):
            self.on_batch(BatchStats(len(items), longest * len(items), waits))

    def _ready(self) -> bool:
        """Some client in the ring may take a turn (its long items of an earlier batch are not still waiting)."""
        return any(not self._flows[k].deferred for k in self._ring)

    async def _work(self) -> None:
        """Batches, each of its short requests' items; between two batches, one client's long items of an earlier
        batch (:func:`_short_first`). A small request then waits for one client's long items at most, however many
        clients send long ones; a client alone gets whole batches."""
        assert self._wake is not None
        while True:
            if not self._later and not self._ready():
                if self._closing and not self._ring:
                    break
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._ready():
                groups = _short_first(await self._collect(), LONG_TOKENS)
                for part in groups[1] if len(groups) > 1 else ():
                    self._defer(part)
                if groups:
                    await self._call(groups[0])
            if self._later:
                group = self._later.popleft()
                if (flow := self._flows.get(group[0].job.client)) is not None:
                    flow.deferred = False
                parts = [p for p in group if not p.job.gone]  # a client gone meanwhile is not computed for
                if parts:
                    await self._call(parts)

    def _defer(self, part: _Part) -> None:
        """Put ``part`` (long items of a batch) in :attr:`_later`, with the other parts of its client's there."""
        flow = self._flows.get(part.job.client)
        for group in self._later:
            if group[0].job.client == part.job.client:
                group.append(part)
                break
        else:
            self._later.append([part])
        if flow is not None:
            flow.deferred = True
