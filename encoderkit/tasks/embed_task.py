"""Bi-encoder fine-tuning and evaluation (contrastive, in-batch negatives; see :mod:`encoderkit.tasks.embed`).

Training data: JSONL ``{query, positive, negatives?}`` or a BEIR source (each judged (query, doc)
pair is a row; ``--num-negatives`` hard negatives are added when ``--negatives mined``).
Evaluation: nDCG@10 / MRR@10 / recall@100 of exact search over the whole corpus of a BEIR source.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.retrieval.beir import is_beir_source, load_retrieval, read_triples
from encoderkit.retrieval.exact import retrieve
from encoderkit.retrieval.metrics import retrieval_scores
from encoderkit.retrieval.mining import groups_from_beir
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import TaskRun, seeded_subset
from encoderkit.tasks.embed import (
    BiEncoder,
    PooledEngine,
    load_bi_encoder,
    mnrl_loss,
    save_sentence_transformers,
    tokenize,
)


def default_max_length(folder: ModelFolder) -> int:
    """A sentence-transformers folder's own max_seq_length (cut to its positions), else 256."""
    return folder.max_length if folder.sentence_transformers else 256


def max_length_for(cfg: Any, folder: ModelFolder) -> int:
    return cfg.max_length or default_max_length(folder)


def build(cfg: Any, tokenizer, folder: ModelFolder) -> TaskRun:
    max_length = max_length_for(cfg, folder)
    k = cfg.num_negatives if cfg.negatives == "mined" else 0
    if is_beir_source(cfg.train):
        data = load_retrieval(cfg.train)
        # sampled: in-batch negatives only (random extra negatives add little to MNRL)
        groups = groups_from_beir(data, cfg if k else dataclasses.replace(cfg, num_negatives=0))
    else:
        groups = read_triples(cfg.train)
        k = min((len(g.negatives) for g in groups), default=0) if cfg.negatives == "mined" else 0
    groups = seeded_subset(groups, cfg.max_train_examples, cfg.seed)
    if len(groups) < cfg.batch_size:
        raise EncoderkitError(f"{cfg.train}: {len(groups)} training pairs, fewer than one batch ({cfg.batch_size}); lower --batch-size")
    q_rows = tokenize(tokenizer, [g.query for g in groups], cfg.max_query_length)
    p_rows = tokenize(tokenizer, [g.positive for g in groups], max_length)
    n_rows = [tokenize(tokenizer, g.negatives[:k], max_length) if k else [] for g in groups]
    pad_id = tokenizer.pad_token_id

    def make_batch(idx: np.ndarray, epoch: int):
        q = encode_batch([q_rows[i] for i in idx], pad_id)
        # positives of the batch first (row i's positive at i), then every row's negatives
        p = encode_batch([p_rows[i] for i in idx] + [r for i in idx for r in n_rows[i]], pad_id)
        return {**{f"q_{a}": b for a, b in q.items()}, **{f"p_{a}": b for a, b in p.items()}}

    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in p_rows]), cfg.batch_size, make_batch,
                             seed=cfg.seed, bucket=cfg.bucket)
    dims = sorted(set(cfg.matryoshka_dims))

    def loss_fn(module, batch):
        q = module(**{a[2:]: b for a, b in batch.items() if a.startswith("q_")})
        p = module(**{a[2:]: b for a, b in batch.items() if a.startswith("p_")})
        return mnrl_loss(q, p, cfg.scale, dims), {}

    model = load_bi_encoder(folder, cfg.pooling)
    evaluate = None
    if cfg.dev:
        if not is_beir_source(cfg.dev):
            raise EncoderkitError(f"--dev {cfg.dev}: embed evaluation needs a BEIR source (folder or SciFact zip, with #split)")
        dev = load_retrieval(cfg.dev)

        def evaluate(module: BiEncoder) -> dict[str, float]:
            return retrieval_scores(retrieve(module, tokenizer, dev, max_length, cfg.max_query_length, cfg.eval_batch_size), dev.qrels)

    def save(module: BiEncoder, folder: Path) -> None:
        save_sentence_transformers(module, tokenizer, folder, max_length)

    card = {"task": "embed", "pooling": model.pooling, "normalize": True, "max_length": max_length,
            "max_query_length": cfg.max_query_length, "matryoshka_dims": dims, "similarity": "cosine"}
    return TaskRun(model, loss_fn, source, evaluate, (cfg.metric or "ndcg@10", "max"), save, card, num_train=len(groups))


def evaluate_folder(folder: ModelFolder, tokenizer, data: str | Path, cfg: Any, engine: Any = None) -> dict[str, float]:
    """nDCG@10 / MRR@10 / recall@100 of exact search over a BEIR corpus; ``engine`` (default: the folder's
    torch encoder) gives the token states that are pooled as the folder says (:class:`PooledEngine`)."""
    if not is_beir_source(str(data)):
        raise EncoderkitError(f"--data {data}: embed evaluation needs a BEIR source (folder or SciFact zip, with #split)")
    model = (load_bi_encoder(folder, folder.pooling or cfg.pooling) if engine is None
             else PooledEngine(engine, folder.pooling or "mean", folder.normalize))
    card = folder.card
    ds = load_retrieval(str(data))
    if cfg.max_examples:  # a seeded subset of the judged queries; the whole corpus stays searchable
        keep = set(seeded_subset(sorted(ds.qrels), cfg.max_examples, cfg.seed))
        ds.qrels = {q: r for q, r in ds.qrels.items() if q in keep}
    max_length = card.get("max_length") or max_length_for(cfg, folder)
    ranked = retrieve(model, tokenizer, ds, max_length, card.get("max_query_length", cfg.max_query_length), cfg.batch_size,
                      progress=True, cache_for=folder.path if engine is None else None)
    return {**retrieval_scores(ranked, ds.qrels), "queries": len(ds.qrels), "documents": len(ds.corpus)}
