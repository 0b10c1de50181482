"""Quantization lever: model folder + :class:`QuantizeConfig` -> new model folder + report.

Methods (``method=``):

- ``dynamic``: post-training dynamic INT8. ``backend=torch`` stores per-channel INT8 weights with
  their scales (real int8 tensors in safetensors; activations quantized at run time by
  ``torch.ao`` dynamic quantization when served); ``backend=onnx`` exports ONNX and runs ORT
  ``quantize_dynamic(per_channel=True)``, writing ``model.int8.onnx``.
- ``static``: INT8 weights *and* activations with a calibration set (ORT QDQ ``quantize_static``,
  MinMax / Entropy / Percentile calibration), with a per-layer fallback to fp32 for the MatMuls
  whose quantization hurts the output most (``fallback_layers``).
- ``qat``: quantization-aware fine-tuning with straight-through fake quantization of Linear
  weights (and activations), then stored as real INT8.
- ``gptq``: weight-only 8/4-bit GPTQ (Hessian from calibration inputs, error feedback, groups,
  act_order), layer by layer through the encoder; see :mod:`encoderkit.compress.gptq`.
- ``rtn``: round-to-nearest at the same bits/groups, the baseline GPTQ is compared against.

Every method refuses a model that is already quantized.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from encoderkit.compress.measure import LeverReport, QualityFn, measure_folder, read_texts, text_batches
from encoderkit.compress.packing import QTensor, QuantSpec, copy_side_files, is_quantized, load_model, rtn_quantize, save_quantized
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.io import output_dir, read_card, write_card, write_json_atomic

METHODS = ("dynamic", "static", "qat", "gptq", "rtn")


@dataclass
class QuantizeConfig(StageConfig):
    """Settings of the quantization lever (CLI: ``encoderkit quantize``; recipe step ``lever: quantize``)."""

    model: str = arg("", help="Model folder to quantize (given by the recipe runner inside a recipe)")
    out: str = arg("", help="Output folder for the quantized model (given by the recipe runner inside a recipe)")
    method: str = arg("dynamic", help="dynamic | static | qat | gptq | rtn", choices=METHODS)
    backend: str = arg("torch", help="dynamic: 'torch' (int8 safetensors) or 'onnx' (ORT int8 model.int8.onnx); static always uses onnx",
                       choices=("torch", "onnx"))
    bits: int = arg(8, help="Weight bits (gptq/rtn: 8 or 4; dynamic/static/qat: 8)", choices=(8, 4))
    group_size: int = arg(128, help="Input columns sharing one scale (gptq/rtn); -1 = one scale per output row")
    symmetric: bool = arg(True, help="Symmetric quantization (no zero point); False stores uint zero points (gptq/rtn)")
    act_order: bool = arg(True, help="gptq: quantize columns in order of decreasing Hessian diagonal")
    damp: float = arg(0.01, help="gptq: dampening added to the Hessian diagonal, as a fraction of its mean")
    block_size: int = arg(128, help="gptq: columns per lazy batch update")
    per_channel: bool = arg(True, help="dynamic/static/qat: one weight scale per output channel (else per tensor)")
    embeddings: str = arg("fp32", help="Also store the word embedding matrix in int8/int4 (rows quantized, dequantized at load)",
                          choices=("fp32", "int8", "int4"))
    calib_data: str = arg("", help="Calibration texts (.txt, .tsv with 'sentence' column, or .jsonl 'text'): static/gptq/qat")
    calib_samples: int = arg(128, help="Number of calibration texts")
    calib_seq_len: int = arg(128, help="Max tokens per calibration text")
    calib_method: str = arg("minmax", help="static: activation range calibration", choices=("minmax", "entropy", "percentile"))
    fallback_layers: int = arg(0, help="static: keep this many most sensitive MatMuls in fp32 (measured by output error)")
    train_data: str = arg("", help="qat: labelled training file for the quantization-aware fine-tuning")
    qat_steps: int = arg(200, help="qat: optimisation steps")
    lr: float = arg(2e-5, help="qat: learning rate")
    batch_size: int = arg(16, help="qat: training batch size; static/gptq: calibration batch size")
    overwrite: bool = arg(False, help="Replace an existing output folder")
    seed: int = arg(0, help="Seed for calibration sampling and QAT")
    measure: bool = arg(True, help="Measure latency (batch 1 and 32, seq 128) before and after", speed=True)

    def validate(self) -> None:
        check(self.bits == 8 or self.method in ("gptq", "rtn"),
              f"bits={self.bits} is only supported by method gptq or rtn; {self.method} is INT8 only")
        check(self.group_size == -1 or self.group_size >= 8, f"group_size must be -1 or >= 8, got {self.group_size}")
        check(0 <= self.damp < 1, f"damp must be in [0, 1), got {self.damp}")
        check(self.calib_samples > 0 and self.calib_seq_len >= 8, "calib_samples must be > 0 and calib_seq_len >= 8")
        check(self.fallback_layers >= 0, "fallback_layers must be >= 0")


def quantize(model_dir: str | Path, cfg: QuantizeConfig, out_dir: str | Path,
             calib: list[Any] | None = None, quality_fn: QualityFn | None = None) -> LeverReport:
    """Quantize the model in ``model_dir`` as ``cfg`` says and write the result to ``out_dir``.

    ``calib`` (texts or text pairs) overrides ``cfg.calib_data``; ``quality_fn(folder) -> dict``
    is measured before and after. Returns the :class:`LeverReport` (also saved in the card).
    """
    from transformers import AutoTokenizer

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if is_quantized(model_dir):
        raise EncoderkitError(f"{model_dir} is already quantized; quantize its unquantized parent "
                              "(see 'parent' in its encoderkit.json) instead of stacking quantizers")
    before = measure_folder(model_dir, latency=cfg.measure, quality_fn=quality_fn)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    details: dict[str, Any] = {}
    with output_dir(out_dir, cfg.overwrite) as tmp:
        if cfg.method == "dynamic" and cfg.backend == "onnx" or cfg.method == "static":
            details = _quantize_onnx(model, tokenizer, cfg, model_dir, tmp, calib)
        else:
            if cfg.method in ("gptq", "rtn", "dynamic"):
                qtensors, details = _weight_only(model, tokenizer, cfg, calib)
            else:
                qtensors, details = _qat(model, model_dir, tokenizer, cfg, calib)
            qtensors.update(_embedding_codes(model, cfg))
            runtime = "torch-int8" if cfg.method in ("dynamic", "qat") else "dequantized-fp32"
            info = {"method": cfg.method, "bits": cfg.bits, "group_size": cfg.group_size, "runtime": runtime}
            save_quantized(model, model_dir, tmp, qtensors, info)
        after = measure_folder(tmp, latency=cfg.measure, quality_fn=quality_fn)
        report = LeverReport("quantize", cfg.method, str(model_dir), str(out_dir), before, after, details)
        parent = {k: v for k, v in read_card(model_dir).items() if k not in ("stage", "parent", "config", "metrics", "created")}
        write_card(tmp, "quantize", model_dir, cfg.result_dict(), after, **parent)
        write_json_atomic(tmp / "report.json", report.summary())
    return report


def calibration_texts(cfg: QuantizeConfig, calib: list[Any] | None) -> list[Any]:
    """``calib`` if given, else the first ``cfg.calib_samples`` texts of ``cfg.calib_data``."""
    if calib is not None:
        texts = list(calib)[: cfg.calib_samples]
    elif cfg.calib_data:
        texts = read_texts(cfg.calib_data, limit=cfg.calib_samples)
    else:
        raise EncoderkitError(f"quantize method={cfg.method} needs calibration texts: pass --calib-data FILE "
                              "(.txt, .tsv or .jsonl from the task's training data)")
    check(len(texts) > 0, "calibration set is empty")
    return texts


def _encoder_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    from encoderkit.compress.gptq import quantizable_linears

    return [pair for layer in quantizable_linears(model) for pair in layer]


@torch.no_grad()
def _weight_only(model: torch.nn.Module, tokenizer: Any, cfg: QuantizeConfig,
                 calib: list[Any] | None) -> tuple[dict[str, QTensor], dict[str, Any]]:
    """GPTQ / RTN / dynamic-INT8 codes of the encoder's Linear weights (model updated in place)."""
    from encoderkit.compress.gptq import gptq_encoder

    if cfg.method == "dynamic":
        spec = QuantSpec(8, -1 if cfg.per_channel else 0, True)
    else:
        spec = QuantSpec(cfg.bits, cfg.group_size, cfg.symmetric)
    if cfg.method == "gptq":
        texts = calibration_texts(cfg, calib)
        batches = list(text_batches(tokenizer, texts, cfg.calib_seq_len, cfg.batch_size))
        qtensors = gptq_encoder(model, batches, spec, act_order=cfg.act_order, damp=cfg.damp, block_size=cfg.block_size)
        return qtensors, {"calib_texts": len(texts), "layers": len(qtensors)}
    if spec.group_size == 0:  # per-tensor: one scale for the whole matrix
        qtensors = {}
        for name, lin in _encoder_linears(model):
            flat = rtn_quantize(lin.weight.reshape(1, -1), QuantSpec(8, -1, True))
            qtensors[f"{name}.weight"] = QTensor(flat.q.reshape(lin.weight.shape), flat.scale.expand(lin.weight.shape[0], 1).clone(),
                                                 None, None, QuantSpec(8, -1, True))
            lin.weight.copy_(qtensors[f"{name}.weight"].dequantize())
        return qtensors, {"layers": len(qtensors), "per_channel": False}
    qtensors = {}
    for name, lin in _encoder_linears(model):
        qt = rtn_quantize(lin.weight, spec)
        lin.weight.copy_(qt.dequantize())
        qtensors[f"{name}.weight"] = qt
    return qtensors, {"layers": len(qtensors)}


@torch.no_grad()
def _embedding_codes(model: torch.nn.Module, cfg: QuantizeConfig) -> dict[str, QTensor]:
    """Row-wise codes of the word embedding matrix when ``cfg.embeddings`` asks for them."""
    if cfg.embeddings == "fp32":
        return {}
    emb = model.get_input_embeddings()
    name = {m: n for n, m in model.named_modules()}[emb] + ".weight"
    bits = 8 if cfg.embeddings == "int8" else 4
    gs = cfg.group_size if bits == 4 and cfg.group_size > 0 else -1
    qt = rtn_quantize(emb.weight, QuantSpec(bits, gs, True))
    emb.weight.copy_(qt.dequantize())
    return {name: qt}
