"""Low-bit weight storage (INT8 / packed INT4 with scales and zero points) and the model loader.

A quantized model folder keeps the standard HF files (``config.json``, tokenizer files) but its
weights live in ``model.quantized.safetensors`` (there is deliberately no ``model.safetensors``,
so plain ``transformers`` fails loudly instead of loading random weights). For a quantized
matrix ``name`` of shape ``(out, in)`` the file holds:

- ``name.qweight``: ``int8 (out, in)`` codes (8 bits), or ``uint8 (out, ceil(in/2))`` with two
  4-bit codes per byte (low nibble = even column);
- ``name.scale``: ``float16 (out, n_groups)``; ``name.zero``: ``uint8 (out, n_groups)`` only when
  asymmetric; ``name.g_idx``: ``int32 (in,)`` group of each column, only with GPTQ act_order.

``config.json`` gets an ``encoderkit_quantization`` entry (method, bits, and per-matrix
``bits/group_size/symmetric/shape``), and head-pruned models an ``encoderkit_heads`` entry (the
heads kept per layer). :func:`load_model` rebuilds a runnable fp32 HF model from any of these
(dequantized weights; with ``int8_runtime=True`` Linear layers run through ``torch.ao`` dynamic
INT8 kernels instead).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from encoderkit.errors import EncoderkitError

QUANT_FILE = "model.quantized.safetensors"
QUANT_KEY = "encoderkit_quantization"
HEADS_KEY = "encoderkit_heads"
_WEIGHT_FILES = {"model.safetensors", "pytorch_model.bin", QUANT_FILE, "config.json", "encoderkit.json", "report.json"}


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


def scale_zero(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) that map the rows of ``w (out, k)`` onto the integer grid: ``(out,)`` each.

    Scales are rounded to float16, the precision they are stored in, so that quantizing and
    dequantizing agree exactly.
    """
    lo, hi = spec.qrange()
    if spec.symmetric:
        amax = w.abs().amax(dim=1).clamp(min=1e-8)
        scale = (amax / hi).half().float()
        return scale, None
    wmin = w.amin(dim=1).clamp(max=0)
    wmax = w.amax(dim=1).clamp(min=0)
    scale = ((wmax - wmin).clamp(min=1e-8) / hi).half().float()
    zero = torch.round(-wmin / scale).clamp(lo, hi)
    return scale, zero


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


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8 (out, ceil(in/2))`` -> ``int32 (out, in)`` in [0, 15]."""
    lo = (packed & 0x0F).to(torch.int32)
    hi = (packed >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=2).reshape(packed.shape[0], -1)[:, :in_features]


def to_storage(name: str, qt: QTensor) -> dict[str, torch.Tensor]:
    """The safetensors entries of one quantized matrix (see the module docstring)."""
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


def save_quantized(model: torch.nn.Module, src_dir: Path, out: Path, qtensors: dict[str, QTensor], info: dict[str, Any]) -> None:
    """Write ``model`` to ``out`` with the matrices in ``qtensors`` (state-dict names) stored low-bit."""
    from safetensors.torch import save_file

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


def copy_side_files(src: Path, out: Path) -> None:
    """Copy tokenizer and sentence-transformers files (everything but weights, config and card)."""
    for p in Path(src).iterdir():
        if p.name in _WEIGHT_FILES or p.suffix in (".onnx", ".data") or p.name.startswith("."):
            continue
        if p.is_dir():
            if p.name not in ("onnx", "openvino", "checkpoints"):
                shutil.copytree(p, out / p.name, dirs_exist_ok=True)
        else:
            shutil.copy2(p, out / p.name)


# -- loading ---------------------------------------------------------------------------------
def read_config(folder: str | Path) -> dict[str, Any]:
    from encoderkit.io import read_json

    return read_json(Path(folder) / "config.json", f"{folder} is not a model folder: config.json is missing")


def is_quantized(folder: str | Path) -> bool:
    """True when ``folder`` holds an encoderkit-quantized model or only an INT8 ONNX graph.

    A folder with fp32 weights *and* an exported ``model.int8.onnx`` beside them is not: its
    weights can still be quantized.
    """
    folder = Path(folder)
    onnx_only = (folder / "model.int8.onnx").is_file() and not (folder / "model.safetensors").is_file()
    return QUANT_KEY in read_config(folder) or (folder / QUANT_FILE).is_file() or onnx_only


def model_class(config: Any) -> Any:
    """The transformers class named in ``config.architectures`` (``AutoModel`` when absent)."""
    import transformers

    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def shrink_heads(model: torch.nn.Module, heads_per_layer: list[list[int]], head_size: int) -> None:
    """Cut every layer's self-attention down to the heads it keeps (indices into the original heads).

    Q/K/V lose the output rows of the removed heads, the attention output dense its input columns.
    """
    from encoderkit.compress.prune import encoder_layers, slice_linear

    for layer, keep in zip(encoder_layers(model), heads_per_layer):
        att = layer.attention
        idx = torch.cat([torch.arange(h * head_size, (h + 1) * head_size) for h in keep]) if keep else torch.zeros(0, dtype=torch.long)
        for proj in ("query", "key", "value"):
            setattr(att.self, proj, slice_linear(getattr(att.self, proj), idx, dim=0))
        att.output.dense = slice_linear(att.output.dense, idx, dim=1)
        att.self.num_attention_heads = len(keep)
        att.self.all_head_size = len(keep) * head_size


def load_model(folder: str | Path, model_cls: Any = None, int8_runtime: bool = False) -> torch.nn.Module:
    """A runnable fp32 model (eval mode) from a plain, quantized or head-pruned encoderkit folder.

    ``model_cls`` defaults to the class in ``config.architectures``. ``int8_runtime`` swaps the
    Linear layers for ``torch.ao`` dynamically quantized INT8 ones (CPU serving of INT8 folders).
    """
    from transformers import AutoConfig

    folder = Path(folder)
    raw = read_config(folder)
    config = AutoConfig.from_pretrained(folder)
    cls = model_cls or model_class(config)
    quant = raw.get(QUANT_KEY)
    heads = raw.get(HEADS_KEY)
    if quant is None and heads is None:
        model = cls.from_pretrained(folder)
    else:
        from safetensors.torch import load_file

        for key in (QUANT_KEY, HEADS_KEY):
            config.__dict__.pop(key, None)
        model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
        if heads is not None:
            shrink_heads(model, heads, config.hidden_size // config.num_attention_heads)
            model.config.__dict__[HEADS_KEY] = heads  # kept, so saving the model again keeps its shape
        weights = folder / (QUANT_FILE if quant is not None else "model.safetensors")
        if not weights.is_file():
            raise EncoderkitError(f"{folder}: {weights.name} is missing; the folder is incomplete, re-run the lever")
        tensors = load_file(str(weights))
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
    model.eval()
    if int8_runtime:
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model
