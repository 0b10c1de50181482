"""A reranker's candidate lists (each query with the passages it reranks), as task distillation trains on them and
compression calibrates with them: a BEIR source's queries (and corpus titles as pseudo queries) with a first-stage
bi-encoder's top documents, or JSONL rows' positive and negatives.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from encoderkit.config import check
from encoderkit.data.beir import is_beir_source, load_retrieval, read_triples
from encoderkit.data.beir import pseudo_queries as title_queries
from encoderkit.models.tokenizer import load_tokenizer
from encoderkit.progress import note
from encoderkit.tasks.common import resolve_model
from encoderkit.tasks.embed.exact import retrieve
from encoderkit.tasks.embed.features import folder_max_length, load_bi_encoder

QueryList = tuple[str, list[str]]  # a query and its candidate passages
MINED_PAIRS = 16  # compression inputs of a BEIR source with a miner: each judged query's top 16 documents
SERVED_CANDIDATES = 100  # the candidates of one served query, as compression times and plans it


def candidate_lists(train: str, miner: str | None, candidates: int, *, candidate_depth: int = 0,
                    pseudo_queries: int = 0, seed: int = 0, limit: int = 0) -> list[QueryList]:
    """(query, candidate passages) per query, every list cut to the same length (at most ``candidates``):
    the split's queries, then the titles; the arguments are :class:`~encoderkit.compress.distill.DistillConfig`'s
    fields of those names."""
    split, titles = candidate_groups(train, miner, candidates, candidate_depth=candidate_depth,
                                     pseudo_queries=pseudo_queries, seed=seed, limit=limit)
    return split + [x for group in titles for x in group]


def candidate_groups(train: str, miner: str | None, candidates: int, *, candidate_depth: int = 0,
                     pseudo_queries: int = 0, title_sets: int | Callable[[int], int] = 1, seed: int = 0,
                     limit: int = 0) -> tuple[list[QueryList], list[list[QueryList]]]:
    """(the split's lists, ``title_sets`` sets of ``pseudo_queries`` corpus titles' lists, no document in two sets);
    ``title_sets`` may be a function of the number of split lists. The first set is the one a single set would be
    (the sample is drawn once, in one seeded order, and cut into sets). ``limit`` cuts the split's lists (and the
    titles when it is smaller than the split)."""
    titles: list[list[QueryList]] = []
    if is_beir_source(train):
        check(bool(miner), f"--train {train} is a BEIR source: rerank distillation needs --miner, a bi-encoder "
                               "folder whose top --candidates per query the teacher scores")

        data = load_retrieval(train)
        n_split = min(len(data.qrels), limit) if limit else len(data.qrels)
        data.qrels = dict(list(data.qrels.items())[:n_split])
        sets = title_sets(n_split) if callable(title_sets) else title_sets
        per_set = max(0, min(pseudo_queries, limit - n_split) if limit else pseudo_queries)
        extra = title_queries(data, per_set * sets, seed=seed) if per_set else {}
        if extra:
            sets = max(1, min(sets, len(extra) // per_set))  # a small corpus: fewer, full sets
            extra = dict(list(extra.items())[: per_set * sets])
            data.queries.update(extra)
            data.qrels.update({q: {} for q in extra})  # ranked like the split's queries; no judgment is read
            note(f"{train}: {n_split} queries of the split + {len(extra)} corpus documents' titles (else first "
                 "sentences) as queries" + (f", a new {len(extra) // sets} each epoch" if sets > 1 else ""))
        miner_folder = resolve_model(miner)  # a folder, or 'minilm'
        depth = max(candidates, candidate_depth)
        ranked = retrieve(load_bi_encoder(miner_folder), load_tokenizer(miner_folder), data,
                          folder_max_length(miner_folder) or 256, 64, 64, k=depth, progress=True,
                          cache_for=miner_folder)
        rng = np.random.default_rng(seed)
        lists = [(data.queries[q], [data.doc_text(d) for d in spread(docs, candidates, rng)])
                 for q, docs in ranked.items()]
        split, rest = lists[:n_split], lists[n_split:]
        if rest:
            per = len(rest) // sets
            titles = [rest[i * per: (i + 1) * per] for i in range(sets)]
    else:
        split = [(t.query, [t.positive, *t.negatives]) for t in read_triples(train)]
        split = split[:limit] if limit else split
        if pseudo_queries:
            note(f"--pseudo-queries {pseudo_queries} ignored: {train} is a file of lists, with no corpus to draw "
                 "titles from (a BEIR source with --miner has one)")
    size = min(candidates, *(len(c) for group in [split, *titles] for _, c in group))
    check(size >= 2, f"--train {train}: a query has {size} candidate(s); rerank distillation needs at least 2 per "
                     "query (JSONL rows need 'negatives')")
    return [(q, c[:size]) for q, c in split], [[(q, c[:size]) for q, c in group] for group in titles]


def spread(ranked: list[str], size: int, rng: np.random.Generator) -> list[str]:
    """``size`` of a first stage's ranked documents: all of them when there are no more; else the top half
    of ``size`` and a seeded sample of the ranks below, in rank order. A reranker serving a top-100 list
    must also push down the documents ranked 50th or 90th, which a list of the top few never shows it."""
    if len(ranked) <= size:
        return list(ranked)
    top = (size + 1) // 2
    deeper = np.sort(rng.choice(np.arange(top, len(ranked)), size - top, replace=False))
    return [*ranked[:top], *(ranked[int(i)] for i in deeper)]
