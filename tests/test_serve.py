"""The HTTP service on a real uvicorn server: endpoints, micro-batching, limits, auth, bad input, shutdown."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import threading
import time

import httpx
import numpy as np
import pytest
from deploy_models import served_predictors

from encoderkit.deploy.batching import MicroBatcher
from encoderkit.deploy.guard import Limits
from encoderkit.deploy.serve import BackgroundServer, FastJSONResponse, create_app, parse_models
from encoderkit.errors import EncoderkitError

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WORDS = ["good", "bad", "fun", "dull", "best", "worst", "great", "boring"]


@pytest.fixture(scope="module")
def predictors(tmp_path_factory, tiny_tokenizer_dir):
    return served_predictors(tmp_path_factory, tiny_tokenizer_dir, max_batch=16)


@pytest.fixture(scope="module")
def server(predictors):
    app = create_app(predictors, Limits(max_body_bytes=4000, max_texts=8, max_chars=300, token=TOKEN),
                     max_batch=16, max_wait_ms=20)
    with BackgroundServer(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        yield client


def test_each_endpoint_answers_like_the_predictor(server, predictors):
    texts = ["the movie was great fun", "a dull story"]
    r = server.post("/v1/classify", json={"texts": texts}).json()
    assert r["model"] == "classify"
    assert [x["label"] for x in r["results"]] == [x["label"] for x in predictors["classify"].classify(texts)]
    r = server.post("/v1/classify", json={"texts": ["a"], "text_pairs": ["b"], "model": "classify"})
    assert r.status_code == 200
    assert abs(r.json()["results"][0]["score"] - predictors["classify"].classify([("a", "b")])[0]["score"]) < 1e-5

    ents = server.post("/v1/extract", json={"texts": ["Angela said that Paris was great"]}).json()["results"]
    assert ents == [[{**e, "score": pytest.approx(e["score"], abs=1e-5)} for e in
                     predictors["ner"].extract(["Angela said that Paris was great"])[0]]]

    ans = server.post("/v1/answer",
                      json={"questions": ["who ?"], "contexts": ["the man was in paris"]}).json()["results"][0]
    assert "the man was in paris"[ans["start"]:ans["end"]] == ans["answer"]

    rr = server.post("/v1/rerank",
                     json={"query": "good movie", "passages": texts + ["fun"], "top_k": 2}).json()["results"]
    ref = predictors["rerank"].rerank("good movie", texts + ["fun"])[:2]
    assert [x["index"] for x in rr] == [x["index"] for x in ref]

    emb = server.post("/v1/embed", json={"texts": texts, "dim": 8}).json()
    assert emb["dim"] == 8
    np.testing.assert_allclose(np.array(emb["embeddings"]), predictors["embed"].embed(texts, dim=8), atol=1e-5)

    health = server.get("/health").json()
    assert health["status"] == "ok" and health["models"]["ner"]["task"] == "ner"
    assert server.get("/openapi.json").json()["paths"].keys() >= {"/v1/classify", "/v1/embed"}
    assert server.get("/docs").status_code == 200


def test_fast_json_gives_the_same_values_as_json_dumps():
    from fastapi.responses import JSONResponse

    vectors = np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32)
    vectors[0, :4] = [1e-5, -3.2e-7, 1e16, 0.0]  # exponent forms, where the text of the two writers differs
    content = {"model": "m\u00e9", "dim": 384, "embeddings": vectors.tolist()}
    fast, slow = FastJSONResponse(content).body, JSONResponse(content).body
    assert json.loads(fast) == json.loads(slow) == content  # every float parses back to the same value
    assert len(fast) < len(slow) * 1.01


def test_concurrent_requests_each_get_their_own_result_in_shared_batches(server, predictors):
    texts = [f"the {a} {b} movie" for a in WORDS for b in WORDS]  # 64 distinct texts
    expected = {t: r for t, r in zip(texts, predictors["classify"].classify(texts), strict=True)}
    before = _batch_count(server.get("/metrics").text)

    def one(text):  # a client of its own per request: httpx's pool shared by 32 threads can race on a socket
        return text, httpx.post(server.base_url.join("/v1/classify"), json={"texts": [text]}, headers=AUTH, timeout=60)

    with cf.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, texts))
    for text, resp in answers:
        assert resp.status_code == 200
        assert abs(resp.json()["results"][0]["score"] - expected[text]["score"]) < 1e-5
    batches = _batch_count(server.get("/metrics").text) - before
    assert batches < len(texts)  # some requests shared a model call


def _batch_count(metrics: str) -> int:
    line = next((x for x in metrics.splitlines() if x.startswith('encoderkit_batch_size_count{model="classify"}')),
                "none 0")  # no line before the model's first batch
    return int(float(line.split()[-1]))  # prometheus_client writes counts as floats


@pytest.mark.parametrize("body,status,code", [
    (b"{", 400, "invalid_json"),
    (b"\xff\xfe\x00{", 400, None),                                # invalid UTF-8
    (b"[1, 2]", 422, "invalid_request"),                          # not an object
    (b'{"texts": "one"}', 422, "invalid_request"),                # wrong type
    (b'{"texts": [1]}', 422, "invalid_request"),
    (b'{"texts": []}', 422, "invalid_request"),
    (b'{"texts": ["  ", ""]}', 422, "empty_text"),               # every item bad: the request fails
    (b'{"texts": ["ok"], "bogus": 1}', 422, "invalid_request"),
    (b'{"texts": ["a","b","c","d","e","f","g","h","i"]}', 422, "too_many_texts"),
    (b'{"texts": ["' + b"a" * 301 + b'"]}', 422, "text_too_long"),
    (b'{"texts": ["' + b"a " * 2500 + b'"]}', 413, "body_too_large"),
    (b'{"texts": ["ok"], "model": "embed"}', 404, "wrong_task"),
    (b'{"texts": ["ok"], "model": "nope"}', 404, "unknown_model"),
    (b'{"texts": ["ok"], "text_pairs": ["a", "b"]}', 422, "invalid_request"),
])
def test_bad_input_gets_a_json_4xx(server, body, status, code):
    r = server.post("/v1/classify", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (code is None or err["code"] == code)


def test_other_bad_requests_and_the_service_survives(server):
    assert server.post("/v1/embed", json={"texts": ["a"], "dim": 999}).status_code == 422
    assert server.post("/v1/embed", json={"texts": ["a"], "dim": 0}).status_code == 422
    assert server.post("/v1/answer", json={"questions": ["a", "b"], "contexts": ["c"]}).status_code == 422
    assert server.post("/v1/rerank", json={"query": "", "passages": ["x"]}).status_code == 422
    assert server.get("/v1/nothing").status_code == 404 and server.get("/v1/classify").status_code == 405
    chunked = server.post("/v1/classify", content=iter([b'{"texts": ["', b"a " * 2500, b'"]}']),
                          headers={"content-type": "application/json"})  # no Content-Length: counted while read
    assert chunked.status_code == 413
    metrics = server.get("/metrics").text
    assert 'status="5' not in metrics and "encoderkit_request_seconds_bucket" in metrics
    assert server.post("/v1/classify", json={"texts": ["still alive"]}).status_code == 200


def test_auth_is_enforced(server):
    url = str(server.base_url)
    assert httpx.post(url + "/v1/classify", json={"texts": ["a"]}).status_code == 401
    wrong = httpx.post(url + "/v1/classify", json={"texts": ["a"]}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # health checks need no token


def test_task_not_served_and_model_required(predictors):
    app = create_app({"a": predictors["classify"], "b": predictors["classify"]})
    with BackgroundServer(app) as url:
        r = httpx.post(url + "/v1/extract", json={"texts": ["x"]})
        assert r.status_code == 404 and "/v1/classify (model a)" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/classify", json={"texts": ["x"]})
        assert r.status_code == 422 and r.json()["error"]["code"] == "model_required"
        assert httpx.post(url + "/v1/classify", json={"texts": ["x"], "model": "b"}).status_code == 200
    assert (parse_models(["x=/a", "/b/c"])
            == {"x": __import__("pathlib").Path("/a"), "c": __import__("pathlib").Path("/b/c")})
    with pytest.raises(EncoderkitError):
        parse_models(["x=/a", "x=/b"])


class _SlowClassifier:
    """Stands in for a Predictor (what the classify task's serve sees of one: a tokenizer and ``run_rows``) whose
    model call takes a while (to test shutdown)."""

    task, backend, max_batch, max_length = "classify", "stub", 8, 16
    backend_reason = "a stand-in"
    info = __import__("types").SimpleNamespace(task="classify", labels=["no", "yes"], normalize=True, card={})
    folder = __import__("pathlib").Path("/nonexistent")
    started = threading.Event()

    @staticmethod
    def tokenizer(texts, pairs=None, **kw):
        return {"input_ids": [[1, 2] for _ in texts]}

    def run_rows(self, rows):
        self.started.set()
        time.sleep(0.6)
        return [[np.array([0.0, 5.0], dtype=np.float32)] for _ in rows]  # logits: "yes"


def test_graceful_shutdown_finishes_requests_in_flight():
    slow = _SlowClassifier()
    app = create_app({"slow": slow}, max_wait_ms=1)
    server = BackgroundServer(app)
    results = []
    with server as url:
        def call():
            results.append(httpx.post(url + "/v1/classify", json={"texts": ["x"]}, timeout=30).status_code)
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        assert slow.started.wait(30)  # a batch is in the model call now
        time.sleep(0.2)  # and the other requests are queued behind it
    for t in threads:
        t.join(timeout=30)
    assert results == [200, 200, 200]


def test_serve_run_uses_the_fast_http_stack_and_no_access_log(monkeypatch):
    import uvicorn

    from encoderkit.deploy import serve

    seen = []
    monkeypatch.setattr(serve, "load_models", lambda *a, **k: {"slow": _SlowClassifier()})
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append(kw))
    serve.run(serve.ServeConfig(model=["x"]))
    serve.run(serve.ServeConfig(model=["x"], access_log=True))
    assert [kw["access_log"] for kw in seen] == [False, True]
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    assert seen[0]["loop"] == "auto"  # uvloop when installed (uvicorn[standard])
    assert issubclass(seen[0]["http"], AutoHTTPProtocol)  # httptools when installed, with the head timeout added
    assert seen[0]["timeout_keep_alive"] == 5.0
    assert "limit_concurrency" not in seen[0]  # the protocol's own caps: uvicorn's would count idle sockets as clients


def test_micro_batcher_groups_and_splits_results():
    calls = []

    def fn(items):
        calls.append(len(items))
        if "boom" in items:
            raise ValueError("bad item")
        return [x.upper() for x in items]

    async def scenario():
        b = MicroBatcher(fn, max_batch=4, max_wait_ms=50)
        await b.start()
        outs = await asyncio.gather(*(b.submit([f"t{i}", f"u{i}"]) for i in range(5)))
        with pytest.raises(ValueError):
            await b.submit(["boom"])
        after = await b.submit(["ok"])  # the worker survived the error
        pending = [asyncio.ensure_future(b.submit([f"late{i}"])) for i in range(3)]
        await asyncio.sleep(0)
        await b.close()  # drains what was submitted
        return outs, after, [p.result() for p in pending]

    outs, after, late = asyncio.run(scenario())
    assert outs == [[f"T{i}", f"U{i}"] for i in range(5)]
    assert after == ["OK"] and late == [["LATE0"], ["LATE1"], ["LATE2"]]
    assert max(calls) <= 4 and calls[:3] == [4, 4, 2]
