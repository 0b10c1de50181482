"""The MicroBatcher: token-budget batches, oldest first, a failing batch bisected to its one bad request."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import threading
import time

import httpx
import numpy as np
import pytest

from encoderkit.deploy.batching import MicroBatcher, token_counts
from encoderkit.deploy.serve import BackgroundServer, create_app


def _cost(items):
    return [c for _, c in items]


def test_token_budget_batches_never_exceed_the_budget():
    budget, max_batch = 200, 16
    batches: list[list[tuple[str, int]]] = []

    def fn(items):
        batches.append(list(items))
        return [name.upper() for name, _ in items]

    rng = random.Random(0)
    requests = [[(f"r{r}i{i}", rng.randint(1, 120)) for i in range(rng.choice([1, 1, 2, 5, 30]))] for r in range(60)]

    async def scenario():
        b = MicroBatcher(fn, max_batch=max_batch, max_wait_ms=5, max_batch_tokens=budget, cost=_cost)
        await b.start()
        outs = await asyncio.gather(*(b.submit(req) for req in requests))
        await b.close()
        return outs

    outs = asyncio.run(scenario())
    assert outs == [[name.upper() for name, _ in req] for req in requests]  # each caller its own, in order
    assert len(batches) > 1 and sum(len(b) for b in batches) == sum(len(r) for r in requests)
    for batch in batches:
        assert len(batch) <= max_batch
        assert max(c for _, c in batch) * len(batch) <= budget, batch
    assert max(max(c for _, c in b) * len(b) for b in batches) > budget // 2  # the budget is used, not just respected


def test_an_item_over_the_budget_runs_alone_and_a_large_request_is_cut():
    sizes = []

    def fn(items):
        sizes.append([c for _, c in items])
        return [c for _, c in items]

    async def scenario():
        b = MicroBatcher(fn, max_batch=8, max_wait_ms=1, max_batch_tokens=100, cost=_cost)
        await b.start()
        big = await b.submit([("huge", 500)])
        many = await b.submit([(f"t{i}", 10) for i in range(25)])
        await b.close()
        return big, many

    big, many = asyncio.run(scenario())
    assert big == [500] and many == [10] * 25
    assert sizes == [[500], [10] * 8, [10] * 8, [10] * 8, [10]]


def test_a_burst_is_answered_oldest_first():
    """A slow engine (40 ms a call) and a burst of 12 requests submitted one after another: every batch
    holds the oldest requests still waiting, so answers come back in arrival order."""
    calls: list[list[str]] = []

    def slow(items):
        calls.append(list(items))
        time.sleep(0.04)
        return list(items)

    answered: list[str] = []

    async def scenario():
        b = MicroBatcher(slow, max_batch=3, max_wait_ms=0)
        await b.start()

        async def client(i: int):
            await asyncio.sleep(0.005 * i)  # distinct arrival times, all while earlier batches run
            await b.submit([f"q{i}"] if i != 4 else [f"q{i}a", f"q{i}b"])  # one request of two items
            answered.append(f"q{i}")

        await asyncio.gather(*(client(i) for i in reversed(range(12))))  # started in reverse: arrival decides
        await b.close()

    asyncio.run(scenario())
    flat = [x for c in calls for x in c]
    arrival = [x for i in range(12) for x in ([f"q{i}"] if i != 4 else ["q4a", "q4b"])]
    assert flat == arrival
    assert answered == [f"q{i}" for i in range(12)]
    assert max(len(c) for c in calls) == 3  # they were batched, not run one by one


def test_a_poisoned_item_fails_only_its_own_request():
    calls = []

    def fn(items):
        calls.append(len(items))
        if "poison" in items:
            raise ValueError("cannot encode 'poison'")
        return [x.upper() for x in items]

    async def scenario():
        b = MicroBatcher(fn, max_batch=32, max_wait_ms=50)
        await b.start()
        reqs = [[f"ok{i}"] for i in range(15)] + [["fine", "poison"]] + [[f"ok{i}"] for i in range(15, 30)]
        outs = await asyncio.gather(*(b.submit(r) for r in reqs), return_exceptions=True)
        again = await b.submit(["after"])
        await b.close()
        return reqs, outs, again

    reqs, outs, again = asyncio.run(scenario())
    bad = [i for i, o in enumerate(outs) if isinstance(o, Exception)]
    assert bad == [15] and "poison" in str(outs[15])
    assert all(outs[i] == [x.upper() for x in reqs[i]] for i in range(len(reqs)) if i != 15)
    assert again == ["AFTER"]
    assert calls[0] == 32 and len(calls) <= 2 * 5 + 2  # one shared call, then a bisection: ~2 log2(31) retries


def test_token_counts_use_the_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    texts = ["good", "a good fun movie", "word " * 200]
    counts = token_counts(tok, texts, max_length=64)
    assert counts[:2] == [len(tok(t)["input_ids"]) for t in texts[:2]] and counts[2] == 64
    assert token_counts(tok, [("good", "fun movie")], 64) == [len(tok("good", "fun movie")["input_ids"])]
    assert token_counts(None, ["a", "b"], 64) == [1, 1]


class _PoisonClassifier:
    """A Predictor stand-in (what the classify task's serve sees of one: a tokenizer and ``run_rows``) whose model
    call (30 ms) raises when a batch holds the text 'poison' (token id 9; every other text is one token, id 1)."""

    task, backend, max_batch, max_length = "classify", "stub", 64, 16
    backend_reason = "a stand-in"
    info = __import__("types").SimpleNamespace(task="classify", labels=["no", "yes"], normalize=True, card={})
    folder = __import__("pathlib").Path("/nonexistent")

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.lock = threading.Lock()

    @staticmethod
    def tokenizer(texts, pairs=None, **kw):
        return {"input_ids": [[9] if t == "poison" else [1] for t in texts]}

    def run_rows(self, rows):
        with self.lock:
            self.sizes.append(len(rows))
        time.sleep(0.03)
        if any(9 in r["input_ids"] for r in rows):
            raise RuntimeError("the engine failed on this batch")
        return [[np.array([0.0, 5.0], dtype=np.float32)] for _ in rows]  # logits: "yes"


def test_one_bad_request_among_30_good_ones_over_http():
    stub = _PoisonClassifier()
    app = create_app({"m": stub}, max_batch=64, max_wait_ms=40)
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        texts = [f"text {i}" for i in range(30)] + ["poison"]

        def call(t):  # a client of its own per request: httpx's pool shared by threads can race on a socket
            return httpx.post(f"{url}/v1/classify", json={"texts": [t]}, timeout=60).status_code

        with cf.ThreadPoolExecutor(31) as pool:
            codes = list(pool.map(call, texts))
        metrics = client.get("/metrics").text
    assert codes[:30] == [200] * 30 and codes[30] >= 500
    assert max(stub.sizes) > 1  # the bad request did share a batch with good ones
    assert "encoderkit_queue_seconds_count" in metrics and 'encoderkit_batch_tokens_count{model="m"}' in metrics


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        MicroBatcher(lambda x: x, max_batch=bad)
    with pytest.raises(ValueError):
        MicroBatcher(lambda x: x, max_batch_tokens=bad)


def test_serve_freezes_the_startup_heap_before_serving(monkeypatch):
    """A full garbage collection over everything loaded at startup stalls every request in flight (the long
    tail): serve moves those objects out of the collector's view before uvicorn starts."""
    import gc

    import uvicorn

    from encoderkit.deploy import serve

    frozen = []
    monkeypatch.setattr(serve, "load_models", lambda *a, **k: {"m": _PoisonClassifier()})
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: frozen.append(gc.get_freeze_count()))
    try:
        serve.run(serve.ServeConfig(model=["x"]))
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 1000


def test_a_large_request_is_token_counted_off_the_event_loop():
    threads = []

    def cost(items):
        threads.append(threading.get_ident())
        return [len(x) for x in items]

    async def scenario():
        b = MicroBatcher(lambda items: items, cost=cost)
        await b.start()
        small = await b.costs(["a few words"])
        large = await b.costs(["word " * 5000])
        await b.close()
        return small, large

    loop_thread = threading.get_ident()  # asyncio.run runs the loop in this thread
    small, large = asyncio.run(scenario())
    assert small == [11] and large == [25000]
    assert threads[0] == loop_thread and threads[1] != loop_thread
