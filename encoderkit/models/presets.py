"""Encoder architecture presets for pretraining from scratch (``small`` and ``base``: BERT-small and BERT-base
shapes; a size given explicitly overrides the preset), as a BERT, ModernBERT or DeBERTa-v3-shaped config.
"""

from __future__ import annotations

from typing import Any

from transformers import BertConfig, DebertaV2Config, ModernBertConfig

from encoderkit.errors import EncoderkitError

# name -> (layers, hidden, heads, ffn)
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 128, 2, 512),
    "mini": (4, 256, 4, 1024),
    "small": (4, 512, 8, 2048),
    "medium": (8, 512, 8, 2048),
    "base": (12, 768, 12, 3072),
}
ARCHS = ("bert", "modernbert", "deberta")


def build_config(
    preset: str | None,
    vocab_size: int,
    max_positions: int,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    ffn: int | None = None,
    arch: str = "bert",
    dropout: float = 0.1,
    special_ids: dict[str, int | None] | None = None,
) -> Any:
    """An HF config for a fresh masked-LM encoder. ``preset`` may be None when all four sizes are
    given. ``special_ids``: pad/cls/sep/mask token ids of the tokenizer (so that fill-mask and
    padding agree with it)."""
    if preset is not None and preset not in PRESETS:
        raise EncoderkitError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)} or give explicit sizes")
    base = PRESETS[preset] if preset else (None, None, None, None)
    sizes = [v if v is not None else b for v, b in zip((layers, hidden, heads, ffn), base)]
    if any(v is None for v in sizes):
        raise EncoderkitError("give --preset or all of --layers, --hidden, --heads, --ffn")
    n_layers, n_hidden, n_heads, n_ffn = (int(v) for v in sizes)  # type: ignore[arg-type]
    if n_hidden % n_heads:
        raise EncoderkitError(f"hidden size {n_hidden} is not divisible by the number of heads {n_heads}")
    ids = special_ids or {}
    if arch == "bert":
        return BertConfig(
            vocab_size=vocab_size, hidden_size=n_hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
            intermediate_size=n_ffn, max_position_embeddings=max_positions, type_vocab_size=2,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=ids.get("pad") or 0,
            architectures=["BertForMaskedLM"],
        )
    if arch == "modernbert":
        return ModernBertConfig(
            vocab_size=vocab_size, hidden_size=n_hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
            intermediate_size=n_ffn, max_position_embeddings=max_positions, pad_token_id=ids.get("pad") or 0,
            cls_token_id=ids.get("cls"), sep_token_id=ids.get("sep"), bos_token_id=ids.get("cls"),
            eos_token_id=ids.get("sep"), attention_dropout=dropout, mlp_dropout=dropout, embedding_dropout=dropout,
            architectures=["ModernBertForMaskedLM"],
        )
    if arch == "deberta":
        return DebertaV2Config(
            vocab_size=vocab_size, hidden_size=n_hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
            intermediate_size=n_ffn, max_position_embeddings=max_positions, type_vocab_size=0,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=ids.get("pad") or 0,
            relative_attention=True, max_relative_positions=-1, position_buckets=min(256, max_positions),
            pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm",
            share_att_key=True, layer_norm_eps=1e-7, legacy=False, architectures=["DebertaV2ForMaskedLM"],
        )
    raise EncoderkitError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
