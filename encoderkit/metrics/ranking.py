"""Retrieval metrics as pure functions on ranked ids and relevance judgments (no model, no torch): nDCG@k (linear
gain, as trec_eval and BEIR), MRR@k and recall@k, and reciprocal-rank fusion of several rankings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

RRF_K = 60  # the constant of Cormack et al. (2009), used without tuning


def reciprocal_rank_fusion(rankings: Sequence[Sequence[str]], k: int = RRF_K) -> list[str]:
    """Documents ordered by the sum over ``rankings`` of ``1 / (k + rank)`` (rank from 1): the
    parameter-free way to combine, e.g., a cross-encoder's order with the first stage's."""
    score = rrf_scores(rankings, k)
    return sorted(score, key=lambda d: -score[d])


def retrieval_scores(
    ranked: Mapping[str, Sequence[str]],
    qrels: Mapping[str, Mapping[str, int]],
    k_ndcg: int = 10,
    k_mrr: int = 10,
    k_recall: tuple[int, ...] = (10, 100),
) -> dict[str, float]:
    """Mean nDCG@k, MRR@k and recall@k over the queries in ``qrels`` that have a relevant document.

    ranked: query id -> document ids, best first. qrels: query id -> {doc id: relevance >= 0}.
    A query missing from ``ranked`` scores 0.
    """
    ndcg, mrr, recall = [], [], {k: [] for k in k_recall}
    for qid, rels in qrels.items():
        relevant = {d: r for d, r in rels.items() if r > 0}
        if not relevant:
            continue
        docs = list(ranked.get(qid, []))
        dcg = sum(relevant.get(d, 0) / math.log2(i + 2) for i, d in enumerate(docs[:k_ndcg]))
        ideal = sorted(relevant.values(), reverse=True)[:k_ndcg]
        idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
        ndcg.append(dcg / idcg)
        first = next((i for i, d in enumerate(docs[:k_mrr]) if d in relevant), None)
        mrr.append(0.0 if first is None else 1.0 / (first + 1))
        for k in k_recall:
            recall[k].append(len(set(docs[:k]) & relevant.keys()) / len(relevant))
    out = {f"ndcg@{k_ndcg}": float(np.mean(ndcg)) if ndcg else 0.0, f"mrr@{k_mrr}": float(np.mean(mrr)) if mrr else 0.0}
    out.update({f"recall@{k}": float(np.mean(v)) if v else 0.0 for k, v in recall.items()})
    return out


def rrf_scores(rankings: Sequence[Sequence[str]], k: int = RRF_K) -> dict[str, float]:
    """Each document's reciprocal-rank-fusion score (see :func:`reciprocal_rank_fusion`)."""
    score: dict[str, float] = {}
    for ranking in rankings:
        for i, d in enumerate(ranking):
            score[d] = score.get(d, 0.0) + 1.0 / (k + i + 1)
    return score
