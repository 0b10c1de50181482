"""Rebuild a runnable fp32 model (:func:`rebuild_model`, called by ``ModelFolder.load``) from a folder plain
``transformers`` cannot load alone; the writing side is :mod:`encoderkit.compress.packing`.

- quantized: no ``model.safetensors`` (so transformers fails loudly); ``model.quantized.safetensors`` holds per
  matrix ``name.qweight`` (int8 codes, or uint8 with two 4-bit codes per byte, low nibble = even column),
  ``name.scale`` (float16 (out, groups)), ``name.zero`` (asymmetric only), ``name.g_idx`` (GPTQ act_order only);
  ``config.json``'s ``encoderkit_quantization`` gives method, bits and each matrix's settings.
- head-pruned: ``config.json``'s ``encoderkit_heads`` lists the heads kept per layer.
- sparse-packed: ``config.json``'s ``encoderkit_sparse``; ``model.sparse.safetensors`` holds the pruned matrices
  packed (:mod:`encoderkit.models.sparse`), unpacked exactly here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from encoderkit.errors import EncoderkitError
from encoderkit.models.anatomy import anatomy_of
from encoderkit.models.sparse import SPARSE_KEY, read_weights

QUANT_FILE = "model.quantized.safetensors"
QUANT_KEY = "encoderkit_quantization"
HEADS_KEY = "encoderkit_heads"


@dataclass
class QuantSpec:
    """How one matrix is quantized: ``bits`` (4/8), ``group_size`` (-1 = whole row), ``symmetric``."""

    bits: int = 8
    group_size: int = -1
    symmetric: bool = True

    def qrange(self) -> tuple[int, int]:
        """Smallest and largest integer code."""
        if self.symmetric:
            m = 2 ** (self.bits - 1) - 1
            return -m, m
        return 0, 2 ** self.bits - 1


@dataclass
class QTensor:
    """Integer codes ``q (out, in)`` (int32 values), ``scale/zero (out, n_groups)``, ``g_idx (in,)``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None
    spec: QuantSpec

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix ``(out, in)`` these codes stand for."""
        g = self.g_idx if self.g_idx is not None else default_g_idx(self.q.shape[1], self.spec.group_size)
        scale = self.scale.float()[:, g]
        zero = self.zero.float()[:, g] if self.zero is not None else 0.0
        return (self.q.float() - zero) * scale


def default_g_idx(in_features: int, group_size: int) -> torch.Tensor:
    """Group index of each input column when groups are consecutive: ``(in,)`` int64."""
    if group_size <= 0:
        return torch.zeros(in_features, dtype=torch.long)
    return torch.arange(in_features) // group_size


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Two 4-bit codes per byte back to codes: ``uint8 (out, ceil(in/2))`` -> ``int32 (out, in)`` in [0, 15]."""
    lo = (packed & 0x0F).to(torch.int32)
    hi = (packed >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=2).reshape(packed.shape[0], -1)[:, :in_features]


def from_storage(name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> QTensor:
    """Rebuild the :class:`QTensor` of ``name`` from its safetensors entries and its metadata."""
    spec = QuantSpec(meta["bits"], meta["group_size"], meta["symmetric"])
    in_f = meta["shape"][1]
    stored = tensors[f"{name}.qweight"]
    if spec.bits == 8:
        q = stored.to(torch.int32)
    else:
        q = unpack_int4(stored, in_f) - (8 if spec.symmetric else 0)
    zero = tensors.get(f"{name}.zero")
    g_idx = tensors.get(f"{name}.g_idx")
    return QTensor(q, tensors[f"{name}.scale"].float(), zero.float() if zero is not None else None,
                   g_idx.long() if g_idx is not None else None, spec)


def encoder_layers(model: torch.nn.Module, stage: str = "") -> list[torch.nn.Module]:
    """The transformer blocks of ``model``, found through its family's :class:`~encoderkit.models.anatomy.Anatomy`.
    A family without an anatomy entry is refused naming it and ``stage`` (the command that needs the blocks, e.g.
    ``prune --method ffn``)."""
    return anatomy_of(model, stage).blocks(model)


def slice_linear(lin: torch.nn.Linear, idx: torch.Tensor, dim: int) -> torch.nn.Linear:
    """A new Linear keeping ``idx`` of the output rows (``dim=0``) or of the input columns (``dim=1``)."""
    w = lin.weight.detach().index_select(dim, idx).clone()
    new = torch.nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None, dtype=w.dtype)
    new.weight.data.copy_(w)
    if lin.bias is not None:
        new.bias.data.copy_(lin.bias.detach()[idx] if dim == 0 else lin.bias.detach())
    return new


def shrink_heads(model: torch.nn.Module, heads_per_layer: list[list[int]], head_size: int) -> None:
    """Cut every block's self-attention down to the heads it keeps (indices among the block's current heads).

    The Q/K/V projections (separate, or one fused ``Wqkv``) lose the output rows of the removed heads, the attention
    output Linear its input columns; where the block's forward reads a head count, it is updated (the anatomy says).
    """
    anatomy = anatomy_of(model, "prune --method heads")
    for block, keep in zip(anatomy.blocks(model), heads_per_layer):
        for path, rows in anatomy.head_rows(block, keep, head_size).items():
            block.set_submodule(path, slice_linear(block.get_submodule(path), rows, dim=0))
        for path, cols in anatomy.head_columns(keep, head_size).items():
            block.set_submodule(path, slice_linear(block.get_submodule(path), cols, dim=1))
        anatomy.set_heads(block, len(keep), head_size)


def rebuild_model(folder: Path, cls: Any, weights: Path, quant: dict[str, Any] | None,
                  heads: list[list[int]] | None, kwargs: dict[str, Any]) -> torch.nn.Module:
    """A model of class ``cls`` rebuilt from a quantized, head-pruned or sparse-packed folder's records: the
    config's shape, the kept heads, and ``weights`` (quantized matrices dequantized to fp32, packed ones unpacked).
    Called by :meth:`encoderkit.models.folder.ModelFolder.load`, which has read those records."""
    config = AutoConfig.from_pretrained(folder, **kwargs)
    for key in (QUANT_KEY, HEADS_KEY, SPARSE_KEY):  # a model saved again is written by its own stage's rules
        config.__dict__.pop(key, None)
    model = cls.from_config(config, **kwargs) if cls.__name__.startswith("Auto") else cls(config)
    if heads is not None:
        shrink_heads(model, heads, anatomy_of(model).head_size(config))
        model.config.__dict__[HEADS_KEY] = heads  # kept, so saving the model again keeps its shape
    tensors = read_weights(weights)
    state = {k: v for k, v in tensors.items() if not k.rsplit(".", 1)[-1] in ("qweight", "scale", "zero", "g_idx")}
    for name, meta in (quant or {}).get("layers", {}).items():
        state[name] = from_storage(name, tensors, meta).dequantize()
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    tied = {k for k, _ in model.named_parameters(remove_duplicate=False)} - {k for k, _ in model.named_parameters()}
    missing = [k for k in missing if k not in tied and not k.endswith("position_ids")]
    if missing or unexpected:
        raise EncoderkitError(f"{weights}: weights do not match the config (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}); the folder was not written by this version of encoderkit")
    return model
