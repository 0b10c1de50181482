"""Multilabel decoding: logits (N, C) -> a sigmoid probability per label, the labels over their
thresholds, and the per-label thresholds picked on dev data. Pure numpy (featurising is classify's
:func:`encoderkit.tasks.classify.features.featurize`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from encoderkit.metrics.scores import f1_binary, multilabel_scores

DEFAULT_THRESHOLD = 0.5
GRID = np.round(np.arange(0.05, 0.951, 0.05), 2)  # 0.05, 0.10, ..., 0.95


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))


def prior_log_odds(y: np.ndarray) -> np.ndarray:
    """Per label (C,), the log-odds of its frequency in targets ``y`` (N, C), smoothed by half a row each way so
    that a label on every row (or none) stays finite: the bias at which a sigmoid head starts at the prior."""
    y = np.asarray(y, dtype=np.float64)
    p = (y.sum(axis=0) + 0.5) / (y.shape[0] + 1.0)
    return np.log(p / (1.0 - p))


def choose_thresholds(probs: np.ndarray, gold: np.ndarray, grid: np.ndarray = GRID,
                      per_label: bool = False) -> np.ndarray:
    """The thresholds (C,) picked from ``grid`` on (probs, gold), both (N, C); ties go to the one nearest 0.5.

    Default: one threshold for every label, the one with the best micro-F1. For calibrated probabilities the
    threshold that maximises micro-F1 is the same for every label (half the best F1), and one threshold tuned on
    all of dev's labels is steadier than a threshold per label tuned on that label's few dev positives, which
    scores worse on held-out text once labels are many. ``per_label``: each label's own best F1 (what macro-F1
    rewards); a label absent from ``gold`` keeps 0.5 (nothing to tune it on)."""
    gold = np.asarray(gold).astype(bool)
    if not per_label:
        f1 = [multilabel_scores(gold, probs >= t)["micro_f1"] for t in grid]
        best = min(zip(f1, grid, strict=True), key=lambda ft: (-ft[0], abs(ft[1] - DEFAULT_THRESHOLD)))[1]
        return np.full(gold.shape[1], best if gold.any() else DEFAULT_THRESHOLD)
    out = np.full(gold.shape[1], DEFAULT_THRESHOLD)
    for c in range(gold.shape[1]):
        if not gold[:, c].any():
            continue
        f1 = [f1_binary(gold[:, c], probs[:, c] >= t, positive=True) for t in grid]
        out[c] = min(zip(f1, grid, strict=True), key=lambda ft: (-ft[0], abs(ft[1] - DEFAULT_THRESHOLD)))[1]
    return out


def thresholds_of(card: Mapping[str, Any], names: list[str]) -> np.ndarray:
    """The thresholds (C,) a model folder's card records per label name (0.5 for a label it does not list)."""
    saved = card.get("thresholds") or {}
    return np.asarray([float(saved.get(n, DEFAULT_THRESHOLD)) for n in names])


def scores(gold: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """micro/macro F1 and subset accuracy (:func:`~encoderkit.metrics.scores.multilabel_scores`) plus micro
    precision and recall, of 0/1 arrays (N, C)."""
    gold, pred = np.asarray(gold).astype(bool), np.asarray(pred).astype(bool)
    tp, npred, ngold = int((gold & pred).sum()), int(pred.sum()), int(gold.sum())
    return {**multilabel_scores(gold, pred), "micro_precision": tp / npred if npred else 0.0,
            "micro_recall": tp / ngold if ngold else 0.0}


def decode(logits: np.ndarray, names: list[str], thresholds: np.ndarray) -> list[dict[str, Any]]:
    """Per row of logits (N, C): the labels at or over their thresholds (most probable first) and every
    label's probability."""
    probs = sigmoid(logits)
    out = []
    for p in probs:
        over = [c for c in np.argsort(-p, kind="stable") if p[c] >= thresholds[c]]
        out.append({"labels": [names[c] for c in over], "scores": {names[c]: float(p[c]) for c in range(len(names))}})
    return out
