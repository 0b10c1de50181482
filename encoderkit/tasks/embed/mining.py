"""Negative mining: (query, positive, negatives) groups from a BEIR source for rerank and embed training. Mined
negatives come from just below the top of a bi-encoder's results (judged documents left out), so near-misses
teach a model what relevance is not; ``sampled`` ones are drawn at random from the corpus.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from encoderkit.data.beir import Retrieval, Triple
from encoderkit.tasks.common import load_tokenizer, resolve_model
from encoderkit.tasks.embed.exact import retrieve
from encoderkit.tasks.embed.features import folder_max_length, load_bi_encoder

CANDIDATES = 100
MINE_FROM, MINE_TO = 3, 30
SAMPLED_POOL = 8  # random negatives kept per group, as a multiple of num_negatives


def candidates(data: Retrieval, miner: str | Path, k: int, max_query_length: int = 64, batch_size: int = 64,
               max_length: int = 0) -> dict[str, list[str]]:
    """Top-k documents per judged query from the bi-encoder ``miner`` (queries cut to ``max_query_length``,
    documents to the miner's own length, or to ``max_length`` where that is shorter)."""
    folder = resolve_model(miner)
    model = load_bi_encoder(folder)  # the folder's own pooling (task_pooling)
    tok = load_tokenizer(folder)
    own = folder_max_length(folder) or 256
    return retrieve(model, tok, data, min(own, max_length) if max_length else own, max_query_length, batch_size,
                    k=k, progress=True, cache_for=folder)


def groups_from_beir(data: Retrieval, *, negatives: str, num_negatives: int, seed: int, miner: str | Path = "",
                     max_query_length: int = 64, batch_size: int = 64, pool: bool = False,
                     max_length: int = 0) -> list[Triple]:
    """One group per judged (query, doc) pair, with ``sampled`` or ``mined`` negatives (by the
    bi-encoder ``miner``, reading documents at most ``max_length`` sub-tokens long: the length the model trains
    at, so the negatives are hard in the view it learns from, and mining a corpus costs what encoding it at that
    length does, not the miner's own, longer length): ``num_negatives`` of them, or with ``pool`` the whole pool to
    draw from (every mined one, or ``SAMPLED_POOL`` times as many random documents)."""
    rng = np.random.default_rng(seed)
    doc_ids = list(data.corpus)
    mined = (candidates(data, miner, MINE_TO, max_query_length, batch_size, max_length) if negatives == "mined"
             else {})
    out = []
    for qid, rels in data.qrels.items():
        ranked = [d for d in mined.get(qid, [])[MINE_FROM:] if d not in rels]
        want = num_negatives * (SAMPLED_POOL if pool and not ranked else 1)
        for d, r in rels.items():
            if r <= 0:
                continue
            if ranked and pool:
                negs = list(ranked)
            elif ranked:
                negs = list(rng.choice(ranked, size=min(num_negatives, len(ranked)), replace=False))
            else:
                negs = []
            while len(negs) < want and len(negs) < len(doc_ids) - len(rels):
                cand = doc_ids[int(rng.integers(len(doc_ids)))]
                if cand not in rels and cand not in negs:
                    negs.append(cand)
            out.append(Triple(data.queries[qid], data.doc_text(d), [data.doc_text(n) for n in negs], f"query {qid}"))
    return out


