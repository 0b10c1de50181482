"""Extractive QA fine-tuning and evaluation: ``AutoModelForQuestionAnswering`` on SQuAD-format data.

Training uses each question's first answer; every context window is a training row (a window
without the answer targets the [CLS] position, as in Hugging Face's SQuAD recipe). Evaluation
decodes the best span over all windows (:func:`encoderkit.tasks.qa.decode_answers`) and scores
it against all gold answers with the official SQuAD v1.1 EM/F1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.evaluate.metrics import squad_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import TaskRun, run_batches, seeded_subset
from encoderkit.tasks.qa import QaFeatures, decode_answers, featurize_qa, window_rows, window_span_logits
from encoderkit.tasks.squad import QaExample, read_squad

DEFAULT_MAX_LENGTH = 256


def doc_stride(cfg: Any) -> int:
    """``--doc-stride``, or a quarter of ``max_length`` when it is 0."""
    return cfg.doc_stride or max_length(cfg) // 4


def max_length(cfg: Any) -> int:
    return cfg.max_length or DEFAULT_MAX_LENGTH


def featurize(tokenizer, examples: list[QaExample], cfg: Any, with_answers: bool) -> QaFeatures:
    kw = {}
    if with_answers:
        kw = {"answer_starts": [e.answers[0][1] for e in examples], "answer_texts": [e.answers[0][0] for e in examples]}
    return featurize_qa(tokenizer, [e.question for e in examples], [e.context for e in examples],
                        max_length=max_length(cfg), doc_stride=doc_stride(cfg), max_question_length=cfg.max_query_length, **kw)


def predict(module, tokenizer, examples: list[QaExample], cfg: Any, batch_size: int) -> list[str]:
    """The best answer text per example ('' when no valid span)."""
    feats = featurize(tokenizer, examples, cfg, with_answers=False)
    outs = run_batches(module, window_rows(feats), tokenizer.pad_token_id, batch_size,
                       lambda o: (o.start_logits, o.end_logits), per_token=True)
    start, end = window_span_logits(feats, outs)  # each out: (2, n)
    answers = decode_answers(feats, start, end, n_best=cfg.n_best, max_answer_length=cfg.max_answer_length)
    return [a[0].text if a else "" for a in answers]


def scores(module, tokenizer, examples: list[QaExample], cfg: Any, batch_size: int) -> dict[str, float]:
    preds = predict(module, tokenizer, examples, cfg, batch_size)
    return squad_scores(preds, [[t for t, _ in e.answers] for e in examples])


def build(cfg: Any, tokenizer, folder: ModelFolder) -> TaskRun:
    from transformers import AutoModelForQuestionAnswering

    same_file = bool(cfg.dev) and Path(cfg.train).resolve() == Path(cfg.dev).resolve()
    train, _ = read_squad(cfg.train, "train" if same_file else cfg.qa_split)
    train = seeded_subset(train, cfg.max_train_examples, cfg.seed)
    rows = window_rows(featurize(tokenizer, train, cfg, with_answers=True), with_answers=True)
    evaluate = None
    if cfg.dev:
        dev, _ = read_squad(cfg.dev, "heldout" if same_file else "all")
        dev = seeded_subset(dev, cfg.max_dev_examples, cfg.seed)

        def evaluate(module) -> dict[str, float]:
            return scores(module, tokenizer, dev, cfg, cfg.eval_batch_size)

    model = folder.load(AutoModelForQuestionAnswering)
    pad_id = tokenizer.pad_token_id
    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), cfg.batch_size,
                             lambda idx, epoch: encode_batch([rows[i] for i in idx], pad_id), seed=cfg.seed, bucket=cfg.bucket)

    def loss_fn(module, batch):
        return module(**batch).loss, {}

    card = {"task": "qa", "max_length": max_length(cfg), "doc_stride": doc_stride(cfg), "max_answer_length": cfg.max_answer_length,
            "max_question_length": cfg.max_query_length, "n_best": cfg.n_best}
    return TaskRun(model, loss_fn, source, evaluate, (cfg.metric or "f1", "max"),
                   lambda m, folder: m.save_pretrained(folder), card, num_train=len(train))


def evaluate_folder(folder: ModelFolder, tokenizer, data: str | Path, cfg: Any, engine: Any = None) -> dict[str, float]:
    """SQuAD EM/F1; ``engine`` (default: the folder's torch model) computes the span logits."""
    model = folder.load(task="qa") if engine is None else engine
    card = folder.card
    saved = (("max_length", "max_length"), ("doc_stride", "doc_stride"), ("max_answer_length", "max_answer_length"),
             ("max_question_length", "max_query_length"))
    cfg = dataclasses.replace(cfg, **{field: card[key] for key, field in saved if key in card})
    examples, skipped = read_squad(data, cfg.qa_split)
    examples = seeded_subset(examples, cfg.max_examples, cfg.seed)
    return {**scores(model, tokenizer, examples, cfg, cfg.batch_size), "questions": len(examples), "skipped_answers": skipped}
