"""Load or build a masked-LM encoder, checked against the tokenizer and sequence length. A folder without an MLM
head (a sentence-transformers model, a plain ``BertModel``) gets a fresh one whose decoder is tied to the input
embeddings, so its first predictions already score tokens by similarity to the word embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForPreTraining, BertForPreTraining

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.models.mlm import mlm_layout


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


def load_encoder(folder: str | Path, vocab_size: int | None = None, seq_len: int | None = None,
                 *, pretraining: bool = False, stage: str = "pretrain", layers: int | None = None) -> nn.Module:
    """A masked-LM model from a local HF folder, with a fresh tied head if it has none.

    ``vocab_size`` (the tokenizer's ``len``) and ``seq_len`` are checked with :func:`check_fits`.
    ``pretraining``: a ``BertForPreTraining`` (MLM + next-sentence heads; BERT folders only).
    ``stage`` names the stage in the refusal of a family without a masked-LM class. ``layers``: keep
    only the first N encoder layers (the checkpoint's layers above N are not loaded)."""
    mf = ModelFolder.open(folder, tokenizer=False)
    try:
        config = AutoConfig.from_pretrained(mf.path)
    except (OSError, ValueError, KeyError) as e:
        raise EncoderkitError(f"{mf.path}/config.json could not be read as a model config ({e})") from e
    check_fits(config, vocab_size if vocab_size is not None else 0, seq_len, str(mf.path))
    if layers is not None:
        have = int(config.num_hidden_layers)
        if not 1 <= layers <= have:
            raise EncoderkitError(f"{stage}: --layers {layers} asks for more layers than {mf.path} has ({have}); "
                                  f"give 1 to {have}, or 0 for all of them")
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):  # ModernBERT: one attention type per layer
            config.layer_types = config.layer_types[:layers]
    if pretraining and config.model_type != "bert":
        raise EncoderkitError(f"{folder}: pretrain --objective mlm+nsp needs a BERT model (next-sentence prediction "
                              f"is BERT's pretraining head); this folder holds a {config.model_type} model: "
                              "use --objective mlm")
    has_head = any(a.endswith("ForMaskedLM") or a == "BertForPreTraining" for a in (config.architectures or []))
    if config.model_type == "deberta-v2" and any(k.startswith("lm_predictions.") for k in weight_names(mf.path)):
        # DeBERTa-v2/v3 checkpoints (microsoft/deberta-v3-*) keep their MLM head as `lm_predictions`, which
        # transformers only loads with legacy=False; their config.json does not say so (the default is legacy)
        config.legacy, has_head = False, True
    model_class = BertForPreTraining if pretraining else AutoModelForMaskedLM
    try:  # a missing head is named in one line by ModelFolder.load, then made here
        model = mf.load(model_class, config=config, dtype=torch.float32)
    except EncoderkitError as e:
        if not isinstance(e.__cause__, ValueError):
            raise
        raise EncoderkitError(
            f"{stage}: {folder} holds a {config.model_type} model, and {config.model_type} has no masked-LM model "
            f"class in transformers, so it cannot be trained or scored with MLM; use an encoder family with one "
            f"(bert, roberta, deberta-v2, electra, distilbert, modernbert...) ({e.__cause__})") from e
    if not has_head:
        init_fresh_head(model)
    model.config.architectures = [type(model).__name__]
    return model


def weight_names(folder: str | Path) -> list[str]:
    """The tensor names in a folder's safetensors weights (read from the headers; [] without them)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    if not (folder / "model.safetensors").is_file():
        return []
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return list(f.keys())


def init_fresh_head(model: nn.Module) -> None:
    """BERT's init for the head transform, zero output biases, and the decoder tied to the
    input embeddings (a fresh untied decoder would start from noise). Every head layout of
    :func:`encoderkit.models.mlm.mlm_layout` (the NSP classifier of a ``BertForPreTraining``
    keeps transformers' own init)."""
    layout = mlm_layout(model)
    std = getattr(model.config, "initializer_range", 0.02)
    for part in layout.modules:
        for m in part.modules():
            if isinstance(m, nn.Linear) and m is not layout.decoder:
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                if m.bias is not None:  # ModernBERT's norms have none
                    nn.init.zeros_(m.bias)
            bias = m._parameters.get("bias")  # output biases held beside the decoder (BERT, DeBERTa-v2)
            if bias is not None and not isinstance(m, nn.LayerNorm):
                with torch.no_grad():
                    bias.zero_()
    if layout.decoder is not None:
        layout.decoder.weight = model.get_input_embeddings().weight
        if layout.decoder.bias is not None:
            with torch.no_grad():
                layout.decoder.bias.zero_()
    model.config.tie_word_embeddings = True


def build_encoder(config: Any, seed: int, *, pretraining: bool = False) -> nn.Module:
    """A freshly initialised masked-LM model for ``config``; the init depends only on ``seed``
    (the caller's global RNG is left as it was). ``pretraining``: a ``BertForPreTraining``
    (MLM + next-sentence heads) for a BERT config."""
    if pretraining and config.model_type != "bert":
        raise EncoderkitError(f"pretrain --objective mlm+nsp needs --arch bert (next-sentence prediction is BERT's "
                              f"pretraining head), got {config.model_type}; use --objective mlm")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if pretraining:
            config.architectures = ["BertForPreTraining"]
            model = AutoModelForPreTraining.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForMaskedLM.from_config(config, dtype=torch.float32)
    return model
