"""The search index behind Milvus (milvus-lite, in-process) and behind /v1/search over real HTTP."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from deploy_models import make_task_model, tiny_root
from test_search_index import _cfg, _corpus, _doc, _sizes

from encoderkit.errors import EncoderkitError
from encoderkit.retrieval.index import run as index
from encoderkit.retrieval.search import Searcher, SearchSettings


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


def test_milvus_lite_round_trip_matches_the_embedded_index(embed_dir, tmp_path):
    pytest.importorskip("pymilvus")
    pytest.importorskip("milvus_lite")
    uri = str(tmp_path / "milvus.db")
    docs = {f"d{i}": _doc(i) for i in range(30)}
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, store="milvus", uri=uri, collection="t"))
    queries = ["python movie fun", "dull story data", "great film"]
    local = Searcher.open(out, backend="torch-fp32").search(queries,
                                                            SearchSettings(first_stage="float", rescore="none"))
    remote_s = Searcher.open(out, backend="torch-fp32", milvus=(uri, "t"))
    remote = remote_s.search(queries, SearchSettings(rescore="none"))
    for a, b in zip(local, remote, strict=True):
        assert [h.doc_id for h in a.hits] == [h.doc_id for h in b.hits]
        np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], atol=1e-3)
    # an update deletes and upserts in Milvus too
    docs2 = {k: v for k, v in docs.items() if k != "d4"} | {"d9": _doc(9) + " changed"}
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs2), out, store="milvus", uri=uri, collection="t"))
    from encoderkit.retrieval.milvus import _count, client

    n = len(Searcher.open(out, backend="torch-fp32").gen.passages)
    assert _count(client(uri), "t") == n
    again = Searcher.open(out, backend="torch-fp32", milvus=(uri, "t")).search(queries, SearchSettings(bm25=True))
    assert all("d4" not in {h.doc_id for h in r.hits} for r in again)


def test_milvus_uri_that_does_not_answer_is_a_clear_error_and_nothing_is_lost(embed_dir, tmp_path):
    pytest.importorskip("pymilvus")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "idx"
    docs = {f"d{i}": _doc(i) for i in range(10)}
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, float16=True))
    sizes, before = _sizes(out), Searcher.open(out, backend="torch-fp32").search(["python"])
    with pytest.raises(EncoderkitError,
                       match=rf"Milvus at http://127.0.0.1:{port} did not answer.*local index .* is unchanged"):
        index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {**docs, "x": "movie"}), out, store="milvus",
                   uri=f"http://127.0.0.1:{port}"))
    assert _sizes(out) == sizes and Searcher.open(out, backend="torch-fp32").search(["python"]) == before
    assert not list(out.glob(".gen-*"))


def test_v1_search_over_real_http(embed_dir, tmp_path, tmp_path_factory, tiny_tokenizer_dir):
    import httpx

    from encoderkit.deploy.guard import Limits
    from encoderkit.deploy.serve import BackgroundServer, create_app
    from encoderkit.inference.predictor import Predictor
    from encoderkit.retrieval.http import search_routes

    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(20)}), out))
    models = {"emb": Predictor.load(embed_dir, backend="torch-fp32")}
    hook = search_routes([f"docs={out}"], backend="torch-fp32")
    app = create_app(models, Limits(max_chars=500, token="s3cret"), extra_routes=(hook,))
    want = Searcher.open(out, backend="torch-fp32").search(["python data"], SearchSettings(k=5, bm25=True))[0]
    auth = {"Authorization": "Bearer s3cret"}
    with BackgroundServer(app) as url:
        r = httpx.post(f"{url}/v1/search", json={"query": "python data", "k": 5, "bm25": True}, headers=auth)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["index"] == "docs" and body["truncated"] is False
        assert [h["doc_id"] for h in body["hits"]] == [h.doc_id for h in want.hits]
        assert httpx.post(f"{url}/v1/search", json={"query": "x"}).status_code == 401
        bad = [({"query": ""}, 422), ({"query": "x" * 501}, 422), ({"query": "x", "index": "nope"}, 404),
               ({"query": "x", "k": 0}, 422), ({"query": "x", "first_stage": "float"}, 422), ({"query": 3}, 422)]
        for payload, code in bad:
            r = httpx.post(f"{url}/v1/search", json=payload, headers=auth)
            assert r.status_code == code, (payload, r.text)
            assert {"code", "message"} <= set(r.json()["error"])  # plus OpenAI's type/param, as every route
        metrics = httpx.get(f"{url}/metrics", headers=auth).text
        assert 'path="/v1/search"' in metrics
    assert json.loads(json.dumps(body))  # plain JSON


def test_v1_search_reranks_with_the_served_cross_encoder(embed_dir, tmp_path, tmp_path_factory, tiny_tokenizer_dir):
    """``serve --rerank NAME=DIR``: /v1/search's rerank_top reorders with the served cross-encoder, as `search --rerank`
    does; without one the 422 names the flag."""
    import httpx
    from deploy_models import make_task_model, tiny_root

    from encoderkit.deploy.guard import Limits
    from encoderkit.deploy.serve import BackgroundServer, create_app
    from encoderkit.inference.predictor import Predictor
    from encoderkit.retrieval.http import search_routes

    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(20)}), out))
    ce = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "rerank")
    cross = Predictor.load(ce, backend="torch-fp32")
    settings = SearchSettings(k=5, rerank_top=10)
    want = Searcher.open(out, backend="torch-fp32", rerank=ce).search(["python data"], settings)[0]
    plain = create_app({"emb": Predictor.load(embed_dir, backend="torch-fp32")},
                       extra_routes=(search_routes([f"docs={out}"], backend="torch-fp32"),))
    with BackgroundServer(plain) as url:
        r = httpx.post(f"{url}/v1/search", json={"query": "python data", "k": 5, "rerank_top": 10})
        assert r.status_code == 422 and "--rerank NAME=DIR" in r.json()["error"]["message"]
    app = create_app({"emb": Predictor.load(embed_dir, backend="torch-fp32"), "ce": cross}, Limits(),
                     extra_routes=(search_routes([f"docs={out}"], backend="torch-fp32", rerankers={"ce": cross}),))
    with BackgroundServer(app) as url:
        for extra in ({}, {"rerank_model": "ce"}):
            r = httpx.post(f"{url}/v1/search", json={"query": "python data", "k": 5, "rerank_top": 10, **extra})
            assert r.status_code == 200, r.text
            assert [h["doc_id"] for h in r.json()["hits"]] == [h.doc_id for h in want.hits]
        r = httpx.post(f"{url}/v1/search", json={"query": "x", "rerank_top": 3, "rerank_model": "nope"})
        assert r.status_code == 404
