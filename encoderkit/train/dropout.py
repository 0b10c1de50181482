"""Dropout while pretraining, apart from the dropout a model keeps for whoever fine-tunes it.

A run that passes over its corpus at most once has nothing to over-fit, so dropout only slows each step and adds
noise (Cramming, Geiping & Goldstein 2022; ModernBERT pretrains without it; the measurement: docs/pretrain.md).
:func:`dropout_set` puts the model's own rates back after the block, so the written ``config.json`` keeps them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

# modules that read a float rate instead of an nn.Dropout (ModernBERT's attention)
_RATE_ATTRIBUTES = ("attention_dropout",)


def planned_passes(max_steps: int, epochs: float, global_batch: int, n_examples: int) -> float:
    """Passes over ``n_examples`` that a run of ``max_steps`` steps of ``global_batch`` makes (``epochs``
    where ``max_steps`` is 0)."""
    return max_steps * global_batch / max(1, n_examples) if max_steps > 0 else epochs


def auto_train_dropout(passes: float) -> float | None:
    """The pretraining dropout for a run of ``passes`` over its corpus: 0.0 for at most one pass, else
    None (the model's own)."""
    return 0.0 if passes <= 1.0 else None


@contextlib.contextmanager
def dropout_set(module: nn.Module, rate: float | None) -> Iterator[None]:
    """Every dropout inside ``module`` at ``rate`` within the block (None: as they are); restored after it,
    also on an error."""
    changed: list[tuple[nn.Module, str, float]] = []
    if rate is not None:
        for m in module.modules():
            if isinstance(m, nn.Dropout):
                changed.append((m, "p", m.p))
                m.p = rate
            for name in _RATE_ATTRIBUTES:
                value = getattr(m, name, None)
                if isinstance(value, float):
                    changed.append((m, name, value))
                    setattr(m, name, rate)
    try:
        yield
    finally:
        for m, name, value in reversed(changed):
            setattr(m, name, value)
