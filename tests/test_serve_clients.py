"""Clients we did not write, with their own defaults, against a real server (issue 53): LangChain's OpenAIEmbeddings
(token ids, chunk_size 1000), cohere's ClientV2 and Client, curl's form content type, and the docs' curl examples;
plus what the service says of truncated texts, bad items and its limits."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from deploy_models import export_task_model, tiny_root

from encoderkit.deploy.guard import Limits
from encoderkit.deploy.serve import BackgroundServer, create_app
from encoderkit.inference.predictor import Predictor

TOKEN = "secret"  # the docs' token
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def predictors(tmp_path_factory, tiny_tokenizer_dir):
    root = tiny_root(tmp_path_factory)
    return {t: Predictor.load(export_task_model(root, tiny_tokenizer_dir, t), backend="onnx-fp32", max_batch=16)
            for t in ("embed", "rerank", "classify")}


@pytest.fixture(scope="module")
def url(predictors):
    # the docs' names: sst2 (classify), emb (embed); the default limits, as `serve` has them
    app = create_app({"emb": predictors["embed"], "rr": predictors["rerank"], "sst2": predictors["classify"]},
                     Limits(token=TOKEN), max_batch=16, max_wait_ms=2)
    with BackgroundServer(app) as u:
        yield u


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


def _byte_encoding():
    """A tiktoken encoding of single bytes (tiktoken's real files are downloaded, and the tests run offline): what
    LangChain encodes with and the server decodes with, patched in for both."""
    tiktoken = pytest.importorskip("tiktoken", reason="optional: pip install tiktoken")
    return tiktoken.Encoding("bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={})


def test_langchain_default_settings_embed_600_texts(url, predictors, monkeypatch):
    lc = pytest.importorskip("langchain_openai", reason="optional: pip install langchain-openai")
    import tiktoken

    enc = _byte_encoding()
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda name: enc)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc)
    texts = [f"document number {i} about {'cats' if i % 2 else 'rivers'}" for i in range(600)]
    emb = lc.OpenAIEmbeddings(model="emb", base_url=url + "/v1", api_key=TOKEN, max_retries=0)  # chunk_size 1000
    assert emb.chunk_size == 1000 and emb.check_embedding_ctx_length  # it sends token ids, 600 in one request
    got = np.array(emb.embed_documents(texts))
    np.testing.assert_allclose(got, predictors["embed"].embed(texts), atol=1e-5)


def test_a_json_body_is_read_whatever_the_content_type(url):
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"Authorization": f"Bearer {TOKEN}"} | ({"content-type": ctype} if ctype else {})
        r = httpx.post(url + "/v1/classify", content=b'{"texts":["great film"]}', headers=headers)
        assert r.status_code == 200, (ctype, r.text)
        assert r.json()["results"][0]["label"] in ("negative", "positive")


def test_long_texts_are_truncated_and_said_so(http, predictors):
    long = "word " * 5000  # 25,000 characters, far past what the model reads
    r = http.post("/v1/embed", json={"texts": ["short", long]})
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] == [1]
    np.testing.assert_allclose(r.json()["embeddings"][1], predictors["embed"].embed([long])[0], atol=1e-5)
    r = http.post("/v1/embeddings", json={"model": "emb", "input": ["short", long]})
    assert r.status_code == 200 and r.json()["truncated"] == [1]
    r = http.post("/v1/classify", json={"texts": [long]})
    assert r.status_code == 200 and r.json()["truncated"] == [0]


def test_one_bad_item_fails_alone(http, predictors):
    r = http.post("/v1/embed", json={"texts": ["good text", "   ", "another"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["embeddings"][1] is None and [e["index"] for e in body["errors"]] == [1]
    assert body["errors"][0]["code"] == "empty_text" and body["errors"][0]["param"] == "texts[1]"
    np.testing.assert_allclose(np.array([body["embeddings"][0], body["embeddings"][2]]),
                               predictors["embed"].embed(["good text", "another"]), atol=1e-5)
    r = http.post("/v1/classify", content=json.dumps({"texts": ["fine", "\ud800 broken"]}))  # ASCII: \ud800 as sent
    assert r.status_code == 200 and r.json()["results"][1] is None and r.json()["results"][0]["label"]
    # OpenAI's shape has no per-item error: an empty text is embedded as what it is, its neighbours kept
    r = http.post("/v1/embeddings", json={"model": "emb", "input": ["good text", ""]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2


def test_limits_name_the_server_flag_and_the_client_setting(url, predictors):
    app = create_app({"emb": predictors["embed"]}, Limits(max_texts=4, max_chars=50), max_batch=4)
    with BackgroundServer(app) as small:
        r = httpx.post(small + "/v1/embeddings", json={"input": ["x"] * 5})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "--max-texts" in msg and "chunk_size" in msg and "embed_batch_size" in msg, msg
        r = httpx.post(small + "/v1/embed", json={"texts": ["x" * 51]})
        assert r.status_code == 422 and "--max-chars" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/embed", json={"texts": ["x"] * 2048}, headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=300)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 2048  # OpenAI's own limit, split into batches


def test_cohere_clients_rerank(url, predictors):
    cohere = pytest.importorskip("cohere", reason="optional: pip install cohere")
    docs = ["paris is the capital of france", "cats sleep a lot", "the louvre is in paris"]
    want = np.argsort(-np.asarray(predictors["rerank"].score_pairs(["where is the louvre"] * 3, docs)),
                      kind="stable").tolist()
    v2 = cohere.ClientV2(api_key=TOKEN, base_url=url)
    got = v2.rerank(model="rr", query="where is the louvre", documents=docs, top_n=3)
    assert [r.index for r in got.results] == want
    assert all(0 <= r.relevance_score <= 1 for r in got.results)
    v1 = cohere.Client(api_key=TOKEN, base_url=url)
    got1 = v1.rerank(model="rr", query="where is the louvre", documents=docs, top_n=2, return_documents=True)
    assert [r.index for r in got1.results] == want[:2] and got1.results[0].document.text == docs[want[0]]


def _doc_curls() -> list[tuple[str, str]]:
    """Each curl command of README.md and docs/*.md that talks to `serve` (file, command)."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.lstrip().startswith("curl ") and "localhost:8000" in line:
                out.append((page.name, line.split("  #")[0].strip()))
    return out


def test_the_docs_curl_examples_answer_200(url):
    curls = _doc_curls()
    assert curls, "docs/deploy.md has a curl example"
    host = url.removeprefix("http://")
    for page, cmd in curls:
        argv = [a.replace("localhost:8000", host) for a in shlex.split(cmd)]  # only the host and port rewritten
        argv[1:1] = ["-s", "-o", "/dev/stderr", "-w", "%{http_code}"]
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
        assert done.stdout == "200", f"{page}: {cmd}: {done.stdout} {done.stderr}"
        assert re.search(r'"results"|"embeddings"|"data"|"hits"', done.stderr), done.stderr
