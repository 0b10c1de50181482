"""Bi-encoder fine-tuning and evaluation (contrastive, in-batch negatives; see :mod:`encoderkit.tasks.embed.features`).

Training data: JSONL ``{query, positive, negatives?}`` or a BEIR source (each judged (query, doc)
pair is a row; ``--num-negatives`` hard negatives are added when ``--negatives mined``).
Evaluation: nDCG@10 / MRR@10 / recall@100 of exact search over the whole corpus of a BEIR source.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.data.beir import Triple, is_beir_source, load_retrieval
from encoderkit.errors import EncoderkitError
from encoderkit.metrics.ranking import retrieval_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import EvalData, TaskRun, TrainData, seeded_subset
from encoderkit.tasks.embed.data import train_groups
from encoderkit.tasks.embed.embedder import Embedder, tokenize
from encoderkit.tasks.embed.exact import retrieve
from encoderkit.tasks.embed.features import (
    BiEncoder,
    false_negative_mask,
    load_bi_encoder,
    mnrl_loss,
    save_sentence_transformers,
)
from encoderkit.tasks.embed.options import EmbedOptions

OPTIONS = EmbedOptions



def pair_batches(q_rows: list[dict[str, np.ndarray]], p_rows: list[dict[str, np.ndarray]],
                 n_rows: list[list[dict[str, np.ndarray]]], pad_id: int, data: TrainData) -> BucketedBatches:
    """Training batches of (query, positive, hard negatives) token rows, bucketed by the positives' lengths:
    ``q_*`` the queries; ``p_*`` the batch's positives first (row i's positive at i), then every row's negatives
    (the embed task's and the sparse task's contrastive batches)."""

    def make_batch(idx: np.ndarray, epoch: int):
        q = encode_batch([q_rows[i] for i in idx], pad_id)
        p = encode_batch([p_rows[i] for i in idx] + [r for i in idx for r in n_rows[i]], pad_id)
        return {**{f"q_{a}": b for a, b in q.items()}, **{f"p_{a}": b for a, b in p.items()}}

    return BucketedBatches(np.asarray([len(r["input_ids"]) for r in p_rows]), data.batch_size, make_batch,
                           seed=data.seed, bucket=data.bucket)


def with_false_negative_mask(source: BucketedBatches, groups: list[Triple], k: int) -> BucketedBatches:
    """``source`` whose batches also hold ``fn_mask`` (:func:`~encoderkit.tasks.embed.features.false_negative_mask`):
    the in-batch passages judged relevant to a row's query (its positive's copies, its claim's other positives)
    leave that row's softmax instead of counting as negatives."""
    relevant: dict[str, set[str]] = {}
    for g in groups:
        relevant.setdefault(g.query, set()).add(g.positive)
    make_batch = source.make_batch

    def make(idx: np.ndarray, epoch: int) -> dict[str, Any]:
        columns = [groups[int(i)].positive for i in idx] + [n for i in idx for n in groups[int(i)].negatives[:k]]
        mask = false_negative_mask([groups[int(i)].query for i in idx], columns, relevant)
        return {**make_batch(idx, epoch), "fn_mask": mask}

    return replace(source, make_batch=make)


def build(data: TrainData, options: EmbedOptions, tokenizer, folder: ModelFolder) -> TaskRun:
    max_length = options.max_length
    audit: dict = {}
    groups, k = train_groups(data, options, audit)
    if len(groups) < data.batch_size:
        raise EncoderkitError(f"{data.train}: {len(groups)} training pairs, fewer than one batch ({data.batch_size}); "
                              "lower --batch-size")
    q_rows = tokenize(tokenizer, [g.query for g in groups], options.max_query_length)
    p_rows = tokenize(tokenizer, [g.positive for g in groups], max_length)
    n_rows = [tokenize(tokenizer, g.negatives[:k], max_length) if k else [] for g in groups]
    pad_id = tokenizer.pad_token_id

    source = with_false_negative_mask(pair_batches(q_rows, p_rows, n_rows, pad_id, data), groups, k)
    dims = list(options.matryoshka_dims)

    def loss_fn(module, batch):
        q = module(**{a[2:]: b for a, b in batch.items() if a.startswith("q_")})
        p = module(**{a[2:]: b for a, b in batch.items() if a.startswith("p_")})
        return mnrl_loss(q, p, options.scale, dims, batch.get("fn_mask")), {}

    model = load_bi_encoder(folder, options.pooling)
    evaluate = None
    if data.dev:
        if not is_beir_source(data.dev):
            raise EncoderkitError(f"--dev {data.dev}: embed evaluation needs a BEIR source (folder or SciFact zip, "
                                  "with #split)")
        dev = load_retrieval(data.dev)

        def evaluate(module: BiEncoder) -> dict[str, float]:
            ranked = retrieve(module, tokenizer, dev, max_length, options.max_query_length, data.eval_batch_size)
            return retrieval_scores(ranked, dev.qrels)

    def save(module: BiEncoder, folder: Path) -> None:
        save_sentence_transformers(module, tokenizer, folder, max_length)

    card = {"task": "embed", "pooling": model.pooling, "normalize": True, "max_length": max_length,
            "max_query_length": options.max_query_length, "matryoshka_dims": dims, "similarity": "cosine"}
    return TaskRun(model, loss_fn, source, evaluate, (data.metric or "ndcg@10", "max"), save, card,
                   num_train=len(groups), audit=audit)


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: EmbedOptions,
                    engine: Any = None) -> dict[str, float]:
    """nDCG@10 / MRR@10 / recall@100 of exact search over a BEIR corpus; ``engine`` (default: the folder's
    torch encoder) gives the token states that an :class:`Embedder` pools and normalises as the folder says."""
    if not is_beir_source(str(data.data)):
        raise EncoderkitError(f"--data {data.data}: embed evaluation needs a BEIR source (folder or SciFact zip, "
                              "with #split)")
    model = (load_bi_encoder(folder, options.pooling) if engine is None
             else Embedder(engine, tokenizer, options.pooling, normalize=folder.normalize,
                           max_length=options.max_length, max_batch=data.batch_size))
    ds = load_retrieval(str(data.data))
    if data.max_examples:  # a seeded subset of the judged queries; the whole corpus stays searchable
        keep = set(seeded_subset(sorted(ds.qrels), data.max_examples, data.seed))
        ds.qrels = {q: r for q, r in ds.qrels.items() if q in keep}
    ranked = retrieve(model, tokenizer, ds, options.max_length, options.max_query_length, data.batch_size,
                      progress=True, cache_for=folder.path if engine is None else None)
    return {**retrieval_scores(ranked, ds.qrels), "queries": len(ds.qrels), "documents": len(ds.corpus)}
