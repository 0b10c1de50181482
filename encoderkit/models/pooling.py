"""Mean pooling for the sequence-classification head (``finetune --task classify --pooling mean``).

Hugging Face's ``BertForSequenceClassification`` classifies the pooler's output: dense + tanh of
the first token's last hidden state. A sentence-transformers checkpoint (all-MiniLM-L6-v2) was
trained to put the sentence's meaning in the *mean* of its tokens instead, so its first token is
a poor summary. With mean pooling, the pooler's dense + tanh read the mean of the real (not
padding) tokens' hidden states; every weight keeps its name, so the folder still loads in
``AutoModelForSequenceClassification``.

The choice is stored in ``config.json`` as ``classifier_pooling: "mean"``, the key ModernBERT's own
classifier reads (for ModernBERT nothing else is needed). For BERT-style models plain
``transformers`` ignores the key and would pool the first token, so call :func:`apply_pooling`
after ``from_pretrained``; every encoderkit loader does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from encoderkit.errors import EncoderkitError

KEY = "classifier_pooling"


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden (B, T, H), mask (B, T) -> (B, H) mean over real tokens or the first token."""
    if pooling == "first":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def pool_array(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """:func:`pool` in numpy on one thread, for an engine's float32 outputs: torch's reduction wakes its thread
    pool, which then fights ONNX Runtime's spinning threads for the cores (on 2 cores that made pooling a quarter
    of a short-sentence run: bench/embed_peers.py)."""
    if pooling == "first":
        return np.ascontiguousarray(hidden[:, 0])
    m = mask.astype(np.float32)
    return np.einsum("bt,bth->bh", m, hidden) / np.maximum(m.sum(1, keepdims=True), 1e-9)


class MaskedMeanPooler(nn.Module):
    """BERT's pooler (``dense`` then ``activation``, the same weights) over the mean of the real tokens."""

    def __init__(self, pooler: nn.Module) -> None:
        super().__init__()
        self.dense = pooler.dense
        self.activation = pooler.activation
        self.mask: torch.Tensor | None = None  # set by the base model's forward pre-hook

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mask, self.mask = self.mask, None
        mean = hidden_states.mean(dim=1) if mask is None else pool(hidden_states, mask, "mean")
        return self.activation(self.dense(mean))


def _remember_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    pooler = getattr(module, "pooler", None)
    if isinstance(pooler, MaskedMeanPooler):
        pooler.mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)


def set_pooling(model: nn.Module, pooling: str) -> None:
    """Make ``model``'s classifier pool by ``pooling`` ('first' or 'mean') and record it in its config."""
    if pooling not in ("first", "mean"):
        raise EncoderkitError(f"unknown classifier pooling {pooling!r}; use 'first' or 'mean'")
    model.config.__dict__[KEY] = "cls" if pooling == "first" and model.config.model_type == "modernbert" else pooling
    apply_pooling(model)


def apply_pooling(model: nn.Module) -> nn.Module:
    """Install the pooling ``model.config`` records (idempotent; a no-op for first-token pooling)."""
    if getattr(model.config, KEY, None) != "mean" or model.config.model_type == "modernbert":
        return model  # ModernBERT reads classifier_pooling itself
    base = model.base_model
    pooler = getattr(base, "pooler", None)
    if isinstance(pooler, MaskedMeanPooler):
        return model
    if pooler is None or not hasattr(pooler, "dense"):
        raise EncoderkitError(
            f"mean pooling for classify needs a BERT-style model whose classifier reads the pooler, or ModernBERT; "
            f"{type(model).__name__} classifies its first token. Use --pooling first")
    base.pooler = MaskedMeanPooler(pooler)
    base.register_forward_pre_hook(_remember_mask, with_kwargs=True)
    return model
