"""More clients and evaluators we did not write (issue 53), as users run them, with no network: llama-index's
OpenAILikeEmbedding and haystack's OpenAIDocumentEmbedder against `serve` (base URL set to the local server), and BEIR's
EvaluateRetrieval on our search output. Each is skipped, with the reason, where its package is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from deploy_models import export_task_model, make_task_model, tiny_root

from encoderkit.deploy.guard import Limits
from encoderkit.deploy.serve import BackgroundServer, create_app
from encoderkit.inference.predictor import Predictor
from encoderkit.metrics.ranking import retrieval_scores

TOKEN = "secret"
TEXTS = ["the movie was great fun", "a dull story", "python code and data", "what time is it", "the best film"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tiny_tokenizer_dir) -> Predictor:
    return Predictor.load(export_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed"),
                          backend="onnx-fp32", max_batch=8)


@pytest.fixture(scope="module")
def url(embedder):
    with BackgroundServer(create_app({"emb": embedder}, Limits(token=TOKEN), max_batch=8, max_wait_ms=2)) as u:
        yield u


def test_llama_index_openai_like_embedding(url, embedder):
    openai_like = pytest.importorskip("llama_index.embeddings.openai_like",
                                      reason="optional: pip install llama-index-embeddings-openai-like")
    emb = openai_like.OpenAILikeEmbedding(model_name="emb", api_base=url + "/v1", api_key=TOKEN, max_retries=0,
                                          embed_batch_size=2)  # several requests, in order
    got = np.array(emb.get_text_embedding_batch(TEXTS))
    np.testing.assert_allclose(got, embedder.embed(TEXTS), atol=1e-5)
    np.testing.assert_allclose(emb.get_query_embedding("a dull story"), embedder.embed(["a dull story"])[0], atol=1e-5)


def test_haystack_document_embedder_keeps_every_embedding_of_a_batch_with_an_empty_and_a_long_document(url, embedder):
    pytest.importorskip("haystack", reason="optional: pip install haystack-ai")
    from haystack import Document
    from haystack.components.embedders import OpenAIDocumentEmbedder
    from haystack.utils import Secret

    long = "word " * 6000  # 30,000 characters, far past what the model reads: truncated, not refused
    docs = [Document(content=t) for t in (TEXTS[0], "", long, TEXTS[1])]
    embedder_h = OpenAIDocumentEmbedder(api_key=Secret.from_token(TOKEN), model="emb", api_base_url=url + "/v1",
                                        progress_bar=False, max_retries=0, batch_size=32)  # one batch, all four
    out = embedder_h.run(documents=docs)["documents"]
    assert all(d.embedding is not None for d in out), "a document of the batch lost its embedding"
    got = np.array([d.embedding for d in out])
    want = embedder.embed([TEXTS[0], long, TEXTS[1]])
    np.testing.assert_allclose(got[[0, 2, 3]], want, atol=1e-5)
    assert len(out[1].embedding) == want.shape[1]


def test_beir_evaluator_gives_our_ndcg_on_our_search_output(tmp_path, tmp_path_factory, tiny_tokenizer_dir):
    evaluation = pytest.importorskip("beir.retrieval.evaluation", reason="optional: pip install beir")
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import SearchConfig
    from encoderkit.retrieval.search import run as search

    model = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    words = ["movie", "film", "story", "python", "code", "data", "fun", "dull", "great", "love"]
    docs = {f"d{i}": " ".join(words[(i * 3 + j * (1 + i % 4)) % len(words)] for j in range(3 + i % 5)) + f" {i}"
            for i in range(30)}  # every text its own: no tied scores, whose order evaluators may break otherwise
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    queries = {f"q{i}": " ".join(words[(i * 2 + j) % len(words)] for j in range(2)) for i in range(8)}
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"id": k, "query": v}) + "\n" for k, v in queries.items()))
    # graded judgements: what BEIR's qrels hold (pytrec_eval's gain is the grade, as ours)
    qrels = {q: {f"d{(i * 5 + j) % 30}": 2 - j % 2 for j in range(3)} for i, q in enumerate(queries)}
    index(IndexConfig(model=str(model), corpus=[str(tmp_path / "c.jsonl")], out=str(tmp_path / "idx"),
                      backend="onnx-fp32"))
    search(SearchConfig(index=str(tmp_path / "idx"), queries=str(tmp_path / "q.jsonl"),
                        output=str(tmp_path / "hits.jsonl"), k=10))
    lines = [json.loads(x) for x in Path(tmp_path / "hits.jsonl").read_text().splitlines()]
    ranked = {r["id"]: [h["doc_id"] for h in r["hits"]] for r in lines}
    results = {r["id"]: {h["doc_id"]: float(h["score"]) for h in r["hits"]} for r in lines}
    assert len(ranked) == 8 and all(len(v) == 10 for v in ranked.values())
    ours = retrieval_scores(ranked, qrels)["ndcg@10"]
    ndcg, *_ = evaluation.EvaluateRetrieval.evaluate(qrels, results, [10])
    assert 0 < ours < 1  # neither trivial
    assert ndcg["NDCG@10"] == pytest.approx(ours, abs=1e-4)  # BEIR rounds to 5 decimals
