"""Load or build a masked-LM encoder, checking it against the tokenizer and sequence length.

:func:`load_encoder` continues from any local HF encoder folder. A folder without an MLM head
(a sentence-transformers model such as all-MiniLM-L6-v2, or a plain ``BertModel``) gets a fresh
``BertForMaskedLM``-style head: the transform initialised like BERT's (normal(0, 0.02) weights,
unit LayerNorm, zero biases) and the decoder tied to the input embeddings, so the first
predictions already score tokens by similarity to the word embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder


def check_fits(config: Any, vocab_size: int, seq_len: int | None, source: str) -> None:
    """Refuse a tokenizer with more ids than the model's embeddings, and blocks longer than its
    position table."""
    if vocab_size > config.vocab_size:
        raise EncoderkitError(
            f"{source}: the tokenizer has {vocab_size} tokens but the model's embeddings hold only "
            f"{config.vocab_size}; use the model's own tokenizer (or a from-scratch --preset with this tokenizer)"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if seq_len is not None and limit is not None and seq_len > limit:
        raise EncoderkitError(
            f"{source}: sequence length {seq_len} is beyond the model's {limit} positions "
            f"(max_position_embeddings); prepare the data with --seq-len {limit} or less"
        )


def load_encoder(folder: str | Path, vocab_size: int | None = None, seq_len: int | None = None) -> nn.Module:
    """A masked-LM model from a local HF folder, with a fresh tied head if it has none.

    ``vocab_size`` (the tokenizer's ``len``) and ``seq_len`` are checked with :func:`check_fits`."""
    from transformers import AutoConfig, AutoModelForMaskedLM

    mf = ModelFolder.open(folder, tokenizer=False)
    try:
        config = AutoConfig.from_pretrained(mf.path)
    except (OSError, ValueError, KeyError) as e:
        raise EncoderkitError(f"{mf.path}/config.json could not be read as a model config ({e})") from e
    check_fits(config, vocab_size if vocab_size is not None else 0, seq_len, str(mf.path))
    has_head = any(a.endswith("ForMaskedLM") for a in (config.architectures or []))
    model = mf.load(AutoModelForMaskedLM, dtype=torch.float32)  # a missing head is named in one line, then made here
    if not has_head:
        init_fresh_head(model)
    model.config.architectures = [type(model).__name__]
    return model


def init_fresh_head(model: nn.Module) -> None:
    """BERT's init for the head transform, a zero decoder bias, and the decoder tied to the
    input embeddings (a fresh untied decoder would start from noise)."""
    head = getattr(model, "cls", None) or getattr(model, "lm_head", None)
    if head is None:
        return
    std = getattr(model.config, "initializer_range", 0.02)
    for m in head.modules():
        if isinstance(m, nn.Linear) and m is not model.get_output_embeddings():
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    out = model.get_output_embeddings()
    out.weight = model.get_input_embeddings().weight
    with torch.no_grad():
        bias = getattr(out, "bias", None)
        if bias is not None:
            bias.zero_()
    model.config.tie_word_embeddings = True


def build_encoder(config: Any, seed: int) -> nn.Module:
    """A freshly initialised masked-LM model for ``config``; the init depends only on ``seed``
    (the caller's global RNG is left as it was)."""
    from transformers import AutoModelForMaskedLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForMaskedLM.from_config(config, dtype=torch.float32)
    return model
