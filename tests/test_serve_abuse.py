"""serve under abuse, as production servers hold: work for departed clients is dropped, queues are bounded (503 with
Retry-After at once), clients share the model fairly, connections are capped per address, keep-alive survives a
413, a drain that cuts a request answers 503, refusals are one summary line; and a load test of all of it at once
(loopback only, a few seconds): good clients see no error and keep their latency."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import socket
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import numpy as np
import pytest

from encoderkit.deploy.batching import LONG_LANE_NICE, MicroBatcher, QueueFull
from encoderkit.deploy.guard import Limits
from encoderkit.deploy.metrics import REFUSALS
from encoderkit.deploy.protocol import server_options
from encoderkit.deploy.serve import BackgroundServer, create_app

MAX_TEXT = "word " * 300  # 1,500 characters: the stub's longest input (64 tokens)


class _Stub:
    """Stands in for a classify Predictor: a token per 5 characters (at most 64), and a model call that sleeps
    ``per_token`` s a token plus ``per_call`` (sleeping releases the GIL: the timing holds on a loaded machine).
    ``rows``: rows computed so far."""

    task, backend, max_batch, max_length = "classify", "stub", 32, 64
    backend_reason = "a stand-in"
    info = types.SimpleNamespace(task="classify", labels=["no", "yes"], normalize=True, card={})
    folder = Path("/nonexistent")

    def __init__(self, per_token: float = 0.0, per_call: float = 0.0) -> None:
        self.per_token, self.per_call, self.rows, self.calls = per_token, per_call, 0, 0
        self.started = threading.Event()

    def tokenizer(self, texts, pairs=None, max_length=None, **kw):
        cap = max_length or self.max_length
        return {"input_ids": [[1] * min(cap, 2 + len(t) // 5) for t in texts]}

    def run_rows(self, rows):
        self.started.set()
        tokens = sum(len(r["input_ids"]) if isinstance(r, dict) and "input_ids" in r else 1 for r in rows)
        time.sleep(self.per_call + self.per_token * tokens)
        self.rows += len(rows)
        self.calls += 1
        return [[np.array([0.0, 5.0], dtype=np.float32)] for _ in rows]


def _post(url: str, texts: list[str], timeout: float = 30, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/classify", json={"texts": texts}, timeout=timeout, **kw)


def _source(addr: str, url: str, timeout: float = 5) -> socket.socket:
    """A TCP connection to ``url`` from loopback address ``addr`` (127.0.0.x: another client address)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    return socket.create_connection((host, int(port)), timeout=timeout, source_address=(addr, 0))


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


# -- the scheduler -----------------------------------------------------------------------------------------------

def test_a_greedy_clients_backlog_never_delays_a_small_request_by_more_than_its_credit():
    """Client A queues 40 items of 100 tokens; client B then sends one of 10. Oldest first, B would wait for all of
    A's; with deficit round robin (200 tokens of credit a batch) B's item is in the next batch, beside at most
    two of A's; alone, A gets full batches."""
    calls: list[list[str]] = []

    def fn(items):
        calls.append([x[0] for x in items])
        time.sleep(0.01)
        return items

    async def scenario():
        b = MicroBatcher(fn, max_batch=32, max_wait_ms=1, max_batch_tokens=100_000, cost=lambda xs: [x[1] for x in xs],
                         fair_tokens=200)
        await b.start()
        alone = await b.submit([("s", 100)] * 40, client="solo")
        greedy = asyncio.ensure_future(b.submit([("a", 100)] * 40, client="a"))
        await asyncio.sleep(0.005)
        small = await b.submit([("b", 10)], client="b")
        greedy_done = greedy.done()
        await greedy
        await b.close()
        return alone, small, greedy_done

    _, small, greedy_done = asyncio.run(scenario())
    assert small == [("b", 10)] and not greedy_done
    assert [len(c) for c in calls[:2]] == [32, 8]  # alone: full batches, oldest first
    first_b = next(i for i, c in enumerate(calls) if "b" in c)
    assert first_b <= 4, calls
    assert calls[first_b].count("a") <= 2  # its credit: 200 tokens, two items


def test_a_clients_connections_take_turns_within_its_share():
    """One client (a reverse proxy's address) on two connections: the first queues 100 items, the second one item
    after it. They take turns an item at a time, so the second's item is in the next batch, not behind the
    first connection's backlog."""
    calls: list[list[str]] = []
    gate = threading.Event()

    def fn(items):
        gate.wait(10)
        calls.append(list(items))
        return items

    async def scenario():
        b = MicroBatcher(fn, max_batch=32, max_wait_ms=0)
        await b.start()
        backlog = asyncio.ensure_future(b.submit(["a"] * 100, client="proxy", connection=1))
        await asyncio.sleep(0.02)  # its first batch holds the model
        small = asyncio.ensure_future(b.submit(["b"], client="proxy", connection=2))
        await asyncio.sleep(0.02)
        gate.set()
        out = await asyncio.gather(backlog, small)
        await b.close()
        return out

    backlog, small = asyncio.run(scenario())
    assert backlog == ["a"] * 100 and small == ["b"]
    assert "b" in calls[1], [len(c) for c in calls]


def test_the_queue_is_bounded_in_texts_and_time_with_small_requests_still_admitted():
    async def scenario():
        gate = threading.Event()

        def fn(items):
            gate.wait(10)
            return items

        b = MicroBatcher(fn, max_batch=4, max_wait_ms=0, max_queue_items=20)
        await b.start()
        first = asyncio.ensure_future(b.submit(["x"] * 16, client="a"))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match="texts are ahead") as refused:
            await b.submit(["y"] * 12, client="b")  # 12 of a's + its own 12 > 20: refused at once
        small = asyncio.ensure_future(b.submit(["z"] * 2, client="c"))  # 2 of a's + 2: in
        gate.set()
        out = await asyncio.gather(first, small)
        await b.close()
        return refused.value, out

    refused, (first, small) = asyncio.run(scenario())
    assert refused.retry_after > 0 and first == ["x"] * 16 and small == ["z", "z"]


def test_a_request_that_cannot_start_in_time_gets_queue_full():
    async def scenario():
        b = MicroBatcher(lambda items: (time.sleep(0.3), items)[1], max_batch=1, max_wait_ms=0, max_queue_wait_s=0.1)
        await b.start()
        first = asyncio.ensure_future(b.submit(["a"], client="a"))
        await asyncio.sleep(0.01)
        late = asyncio.ensure_future(b.submit(["b"], client="a"))  # behind a's own 0.3 s call
        done = await asyncio.gather(first, late, return_exceptions=True)
        await b.close()
        return done

    first, late = asyncio.run(scenario())
    assert first == ["a"] and isinstance(late, QueueFull) and "without starting" in str(late)


def test_a_cancelled_request_is_dropped_and_its_items_never_computed():
    computed: list[str] = []

    def fn(items):
        computed.extend(items)
        time.sleep(0.05)
        return items

    async def scenario():
        b = MicroBatcher(fn, max_batch=2, max_wait_ms=0)
        await b.start()
        doomed = asyncio.ensure_future(b.submit([f"d{i}" for i in range(20)]))
        await asyncio.sleep(0.02)  # its first batch is running
        doomed.cancel()
        after = await b.submit(["ok"])
        await b.close()
        return after

    assert asyncio.run(scenario()) == ["ok"]
    assert len([x for x in computed if x.startswith("d")]) <= 4  # the batch in flight (and at most one more)


def test_a_large_request_is_tokenized_only_once_computed_never_when_refused_or_abandoned():
    """Requests are queued at an estimate and counted only after they are computed (here by ``cost``, as for a
    call that does not count): one refused by the queue, or whose caller leaves before its turn, is never
    tokenized (the CPU of the model calls is not spent on requests that are never computed)."""
    counted: list[str] = []
    gate = threading.Event()

    def cost(items):
        counted.extend(x[:1] for x in items)
        return [len(x) // 5 for x in items]

    def fn(items):
        gate.wait(10)
        return items

    big = [("a" + "x" * 1499)] * 20  # 30,000 characters

    async def scenario():
        b = MicroBatcher(fn, max_batch=4, max_wait_ms=0, cost=cost, max_queue_items=40)
        await b.start()
        small = asyncio.ensure_future(b.submit_counted(["s" * 50], 64))
        await asyncio.sleep(0.02)  # its call holds the model
        abandoned = asyncio.ensure_future(b.submit_counted([("b" + "x" * 1499)] * 20, 64))
        await asyncio.sleep(0.02)
        abandoned.cancel()
        kept = asyncio.ensure_future(b.submit_counted(big, 64))
        await asyncio.sleep(0.02)
        with pytest.raises(QueueFull):
            await b.submit_counted([("c" + "x" * 1499)] * 30, 64)
        gate.set()
        out = await asyncio.gather(small, kept)
        await b.close()
        return out

    (_, small_counts), (big_out, big_counts) = asyncio.run(scenario())
    assert small_counts == [10] and big_out == big and big_counts == [300] * 20  # exact, uncut counts
    assert "b" not in counted and "c" not in counted
    assert counted.count("a") == 20 and counted.index("s") < counted.index("a")


def test_short_requests_never_wait_for_more_than_one_clients_long_items():
    """Three clients queue long items, two send short ones. A batch's short requests run in a call of their own,
    first; the long items it took wait, one client's a call, between later batches (within their share of the
    model's time): a small request waits for one client's long items at most, not for every long item of its
    batch."""
    calls: list[list[tuple[str, int]]] = []
    gate = threading.Event()

    def fn(items):
        gate.wait(10)
        calls.append(list(items))
        time.sleep(0.005)
        return items

    async def scenario():
        b = MicroBatcher(fn, max_batch=32, max_wait_ms=1, cost=lambda xs: [x[1] for x in xs], fair_tokens=256)
        await b.start()
        first = asyncio.ensure_future(b.submit([("warm", 10)], client="w"))
        await asyncio.sleep(0.02)
        longs = [asyncio.ensure_future(b.submit([(c, 256)] * 4, client=c)) for c in ("L1", "L2", "L3")]
        await asyncio.sleep(0.01)
        gate.set()
        for _ in range(5):  # a wave of small requests as soon as the last is answered
            await asyncio.gather(*(b.submit([(c, 20)], client=c) for c in ("S1", "S2")))
        await asyncio.gather(first, *longs)
        await b.close()

    asyncio.run(scenario())
    calls = calls[1:]
    assert all(len({x[1] for x in c}) == 1 for c in calls), calls  # short and long items never share a call
    short_at = [i for i, c in enumerate(calls) if c[0][1] == 20]
    assert len(short_at) == 5 and short_at[0] == 0, calls  # each wave in one call; the first batch's shorts first
    assert all(b - a <= 2 for a, b in itertools.pairwise(short_at)), calls  # one long call at most between two waves
    assert all(len({x[0] for x in c}) == 1 for c in calls[:short_at[-1]] if c[0][1] == 256), calls  # one client's


def test_a_client_alone_gets_its_long_items_in_whole_batches():
    """Long items run in calls of ``fair_tokens`` only while another client is queued: a client alone embedding
    long passages gets batches of ``max_batch`` rows, not one row a call."""
    calls: list[int] = []

    def fn(items):
        calls.append(len(items))
        return items

    async def scenario():
        b = MicroBatcher(fn, max_batch=8, max_wait_ms=1, cost=lambda xs: [x[1] for x in xs], fair_tokens=256)
        await b.start()
        await b.submit([("p", 256)] * 20, client="alone")
        await b.close()

    asyncio.run(scenario())
    assert sum(calls) == 20 and max(calls) == 8 and len(calls) <= 4, calls


def _nice() -> int:
    """The calling thread's OS priority (Linux: per thread)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def test_long_rows_run_beside_short_batches_in_a_lane_of_their_own():
    """With lanes (serve makes them where the engine opens a one-thread session), a client's long items run in a thread
    of their own, at a lower OS priority, while the short requests of others go on in the short lane: none waits for
    a long row's call. With no long item waiting or running, a batch runs on every thread (``fn``)."""
    log: list[tuple[str, float, float, list, int]] = []  # lane, start, end, items, the thread's nice

    def lane(name: str, seconds: float):
        def run(items):
            start = time.perf_counter()
            time.sleep(seconds)
            log.append((name, start, time.perf_counter(), list(items), _nice()))
            return items
        return run

    async def scenario():
        b = MicroBatcher(lane("wide", 0.005), max_batch=32, max_wait_ms=1, cost=lambda xs: [x[1] for x in xs],
                         short_lane=lane("short", 0.005), long_lane=lambda: lane("long", 0.6))
        await b.start()
        await b.submit([("q", 10)], client="S")
        longs = asyncio.ensure_future(b.submit([("L", 256)] * 2, client="L"))
        await asyncio.sleep(0.1)  # its first row's call is running
        for _ in range(5):
            await b.submit([("s", 10)], client="S")
        await longs
        await b.submit([("q", 10)], client="S")
        await b.close()

    asyncio.run(scenario())
    assert [e[0] for e in log if e[3][0][0] == "q"] == ["wide", "wide"], log  # no long item: every thread
    rows = [e for e in log if e[0] == "long"]
    assert [len(e[3]) for e in rows] == [1, 1], log  # one 256-token row a call (fair_tokens) in the long lane
    short = [e for e in log if e[3][0][0] == "s"]
    assert [e[0] for e in short] == ["short"] * 5, log
    assert all(rows[0][1] < e[1] and e[2] < rows[0][2] for e in short), log  # all five during the first row's call
    if sys.platform == "linux":
        assert all(e[4] >= LONG_LANE_NICE for e in rows) and all(e[4] < LONG_LANE_NICE for e in short), log


def test_long_texts_alone_run_on_every_thread_not_in_the_long_lane():
    """Long texts with no short request about (passages being indexed) keep the whole model: whole batches on
    every thread (``fn``), never the one-thread long lane; once short requests come, long rows move to the lane."""
    log: list[tuple[str, int]] = []

    def lane(name: str):
        def run(items):
            time.sleep(0.01)
            log.append((name, len(items)))
            return items
        return run

    async def scenario():
        b = MicroBatcher(lane("wide"), max_batch=8, max_wait_ms=1, cost=lambda xs: [x[1] for x in xs],
                         short_lane=lane("short"), long_lane=lambda: lane("long"))
        await b.start()
        await b.submit([("P", 200)] * 8, client="c0")
        assert log and {name for name, _ in log} == {"wide"} and max(n for _, n in log) > 1, log
        log.clear()
        await b.submit([("s", 10)], client="S")
        await b.submit([("P", 200)], client="c0")
        await b.close()

    asyncio.run(scenario())
    assert log == [("wide", 1), ("long", 1)], log  # a short batch just ran: the long row goes to its lane


class _LaneEngine:
    """An engine that opens lanes (``lane(threads)``), each named in the order it was made."""

    def __init__(self, threads: int, name: str = "wide", made: list | None = None) -> None:
        self.threads, self.name, self.made = threads, name, made if made is not None else []

    def lane(self, threads: int) -> _LaneEngine:
        self.made.append(threads)
        return _LaneEngine(threads, f"lane{len(self.made)}", self.made)


class _LaneStub(_Stub):
    """The classify stand-in on an engine with lanes; ``seen``: (engine, text length, thread nice) per row. Texts of
    1,500 characters are 302 tokens: long."""

    max_length = 512

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.engine, self.seen = _LaneEngine(2), []

    def run_rows(self, rows):
        self.seen += [(self.engine.name, len(r["input_ids"]), _nice()) for r in rows]
        time.sleep(0.5 if len(rows[0]["input_ids"]) >= 128 else 0.002)
        return [[np.array([0.0, 5.0], dtype=np.float32)] for _ in rows]


def test_serve_runs_long_texts_on_a_one_thread_lane_beside_short_requests():
    """serve gives a model whose engine opens lanes a short lane (its threads but one) and a long lane (one thread,
    made in that lane's low-priority thread): a client's long texts run there while another's short requests are
    answered in the short lane; without lanes (``long_lane=False``), or with one thread, none is made."""
    stub = _LaneStub()
    app = create_app({"m": stub}, Limits(max_texts=256, max_chars=2000), max_batch=32, max_wait_ms=1)
    assert stub.engine.made == [1]  # the short lane: 2 threads but one
    with BackgroundServer(app) as url:
        assert stub.engine.made == [1, 1]  # the long lane, at start
        assert _post(url, ["short"]).status_code == 200
        with _source("127.0.0.3", url, timeout=30) as s:  # another client sends two long texts
            body = b'{"texts": ["' + b"word " * 300 + b'", "' + b"word " * 300 + b'"]}'
            s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.15)
            started = time.perf_counter()
            for _ in range(5):
                assert _post(url, ["short"]).status_code == 200
            short_s = time.perf_counter() - started
            assert s.recv(12) == b"HTTP/1.1 200"
    assert short_s < 0.5, short_s  # not one waited for a long row's call (0.5 s)
    by_lane = {(name, n >= 128) for name, n, _ in stub.seen}
    assert by_lane == {("wide", False), ("lane1", False), ("lane2", True)}, stub.seen
    if sys.platform == "linux":
        assert all(nice >= LONG_LANE_NICE for name, _, nice in stub.seen if name == "lane2"), stub.seen
    for kw, engine in (({"long_lane": False}, _LaneEngine(2)), ({}, _LaneEngine(1))):
        other = _LaneStub()
        other.engine = engine
        create_app({"m": other}, **kw)
        assert engine.made == [], kw


def test_a_refused_connection_is_held_before_its_503_so_reconnecting_in_a_loop_is_slow():
    app = create_app({"m": _Stub()})
    with BackgroundServer(app, **server_options(max_connections_per_client=1, refuse_delay_s=0.6)) as url:
        keep = _source("127.0.0.5", url)
        start = time.monotonic()
        with _source("127.0.0.5", url) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # not read: held, then refused
            answer = _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"200 OK" not in answer
        assert time.monotonic() - start >= 0.5
        keep.close()


def test_serve_keeps_each_tokenizer_call_on_one_thread(monkeypatch):
    """The tokenizers' Rust thread pool would take the cores the model calls need: serve sets
    TOKENIZERS_PARALLELISM=false (unless the user set it) before it loads a tokenizer."""
    import uvicorn

    from encoderkit.deploy import serve

    seen: list[str | None] = []
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(serve, "load_models",
                        lambda *a, **k: seen.append(os.environ.get("TOKENIZERS_PARALLELISM")) or {"m": _Stub()})
    monkeypatch.setattr(serve, "_freeze_startup_heap", lambda: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    serve.run(serve.ServeConfig(model=["x"]))
    assert seen == ["false"]


# -- over HTTP ---------------------------------------------------------------------------------------------------

def test_a_client_that_disconnects_is_not_computed_for():
    stub = _Stub(per_call=0.05)
    app = create_app({"m": stub}, Limits(max_texts=256, max_chars=2000), max_batch=8, max_wait_ms=1)
    with BackgroundServer(app) as url:
        with pytest.raises(httpx.TimeoutException):
            _post(url, ["x"] * 256, timeout=0.2)  # 32 calls of 50 ms: abandoned after the first few
        time.sleep(0.3)
        rows = stub.rows
        time.sleep(0.3)
        assert stub.rows == rows  # nothing more was computed for it
        assert rows < 128
        assert _post(url, ["after"]).status_code == 200


def test_a_client_gets_one_share_however_many_connections_it_opens():
    """A greedy client loops 32-text requests on 8 connections from one address; another client sends one text.
    Shared by address, the greedy client's items in the batch that computes the small request are one share (the
    256 tokens of credit: 4 texts of 64 tokens), not 8 (one per connection, which filled whole batches)."""
    calls: list[list[str]] = []
    stub = _Stub(per_call=0.02)
    stub_run = stub.run_rows

    def run_rows(rows):
        calls.append(["good" if len(r["input_ids"]) < 10 else "greedy" for r in rows])
        return stub_run(rows)

    stub.run_rows = run_rows  # type: ignore[method-assign]
    stop = threading.Event()

    def greedy() -> None:
        with httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address=ABUSER)) as c:
            while not stop.is_set():
                c.post("/v1/classify", json={"texts": [MAX_TEXT] * 32})

    app = create_app({"m": stub}, Limits(max_texts=64), max_batch=32, max_wait_ms=2, fair_tokens=256)
    with BackgroundServer(app) as url:
        threads = [threading.Thread(target=greedy) for _ in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(calls) < 8 and time.monotonic() < deadline:  # every connection's request has arrived
            time.sleep(0.02)
        with httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.4")) as c:
            r = c.post("/v1/classify", json={"texts": ["good"]})
        stop.set()
        for t in threads:
            t.join(30)
    assert r.status_code == 200
    shared = next(c for c in calls if "good" in c)
    assert shared.count("greedy") <= 5, [c.count("greedy") for c in calls]


class _CountingTokenizer:
    """A fast (Rust) tokenizer that notes every text it tokenizes."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer, self.seen = AutoTokenizer.from_pretrained(folder), []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, texts, *args, **kw):
        self.seen.extend(texts if isinstance(texts, list) else [texts])
        return self.tokenizer(texts, *args, **kw)


def test_each_text_is_tokenized_once_by_the_model_call(tiny_tokenizer_dir):
    """The queue sizes a request without tokenizing it, and the counts a response reports ('truncated') come from
    the model call's own tokenizing: each text of a small request and of a large one is tokenized once."""
    stub = _Stub()
    stub.tokenizer = _CountingTokenizer(tiny_tokenizer_dir)  # type: ignore[assignment]
    long_text = "a good movie " * 40  # 120 words: over the stub's 64 tokens
    large = [f"text {i} " + "x" * 1400 for i in range(20)]  # 28,000 characters: a large request
    app = create_app({"m": stub}, Limits(max_texts=64), max_wait_ms=1)
    with BackgroundServer(app) as url:
        small = _post(url, ["a good movie", long_text])
        big = _post(url, large)
    assert small.status_code == 200 and small.json()["truncated"] == [1]
    assert big.status_code == 200 and big.json()["truncated"] == []
    seen = __import__("collections").Counter(stub.tokenizer.seen)
    assert seen == {t: 1 for t in ["a good movie", long_text, *large]}, {t[:20]: n for t, n in seen.items() if n > 1}


def test_the_token_tap_counts_as_the_tokenizer_does_truncated_ones_one_past_the_cut(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from encoderkit.deploy.batching import TokenTap, token_counts

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    texts = ["a good movie", "not so good " * 30, ""]
    pairs = [("a question", "an answer " * 20), ("short", "pair")]
    tap = TokenTap(tokenizer)
    tap(texts, truncation=True, max_length=16)
    tap([q for q, _ in pairs], [d for _, d in pairs], truncation=True, max_length=16)
    assert [tap.counts[x] for x in [*texts, *pairs]] == token_counts(tokenizer, texts, 17) + token_counts(
        tokenizer, pairs, 17)
    assert tap.counts["not so good " * 30] == 17 and len(tap) == len(tokenizer)


def test_a_full_queue_answers_503_with_retry_after_at_once():
    stub = _Stub(per_call=0.3)
    app = create_app({"m": stub}, Limits(max_texts=64), max_batch=4, max_wait_ms=1, max_queue_texts=64)
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=30) as other:
        first = threading.Thread(target=_post, args=(url, ["x"] * 60))
        first.start()
        assert stub.started.wait(10)
        start = time.monotonic()
        r = other.post("/v1/classify", json={"texts": ["y"] * 60})
        assert r.status_code == 503 and time.monotonic() - start < 0.25  # at once, not after waiting
        assert r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1
        assert other.post("/v1/classify", json={"texts": ["small"]}).status_code == 200  # a small one gets in
        first.join()


def test_connections_are_limited_per_client_address_and_idle_ones_make_room():
    stub = _Stub()
    app = create_app({"m": stub})
    options = server_options(head_timeout_s=5.0, max_connections=6, max_connections_per_client=3)
    with BackgroundServer(app, **options) as url:
        idle = [_source("127.0.0.2", url) for _ in range(3)]
        extra = _source("127.0.0.2", url)  # a fourth from the same address: 503 and closed
        answer = _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower()
        more = [_source("127.0.0.3", url) for _ in range(3)]  # 6 open: the global limit
        with httpx.Client(base_url=url, timeout=10) as c:  # another address still gets in: the oldest idle goes
            assert c.post("/v1/classify", json={"texts": ["good"]}).status_code == 200
        assert _read_all(idle[0]) == b""
        for s in [*idle, extra, *more]:
            s.close()


def test_keep_alive_survives_a_413():
    app = create_app({"m": _Stub()}, Limits(max_body_bytes=20_000))
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(10):  # declared over the limit, answered before the body is read
            assert c.post("/v1/classify", content=b"x" * 200_000).status_code == 413
            assert c.post("/v1/classify", json={"texts": ["next"]}).status_code == 200

        def chunks():
            for _ in range(20):
                yield b"x" * 10_000

        for _ in range(3):  # streamed past the limit
            assert c.post("/v1/classify", content=chunks()).status_code == 413
            assert c.post("/v1/classify", json={"texts": ["next"]}).status_code == 200
        assert c.get("/metrics").status_code == 200


def test_a_request_cut_by_the_shutdown_deadline_gets_503():
    stub = _Stub(per_call=2.0)
    app = create_app({"m": stub}, max_wait_ms=1)
    result: list[httpx.Response] = []
    with BackgroundServer(app, timeout_graceful_shutdown=0.5) as url:
        t = threading.Thread(target=lambda: result.append(_post(url, ["slow"])))
        t.start()
        assert stub.started.wait(10)
    t.join(30)
    assert result[0].status_code == 503, result[0].text
    assert result[0].headers["retry-after"] == "1" and result[0].json()["error"]["code"] == "shutting_down"


def test_refusals_are_logged_as_a_summary_not_a_line_each():
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    before = sum(REFUSALS.total.values())
    try:
        with BackgroundServer(create_app({"m": _Stub()}), **server_options(max_connections_per_client=2,
                                                                     refuse_delay_s=0)) as url:
            keep = [_source("127.0.0.4", url) for _ in range(2)]
            for _ in range(60):
                with _source("127.0.0.4", url) as s:
                    assert _read_all(s).startswith(b"HTTP/1.1 503")
            for s in keep:
                s.close()
    finally:
        logger.removeHandler(handler)
    assert sum(REFUSALS.total.values()) - before >= 60
    refused = [x for x in lines if x.startswith("refused")]
    assert len(refused) <= 2, lines
    assert "Exceeded concurrency limit" not in " ".join(lines)


# -- the load test -----------------------------------------------------------------------------------------------

def _good_client(url: str, stop: threading.Event, out: list[float], errors: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                r = c.post("/v1/classify", json={"texts": ["a good movie", "not so good"]})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                errors.append(repr(e))
            out.append(time.perf_counter() - start)


ABUSER = "127.0.0.3"  # the greedy and abandoning client's address (serve shares the model by address)


def _greedy_client(url: str, stop: threading.Event, answered: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=60, transport=httpx.HTTPTransport(local_address=ABUSER)) as c:
        while not stop.is_set():
            answered.append(c.post("/v1/classify", json={"texts": [MAX_TEXT] * 256}).status_code)


def _abandoner(url: str, stop: threading.Event, abandoned: list[int]) -> None:
    """A maximum-size request dropped after 0.3 s, again every second."""
    while not stop.is_set():
        with httpx.Client(base_url=url, timeout=0.3, transport=httpx.HTTPTransport(local_address=ABUSER)) as c:
            try:
                c.post("/v1/classify", json={"texts": [MAX_TEXT] * 256})
            except httpx.HTTPError:
                abandoned.append(1)
        stop.wait(0.7)


def _idle_sockets(url: str, stop: threading.Event, n: int) -> None:
    """``n`` sockets from 127.0.0.2 that never send a byte, reopened as the server closes them."""
    socks: list[socket.socket] = []
    while not stop.is_set():
        alive = []
        for s in socks:
            try:
                s.setblocking(False)
                closed = s.recv(1024, socket.MSG_PEEK) is not None
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                s.close()
            else:
                alive.append(s)
        socks = alive
        while len(socks) < n:
            try:
                socks.append(_source("127.0.0.2", url, timeout=1))
            except OSError:
                break
        stop.wait(0.25)
    for s in socks:
        s.close()


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99))


def _phase(url: str, seconds: float, good: int, abuse: bool) -> tuple[list[float], list[str], list[int], int]:
    """Good clients' latencies and errors over ``seconds``, with ``abuse`` under way (from 0.5 s before), the
    greedy client's statuses and the number of abandoned requests."""
    stop, latencies, errors, greedy, abandoned = threading.Event(), [], [], [], []
    threads = []
    if abuse:
        threads += [threading.Thread(target=_greedy_client, args=(url, stop, greedy)),
                    threading.Thread(target=_idle_sockets, args=(url, stop, 150))]
        threads += [threading.Thread(target=_abandoner, args=(url, stop, abandoned)) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the abuse is under way (the bench's good clients start so too)
    good_threads = [threading.Thread(target=_good_client, args=(url, stop, latencies, errors)) for _ in range(good)]
    for t in good_threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in [*threads, *good_threads]:
        t.join(60)
    return latencies, errors, greedy, len(abandoned)


def test_good_clients_keep_their_latency_beside_a_greedy_client_abandoned_requests_and_idle_sockets():
    """Six good clients loop small requests; then, beside them, a client loops maximum-size requests (256 x 1,500
    characters), six such requests are abandoned after 0.3 s every second (both from 127.0.0.3), and 150 idle
    sockets from 127.0.0.2 are held open (reopened as they are closed). Oldest-first batching made the good
    clients wait for whole maximum-size requests; here they get no error and their p99 stays within a bound of
    their p99 without the abuse (the issue asks 2x; the bound here is wider for a loaded 2-core machine:
    docs/deploy.md has the measured ratio)."""
    stub = _Stub(per_token=60e-6, per_call=0.002)  # a maximum-size request: 16,384 tokens, 1 s of model calls
    app = create_app({"m": stub}, Limits(max_texts=256, max_chars=2000), max_batch=32, max_wait_ms=2,
                     max_queue_texts=4096, max_queue_wait_s=5.0, fair_tokens=256)
    options = server_options(head_timeout_s=1.0, max_connections=200, max_connections_per_client=40)
    gc.collect()
    gc.freeze()  # as serve does (_freeze_startup_heap): the heap of the tests before is not walked by each collection
    try:
        with BackgroundServer(app, **options) as url:
            _phase(url, 0.5, 6, abuse=False)  # warm-up
            quiet, quiet_errors, _, _ = _phase(url, 2.5, 6, abuse=False)
            rows = stub.rows
            abused, abuse_errors, greedy, abandoned = _phase(url, 3.0, 6, abuse=True)
            abuse_rows = stub.rows - rows
    finally:
        gc.unfreeze()
    assert quiet_errors == [] and abuse_errors == []
    assert len(quiet) > 50 and len(abused) > 50
    q, a = _p99(quiet), _p99(abused)
    # oldest first, a good request waits for whole maximum-size requests (1 s each, and six abandoned ones)
    assert a <= max(4 * q, q + 0.5), (q, a)
    assert 200 in greedy  # fair, not starved
    # the abandoned requests (256 texts each) were not computed after their clients left
    assert abandoned >= 6 and abuse_rows < 2 * len(abused) + 256 * (len(greedy) + 1) + abandoned * 256 // 2, abuse_rows
