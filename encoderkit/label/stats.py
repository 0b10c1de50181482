"""Accuracy with a Wilson score interval, and the confusion table, on audited items."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval (95% by default) for ``k`` successes out of ``n`` (Wilson 1927)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def agreement(gold: Sequence[str], pred: Sequence[str | None], labels: Sequence[str]) -> dict[str, Any]:
    """``accuracy``, ``ci_low``/``ci_high`` (Wilson 95%), ``n`` and ``confusion[gold][pred]`` (a missing
    prediction counts as wrong, under the column ``unlabeled``), plus per-class recall and precision."""
    n = len(gold)
    k = sum(g == p for g, p in zip(gold, pred, strict=True))
    lo, hi = wilson(k, n)
    cols = [*labels, "unlabeled"] if any(p is None for p in pred) else list(labels)
    confusion = {g: dict.fromkeys(cols, 0) for g in labels}
    for g, p in zip(gold, pred, strict=True):
        confusion[g]["unlabeled" if p is None else p] += 1
    per_class = {}
    for c in labels:
        row = sum(confusion[c].values())
        col = sum(confusion[g][c] for g in labels)
        per_class[c] = {"gold": row, "recall": round(confusion[c][c] / row, 4) if row else None,
                        "precision": round(confusion[c][c] / col, 4) if col else None}
    return {"n": n, "correct": k, "accuracy": round(k / n, 4) if n else None, "ci_low": round(lo, 4),
            "ci_high": round(hi, 4), "confusion": confusion, "per_class": per_class}
