"""The search index with the real MiniLM on a SciFact slice: rescoring recovers what the binary first
stage loses, and the retrieval metrics agree with ranx (a maintained implementation) on a real run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from encoderkit.data.beir import load_retrieval
from encoderkit.metrics.ranking import retrieval_scores
from encoderkit.retrieval.index import IndexConfig
from encoderkit.retrieval.index import run as index
from encoderkit.retrieval.search import Searcher, SearchSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slice_index(minilm_dir, shared_data, tmp_path_factory):
    """The judged documents of 40 SciFact test queries plus random others: 200 documents, one passage each."""
    import torch

    data = load_retrieval(f"{shared_data}/scifact/scifact_hf_export.zip#test")
    qids = sorted(data.qrels)[:40]
    judged = sorted({d for q in qids for d in data.qrels[q]})
    rng = np.random.default_rng(0)
    others = [d for d in rng.permutation(sorted(data.corpus)) if d not in set(judged)][: 200 - len(judged)]
    root = tmp_path_factory.mktemp("scifact_slice")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d, "title": data.corpus[d][0], "text": data.corpus[d][1]}) + "\n"
                              for d in judged + list(others)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        index(IndexConfig(model=str(minilm_dir), corpus=[str(corpus)], out=str(root / "idx"), float16=True,
                          backend="torch-fp32",
                          passage_tokens=-1))
        s = Searcher.open(root / "idx", backend="torch-fp32")
        qv = s.embed([data.queries[q] for q in qids])
    finally:
        torch.set_num_threads(threads)
    return s, qv, qids, {q: data.qrels[q] for q in qids}


def _top(s, qv, settings, k=10):
    settings.k = k
    return [[h.doc_id for h in r.hits] for r in s.search_vectors(qv, settings)]


def test_rescoring_recovers_the_float_top_10(slice_index):
    s, qv, _, _ = slice_index
    exact = _top(s, qv, SearchSettings(first_stage="float", rescore="none"))

    def overlap(settings):
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(_top(s, qv, settings), exact, strict=True)])

    binary = overlap(SearchSettings(first_stage="binary", rescore="none"))
    rescored = overlap(SearchSettings(first_stage="binary", rescore="float", rescore_multiplier=4))
    int8_rescored = overlap(SearchSettings(first_stage="binary", rescore="int8", rescore_multiplier=4))
    deeper = overlap(SearchSettings(first_stage="binary", rescore="float", rescore_multiplier=10))
    assert rescored > binary + 0.05 and rescored >= 0.9, (binary, rescored)
    assert int8_rescored >= 0.85 and deeper >= rescored
    assert overlap(SearchSettings(first_stage="int8", rescore="float")) >= 0.97


def test_retrieval_metrics_match_ranx_on_a_real_run(slice_index):
    ranx = pytest.importorskip("ranx")
    s, qv, qids, qrels = slice_index
    for settings in (SearchSettings(first_stage="float", rescore="none"), SearchSettings(bm25=False)):
        ranked = dict(zip(qids, _top(s, qv, settings, k=100), strict=True))
        ours = retrieval_scores(ranked, qrels)
        run = ranx.Run({q: {d: float(100 - i) for i, d in enumerate(docs)} for q, docs in ranked.items()})
        theirs = ranx.evaluate(ranx.Qrels(qrels), run, ["ndcg@10", "mrr@10", "recall@10", "recall@100"])
        for k, v in theirs.items():
            assert ours[k] == pytest.approx(v, abs=1e-9), k
        assert 0.3 < ours["ndcg@10"] < 1.0  # a real run, not a degenerate one
