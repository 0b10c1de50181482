"""Sequence classification (single texts or pairs; multi-class or multi-label).

Head: Hugging Face's own ``AutoModelForSequenceClassification`` (for BERT: the pooler's dense+tanh,
then a linear layer). ``--pooling`` says what the pooler reads: the first token ([CLS], HF's
default) or the mean of the real tokens (:mod:`encoderkit.models.pooling`; BERT-style models and
ModernBERT). ``auto`` takes what the model folder records: its ``classifier_pooling``, else a
sentence-transformers folder's own pooling (mean for all-MiniLM-L6-v2), else the first token. The
choice is saved in ``config.json`` (``classifier_pooling``) and ``encoderkit.json``; every encoderkit
loader, ONNX export included, applies it (plain ``transformers`` needs
``encoderkit.models.pooling.apply_pooling(model)`` for a mean-pooled BERT).

Labels: the sorted set of training labels (numeric order when all are integers). A dev label that
never occurs in training is an error. Multi-label rows give their labels joined by
``label_separator`` (or as a JSON list in JSONL); the loss is BCE and a label is predicted when its
probability is at least 0.5. Texts longer than ``max_length`` sub-tokens are truncated (the longer
of a pair first).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.evaluate.metrics import classification_scores, multilabel_scores
from encoderkit.models.pooling import KEY, set_pooling
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import TaskRun, check_labels, load_task_model, run_batches, seeded_subset
from encoderkit.tasks.embed import folder_pooling
from encoderkit.tasks.labeled import labelled_rows
from encoderkit.tasks.tabular import column, read_rows, text_column

DEFAULT_MAX_LENGTH = 128


def read_examples(path: str | Path, cfg: Any, train: bool = False) -> tuple[list[str], list[str] | None, list[list[str]], list[str]]:
    """texts, pairs (or None), labels (a list per row; one element unless multi-label), row locations.
    Output of ``encoderkit label`` loses its unlabeled lines; for training, its audit corrections
    are applied and suspected errors dropped when asked (:mod:`encoderkit.tasks.labeled`)."""
    rows = read_rows(path)
    rows = labelled_rows(rows, path, getattr(cfg, "audit_sheet", "") if train else "",
                         bool(getattr(cfg, "drop_suspected", False)) and train)
    texts = text_column(rows, cfg.text_column, path, "--text-column")
    pairs = text_column(rows, cfg.text_pair_column, path, "--text-pair-column") if cfg.text_pair_column else None
    raw = column(rows, cfg.label_column, path, "--label-column")
    labels = []
    for r, v in zip(rows, raw, strict=True):
        if isinstance(v, list):
            items = [str(x) for x in v]
        elif cfg.multi_label:
            items = [x.strip() for x in str(v).split(cfg.label_separator) if x.strip()]
        else:
            items = [str(v).strip()]
        if not items or (not cfg.multi_label and (len(items) != 1 or not items[0])):
            raise EncoderkitError(f"{r.where}: label {v!r} in column {cfg.label_column!r} is empty; fill or drop the row")
        labels.append(items)
    return texts, pairs, labels, [r.where for r in rows]


def label_names(labels: list[list[str]]) -> list[str]:
    names = sorted({x for items in labels for x in items})
    if all(n.lstrip("-").isdigit() for n in names):
        names.sort(key=int)
    return names


def featurize(tokenizer, texts: list[str], pairs: list[str] | None, max_length: int) -> list[dict[str, np.ndarray]]:
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    return [{k: np.asarray(enc[k][i], dtype=np.int64) for k in keys} for i in range(len(texts))]


def _targets(labels: list[list[str]], names: list[str], multi_label: bool) -> np.ndarray:
    index = {n: i for i, n in enumerate(names)}
    if multi_label:
        y = np.zeros((len(labels), len(names)), dtype=np.float32)
        for r, items in enumerate(labels):
            y[r, [index[x] for x in items]] = 1.0
        return y
    return np.asarray([index[items[0]] for items in labels], dtype=np.int64)


def predict_logits(module, rows: list[dict[str, np.ndarray]], pad_id: int, batch_size: int) -> np.ndarray:
    """Logits (N, C) for feature rows, in their order."""
    return np.stack(run_batches(module, rows, pad_id, batch_size, lambda out: out.logits))


def scores(logits: np.ndarray, targets: np.ndarray, multi_label: bool) -> dict[str, float]:
    if multi_label:
        return multilabel_scores(targets, (logits >= 0).astype(np.int64))  # sigmoid >= 0.5
    return classification_scores(targets, logits.argmax(-1), logits.shape[-1])


def resolve_pooling(pooling: str, model_dir: Path) -> str:
    """``--pooling`` for classify: 'first' or 'mean'; ``auto`` from the model folder (see the module doc)."""
    if pooling != "auto":
        return pooling
    saved = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get(KEY)
    if saved:
        return "mean" if saved == "mean" else "first"
    return folder_pooling(Path(model_dir)) or "first"


def build(cfg: Any, tokenizer, model_dir: Path) -> TaskRun:
    """Read train/dev, featurize, and make the HF classification model and its engine pieces."""
    from transformers import AutoModelForSequenceClassification

    texts, pairs, labels, _ = read_examples(cfg.train, cfg, train=True)
    texts, pairs, labels = _subset(cfg.max_train_examples, cfg.seed, texts, pairs, labels)
    names = label_names(labels)
    if len(names) < 2 and not cfg.multi_label:
        raise EncoderkitError(f"{cfg.train}: only one label ({names}) in column {cfg.label_column!r}; a classifier needs two or more")
    rows = featurize(tokenizer, texts, pairs, (cfg.max_length or DEFAULT_MAX_LENGTH))
    y = _targets(labels, names, cfg.multi_label)
    for r, t in zip(rows, y, strict=True):
        r["labels"] = t
    evaluate = None
    if cfg.dev:
        dtexts, dpairs, dlabels, where = read_examples(cfg.dev, cfg)
        dtexts, dpairs, dlabels = _subset(cfg.max_dev_examples, cfg.seed, dtexts, dpairs, dlabels)
        check_labels(set(names), [x for items in dlabels for x in items], [w for w, items in zip(where, dlabels, strict=False) for _ in items])
        drows = featurize(tokenizer, dtexts, dpairs, (cfg.max_length or DEFAULT_MAX_LENGTH))
        dy = _targets(dlabels, names, cfg.multi_label)

        def evaluate(module) -> dict[str, float]:
            return scores(predict_logits(module, drows, tokenizer.pad_token_id, cfg.eval_batch_size), dy, cfg.multi_label)

    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=len(names), id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
        problem_type="multi_label_classification" if cfg.multi_label else "single_label_classification",
    )
    pooling = resolve_pooling(cfg.pooling, model_dir)
    set_pooling(model, pooling)
    pad_id = tokenizer.pad_token_id

    def loss_fn(module, batch):
        out = module(**batch)
        return out.loss, {}

    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), cfg.batch_size,
                             lambda idx, epoch: encode_batch([rows[i] for i in idx], pad_id), seed=cfg.seed, bucket=cfg.bucket)

    def save(module, folder: Path) -> None:
        module.save_pretrained(folder)

    primary = ("micro_f1", "max") if cfg.multi_label else (cfg.metric or "accuracy", "max")
    card = {"task": "classify", "labels": names, "pooling": pooling, "max_length": (cfg.max_length or DEFAULT_MAX_LENGTH),
            "multi_label": cfg.multi_label, "text_pair": bool(cfg.text_pair_column)}
    return TaskRun(model, loss_fn, source, evaluate, primary, save, card, num_train=len(rows))


def evaluate_folder(model_dir: Path, tokenizer, data: str | Path, cfg: Any, card: dict) -> dict[str, float]:
    """Metrics of a saved classifier on a labelled file."""
    from transformers import AutoModelForSequenceClassification

    model = load_task_model(model_dir, AutoModelForSequenceClassification)
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    multi = model.config.problem_type == "multi_label_classification"
    cfg.multi_label = multi
    texts, pairs, labels, where = read_examples(data, cfg)
    texts, pairs, labels = _subset(cfg.max_examples, cfg.seed, texts, pairs, labels)
    check_labels(set(names), [x for items in labels for x in items], [w for w, items in zip(where, labels, strict=False) for _ in items])
    rows = featurize(tokenizer, texts, pairs, card.get("max_length", cfg.max_length or DEFAULT_MAX_LENGTH))
    logits = predict_logits(model, rows, tokenizer.pad_token_id, cfg.batch_size)
    return {**scores(logits, _targets(labels, names, multi), multi), "examples": len(rows)}


def _subset(limit: int, seed: int, *columns):
    """The same seeded subset of rows (see :func:`seeded_subset`) from each column (None stays None)."""
    keep = seeded_subset(list(range(len(columns[0]))), limit, seed)
    return tuple(None if c is None else [c[i] for i in keep] for c in columns)
