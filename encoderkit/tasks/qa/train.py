"""Extractive QA fine-tuning and evaluation: ``AutoModelForQuestionAnswering`` on SQuAD-format data. Every
context window is a training row (one without the first answer targets [CLS], as in HF's SQuAD recipe); the best
span over all windows is scored against all gold answers with SQuAD v1.1 EM/F1. A new span head (random weights)
learns at ``HEAD_LR_SCALE`` times ``--lr``: at the encoder's rate it barely moves in a few hundred steps, so the
encoder alone would have to turn towards its random directions (the figures: docs/finetune.md, "Question answering
against the HF Trainer"); a QA folder's trained head keeps ``--lr``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoModelForQuestionAnswering

from encoderkit.metrics.scores import squad_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import EvalData, TaskRun, TrainData, head_name, run_batches, seeded_subset
from encoderkit.tasks.qa.data import QaExample, read_squad
from encoderkit.tasks.qa.features import QaFeatures, decode_answers, featurize_qa, window_rows, window_span_logits
from encoderkit.tasks.qa.options import QaOptions

OPTIONS = QaOptions
HEAD_LR_SCALE = 100.0  # a new span head (random weights) learns at this times --lr


def featurize(tokenizer, examples: list[QaExample], options: QaOptions, with_answers: bool) -> QaFeatures:
    kw = {}
    if with_answers:
        kw = {"answer_starts": [e.answers[0][1] for e in examples], "answer_texts": [e.answers[0][0] for e in examples]}
    return featurize_qa(tokenizer, [e.question for e in examples], [e.context for e in examples],
                        max_length=options.max_length, doc_stride=options.doc_stride,
                        max_question_length=options.max_question_length, **kw)


def predict(module, tokenizer, examples: list[QaExample], options: QaOptions, batch_size: int) -> list[str]:
    """The best answer text per example ('' when no valid span)."""
    feats = featurize(tokenizer, examples, options, with_answers=False)
    outs = run_batches(module, window_rows(feats), tokenizer.pad_token_id, batch_size,
                       lambda o: (o.start_logits, o.end_logits), per_token=True)
    start, end = window_span_logits(feats, outs)  # each out: (2, n)
    answers = decode_answers(feats, start, end, n_best=options.n_best, max_answer_length=options.max_answer_length)
    return [a[0].text if a else "" for a in answers]


def scores(module, tokenizer, examples: list[QaExample], options: QaOptions, batch_size: int) -> dict[str, float]:
    preds = predict(module, tokenizer, examples, options, batch_size)
    return squad_scores(preds, [[t for t, _ in e.answers] for e in examples])


def build(data: TrainData, options: QaOptions, tokenizer, folder: ModelFolder) -> TaskRun:
    same_file = bool(data.dev) and Path(data.train).resolve() == Path(data.dev).resolve()
    train, _ = read_squad(data.train, "train" if same_file else options.qa_split)
    train = seeded_subset(train, data.max_train_examples, data.seed)
    rows = window_rows(featurize(tokenizer, train, options, with_answers=True), with_answers=True)
    evaluate = None
    if data.dev:
        dev, _ = read_squad(data.dev, "heldout" if same_file else "all")
        dev = seeded_subset(dev, data.max_dev_examples, data.seed)

        def evaluate(module) -> dict[str, float]:
            return scores(module, tokenizer, dev, options, data.eval_batch_size)

    model = folder.load(AutoModelForQuestionAnswering)
    lr_scale = {} if folder.task == "qa" else {head_name(model, 2): HEAD_LR_SCALE}  # a trained head keeps --lr
    pad_id = tokenizer.pad_token_id
    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), data.batch_size,
                             lambda idx, epoch: encode_batch([rows[i] for i in idx], pad_id), seed=data.seed,
                             bucket=data.bucket)

    def loss_fn(module, batch):
        return module(**batch).loss, {}

    card = {"task": "qa", "max_length": options.max_length, "doc_stride": options.doc_stride,
            "max_answer_length": options.max_answer_length, "max_question_length": options.max_question_length,
            "n_best": options.n_best, **({"head": {"lr_scale": HEAD_LR_SCALE}} if lr_scale else {})}
    return TaskRun(model, loss_fn, source, evaluate, (data.metric or "f1", "max"),
                   lambda m, folder: m.save_pretrained(folder), card, num_train=len(train),
                   lr_scale=lr_scale)


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: QaOptions,
                    engine: Any = None) -> dict[str, float]:
    """SQuAD EM/F1; ``engine`` (default: the folder's torch model) computes the span logits."""
    model = folder.load(task="qa") if engine is None else engine
    examples, skipped = read_squad(data.data, options.qa_split)
    examples = seeded_subset(examples, data.max_examples, data.seed)
    return {**scores(model, tokenizer, examples, options, data.batch_size), "questions": len(examples),
            "skipped_answers": skipped}
