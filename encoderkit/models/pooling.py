"""Pooling: how a text's token vectors become one vector, and which token a classifier reads.

This module owns the pooling vocabulary (:data:`POOLINGS`, ``cls`` read as ``first``), the defaults of each
kind of head (:data:`DEFAULTS`; a head's kind is :attr:`encoderkit.models.heads.Head.pooling`), what a
folder records (a sequence classifier's ``config.json`` ``classifier_pooling``; an embedding's card and
sentence-transformers ``1_Pooling/config.json``) and the one rule for a folder's recorded pooling against
``--pooling`` (:func:`resolve_pooling`, :func:`task_pooling`). Everything else asks it.

Mean pooling for the sequence-classification head (``finetune --task classify --pooling mean``):
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
from encoderkit.models.card import CARD
from encoderkit.models.heads import CLASSIFIER, HEADS, SENTENCE
from encoderkit.progress import note

KEY = "classifier_pooling"  # where a sequence classifier's config.json records its pooling
FIRST, MEAN = "first", "mean"
POOLINGS = (FIRST, MEAN)  # the one vocabulary: the first token ([CLS]) or the mean of the real tokens
ALIASES = {"cls": FIRST}  # older cards; ModernBERT's classifier_pooling
AUTO = "auto"  # --pooling auto: the folder's own, else the head's default
FLAG_CHOICES = (AUTO, MEAN, FIRST)  # what --pooling takes
# the kinds of pooling a folder records: a head's (Head.pooling: CLASSIFIER, SENTENCE), and a static embedding's
STATIC = "static"  # a static (model2vec) embedding: the mean of its token vectors
DEFAULTS = {CLASSIFIER: FIRST, SENTENCE: MEAN, STATIC: MEAN}
# why a saved model of this kind cannot be scored with another pooling than the one it records
FIXED = {CLASSIFIER: f"its classifier was trained on it (config.json {KEY})",
         STATIC: "a static embedding is the mean of its token vectors"}


def pooling_name(value: Any, where: str) -> str:
    """``value`` in the one pooling vocabulary (:data:`POOLINGS`); 'cls' is an alias of 'first'."""
    name = ALIASES.get(str(value), str(value))
    if name not in POOLINGS:
        raise EncoderkitError(f"{where}: pooling {value!r} is not supported; use {' or '.join(map(repr, POOLINGS))}")
    return name


def default_pooling(head_kind: str) -> str:
    """The pooling of a head of ``head_kind`` (:data:`CLASSIFIER`, :data:`SENTENCE`, :data:`STATIC`) recording none."""
    return DEFAULTS[head_kind]


def resolve_pooling(recorded: str | None, asked: str | None, *, head_kind: str, scoring: bool = False,
                    where: str = "the model") -> str:
    """The one rule for a folder's ``recorded`` pooling against ``--pooling`` ``asked``.

    ``asked`` ('first' or 'mean') wins; not asked (None, '' or 'auto'): ``recorded``, else the default of
    ``head_kind`` (:data:`DEFAULTS`). Training a new head (``scoring`` False) takes what is asked silently: the
    result is recorded with the model. ``scoring`` a saved model (``evaluate``) with another pooling than it
    records: an embedding is pooled as asked, with a note; a classifier or a static embedding
    (:data:`FIXED`) is refused, naming ``where``."""
    if asked in (None, "", AUTO):
        return recorded or default_pooling(head_kind)
    name = pooling_name(asked, "--pooling")
    if not scoring or recorded is None or name == recorded:
        return name
    if head_kind in FIXED:
        raise EncoderkitError(f"{where} records {recorded} pooling and {FIXED[head_kind]}: it cannot be scored "
                              f"with --pooling {name}; drop --pooling, or fine-tune a model with --pooling {name}")
    note(f"{where}: pooling with --pooling {name}, not the {recorded} pooling it records (and that predict, "
         "index and serve use)")
    return name


def task_pooling(folder: Any, task: str, asked: str | None = None, *, scoring: bool = False) -> str | None:
    """The pooling ``task`` uses on ``folder`` (a :class:`~encoderkit.models.folder.ModelFolder`) when
    ``--pooling`` is ``asked``: :func:`resolve_pooling` with the pooling the folder records when it already is
    a ``task`` model (a mean-pooled embedding is not a mean-pooled classifier), for the kind of head
    ``task`` has. None for a task whose head pools nothing (ner, qa, mlm, sparse), where asking is refused."""
    head_kind = HEADS[task].pooling
    if head_kind is None:
        if asked not in (None, "", AUTO):
            raise EncoderkitError(f"--pooling {asked}: a {task} model pools nothing (only embed, classify, rerank "
                                  "and multilabel models do); drop the flag")
        return None
    if head_kind == SENTENCE and getattr(folder, "static_weights", None) is not None:
        head_kind = STATIC
    recorded = folder.pooling if folder.task == task else None
    return resolve_pooling(recorded, asked, head_kind=head_kind, scoring=scoring,
                           where=f"{folder.task} model {folder.path}")


def recorded_pooling(head_kind: str | None, path: Any, config: dict[str, Any], card: dict[str, Any],
                     st_pooling: dict[str, Any] | None) -> str | None:
    """The pooling the folder at ``path`` records for its kind of head: a :data:`CLASSIFIER` its ``config.json``
    ``classifier_pooling`` (first by default); a :data:`SENTENCE` embedding its card's ``pooling``, else its
    sentence-transformers pooling module ``st_pooling`` (``1_Pooling/config.json``), else mean; a
    :data:`STATIC` one mean; None for a head that pools nothing."""
    if head_kind == CLASSIFIER:
        value = config.get(KEY)
        return pooling_name(value, f"{path}/config.json {KEY}") if value else default_pooling(CLASSIFIER)
    if head_kind == SENTENCE:
        pooling = None if st_pooling is None else st_config_pooling(st_pooling, f"{path}/1_Pooling/config.json")
        if card.get("pooling"):
            pooling = pooling_name(card["pooling"], f"{path}/{CARD}")
        return pooling or default_pooling(SENTENCE)
    return default_pooling(STATIC) if head_kind == STATIC else None


def st_config_pooling(config: dict[str, Any], where: str) -> str:
    """'first' / 'mean' from a sentence-transformers pooling module's config."""
    if config.get("pooling_mode_cls_token"):
        return FIRST
    if config.get("pooling_mode_mean_tokens", True):
        return MEAN
    raise EncoderkitError(f"{where}: only mean and first-token (cls) pooling are supported")


def st_pooling_config(pooling: str, hidden: int) -> dict[str, Any]:
    """A sentence-transformers pooling module's config (``1_Pooling/config.json``) pooling by ``pooling``."""
    return {"word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == FIRST,
            "pooling_mode_mean_tokens": pooling == MEAN, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False}


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden (B, T, H), mask (B, T) -> (B, H) mean over real tokens or the first token."""
    if pooling == FIRST:
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def pool_array(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """:func:`pool` in numpy on one thread, for an engine's float32 outputs: torch's reduction wakes its thread
    pool, which then fights ONNX Runtime's spinning threads for the cores (bench/embed_peers.py)."""
    if pooling == FIRST:
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
        mean = hidden_states.mean(dim=1) if mask is None else pool(hidden_states, mask, MEAN)
        return self.activation(self.dense(mean))


def _remember_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    pooler = getattr(module, "pooler", None)
    if isinstance(pooler, MaskedMeanPooler):
        pooler.mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)


def set_pooling(model: nn.Module, pooling: str) -> None:
    """Make ``model``'s classifier pool by ``pooling`` ('first' or 'mean') and record it in its config."""
    pooling = pooling_name(pooling, "classifier")
    model.config.__dict__[KEY] = "cls" if pooling == FIRST and model.config.model_type == "modernbert" else pooling
    apply_pooling(model)


def apply_pooling(model: nn.Module) -> nn.Module:
    """Install the pooling ``model.config`` records (idempotent; a no-op for first-token pooling)."""
    if getattr(model.config, KEY, None) != MEAN or model.config.model_type == "modernbert":
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
