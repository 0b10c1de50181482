"""Cross-encoder reranking: ``AutoModelForSequenceClassification`` with one output (a relevance score).

Training rows are groups of one query with 1 positive and ``num_negatives`` negatives; the loss
is cross-entropy over the group's scores with the positive as the target (listwise softmax).
Data: JSONL ``{query, positive, negatives}`` (each row needs at least ``num_negatives``
negatives) or a BEIR source (each judged (query, doc) pair is a row; negatives ``sampled`` at
random from the corpus, or ``mined``: drawn from ranks 4-30 of a bi-encoder's results, leaving
out judged documents; see :mod:`encoderkit.retrieval.mining`). Each group keeps a
pool of negatives (a row's list, the mined ranks, or ``SAMPLED_POOL`` x N random documents) and
every epoch draws a fresh ``num_negatives`` from it, seeded by (seed, epoch, row), so a run of
several epochs sees several times as many distinct negatives.

Evaluation on a BEIR source reranks the bi-encoder's top 100 per query (nDCG@10, MRR@10), and
reports the first stage's metrics (``first_stage_*``) and those of the reciprocal-rank fusion of
the two orders (``fused_*``, k = 60, nothing tuned);
on JSONL it ranks each row's positive among its negatives (MRR, accuracy@1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.retrieval.beir import is_beir_source, load_retrieval, read_triples
from encoderkit.retrieval.metrics import reciprocal_rank_fusion, retrieval_scores
from encoderkit.retrieval.mining import CANDIDATES, candidates, groups_from_beir
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import TaskRun, run_batches, seeded_subset

DEFAULT_MAX_LENGTH = 256


def pair_rows(tokenizer, queries: list[str], passages: list[str], max_length: int) -> list[dict[str, np.ndarray]]:
    # longest_first: the passage is cut first; a query longer than the passage is cut too (only_second
    # fails outright on a query longer than max_length). The deploy runtime truncates the same way.
    enc = tokenizer(queries, passages, truncation="longest_first", max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    return [{k: np.asarray(enc[k][i], dtype=np.int64) for k in keys} for i in range(len(queries))]


def score_pairs(module, tokenizer, query: str | list[str], passages: list[str], max_length: int = 256, batch_size: int = 64) -> np.ndarray:
    """Relevance scores (N,) of (query, passage) pairs; ``query`` is one string or one per passage.
    ``module``: a torch model or an engine whose output is the logits (the first one is the score)."""
    if not passages:
        return np.zeros(0, dtype=np.float32)
    queries = [query] * len(passages) if isinstance(query, str) else list(query)
    rows = pair_rows(tokenizer, queries, passages, max_length)
    out = run_batches(module, rows, tokenizer.pad_token_id, batch_size, lambda o: o.logits[:, :1])
    return np.asarray(out, dtype=np.float32).reshape(len(rows), -1)[:, 0]


def build(cfg: Any, tokenizer, folder: ModelFolder) -> TaskRun:
    from transformers import AutoModelForSequenceClassification

    max_length = cfg.max_length or DEFAULT_MAX_LENGTH
    if is_beir_source(cfg.train):
        groups = groups_from_beir(load_retrieval(cfg.train), cfg, pool=True)
    else:
        groups = read_triples(cfg.train)
    groups = seeded_subset(groups, cfg.max_train_examples, cfg.seed)
    k = cfg.num_negatives
    short = [g for g in groups if len(g.negatives) < k]
    if short:
        raise EncoderkitError(f"{short[0].where}: {len(short[0].negatives)} negatives, fewer than --num-negatives {k}; "
                              "add negatives or lower --num-negatives")
    pad_id = tokenizer.pad_token_id

    def group_rows(i: int, epoch: int) -> list[dict[str, np.ndarray]]:
        g = groups[i]
        pick = np.random.default_rng([cfg.seed, epoch, i]).choice(len(g.negatives), size=k, replace=False)
        return pair_rows(tokenizer, [g.query] * (k + 1), [g.positive] + [g.negatives[j] for j in pick], max_length)

    def make_batch(idx: np.ndarray, epoch: int):
        return encode_batch([r for i in idx for r in group_rows(int(i), epoch)], pad_id)

    # bucket by the query + positive length (negatives change every epoch)
    lengths = [len(r["input_ids"]) for r in pair_rows(tokenizer, [g.query for g in groups], [g.positive for g in groups], max_length)]
    source = BucketedBatches(np.asarray(lengths), cfg.batch_size, make_batch, seed=cfg.seed, bucket=cfg.bucket)

    def loss_fn(module, batch):
        scores = module(**batch).logits.view(-1, k + 1).float()  # (B, 1+k), positive first
        target = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
        return torch.nn.functional.cross_entropy(scores, target), {}

    evaluate, primary = None, ("mrr@10", "max")
    if cfg.dev:
        evaluate, primary = dev_evaluator(cfg, tokenizer, max_length)
    model = folder.load(AutoModelForSequenceClassification, num_labels=1)
    card = {"task": "rerank", "max_length": max_length, "num_labels": 1, "loss": "listwise softmax over 1 positive + negatives"}
    return TaskRun(model, loss_fn, source, evaluate, (cfg.metric or primary[0], "max"),
                   lambda m, folder: m.save_pretrained(folder), card, num_train=len(groups))


def dev_evaluator(cfg: Any, tokenizer, max_length: int, data_spec: str | None = None, limit: int | None = None):
    """``(evaluate(module) -> metrics, primary)`` for a BEIR source or a triples JSONL."""
    spec = data_spec or cfg.dev
    limit = cfg.max_dev_examples if limit is None else limit
    if is_beir_source(spec):
        data = load_retrieval(spec)
        if limit:
            keep = set(seeded_subset(sorted(data.qrels), limit, cfg.seed))
            data.qrels = {q: r for q, r in data.qrels.items() if q in keep}
        first = candidates(data, cfg.miner, cfg, getattr(cfg, "candidates", CANDIDATES))
        before = {f"first_stage_{k}": v for k, v in retrieval_scores(first, data.qrels).items()}

        def evaluate(module) -> dict[str, float]:
            from encoderkit.progress import progress

            ranked = {}
            for qid, docs in progress(first.items(), total=len(first), desc="rerank", unit="query", leave=False):
                s = score_pairs(module, tokenizer, data.queries[qid], [data.doc_text(d) for d in docs], max_length, cfg.eval_batch_size)
                ranked[qid] = [docs[i] for i in np.argsort(-s, kind="stable")]
            fused = {q: reciprocal_rank_fusion([ranked[q], first[q]]) for q in ranked}
            return {**retrieval_scores(ranked, data.qrels), **before,
                    **{f"fused_{k}": v for k, v in retrieval_scores(fused, data.qrels).items()}}

        return evaluate, ("ndcg@10", "max")
    triples = seeded_subset(read_triples(spec), limit, cfg.seed)

    def evaluate_triples(module) -> dict[str, float]:
        rr, top1 = [], []
        for t in triples:
            s = score_pairs(module, tokenizer, t.query, [t.positive] + t.negatives, max_length, cfg.eval_batch_size)
            rank = int((s[1:] > s[0]).sum())
            rr.append(1.0 / (rank + 1))
            top1.append(float(rank == 0))
        return {"mrr@10": float(np.mean(rr)), "accuracy@1": float(np.mean(top1))}

    return evaluate_triples, ("mrr@10", "max")


def evaluate_folder(folder: ModelFolder, tokenizer, data: str | Path, cfg: Any, engine: Any = None) -> dict[str, float]:
    """nDCG@10 reranking a first stage (BEIR) or MRR of each row's positive (JSONL); ``engine`` (default:
    the folder's torch model) computes the relevance logits."""
    model = folder.load(task="rerank") if engine is None else engine
    cfg = dataclasses.replace(cfg, eval_batch_size=cfg.batch_size)
    evaluate, _ = dev_evaluator(cfg, tokenizer, folder.card.get("max_length", cfg.max_length or DEFAULT_MAX_LENGTH), str(data), cfg.max_examples)
    return evaluate(model)
