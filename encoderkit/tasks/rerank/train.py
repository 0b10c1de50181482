"""Cross-encoder reranking: ``AutoModelForSequenceClassification`` with one output, trained listwise (a softmax over
one positive and ``num_negatives`` negatives, drawn afresh each epoch from the group's pool, so several epochs see
more distinct negatives). A new relevance head (random weights) learns at ``HEAD_LR_SCALE`` times ``--lr``, as QA's
span head does: at the encoder's rate the listwise loss stays at log(1 + negatives) for an epoch of a small set; a
cross-encoder folder's trained head keeps ``--lr``. Evaluation on a BEIR source reranks a bi-encoder's top
candidates and also reports the first stage and their reciprocal-rank fusion; on JSONL it ranks each row's positive
among its negatives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from encoderkit.data.beir import is_beir_source, load_retrieval, read_triples
from encoderkit.errors import EncoderkitError
from encoderkit.metrics.ranking import reciprocal_rank_fusion, retrieval_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.progress import progress
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import EvalData, TaskRun, TrainData, head_name, seeded_subset
from encoderkit.tasks.embed.mining import candidates
from encoderkit.tasks.rerank.data import train_groups
from encoderkit.tasks.rerank.features import pair_rows, score_pairs
from encoderkit.tasks.rerank.options import RerankOptions

OPTIONS = RerankOptions
HEAD_LR_SCALE = 100.0  # a new relevance head (random weights) learns at this times --lr


def build(data: TrainData, options: RerankOptions, tokenizer, folder: ModelFolder) -> TaskRun:
    max_length = options.max_length
    audit: dict = {}
    groups = train_groups(data, options, audit)
    k = options.num_negatives
    short = [g for g in groups if len(g.negatives) < k]
    if short:
        raise EncoderkitError(f"{short[0].where}: {len(short[0].negatives)} negatives, fewer than --num-negatives {k}; "
                              "add negatives or lower --num-negatives")
    pad_id = tokenizer.pad_token_id

    def group_rows(i: int, epoch: int) -> list[dict[str, np.ndarray]]:
        g = groups[i]
        pick = np.random.default_rng([data.seed, epoch, i]).choice(len(g.negatives), size=k, replace=False)
        return pair_rows(tokenizer, [g.query] * (k + 1), [g.positive] + [g.negatives[j] for j in pick], max_length)

    def make_batch(idx: np.ndarray, epoch: int):
        return encode_batch([r for i in idx for r in group_rows(int(i), epoch)], pad_id)

    # bucket by the query + positive length (negatives change every epoch)
    firsts = pair_rows(tokenizer, [g.query for g in groups], [g.positive for g in groups], max_length)
    lengths = [len(r["input_ids"]) for r in firsts]
    source = BucketedBatches(np.asarray(lengths), data.batch_size, make_batch, seed=data.seed, bucket=data.bucket)

    def loss_fn(module, batch):
        scores = module(**batch).logits.view(-1, k + 1).float()  # (B, 1+k), positive first
        target = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
        return torch.nn.functional.cross_entropy(scores, target), {}

    evaluate, primary = None, ("mrr@10", "max")
    if data.dev:
        evaluate, primary = dev_evaluator(data.dev, data.max_dev_examples, data.seed, data.eval_batch_size, options,
                                          tokenizer)
    model = folder.load(AutoModelForSequenceClassification, num_labels=1)
    lr_scale = {} if folder.task == "rerank" else {head_name(model, 1): HEAD_LR_SCALE}  # a trained head keeps --lr
    card = {"task": "rerank", "max_length": max_length, "num_labels": 1,
            "loss": "listwise softmax over 1 positive + negatives",
            **({"head": {"lr_scale": HEAD_LR_SCALE}} if lr_scale else {})}
    return TaskRun(model, loss_fn, source, evaluate, (data.metric or primary[0], "max"),
                   lambda m, folder: m.save_pretrained(folder), card, num_train=len(groups), audit=audit,
                   lr_scale=lr_scale)


def dev_evaluator(spec: str, limit: int, seed: int, batch_size: int, options: RerankOptions, tokenizer):
    """``(evaluate(module) -> metrics, primary)`` on a BEIR source or a triples JSONL (a seeded subset
    of ``limit`` queries or rows; 0: all), scoring pairs of ``options.max_length`` sub-tokens."""
    max_length = options.max_length
    if is_beir_source(spec):
        data = load_retrieval(spec)
        if limit:
            keep = set(seeded_subset(sorted(data.qrels), limit, seed))
            data.qrels = {q: r for q, r in data.qrels.items() if q in keep}
        first = candidates(data, options.miner, options.candidates, options.max_query_length, batch_size)
        before = {f"first_stage_{k}": v for k, v in retrieval_scores(first, data.qrels).items()}

        def evaluate(module) -> dict[str, float]:
            ranked = {}
            for qid, docs in progress(first.items(), total=len(first), desc="rerank", unit="query", leave=False):
                s = score_pairs(module, tokenizer, data.queries[qid], [data.doc_text(d) for d in docs], max_length,
                                batch_size)
                ranked[qid] = [docs[i] for i in np.argsort(-s, kind="stable")]
            fused = {q: reciprocal_rank_fusion([ranked[q], first[q]]) for q in ranked}
            return {**retrieval_scores(ranked, data.qrels), **before,
                    **{f"fused_{k}": v for k, v in retrieval_scores(fused, data.qrels).items()}, "queries": len(ranked)}

        return evaluate, ("ndcg@10", "max")
    triples = seeded_subset(read_triples(spec), limit, seed)

    def evaluate_triples(module) -> dict[str, float]:
        rr, top1 = [], []
        for t in triples:
            s = score_pairs(module, tokenizer, t.query, [t.positive] + t.negatives, max_length, batch_size)
            rank = int((s[1:] > s[0]).sum())
            rr.append(1.0 / (rank + 1))
            top1.append(float(rank == 0))
        return {"mrr@10": float(np.mean(rr)), "accuracy@1": float(np.mean(top1))}

    return evaluate_triples, ("mrr@10", "max")


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: RerankOptions,
                    engine: Any = None) -> dict[str, float]:
    """nDCG@10 reranking a first stage (BEIR) or MRR of each row's positive (JSONL); ``engine`` (default:
    the folder's torch model) computes the relevance logits."""
    model = folder.load(task="rerank") if engine is None else engine
    evaluate, _ = dev_evaluator(str(data.data), data.max_examples, data.seed, data.batch_size, options, tokenizer)
    return evaluate(model)
