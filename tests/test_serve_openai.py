"""The peers' API shapes on a real server: OpenAI embeddings (through the real `openai` client), Cohere/Jina
rerank beside encoderkit's own shape, /v1/models, and OpenAI-shaped 4xx errors for every bad field."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from deploy_models import export_task_model, tiny_root

from encoderkit.deploy.guard import Limits
from encoderkit.deploy.serve import BackgroundServer, create_app
from encoderkit.inference.predictor import Predictor

openai = pytest.importorskip("openai")
TOKEN = "s3cret"
TEXTS = ["the movie was great fun", "a dull story", "paris is a city in france"]


@pytest.fixture(scope="module")
def predictors(tmp_path_factory, tiny_tokenizer_dir):
    root = tiny_root(tmp_path_factory)
    return {t: Predictor.load(export_task_model(root, tiny_tokenizer_dir, t), backend="onnx-fp32", max_batch=16)
            for t in ("embed", "rerank", "classify")}


@pytest.fixture(scope="module")
def url(predictors):
    app = create_app({"emb": predictors["embed"], "rr": predictors["rerank"], "cls": predictors["classify"]},
                     Limits(max_texts=8, max_chars=300, token=TOKEN), max_batch=16, max_wait_ms=5)
    with BackgroundServer(app) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        yield c


def test_openai_client_embeddings_match_the_predictor(client, predictors):
    p = predictors["embed"]
    one = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, p.embed(TEXTS[:1])[0], atol=1e-6)
    many = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2] and many.model == "emb"
    np.testing.assert_allclose(np.array([d.embedding for d in many.data]), p.embed(TEXTS), atol=1e-6)
    tokens = sum(len(ids) for ids in p.tokenizer(TEXTS)["input_ids"])
    assert many.usage.prompt_tokens == many.usage.total_tokens == tokens

    short = client.embeddings.create(model="emb", input=TEXTS, dimensions=8, encoding_format="float")
    vecs = np.array([d.embedding for d in short.data])
    assert vecs.shape == (3, 8)
    np.testing.assert_allclose(vecs, p.embed(TEXTS, dim=8), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)  # re-normalised after the cut

    b64 = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
    np.testing.assert_array_equal(np.array([d.embedding for d in b64.data], dtype=np.float32),
                                  np.array([d.embedding for d in many.data], dtype=np.float32))


def test_base64_is_little_endian_float32(http, predictors):
    import base64

    r = http.post("/v1/embeddings", json={"model": "emb", "input": TEXTS[1], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, predictors["embed"].embed(TEXTS[1:2])[0], atol=1e-6)


def test_langchain_openai_embeddings(url, predictors):
    lc = pytest.importorskip("langchain_openai")
    emb = lc.OpenAIEmbeddings(model="emb", base_url=url + "/v1", api_key=TOKEN, check_embedding_ctx_length=False,
                              max_retries=0)
    np.testing.assert_allclose(np.array(emb.embed_documents(TEXTS)), predictors["embed"].embed(TEXTS), atol=1e-5)
    np.testing.assert_allclose(emb.embed_query(TEXTS[0]), predictors["embed"].embed(TEXTS[:1])[0], atol=1e-5)


def test_unknown_model_is_a_404_in_openai_shape(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    assert info.value.status_code == 404
    r = http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404
    assert r.json()["error"].keys() == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert http.post("/v1/embeddings", json={"model": "cls", "input": "x"}).status_code == 404  # not an embed model


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": [[1, 2]] * 9}, "input"),                     # token arrays: counted before they are decoded
    ({"input": ["x"] * 9}, "input"),                        # over max_texts
    ({"input": "a" * 301}, "input[0]"),                     # over max_chars
    ({"input": "\ud800 lone surrogate"}, "input[0]"),       # valid JSON, not encodable text
    ({"input": "x", "dimensions": -3}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 33}, "dimensions"),       # the tiny model has 32
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "dimensions": 2.5}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "encoding_format": 1}, "encoding_format"),
    ({"input": "x", "model": 7}, "model"),
    ({"input": "x", "user": ["u"]}, "user"),
])
def test_bad_embeddings_fields_get_a_400_in_openai_shape(http, body, param):
    r = http.post("/v1/embeddings", content=json.dumps({"model": "emb", **body}),  # ASCII JSON: "\ud800" as sent
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.keys() == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and err["param"] == param, err


def test_malformed_json_and_missing_token(url, http):
    r = http.post("/v1/embeddings", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/embeddings", json={"model": "emb", "input": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/embeddings", content=b"not json at all", headers={"content-type": "application/json"})
    assert r.status_code == 401  # the token is checked before the body is read


def test_rerank_both_shapes_give_the_same_order(http, predictors):
    query, docs = "good movie", ["a dull story", "the movie was great fun", "paris", "fun and good"]
    ours = http.post("/v1/rerank", json={"query": query, "passages": docs}).json()["results"]
    expected = predictors["rerank"].rerank(query, docs)
    assert [x["index"] for x in ours] == [x["index"] for x in expected]
    for path in ("/v1/rerank", "/rerank"):
        cohere = http.post(path, json={"query": query, "documents": docs, "model": "rr"}).json()
        assert [x["index"] for x in cohere["results"]] == [x["index"] for x in expected]
        scores = [x["relevance_score"] for x in cohere["results"]]
        assert all(0 <= s <= 1 for s in scores) and scores == sorted(scores, reverse=True)
        assert cohere["usage"]["total_tokens"] > 0
    jina = http.post("/v1/rerank", json={"query": query, "documents": [{"text": d} for d in docs], "top_n": 2,
                                         "return_documents": True}).json()["results"]
    assert [x["index"] for x in jina] == [x["index"] for x in expected[:2]]
    assert [x["document"]["text"] for x in jina] == [docs[x["index"]] for x in expected[:2]]
    raw = http.post("/v1/rerank", json={"query": query, "documents": docs, "raw_scores": True}).json()["results"]
    np.testing.assert_allclose([x["relevance_score"] for x in raw], [x["score"] for x in expected], atol=1e-5)


@pytest.mark.parametrize("body", [
    {"query": "q"},                                          # neither documents nor passages
    {"query": "q", "documents": ["a"], "passages": ["a"]},
    {"query": "q", "documents": []},
    {"query": "", "documents": ["a"]},
    {"query": "q", "documents": [{"title": "a"}]},
    {"query": "q", "documents": [3]},
    {"query": "q", "documents": ["a"], "top_n": 0},
    {"query": "q", "documents": ["a"], "top_n": "2"},
    {"query": "q", "documents": ["a"], "top_k": 2},
    {"query": "q", "documents": ["a"], "return_documents": "yes"},
    {"query": "q", "documents": ["a"], "model": "emb"},
    {"query": 1, "documents": ["a"]},
])
def test_bad_rerank_bodies_get_a_4xx_in_openai_shape(http, body):
    r = http.post("/v1/rerank", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"].keys() == {"message", "type", "param", "code"}


def test_models_list(client, http):
    listed = client.models.list()
    assert {m.id for m in listed.data} == {"emb", "rr", "cls"}
    assert {m.id: m.model_extra["task"] for m in listed.data}["emb"] == "embed"
    assert client.models.retrieve("rr").id == "rr"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert http.get("/openapi.json").json()["paths"].keys() >= {"/v1/embeddings", "/v1/rerank", "/rerank", "/v1/models"}


def test_metrics_count_the_new_routes_by_path(client, http):
    client.embeddings.create(model="emb", input=["counted"])
    http.post("/rerank", json={"query": "q", "documents": ["a"]})
    metrics = http.get("/metrics").text
    assert 'encoderkit_requests_total{path="/v1/embeddings",status="200"}' in metrics
    assert 'encoderkit_requests_total{path="/rerank",status="200"}' in metrics
    assert ('encoderkit_batch_tokens_count{model="emb"}' in metrics
            and 'encoderkit_queue_seconds_count{model="rr"}' in metrics)
