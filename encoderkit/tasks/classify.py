"""Sequence classification (single texts or pairs; multi-class or multi-label).

Head: Hugging Face's own ``AutoModelForSequenceClassification`` (for BERT: the pooler's dense+tanh,
then a linear layer). ``--pooling`` says what the pooler reads: the first token ([CLS], HF's
default and ``auto``'s choice, so plain ``transformers`` -- ``pipeline("text-classification")`` --
computes what encoderkit computes) or, only on request, the mean of the real tokens
(:mod:`encoderkit.models.pooling`; BERT-style models and ModernBERT). ``auto`` keeps the pooling
of a folder that is already a classifier, else takes the first token. Mean pooling is saved in
``config.json`` (``classifier_pooling``) and ``encoderkit.json``; every encoderkit loader, ONNX
export included, applies it, but plain ``transformers`` pools the first token of a BERT whatever
the config says (ModernBERT reads the key itself), so a mean-pooled BERT folder gives other labels
there: the log, the card (``hf_compatible: false`` and a ``warning``) and the README say so.

Labels: the sorted set of training labels (numeric order when all are integers). A dev label that
never occurs in training is an error. Multi-label rows give their labels joined by
``label_separator`` (or as a JSON list in JSONL); the loss is BCE and a label is predicted when its
probability is at least 0.5. Texts longer than ``max_length`` sub-tokens are truncated (the longer
of a pair first).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.evaluate.metrics import classification_scores, multilabel_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import set_pooling
from encoderkit.progress import note
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import TaskRun, check_labels, run_batches, seeded_subset
from encoderkit.tasks.inference import Engine, ModuleEngine, run_rows
from encoderkit.tasks.labeled import labelled_rows
from encoderkit.tasks.tabular import column, find_text_column, read_rows, text_column

DEFAULT_MAX_LENGTH = 128


def resolve_text_column(rows: list, path: str | Path, cfg: Any, saved: str | None = None) -> str:
    """``--text-column``, or for ``auto`` the column the model was trained on (``saved``, when the file
    has it), else one found by :func:`~encoderkit.tasks.tabular.find_text_column`, stated in the log."""
    if cfg.text_column != "auto":
        return cfg.text_column
    if saved and saved in rows[0].fields:
        return saved
    name, how = find_text_column(rows, path, exclude=(cfg.label_column, cfg.text_pair_column))
    note(f"{path}: text column {name!r} ({how}); --text-column picks another")
    return name


def read_examples(path: str | Path, cfg: Any, saved_column: str | None = None, train: bool = False
                  ) -> tuple[list[str], list[str] | None, list[list[str]], list[str], str]:
    """texts, pairs (or None), labels (a list per row; one element unless multi-label), row locations,
    and the text column read. Output of ``encoderkit label`` loses its unlabeled lines; for training, its
    audit corrections are applied and suspected errors dropped when asked (:mod:`encoderkit.tasks.labeled`)."""
    rows = read_rows(path)
    rows = labelled_rows(rows, path, getattr(cfg, "audit_sheet", "") if train else "",
                         bool(getattr(cfg, "drop_suspected", False)) and train)
    name = resolve_text_column(rows, path, cfg, saved_column)
    texts = text_column(rows, name, path, "--text-column")
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
    return texts, pairs, labels, [r.where for r in rows], name


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
    """Logits (N, C) for feature rows, in their order, from a torch module (training's dev evaluation)."""
    return np.stack(run_batches(module, rows, pad_id, batch_size, lambda out: out.logits))


def engine_logits(engine: Engine, rows: list[dict[str, np.ndarray]], pad_id: int, batch_size: int) -> np.ndarray:
    """Logits (N, C) for feature rows from any engine (evaluate, the Predictor: torch or ONNX Runtime)."""
    return np.stack([out[0] for out in run_rows(engine, rows, pad_id, batch_size)]) if rows else np.zeros((0, 0), np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def decode(logits: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    """Per row of logits (N, C): the label, its probability and every label's probability; a one-logit
    head (a reranker) gives its sigmoid as ``score``."""
    if logits.shape[1] == 1:
        probs = 1.0 / (1.0 + np.exp(-logits[:, 0]))
        return [{"label": "score", "score": float(p), "scores": {"score": float(p)}} for p in probs]
    probs = softmax(logits)
    labels = labels or [f"LABEL_{i}" for i in range(logits.shape[1])]
    return [{"label": labels[int(p.argmax())], "score": float(p.max()),
             "scores": {labels[c]: float(p[c]) for c in range(len(p))}} for p in probs]


def scores(logits: np.ndarray, targets: np.ndarray, multi_label: bool) -> dict[str, float]:
    if multi_label:
        return multilabel_scores(targets, (logits >= 0).astype(np.int64))  # sigmoid >= 0.5
    return classification_scores(targets, logits.argmax(-1), logits.shape[-1])


def resolve_pooling(pooling: str, folder: ModelFolder) -> str:
    """``--pooling`` for classify: 'first' or 'mean'; ``auto``: a classifier folder's own, else 'first'."""
    if pooling != "auto":
        return pooling
    return folder.pooling if folder.task == "classify" and folder.pooling else "first"


def hf_mismatch_warning(model_type: str, pooling: str) -> str | None:
    """The warning a mean-pooled classifier carries when plain transformers would pool its first token."""
    if pooling != "mean" or model_type == "modernbert":
        return None
    return (f"mean pooling: plain transformers (AutoModelForSequenceClassification, pipeline) pools the first token of a "
            f"{model_type} whatever config.json says, so it gives OTHER outputs than encoderkit for this folder; load it "
            "with encoderkit (evaluate, predict, serve, export) or apply encoderkit.models.pooling.apply_pooling(model)")


def build(cfg: Any, tokenizer, folder: ModelFolder) -> TaskRun:
    """Read train/dev, featurize, and make the HF classification model and its engine pieces."""
    from transformers import AutoModelForSequenceClassification

    texts, pairs, labels, _, text_col = read_examples(cfg.train, cfg, train=True)
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
        dtexts, dpairs, dlabels, where, _ = read_examples(cfg.dev, cfg, text_col)
        dtexts, dpairs, dlabels = _subset(cfg.max_dev_examples, cfg.seed, dtexts, dpairs, dlabels)
        check_labels(set(names), [x for items in dlabels for x in items], [w for w, items in zip(where, dlabels, strict=False) for _ in items])
        drows = featurize(tokenizer, dtexts, dpairs, (cfg.max_length or DEFAULT_MAX_LENGTH))
        dy = _targets(dlabels, names, cfg.multi_label)

        def evaluate(module) -> dict[str, float]:
            return scores(predict_logits(module, drows, tokenizer.pad_token_id, cfg.eval_batch_size), dy, cfg.multi_label)

    model = folder.load(
        AutoModelForSequenceClassification, num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
        problem_type="multi_label_classification" if cfg.multi_label else "single_label_classification",
    )
    pooling = resolve_pooling(cfg.pooling, folder)
    set_pooling(model, pooling)
    warning = hf_mismatch_warning(model.config.model_type, pooling)
    if warning:
        note(f"WARNING: {warning}")
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
            "multi_label": cfg.multi_label, "text_pair": bool(cfg.text_pair_column), "text_column": text_col,
            "label_column": cfg.label_column, **({"text_pair_column": cfg.text_pair_column} if cfg.text_pair_column else {}),
            "hf_compatible": warning is None,
            **({"warning": warning} if warning else {})}
    return TaskRun(model, loss_fn, source, evaluate, primary, save, card, num_train=len(rows))


def evaluate_folder(folder: ModelFolder, tokenizer, data: str | Path, cfg: Any, engine: Engine | None = None) -> dict[str, float]:
    """Metrics of a saved classifier on a labelled file; ``engine`` (default: the folder's torch model)
    is what computes the logits, e.g. ONNX Runtime on its export (the compression measurer)."""
    if engine is None:
        engine = ModuleEngine(folder.load(task="classify"), ["logits"])
    names = folder.labels
    multi = folder.config.get("problem_type") == "multi_label_classification"
    cfg = dataclasses.replace(cfg, multi_label=multi)
    texts, pairs, labels, where, _ = read_examples(data, cfg, folder.card.get("text_column"))
    texts, pairs, labels = _subset(cfg.max_examples, cfg.seed, texts, pairs, labels)
    check_labels(set(names), [x for items in labels for x in items], [w for w, items in zip(where, labels, strict=False) for _ in items])
    rows = featurize(tokenizer, texts, pairs, folder.card.get("max_length", cfg.max_length or DEFAULT_MAX_LENGTH))
    logits = engine_logits(engine, rows, tokenizer.pad_token_id, cfg.batch_size)
    return {**scores(logits, _targets(labels, names, multi), multi), "examples": len(rows)}


def _subset(limit: int, seed: int, *columns):
    """The same seeded subset of rows (see :func:`seeded_subset`) from each column (None stays None)."""
    keep = seeded_subset(list(range(len(columns[0]))), limit, seed)
    return tuple(None if c is None else [c[i] for i in keep] for c in columns)
