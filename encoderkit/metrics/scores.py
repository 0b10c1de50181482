"""Task metrics as pure functions on labels and predictions (no model, no torch), all fractions in [0, 1]:
classification, NER (entity-level by seqeval, conlleval-compatible) and QA (the official SQuAD v1.1 EM / F1).
Retrieval metrics live in :mod:`encoderkit.metrics.ranking`.
"""

from __future__ import annotations

import re
import string
import warnings
from collections import Counter
from collections.abc import Sequence

import numpy as np

# -- classification -------------------------------------------------------------------------


def accuracy(gold: Sequence[int], pred: Sequence[int]) -> float:
    gold, pred = np.asarray(gold), np.asarray(pred)
    return float((gold == pred).mean()) if len(gold) else 0.0


def _prf(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return p, r, f


def f1_binary(gold: Sequence[int], pred: Sequence[int], positive: int = 1) -> float:
    """F1 of the ``positive`` class."""
    gold, pred = np.asarray(gold), np.asarray(pred)
    tp = int(((pred == positive) & (gold == positive)).sum())
    fp = int(((pred == positive) & (gold != positive)).sum())
    fn = int(((pred != positive) & (gold == positive)).sum())
    return _prf(tp, fp, fn)[2]


def macro_f1(gold: Sequence[int], pred: Sequence[int], num_classes: int | None = None) -> float:
    """Unweighted mean of per-class F1 over the classes that occur in gold or predictions
    (or over ``range(num_classes)`` when given)."""
    gold, pred = np.asarray(gold), np.asarray(pred)
    classes = range(num_classes) if num_classes else sorted(set(gold.tolist()) | set(pred.tolist()))
    scores = [f1_binary(gold, pred, positive=c) for c in classes]
    return float(np.mean(scores)) if scores else 0.0


def classification_scores(gold: Sequence[int], pred: Sequence[int], num_classes: int) -> dict[str, float]:
    """accuracy and macro_f1; plus f1 (of class 1) for two classes."""
    out = {"accuracy": accuracy(gold, pred), "macro_f1": macro_f1(gold, pred, num_classes)}
    if num_classes == 2:
        out["f1"] = f1_binary(gold, pred)
    return out


def multilabel_scores(gold: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """gold, pred: 0/1 arrays (N, C). Subset accuracy, micro-F1 and macro-F1 over the C labels."""
    gold, pred = np.asarray(gold).astype(bool), np.asarray(pred).astype(bool)
    tp = int((gold & pred).sum())
    fp = int((~gold & pred).sum())
    fn = int((gold & ~pred).sum())
    per_label = [_prf(int((gold[:, c] & pred[:, c]).sum()), int((~gold[:, c] & pred[:, c]).sum()),
                      int((gold[:, c] & ~pred[:, c]).sum()))[2] for c in range(gold.shape[1])]
    return {"subset_accuracy": float((gold == pred).all(axis=1).mean()) if len(gold) else 0.0,
            "micro_f1": _prf(tp, fp, fn)[2], "macro_f1": float(np.mean(per_label)) if per_label else 0.0}


# -- NER ------------------------------------------------------------------------------------


def entity_scores(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity-level precision, recall and F1 (micro over all types) from IOB2 tags per sentence,
    plus ``f1_<TYPE>`` per entity type, computed by seqeval (its default, conlleval-compatible mode)."""
    from seqeval.metrics import (  # noqa: PLC0415 - seqeval imports sklearn and scipy (seconds); only NER needs it
        classification_report,
        f1_score,
        precision_score,
        recall_score,
    )

    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences but {len(pred)} predicted")
    for i, (g, p) in enumerate(zip(gold, pred, strict=True)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold tags but {len(p)} predicted")
    y_true, y_pred = [list(g) for g in gold], [list(p) for p in pred]
    out = {"precision": float(precision_score(y_true, y_pred, zero_division=0)),
           "recall": float(recall_score(y_true, y_pred, zero_division=0)),
           "f1": float(f1_score(y_true, y_pred, zero_division=0))}
    with warnings.catch_warnings():  # a type seen only in the predictions has no support: its F1 is 0
        warnings.simplefilter("ignore")
        report = classification_report(y_true, y_pred, output_dict=True, zero_division=0)
    for kind, row in sorted(report.items()):
        if not kind.endswith(" avg"):
            out[f"f1_{kind}"] = float(row["f1-score"])
    return out


# -- SQuAD ----------------------------------------------------------------------------------

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """The official SQuAD v1.1 normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def squad_exact(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_f1(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean over questions of the best exact match / F1 against that question's gold answers."""
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions for {len(golds)} questions")
    em = [max(squad_exact(p, g) for g in gs) for p, gs in zip(predictions, golds, strict=True)]
    f1 = [max(squad_f1(p, g) for g in gs) for p, gs in zip(predictions, golds, strict=True)]
    return {"exact_match": float(np.mean(em)) if em else 0.0, "f1": float(np.mean(f1)) if f1 else 0.0}
