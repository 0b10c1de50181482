"""Sequence classification fine-tuning and evaluation (single texts or pairs; multi-class or multi-label: BCE, a
label at probability 0.5) on HF's own ``AutoModelForSequenceClassification``, so plain ``transformers`` computes
what encoderkit computes; except ``--pooling mean`` on a BERT-style model, which plain transformers ignores, so the
log and the card warn (``hf_compatible: false``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoModelForSequenceClassification

from encoderkit.errors import EncoderkitError
from encoderkit.metrics.scores import classification_scores, multilabel_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import MEAN, set_pooling
from encoderkit.progress import note
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.classify.data import label_names, read_examples
from encoderkit.tasks.classify.features import engine_logits, featurize
from encoderkit.tasks.classify.options import ClassifyOptions
from encoderkit.tasks.common import EvalData, TaskRun, TrainData, check_labels, run_batches, seeded_subset
from encoderkit.tasks.inference import ModuleEngine

OPTIONS = ClassifyOptions


def label_targets(labels: list[list[str]], names: list[str], multi_label: bool) -> np.ndarray:
    """Class ids (N,) int64, or with ``multi_label`` 0/1 targets (N, C) float32, of label lists over ``names``."""
    index = {n: i for i, n in enumerate(names)}
    if multi_label:
        y = np.zeros((len(labels), len(names)), dtype=np.float32)
        for r, items in enumerate(labels):
            y[r, [index[x] for x in items]] = 1.0
        return y
    return np.asarray([index[items[0]] for items in labels], dtype=np.int64)


def predict_logits(module, rows: list[dict[str, np.ndarray]], pad_id: int, batch_size: int) -> np.ndarray:
    """Logits (N, C) for feature rows, in their order, from a torch module (training's dev evaluation)."""
    return np.stack(run_batches(module, rows, pad_id, batch_size, lambda out: out.logits))


def scores(logits: np.ndarray, targets: np.ndarray, multi_label: bool) -> dict[str, float]:
    if multi_label:
        return multilabel_scores(targets, (logits >= 0).astype(np.int64))  # sigmoid >= 0.5
    return classification_scores(targets, logits.argmax(-1), logits.shape[-1])


def hf_mismatch_warning(model_type: str, pooling: str) -> str | None:
    """The warning a mean-pooled classifier carries when plain transformers would pool its first token."""
    if pooling != MEAN or model_type == "modernbert":
        return None
    return (f"mean pooling: plain transformers (AutoModelForSequenceClassification, pipeline) pools the first token "
            f"of a {model_type} whatever config.json says, so it gives OTHER outputs than encoderkit for this folder; "
            "load it with encoderkit (evaluate, predict, serve, export) or apply "
            "encoderkit.models.pooling.apply_pooling(model)")


def build(data: TrainData, options: ClassifyOptions, tokenizer, folder: ModelFolder) -> TaskRun:
    """Read train/dev, featurize, and make the HF classification model and its engine pieces."""
    multi = options.multi_label
    texts, pairs, labels, _, text_col = read_examples(data.train, options, train=True)
    texts, pairs, labels = _subset(data.max_train_examples, data.seed, texts, pairs, labels)
    names = label_names(labels)
    if len(names) < 2 and not multi:
        raise EncoderkitError(f"{data.train}: only one label ({names}) in column {options.label_column!r}; a "
                              "classifier needs two or more")
    rows = featurize(tokenizer, texts, pairs, options.max_length)
    y = label_targets(labels, names, multi)
    for r, t in zip(rows, y, strict=True):
        r["labels"] = t
    evaluate = None
    if data.dev:
        dtexts, dpairs, dlabels, where, _ = read_examples(data.dev, options, text_col)
        dtexts, dpairs, dlabels = _subset(data.max_dev_examples, data.seed, dtexts, dpairs, dlabels)
        check_labels(set(names), [x for items in dlabels for x in items],
                     [w for w, items in zip(where, dlabels, strict=False) for _ in items])
        drows = featurize(tokenizer, dtexts, dpairs, options.max_length)
        dy = label_targets(dlabels, names, multi)

        def evaluate(module) -> dict[str, float]:
            return scores(predict_logits(module, drows, tokenizer.pad_token_id, data.eval_batch_size), dy, multi)

    model = folder.load(
        AutoModelForSequenceClassification, num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
        problem_type="multi_label_classification" if multi else "single_label_classification",
    )
    pooling = options.pooling
    set_pooling(model, pooling)
    warning = hf_mismatch_warning(model.config.model_type, pooling)
    if warning:
        note(f"WARNING: {warning}")
    pad_id = tokenizer.pad_token_id

    def loss_fn(module, batch):
        out = module(**batch)
        return out.loss, {}

    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), data.batch_size,
                             lambda idx, epoch: encode_batch([rows[i] for i in idx], pad_id), seed=data.seed,
                             bucket=data.bucket)

    def save(module, folder: Path) -> None:
        module.save_pretrained(folder)

    primary = ("micro_f1", "max") if multi else (data.metric or "accuracy", "max")
    card = {"task": "classify", "labels": names, "pooling": pooling, "max_length": options.max_length,
            "multi_label": multi, "text_pair": bool(options.text_pair_column), "text_column": text_col,
            "label_column": options.label_column,
            **({"text_pair_column": options.text_pair_column} if options.text_pair_column else {}),
            "hf_compatible": warning is None,
            **({"warning": warning} if warning else {})}
    return TaskRun(model, loss_fn, source, evaluate, primary, save, card, num_train=len(rows))


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: ClassifyOptions,
                    engine: Any = None) -> dict[str, float]:
    """Metrics of a saved classifier on a labelled file; ``engine`` (default: the folder's torch model)
    is what computes the logits, e.g. ONNX Runtime on its export (the compression measurer)."""
    if engine is None:
        engine = ModuleEngine(folder.load(task="classify"), ["logits"])
    names = folder.labels
    multi = options.multi_label
    texts, pairs, labels, where, _ = read_examples(data.data, options, folder.card.get("text_column"))
    texts, pairs, labels = _subset(data.max_examples, data.seed, texts, pairs, labels)
    check_labels(set(names), [x for items in labels for x in items],
                 [w for w, items in zip(where, labels, strict=False) for _ in items])
    rows = featurize(tokenizer, texts, pairs, options.max_length)
    logits = engine_logits(engine, rows, tokenizer.pad_token_id, data.batch_size)
    return {**scores(logits, label_targets(labels, names, multi), multi), "examples": len(rows)}


def _subset(limit: int, seed: int, *columns):
    """The same seeded subset of rows (see :func:`seeded_subset`) from each column (None stays None)."""
    keep = seeded_subset(list(range(len(columns[0]))), limit, seed)
    return tuple(None if c is None else [c[i] for i in keep] for c in columns)
