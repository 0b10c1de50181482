"""Low-bit weight storage (INT8 / packed INT4 with scales and zero points): the writing side.

The reading side and the loader live in :mod:`encoderkit.models.rebuild` and :mod:`encoderkit.models.folder`, so
the deploy layer can load these folders too; they are re-exported here for the levers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import load_model, read_config  # noqa: F401 -- the one loader, re-exported for the levers
from encoderkit.models.folder_files import copy_side_files
from encoderkit.models.rebuild import (  # noqa: F401 -- re-exported for the levers and their tests
    HEADS_KEY,
    QUANT_FILE,
    QUANT_KEY,
    QTensor,
    QuantSpec,
    default_g_idx,
    from_storage,
    shrink_heads,
    unpack_int4,
)
from encoderkit.models.sparse import SPARSE_FILE


def scale_zero(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) that map the rows of ``w (out, k)`` onto the integer grid: ``(out,)`` each.

    Scales are rounded to float16, the precision they are stored in, so that quantizing and
    dequantizing agree exactly.
    """
    lo, hi = spec.qrange()
    if spec.symmetric:
        amax = w.abs().amax(dim=1)
        return _stored_scale(amax / hi), None
    wmin = w.amin(dim=1).clamp(max=0)
    wmax = w.amax(dim=1).clamp(min=0)
    scale = _stored_scale((wmax - wmin) / hi)
    zero = torch.round(-wmin / scale).clamp(lo, hi)
    return scale, zero


def _stored_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` rounded to float16; a scale fp16 cannot hold (an all-zero row or group, or one
    below 6e-8) becomes 1, so codes stay finite and dequantize to the zeros they came from."""
    s = scale.half().float()
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Integer codes of ``w (out, k)`` with per-row ``scale``/``zero`` ``(out,)``; returns ``(out, k)`` float."""
    lo, hi = spec.qrange()
    z = zero[:, None] if zero is not None else 0.0
    return torch.clamp(torch.round(w / scale[:, None]) + z, lo, hi)


def rtn_quantize(w: torch.Tensor, spec: QuantSpec) -> QTensor:
    """Round-to-nearest quantization of ``w (out, in)`` with groups of ``spec.group_size`` columns."""
    w = w.detach().float()
    in_f = w.shape[1]
    gs = in_f if spec.group_size <= 0 else spec.group_size
    q = torch.empty_like(w)
    scales, zeros = [], []
    for start in range(0, in_f, gs):
        block = w[:, start:start + gs]
        s, z = scale_zero(block, spec)
        q[:, start:start + gs] = quantize_codes(block, s, z, spec)
        scales.append(s)
        zeros.append(z)
    scale = torch.stack(scales, dim=1)
    zero = torch.stack(zeros, dim=1) if not spec.symmetric else None
    return QTensor(q.to(torch.int32), scale, zero, None, spec)


# -- bytes -----------------------------------------------------------------------------------
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: ``codes (out, in)`` in [0, 15] -> ``uint8 (out, ceil(in/2))``."""
    c = codes.to(torch.uint8)
    if c.shape[1] % 2:
        c = torch.cat([c, torch.zeros(c.shape[0], 1, dtype=torch.uint8)], dim=1)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def to_storage(name: str, qt: QTensor) -> dict[str, torch.Tensor]:
    """The safetensors entries of one quantized matrix (the format of :mod:`encoderkit.models.rebuild`)."""
    q = qt.q
    if qt.spec.bits == 8:
        stored = q.to(torch.int8) if qt.spec.symmetric else q.to(torch.uint8)
    elif qt.spec.bits == 4:
        stored = pack_int4(q + 8 if qt.spec.symmetric else q)
    else:
        raise EncoderkitError(f"{name}: {qt.spec.bits}-bit storage is not supported (use 4 or 8)")
    out = {f"{name}.qweight": stored.contiguous(), f"{name}.scale": qt.scale.half().contiguous()}
    if qt.zero is not None:
        out[f"{name}.zero"] = qt.zero.to(torch.uint8).contiguous()
    if qt.g_idx is not None:
        out[f"{name}.g_idx"] = qt.g_idx.to(torch.int32).contiguous()
    return out


def save_quantized(model: torch.nn.Module, src_dir: Path, out: Path, qtensors: dict[str, QTensor],
                   info: dict[str, Any]) -> None:
    """Write ``model`` to ``out`` with the matrices in ``qtensors`` (state-dict names) stored low-bit."""
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for key, t in state.items():
        if t.data_ptr() in seen:  # tied weight (e.g. the MLM decoder): stored once, re-tied at load
            continue
        seen[t.data_ptr()] = key
        if key in qtensors:
            tensors.update(to_storage(key, qtensors[key]))
        else:
            tensors[key] = t.detach().contiguous()
    save_file(tensors, str(out / QUANT_FILE), metadata={"format": "pt", "encoderkit": "quantized"})
    layers = {k: {"bits": v.spec.bits, "group_size": v.spec.group_size, "symmetric": v.spec.symmetric,
                  "shape": list(v.q.shape)} for k, v in qtensors.items()}
    model.config.__dict__[QUANT_KEY] = {**info, "layers": layers}
    model.config.save_pretrained(out)
    del model.config.__dict__[QUANT_KEY]
    copy_side_files(src_dir, out)


# -- loading ---------------------------------------------------------------------------------
def is_quantized(folder: str | Path) -> bool:
    """True when ``folder`` holds an encoderkit-quantized model or only an INT8 ONNX graph.

    A folder with fp32 weights *and* an exported ``model.int8.onnx`` beside them is not: its
    weights can still be quantized.
    """
    folder = Path(folder)
    onnx_only = (folder / "model.int8.onnx").is_file() and not any(
        (folder / name).is_file() for name in ("model.safetensors", SPARSE_FILE))
    return QUANT_KEY in read_config(folder) or (folder / QUANT_FILE).is_file() or onnx_only
