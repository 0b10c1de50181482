"""Micro-batching: concurrent requests share one model call, within a token budget, fairly between clients.

A batch holds at most ``max_batch`` items and ``max_batch_tokens`` padded tokens (longest item x items) and runs
in a worker thread. A batch whose call raises is bisected at request boundaries and retried, so only the request
that makes the call fail gets the error, never the neighbours it happened to share a batch with.

Each client (``submit``'s ``client``, by default :data:`current_client`: serve sets it to the client's address)
has its own queue, and within it each of its connections (:data:`current_connection`) one, served in turn an
item at a time: a client gets one share however many connections it opens, and the connections behind one
address (a reverse proxy's) share it fairly. While one client alone is active its requests fill whole batches.
While several are (queued, or submitted within :data:`FAIR_WINDOW_S`), batches are formed by deficit round robin:
each batch gives every waiting client ``fair_tokens`` more tokens of credit and takes its items while the credit
lasts, so a client looping maximum-size requests adds about ``fair_tokens`` to each batch and the small requests
of others are never queued behind its backlog. A request whose caller has gone (its task cancelled: serve cancels
it when the client disconnects) is dropped from the queue, and the items it had not yet placed are never computed.

Long items (:data:`LONG_TOKENS` or more, beside short ones or alone) are put aside when a batch takes them: its
short requests run first, in a call of their own (:func:`_short_first`), and the long items run later, one
client's at a time, at most ``fair_tokens`` of them (at least one item) a call, and a connection whose long items
wait takes no more meanwhile. While short requests wait (or their clients are about to send the next, within
:data:`SHORT_GRACE_S` of their answer), the long items get :data:`LONG_SHARE` of the model's time: a small request
waits for one long call at most, and a client looping maximum-size texts slows the others by a bounded factor
however much one of its rows costs beside theirs; with nothing short waiting, long items get the whole model.

With a ``long_lane`` (serve makes one where the engine can run a second session on a thread of its own,
:meth:`~encoderkit.inference.engines.OpenVinoEngine.lane`), the long items put aside run in it instead, beside the
short batches, which meanwhile run in the ``short_lane`` (the model on the other threads): a short request never
waits for a long row. The long lane's thread, and the threads its engine starts there, run at a lower OS priority
(:data:`LONG_LANE_NICE`): where the short batches and the long rows want the same core, the short batch gets it at
once, and the long rows get what it leaves (a core of their own on an otherwise idle 2-core machine). While no long
item waits or runs, a batch runs on every thread (``fn``), as without lanes, and a long row waits for such a call to
end rather than share its cores. Long items with no short batch in the last :data:`SHORT_RECENT_S` (long texts
alone: passages being indexed) run on every thread too, as without lanes, in calls as large as a batch. The lanes
compute what ``fn`` does, text for text (the engines' contract: tests/test_batch_independence.py).

Items are sized for the queue without tokenizing (:meth:`MicroBatcher.estimate`: their UTF-8 bytes times the tokens
per byte of the texts computed so far); with ``counted=True`` the model call returns each item's exact token count
from its own tokenizing (:class:`TokenTap`), which teaches the estimate and answers :meth:`submit_counted`: a text
is tokenized once, by the model call, and never for a request that is refused or abandoned before its turn.

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
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# the client a request comes from (serve's RequestGuard sets it per request): the key of its fair share
current_client: contextvars.ContextVar[Any] = contextvars.ContextVar("encoderkit_client", default=None)
# the connection it came on: a client's connections take turns within its share
current_connection: contextvars.ContextVar[Any] = contextvars.ContextVar("encoderkit_connection", default=None)
FAIR_WINDOW_S = 1.0  # a client answered or submitting this recently still counts as active (between requests)
RATE_SMOOTHING = 0.2  # weight of the latest model call in the tokens-per-second and tokens-per-byte estimates
SPECIAL_TOKENS = 4  # room for a sequence's special tokens ([CLS], [SEP], a pair's second [SEP]) in an estimate


class QueueFull(Exception):
    """A request refused because its model's queue is over a bound; ``retry_after``: seconds to wait."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


OFFLOAD_CHARS = 20_000  # a fallback count of more characters runs off the event loop
SHORT_FIRST = 2  # a batch's requests whose items are at most 1/SHORT_FIRST of its longest run first, in their own call
LONG_TOKENS = 128  # ... when that longest item has this many tokens or more (a call of short texts only stays one)
LONG_SHARE = 1 / 3  # while short requests wait, the most of the model's time that the long items put aside get
SHORT_GRACE_S = 0.05  # how long the model waits for a short request before it runs long items beyond their share
LONG_LANE_NICE = 19  # the long lane's thread: short batches take a core from it at once
SHORT_RECENT_S = 1.0  # no short batch this long: long items run on every thread, not in the long lane


@dataclass
class _Job:
    items: list[Any]
    costs: list[int]  # tokens per item, as the queue counts them
    future: asyncio.Future
    enqueued: float  # loop time of submit
    taken: int = 0  # items already placed in a batch
    results: list[Any] = field(default_factory=list)  # by position, filled as the calls holding them end
    counts: list[int | None] = field(default_factory=list)  # exact tokens per item, from the model call (counted)
    done: int = 0  # items computed
    failed: bool = False
    client: Any = None
    conn: Any = None
    limit: int | None = None  # the tokens the caller counts up to (submit_counted)

    @property
    def gone(self) -> bool:
        """Failed in an earlier batch, answered, or its caller went away (cancelled)."""
        return self.failed or self.future.done()


@dataclass
class _Flow:
    """One client's queue, one per connection in turn order (the first takes the next item), its deficit-round-robin
    credit (tokens), and the connections whose long items of an earlier batch still wait (no turn until they ran)."""

    conns: dict[Any, deque[_Job]] = field(default_factory=dict)
    credit: int = 0
    round: int = -1  # the batch in which it last got its quantum
    seen: float = 0.0  # loop time of its latest submit or answer (a client between requests is still active)
    in_ring: bool = False
    held: set[Any] = field(default_factory=set)

    def add(self, job: _Job) -> None:
        self.conns.setdefault(job.conn, deque()).append(job)

    def turn_over(self, conn: Any) -> None:
        """``conn`` has had its turn: the next connection's comes first."""
        self.conns[conn] = self.conns.pop(conn)

    def prune(self, expire: Callable[[_Job], None]) -> None:
        """Drop the jobs that are gone (``expire`` may fail a head first), and the connections left with none."""
        for conn in list(self.conns):
            jobs = self.conns[conn]
            while jobs:
                expire(jobs[0])
                if not jobs[0].gone:
                    break
                jobs.popleft()
            if not jobs:
                del self.conns[conn]

    def ready(self) -> bool:
        """A connection may take a turn (or none is left: a turn takes the client out of the ring)."""
        return not self.conns or any(conn not in self.held for conn in self.conns)

    def waiting(self) -> dict[Any, tuple[int, int]]:
        """Per connection, the items and tokens not yet placed in a batch."""
        out = {}
        for conn, jobs in self.conns.items():
            live = [j for j in jobs if not j.gone]
            out[conn] = (sum(len(j.items) - j.taken for j in live), sum(sum(j.costs[j.taken:]) for j in live))
        return out


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


def lower_priority(nice: int = LONG_LANE_NICE) -> None:
    """Lower the calling thread's OS priority to ``nice`` (Linux: per thread; threads it starts inherit it); a no-op
    where the OS does not allow it."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(nice, os.getpriority(os.PRIO_PROCESS, 0)))


def _chars(item: Any) -> int:
    """Characters of a text or of the texts in a tuple (other items: 0)."""
    if isinstance(item, str):
        return len(item)
    return sum(len(x) for x in item if isinstance(x, str)) if isinstance(item, (tuple, list)) else 0


def _bytes(item: Any) -> int:
    """UTF-8 bytes of a text or of the texts in a tuple."""
    return sum(len(x.encode("utf-8", "surrogatepass")) for x in ((item,) if isinstance(item, str) else item)
               if isinstance(x, str))


class TokenTap:
    """A tokenizer that notes, as it tokenizes, each text's (or text pair's) token count: its ids, or one more than
    its ``max_length`` when it was truncated (a fast tokenizer's encodings show the overflow). The model call's
    runner uses it in place of its tokenizer, so the counts come from the tokenizing the call does anyway. Calls
    that return windows (``return_overflowing_tokens``) or padded rows note nothing; ``counts``: text -> tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.counts: dict[Any, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        enc = self.tokenizer(*args, **kw)
        texts = args[0] if args else kw.get("text")
        pairs = args[1] if len(args) > 1 else kw.get("text_pair")
        if (kw.get("return_overflowing_tokens") or kw.get("padding") or not isinstance(texts, (list, tuple))
                or (pairs is not None and not isinstance(pairs, (list, tuple)))):
            return enc
        with contextlib.suppress(KeyError, TypeError, IndexError, AttributeError):
            ids = enc["input_ids"]
            if len(ids) != len(texts):
                return enc
            cut = kw.get("max_length") if kw.get("truncation") else None
            encodings = getattr(enc, "encodings", None)
            for i, text in enumerate(texts):
                n = len(ids[i])
                if encodings is not None:
                    n += 1 if encodings[i].overflowing else 0
                elif cut is not None and n >= cut:
                    continue  # at the cut without a fast tokenizer's encodings: truncated or not, unknown
                self.counts[text if pairs is None else (text, pairs[i])] = n
        return enc


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

    ``fn`` must return one result per item, in order; with ``counted=True`` it returns ``(results, counts)``, the
    exact tokens of each item (None where unknown) as its own tokenizing found them. ``cost(items) -> tokens per
    item`` counts what a call did not (default: 1 per item). ``on_batch(BatchStats)`` is called after each model
    call (for metrics). ``max_batch_tokens=None`` leaves only ``max_batch``. ``max_queue_items`` /
    ``max_queue_wait_s`` bound the queue (None: unbounded); ``fair_tokens`` is the credit each active client gets
    per batch while several are active, and the most tokens of waiting long items one call runs. ``long_lane`` makes
    (once, in its own thread at :meth:`start`) a call like ``fn`` for the long items put aside, run beside the short
    batches, which then use ``short_lane`` (a call like ``fn`` on the model's other threads; None: ``fn``): see the
    module docstring.
    """

    def __init__(self, fn: Callable[[list[Any]], Any], max_batch: int = 32, max_wait_ms: float = 5.0,
                 on_batch: Callable[[BatchStats], None] | None = None, name: str = "batcher",
                 max_batch_tokens: int | None = None, cost: Callable[[list[Any]], list[int]] | None = None,
                 max_queue_items: int | None = None, max_queue_wait_s: float | None = None,
                 fair_tokens: int = 256, counted: bool = False,
                 short_lane: Callable[[list[Any]], Any] | None = None,
                 long_lane: Callable[[], Callable[[list[Any]], Any]] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if fair_tokens < 1:
            raise ValueError(f"fair_tokens must be >= 1, got {fair_tokens}")
        self.fn, self.max_batch, self.max_wait = fn, max_batch, max(0.0, max_wait_ms) / 1000.0
        self.max_batch_tokens, self.cost, self.counted = max_batch_tokens, cost, counted
        self.max_queue_items, self.max_queue_wait_s, self.fair_tokens = max_queue_items, max_queue_wait_s, fair_tokens
        self.on_batch, self.name = on_batch, name
        self._flows: dict[Any, _Flow] = {}
        self._ring: deque[Any] = deque()  # clients with queued jobs, in round-robin order
        self._later: deque[list[_Part]] = deque()  # long items taken in batches, per client (_short_first)
        self._spent = {False: 0.0, True: 0.0}  # model seconds of short batches and of long items since they waited
        self._after_short = False  # the last call was a batch of short requests
        self._later_empty = 0.0  # loop time when the last long items put aside were taken to run
        self._round = 0  # batches formed so far: a client's quantum is granted once per batch
        self._rate: float | None = None  # tokens per second of recent model calls
        self.per_byte = 1.0  # tokens per UTF-8 byte of the texts computed (the estimate starts at the bound)
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closing = False
        self.short_lane, self.long_lane = short_lane, long_lane
        self._long_fn: Callable[[list[Any]], Any] | None = None  # long_lane's call, made in its thread
        self._long_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-long",
                                                 initializer=lower_priority) if long_lane else None
        self._long_worker: asyncio.Task | None = None
        self._long_wake: asyncio.Event | None = None
        self._long_running = False  # a call of the long lane is in flight
        self._wide = False  # a call on every thread (fn) is in flight: the long lane waits for its end
        self._short_at = float("-inf")  # when the last call of short items started

    async def start(self) -> None:
        """Start the worker on the running event loop."""
        loop = asyncio.get_running_loop()
        if self.long_lane is not None:  # its engine's threads start in the lane's thread, at its priority
            self._long_fn = await loop.run_in_executor(self._long_executor, self.long_lane)
            self._long_wake = asyncio.Event()
        self._wake = asyncio.Event()
        self._worker = loop.create_task(self._work(), name=self.name)
        if self._long_fn is not None:
            self._long_worker = loop.create_task(self._long_work(), name=f"{self.name}-long")

    def estimate(self, items: Sequence[Any], limit: int) -> list[int]:
        """Tokens per item as the queue counts them, without tokenizing: its UTF-8 bytes times the tokens per byte
        the model calls have counted (:attr:`per_byte`; the bytes themselves until a call has counted some), plus
        room for special tokens, at most ``limit``. Cheap (no tokenizer on the event loop, none for a request that is
        refused or abandoned), close for the traffic the model serves, and exact where it matters: a model call
        tokenizes what it computes."""
        return [min(limit, SPECIAL_TOKENS + int(b * self.per_byte + 0.5)) for b in map(_bytes, items)]

    async def submit(self, items: Sequence[Any], costs: Sequence[int] | None = None, client: Any = None,
                     connection: Any = None) -> list[Any]:
        """Results for ``items`` (one per item, in order), computed in shared batches; ``costs`` are
        the items' token counts (computed with ``cost`` when not given). ``client``: whose fair share the request
        takes (default: :data:`current_client`), ``connection``: its turn within it (default:
        :data:`current_connection`). Raises :class:`QueueFull` when the queue is over a bound."""
        if not items:
            return []
        job = await self._enqueue(list(items), costs, client, connection)
        return await job.future  # cancelling the caller cancels the future: the job is dropped (see _take)

    async def _enqueue(self, items: list[Any], costs: Sequence[int] | None, client: Any, connection: Any,
                       limit: int | None = None) -> _Job:
        if self._wake is None or self._closing:
            raise RuntimeError(f"{self.name} is not running")
        if costs is None:
            costs = await self.costs(items)
        if len(costs) != len(items):
            raise ValueError(f"{len(costs)} token counts for {len(items)} items")
        key = current_client.get() if client is None else client
        conn = current_connection.get() if connection is None else connection
        loop = asyncio.get_running_loop()
        job = _Job(items, [max(1, int(c)) for c in costs], loop.create_future(), loop.time(), client=key, conn=conn,
                   limit=limit, results=[None] * len(items), counts=[None] * len(items))
        self._admit(key, job)
        flow = self._flows.setdefault(key, _Flow())
        if not flow.in_ring:
            flow.in_ring = True
            self._ring.append(key)
        flow.add(job)
        flow.seen = job.enqueued
        self._wake.set()
        return job

    def _admit(self, key: Any, job: _Job) -> None:
        """Raise :class:`QueueFull` when the work ahead of ``job``, as the round robin serves it, is over a bound:
        its connection's own queue, each other connection of its client up to that plus the new request, and each
        other client's queue up to what its client has ahead plus the new request."""
        if self.max_queue_items is None and self.max_queue_wait_s is None:
            return
        waiting = {k: self._flows[k].waiting() for k in self._ring}
        total_tokens = sum(k for w in waiting.values() for _, k in w.values())
        mine = waiting.pop(key, {})
        own_items, own_tokens = mine.pop(job.conn, (0, 0))
        others = [(sum(i for i, _ in w.values()), sum(k for _, k in w.values())) for w in waiting.values()]
        if not own_items and not any(i for i, _ in mine.values()) and not any(i for i, _ in others):
            return  # an idle model takes any request
        n, t = len(job.items), sum(job.costs)
        own_items += sum(min(i, own_items + n) for i, _ in mine.values())  # its client's share, served in turn
        own_tokens += sum(min(k, own_tokens + t) for _, k in mine.values())
        items_ahead = own_items + sum(min(i, own_items + n) for i, _ in others)
        tokens_ahead = own_tokens + sum(min(k, own_tokens + t) for _, k in others)
        drain = total_tokens / self._rate if self._rate else 1.0
        if self.max_queue_items is not None and items_ahead + n > self.max_queue_items:
            raise QueueFull(f"model {self.name} is busy: {items_ahead} texts are ahead of this request's {n}, over "
                            f"the queue's {self.max_queue_items}; retry later, or send fewer texts", drain)
        if self.max_queue_wait_s is not None and self._rate:
            wait = tokens_ahead / self._rate
            if wait > self.max_queue_wait_s:
                raise QueueFull(f"model {self.name} is busy: this request would wait about {wait:.1f} s, over the "
                                f"queue's {self.max_queue_wait_s:g} s; retry later, or send fewer texts", wait)

    async def submit_counted(self, items: list[Any], limit: int, exact: bool = True) -> tuple[list[Any], list[int]]:
        """:meth:`submit` ``items`` queued at :meth:`estimate` (at most ``limit`` tokens each); the results and each
        item's exact token count, as the model call's tokenizing found it (``counted``), else counted with
        ``cost`` once computed (in a thread when large). ``exact=False``: estimates will do, nothing is counted
        again. A request that is refused, or whose client leaves before its turn, costs no tokenizing."""
        if not items:
            return [], []
        job = await self._enqueue(list(items), self.estimate(items, limit), None, None, limit)
        results = await job.future
        counts = list(job.counts)
        missing = [i for i, c in enumerate(counts) if c is None]
        if missing and exact:
            for i, c in zip(missing, await self.costs([items[i] for i in missing]), strict=True):
                counts[i] = c
        return results, [job.costs[i] if c is None else c for i, c in enumerate(counts)]

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
        if self._long_worker is not None and self._long_wake is not None:
            self._long_wake.set()
            await self._long_worker
            self._long_executor.shutdown(wait=True)
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
            flow.prune(lambda job: self._expire(job, now))
            if not flow.conns:  # nothing waits: it leaves the ring, and its credit goes (deficit round robin)
                self._ring.popleft()
                flow.in_ring, flow.credit = False, 0
                continue
            if not flow.ready():  # its long items of an earlier batch have not run yet
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
        """One client's turn: its connections' oldest items, one connection's item after another's, while they fit
        in the batch (and in its credit, when ``fair``); True when the batch is full."""
        runs = {id(p.job): p for p in parts}  # a job's run of items in this batch, extended as it takes more
        passed = 0  # connections in a row that could not take an item (over the credit, or waiting long items)
        while flow.conns and passed < len(flow.conns):
            conn, jobs = next(iter(flow.conns.items()))
            if jobs[0].gone:
                jobs.popleft()
                if not jobs:
                    del flow.conns[conn]
                continue
            job = jobs[0]
            c = job.costs[job.taken]
            if conn in flow.held or (fair and c > flow.credit):
                passed += 1
                flow.turn_over(conn)
                continue
            alone = not self._fits(count + 1, max(longest, c))
            if alone and count:
                return count, longest, True
            # (an item over the budget alone runs alone rather than never)
            count, longest = count + 1, max(longest, c)
            run = runs.get(id(job))
            if run is None:
                run = runs[id(job)] = _Part(job, job.taken, job.taken)
                parts.append(run)
            job.taken += 1
            run.end = job.taken
            flow.credit -= c if fair else 0
            passed = 0
            if job.taken == len(job.items):
                jobs.popleft()
            if jobs:
                flow.turn_over(conn)
            else:
                del flow.conns[conn]
            if alone:
                return count, longest, True
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
    async def _call(self, parts: list[_Part], long: bool = False) -> None:
        """Run ``parts`` as one call (``long``: of long items put aside, for their share of the model's time); on
        failure, bisect at job boundaries until the failing job is alone."""
        loop = asyncio.get_running_loop()
        items = [x for p in parts for x in p.job.items[p.start:p.end]]
        fn, executor, wide = self.fn, self._executor, False
        if not long:
            self._short_at = loop.time()
        if self._long_fn is not None and long:
            if loop.time() - self._short_at < SHORT_RECENT_S:
                fn, executor = self._long_fn, self._long_executor
            # else no short request is about: every thread, as without lanes (long texts alone, e.g. passages
            # being indexed, keep the whole model's throughput); a short one arriving waits for this call
        elif self._long_fn is not None and self.short_lane is not None:
            if self._later or self._long_running:  # long items run or wait beside it: the other threads
                fn = self.short_lane
            else:  # every thread: the long lane waits for its end
                wide = self._wide = True
        started = loop.time()
        try:
            try:
                out = await loop.run_in_executor(executor, fn, items)
            finally:
                self._spent[long] += loop.time() - started
                if wide:
                    self._wide = False
                    if self._long_wake is not None:
                        self._long_wake.set()
            results, counts = out if self.counted else (out, None)
            if len(results) != len(items) or (counts is not None and len(counts) != len(items)):
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
                await self._call(half, long)
            return
        self._report(parts, items, started)
        seconds = loop.time() - started
        if seconds > 0:
            rate = sum(c for p in parts for c in p.job.costs[p.start:p.end]) / seconds
            self._rate = rate if self._rate is None else (1 - RATE_SMOOTHING) * self._rate + RATE_SMOOTHING * rate
        if counts is not None:
            self._learn(parts, counts)
        pos = 0
        for p in parts:
            n = p.end - p.start
            p.job.results[p.start:p.end] = results[pos:pos + n]
            if counts is not None:
                p.job.counts[p.start:p.end] = counts[pos:pos + n]
            pos += n
            p.job.done += n
            if p.job.done == len(p.job.items) and not p.job.future.done():
                p.job.future.set_result(p.job.results)
                if (flow := self._flows.get(p.job.client)) is not None:
                    flow.seen = loop.time()

    def _learn(self, parts: list[_Part], counts: Sequence[int | None]) -> None:
        """Move :attr:`per_byte` towards the tokens per byte of this call's texts that it counted whole."""
        tokens = size = 0
        pos = 0
        for p in parts:
            for item in p.job.items[p.start:p.end]:
                c = counts[pos]
                pos += 1
                if c is not None and (p.job.limit is None or c <= p.job.limit):
                    tokens += max(0, c - 2)
                    size += _bytes(item)
        if size:
            self.per_byte = (1 - RATE_SMOOTHING) * self.per_byte + RATE_SMOOTHING * tokens / size

    def _report(self, parts: list[_Part], items: list[Any], started: float) -> None:
        if self.on_batch is None:
            return
        longest = max(c for p in parts for c in p.job.costs[p.start:p.end])
        waits = [started - p.job.enqueued for p in parts if p.start == 0]
        with contextlib.suppress(Exception):
            self.on_batch(BatchStats(len(items), longest * len(items), waits))

    def _ready(self) -> bool:
        """Some client in the ring may take a turn (a connection of it has items, and no long items waiting)."""
        return any(self._flows[k].ready() for k in self._ring)

    async def _work(self) -> None:
        """Batches, each of its short requests' items; between two batches, when they are owed time, at most
        ``fair_tokens`` of one client's long items of earlier batches (:func:`_short_first`). A small request then
        waits for about one long row at most, however many long items were taken; a client alone gets whole
        batches."""
        assert self._wake is not None
        while True:
            later = bool(self._later) and self._long_fn is None  # else the long lane runs them (_long_work)
            if not later and not self._ready():
                if self._closing and not self._ring:
                    break
                self._wake.clear()
                await self._wake.wait()
                continue
            if later and not await self._short_first_now():
                parts = self._next_later()
                self._after_short = False
                if parts:
                    await self._call(parts, long=True)
                continue
            groups = _short_first(await self._collect(), LONG_TOKENS)
            if len(groups) == 1 and self._long(groups[0]):
                groups.insert(0, [])  # long items only: put aside too, to run in calls of bounded size
            for part in groups[1] if len(groups) > 1 else ():
                self._defer(part)
            if groups and groups[0]:
                self._after_short = True
                await self._call(groups[0])

    async def _long_work(self) -> None:
        """The long lane: the long items put aside, at most ``fair_tokens`` of one client's a call
        (:meth:`_next_later`), in a thread of their own beside the short batches; a call on every thread (no long
        item waited when it started) ends first."""
        assert self._long_wake is not None and self._wake is not None and self._worker is not None
        while True:
            if not self._later or self._wide:
                if not self._later and self._closing and self._worker.done():
                    break
                self._long_wake.clear()
                await self._long_wake.wait()
                continue
            parts = self._next_later()
            if parts:
                self._long_running = True
                try:
                    await self._call(parts, long=True)
                finally:
                    self._long_running = False
            self._wake.set()  # its connections may take turns again

    @staticmethod
    def _long(parts: list[_Part]) -> bool:
        return max((c for p in parts for c in p.job.costs[p.start:p.end]), default=0) >= LONG_TOKENS

    async def _short_first_now(self) -> bool:
        """Whether a batch of waiting short requests runs before the long items put aside: while those have had
        their :data:`LONG_SHARE` of the model's time since they waited, a short request that is queued, or arrives
        within :data:`SHORT_GRACE_S` (a client sending its next request), goes first. A client that loops
        maximum-size texts then slows the others' by a bounded factor, whatever one of its rows costs beside
        theirs; and long items get the whole model when nothing short waits."""
        if self._spent[True] * (1 - LONG_SHARE) <= self._spent[False] * LONG_SHARE or self._closing:
            return False  # their share is owed: they run now
        if self._ready():
            return True
        if not self._after_short:  # the clients of the last short batch are not about to send their next
            return False
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHORT_GRACE_S
        while not self._ready() and (left := deadline - loop.time()) > 0:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)
        return self._ready()

    def _defer(self, part: _Part) -> None:
        """Put ``part`` (long items of a batch) in :attr:`_later`, with the other parts of its client's there; its
        connection takes no turn until they ran."""
        now = asyncio.get_running_loop().time()
        if not self._later and now - self._later_empty > FAIR_WINDOW_S:  # the first in a while: their share counts
            self._spent = {False: 0.0, True: 0.0}                      # from now

        for group in self._later:
            if group[0].job.client == part.job.client:
                group.append(part)
                break
        else:
            self._later.append([part])
        if (flow := self._flows.get(part.job.client)) is not None:
            flow.held.add(part.job.conn)
        if self._long_wake is not None:
            self._long_wake.set()

    def _fits_later(self, alone: bool, tokens: int, items: int) -> bool:
        """Whether a call of put-aside long items may grow to ``items`` items of ``tokens`` tokens: a batch's
        bounds for a client alone, else ``fair_tokens``."""
        if not alone:
            return tokens <= self.fair_tokens
        return items <= self.max_batch and (self.max_batch_tokens is None or tokens <= self.max_batch_tokens)

    def _next_later(self) -> list[_Part]:
        """The first waiting client's long items, at most ``fair_tokens`` of them (at least one item): a small
        request that arrives meanwhile waits for no more. A client alone (no other client queued or with long
        items waiting) gets a whole batch. The rest waits after the other clients' (in :attr:`_later`). Its
        connections with nothing left there take turns again."""
        first = self._later.popleft()
        client = first[0].job.client
        alone = all(k == client for k in self._ring) and all(g[0].job.client == client for g in self._later if g)
        group = [p for p in first if not p.job.gone]  # a client gone meanwhile is not computed for
        out: list[_Part] = []
        tokens = 0
        while group:
            p = group[0]
            c = p.job.costs[p.start]
            if out and not self._fits_later(alone, tokens + c, sum(q.end - q.start for q in out) + 1):
                break
            if out and out[-1].job is p.job:
                out[-1].end += 1
            else:
                out.append(_Part(p.job, p.start, p.start + 1))
            tokens += c
            if p.start + 1 < p.end:
                group[0] = _Part(p.job, p.start + 1, p.end)
            else:
                group.pop(0)
        if group:
            self._later.append(group)
        elif not self._later:
            self._later_empty = asyncio.get_running_loop().time()
        if (flow := self._flows.get(client)) is not None:
            flow.held = {p.job.conn for g in self._later for p in g if p.job.client == client}
        return out
