"""Exact search: top-k by dot product over unit embeddings, and the bi-encoder run over a BEIR
source (the evaluation of an embed model and the first stage of negative mining)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.tasks.embed.embedder import Embedder
from encoderkit.tasks.embed.features import BiEncoder, encode, encode_cached


def search(query_emb: np.ndarray, doc_emb: np.ndarray, doc_ids: list[str], query_ids: list[str],
           k: int = 100) -> dict[str, list[str]]:
    """Exact top-k by dot product: query id -> doc ids, best first."""
    out = {}
    for start in range(0, len(query_ids), 256):
        scores = query_emb[start : start + 256] @ doc_emb.T
        top = np.argpartition(-scores, min(k, scores.shape[1] - 1), axis=1)[:, :k]
        for row, qid in enumerate(query_ids[start : start + 256]):
            order = top[row][np.argsort(-scores[row, top[row]], kind="stable")]
            out[qid] = [doc_ids[j] for j in order]
    return out


def retrieve(model: BiEncoder | Embedder, tokenizer, data: Any, max_length: int, max_query_length: int,
             batch_size: int = 64, k: int = 100, progress: bool = False,
             cache_for: Path | None = None) -> dict[str, list[str]]:
    """Top-k documents of every judged query of a :class:`~encoderkit.data.beir.Retrieval`, embedded by ``model``
    (a training-time module, or an :class:`Embedder` over any engine: :func:`encode`).
    ``cache_for``: the saved folder ``model`` was loaded from, to reuse its corpus embeddings
    (:func:`encode_cached`); None while weights are changing (evaluation during training)."""
    doc_ids = list(data.corpus)
    texts = [data.doc_text(d) for d in doc_ids]
    docs = (encode_cached(model, tokenizer, texts, max_length, batch_size, progress, cache_for) if cache_for is not None
            else encode(model, tokenizer, texts, max_length, batch_size, progress))
    qids = list(data.qrels)
    queries = encode(model, tokenizer, [data.queries[q] for q in qids], max_query_length, batch_size)
    return search(queries, docs, doc_ids, qids, k)
