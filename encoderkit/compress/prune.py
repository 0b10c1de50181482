"""Pruning lever: model folder + :class:`PruneConfig` -> new model folder + report.

Methods (``method=``):

- ``magnitude``: unstructured, the smallest |w| of the encoder's Linear weights set to zero,
  globally or per layer, in one shot or gradually over the recovery steps. A dense safetensors
  file is not smaller for it; the report says so.
- ``2:4``: semi-structured, in every group of 4 consecutive input weights the 2 smallest are
  zero (masks kept through recovery). Speed-up only on a CUDA GPU with
  ``torch.sparse.to_sparse_semi_structured``; on CPU the report says there is none.
- ``heads``: whole attention heads removed (same number per layer), Q/K/V rows and output
  columns physically cut, by an importance score.
- ``ffn``: FFN neurons removed (same number per layer, so ``config.intermediate_size`` stays
  valid), intermediate rows and output columns physically cut.
- ``vocab``: tokens the task data never produces removed from tokenizer and embedding matrix
  (see :mod:`encoderkit.compress.vocab`).

``amount`` is the fraction removed, in [0, 1). Optional recovery fine-tuning uses the unpruned
model as teacher (KD on logits) through the training engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.compress.measure import LeverReport, QualityFn
from encoderkit.config import StageConfig, arg, check

METHODS = ("magnitude", "2:4", "heads", "ffn", "vocab")


@dataclass
class PruneConfig(StageConfig):
    """Settings of the pruning lever (CLI: ``encoderkit prune``; recipe step ``lever: prune``)."""

    model: str = arg("", help="Model folder to prune (given by the recipe runner inside a recipe)")
    out: str = arg("", help="Output folder for the pruned model (given by the recipe runner inside a recipe)")
    method: str = arg("magnitude", help="magnitude | 2:4 | heads | ffn | vocab", choices=METHODS)
    amount: float = arg(0.5, help="Fraction removed, in [0, 1): of weights (magnitude), heads (heads), neurons (ffn)")
    scope: str = arg("global", help="magnitude: rank weights over all layers or within each layer", choices=("global", "layer"))
    schedule: str = arg("oneshot", help="magnitude: prune at once, or gradually (cubic) over the recovery steps",
                        choices=("oneshot", "gradual"))
    importance: str = arg("taylor", help="heads/ffn: score by weight norms or first-order Taylor |w*grad| on calibration data",
                          choices=("magnitude", "taylor"))
    calib_data: str = arg("", help="Texts (.txt/.tsv/.jsonl) for Taylor importance scores")
    calib_samples: int = arg(128, help="Number of calibration texts")
    vocab_data: list[str] = arg([], help="vocab: text files whose tokens are kept (the task's train/dev/test data)")
    keep_tokens: int = arg(0, help="vocab: also keep the first N tokens of the old vocabulary (e.g. frequent pieces)")
    recovery_data: str = arg("", help="Labelled training file for recovery fine-tuning (empty: no recovery)")
    recovery_steps: int = arg(0, help="Recovery fine-tuning steps (KD from the unpruned model + task loss)")
    kd_alpha: float = arg(0.5, help="Recovery loss = alpha * KD(logits) + (1 - alpha) * task loss")
    temperature: float = arg(2.0, help="KD temperature")
    lr: float = arg(3e-5, help="Recovery learning rate")
    batch_size: int = arg(32, help="Recovery / calibration batch size")
    seq_len: int = arg(128, help="Max tokens per example for recovery and calibration")
    overwrite: bool = arg(False, help="Replace an existing output folder")
    seed: int = arg(0, help="Seed for calibration sampling and recovery")
    device: str = arg("cpu", help="Device for recovery / 2:4 semi-structured kernels", choices=("cpu", "cuda"), speed=True)

    def validate(self) -> None:
        check(0 <= self.amount < 1, f"prune amount must be in [0, 1), got {self.amount}")
        check(self.recovery_steps >= 0, "recovery_steps must be >= 0")
        check(0 <= self.kd_alpha <= 1, f"kd_alpha must be in [0, 1], got {self.kd_alpha}")
        check(self.schedule == "oneshot" or self.recovery_steps > 0,
              "schedule=gradual needs recovery_steps > 0 and recovery_data")


def prune(model_dir: str | Path, cfg: PruneConfig, out_dir: str | Path,
          calib: list[Any] | None = None, quality_fn: QualityFn | None = None) -> LeverReport:
    """Prune the model in ``model_dir`` as ``cfg`` says and write the result to ``out_dir``.

    ``calib`` (texts or pairs) overrides ``cfg.calib_data`` for importance scores;
    ``quality_fn(folder) -> dict`` is measured before and after.
    """
    raise NotImplementedError  # filled in below


def run(cfg: PruneConfig) -> LeverReport:
    """Prune a model folder (unstructured, 2:4, attention heads, FFN neurons or vocabulary)."""
    check(bool(cfg.model) and bool(cfg.out), "prune: --model and --out are required")
    return prune(cfg.model, cfg, cfg.out)
