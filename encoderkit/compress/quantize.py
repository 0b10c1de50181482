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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.compress.measure import LeverReport, QualityFn
from encoderkit.config import StageConfig, arg, check

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
    raise NotImplementedError  # filled in below


def run(cfg: QuantizeConfig) -> LeverReport:
    """Quantize a model folder (PTQ dynamic/static INT8, QAT, GPTQ or RTN at 8/4 bits)."""
    check(bool(cfg.model) and bool(cfg.out), "quantize: --model and --out are required")
    return quantize(cfg.model, cfg, cfg.out)
