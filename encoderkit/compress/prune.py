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

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from encoderkit.compress.measure import LeverReport, QualityFn, finish_lever, measure_folder, text_batches
from encoderkit.compress.packing import HEADS_KEY, is_quantized, load_model
from encoderkit.compress.recovery import recover, self_target_loss
from encoderkit.compress.students import is_multi_label
from encoderkit.compress.task_data import LeverData, TaskInputs
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import describe, detect
from encoderkit.io import output_dir
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.models.rebuild import encoder_layers, slice_linear
from encoderkit.progress import progress

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
    calib_data: str = arg("", help="The task's inputs for Taylor importance scores (its data file, read by the task's reader; or a .txt of texts)")
    calib_samples: int = arg(128, help="Number of calibration texts")
    vocab_data: list[str] = arg([], help="vocab: the task's data files whose tokens are kept (train/dev/test, read by the task's reader)")
    keep_tokens: int = arg(0, help="vocab: also keep the first N tokens of the old vocabulary (e.g. frequent pieces)")
    recovery_data: str = arg("", help="The task's training data for recovery fine-tuning (read by the task's reader)")
    recovery_steps: int = arg(0, help="Recovery fine-tuning steps (KD from the unpruned model's outputs, + the label loss for labelled classify data)")
    kd_alpha: float = arg(0.5, help="Recovery loss = alpha * KD(outputs) + (1 - alpha) * label loss (classify data with labels)")
    temperature: float = arg(2.0, help="KD temperature")
    lr: float = arg(3e-5, help="Recovery learning rate")
    batch_size: int = arg(32, help="Recovery / calibration batch size")
    seq_len: int = arg(0, help="Max tokens per example for recovery and calibration (0: the model's max length, the length it serves at)")
    overwrite: bool = arg(False, help="Replace an existing output folder")
    seed: int = arg(0, help="Seed for calibration sampling and recovery")
    measure: bool = arg(True, help="Measure latency (batch 1 and 32, seq 128) before and after", speed=True)
    device: str = arg("cpu", help="Device for recovery / 2:4 semi-structured kernels", choices=("cpu", "cuda"), speed=True)

    def validate(self) -> None:
        check(0 <= self.amount < 1, f"prune amount must be in [0, 1), got {self.amount}")
        check(self.recovery_steps >= 0, "recovery_steps must be >= 0")
        check(self.seq_len >= 0, f"seq_len must be >= 0 (0: the model's max length), got {self.seq_len}")
        check(0 <= self.kd_alpha <= 1, f"kd_alpha must be in [0, 1], got {self.kd_alpha}")
        check(self.schedule == "oneshot" or self.recovery_steps > 0,
              "schedule=gradual needs recovery_steps > 0 and recovery_data")


def data_needs(cfg: PruneConfig) -> tuple[str, ...]:
    """The lever data fields (:mod:`encoderkit.compress.task_data`) ``cfg`` needs and does not name itself."""
    needs = []
    if cfg.recovery_steps > 0 and not cfg.recovery_data:
        needs.append("train")
    if (cfg.method == "vocab" and not cfg.vocab_data) or (
            cfg.method in ("heads", "ffn") and cfg.importance == "taylor" and not (cfg.calib_data or cfg.recovery_data)):
        needs.append("calib")
    return tuple(needs)


def prune(model_dir: str | Path, config: PruneConfig, out_dir: str | Path,
          calib: list[Any] | None = None, quality_fn: QualityFn | None = None, data: LeverData | None = None) -> LeverReport:
    """Prune the model in ``model_dir`` as ``config`` says and write the result to ``out_dir``.

    ``calib`` (texts or pairs) overrides the calibration data for importance scores; ``data`` is
    where the declared data fields come from (default: ``config``'s own files, read as the model's
    task's data); ``quality_fn(folder) -> dict`` is measured before and after.
    """

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if is_quantized(model_dir):
        raise EncoderkitError(f"{model_dir} is quantized; prune its unquantized parent first, then quantize")
    data = (data or LeverData.for_model(model_dir)).with_sources(train=config.recovery_data, calib=config.calib_data)
    folder = ModelFolder.open(model_dir)
    cfg = config if config.seq_len else dataclasses.replace(config, seq_len=folder.max_length)  # the length it serves at
    if cfg.method == "vocab":
        from encoderkit.compress.vocab import prune_vocab

        return prune_vocab(model_dir, cfg, out_dir, quality_fn, data)
    before = measure_folder(model_dir, latency=cfg.measure, quality_fn=quality_fn)
    tokenizer = folder.tokenizer()
    model = folder.load()
    encoder_layers(model, f"prune --method {cfg.method}")  # a family without BERT's layer list: refused by name, first
    heads = folder.kept_heads
    details: dict[str, Any] = {}
    masks: dict[str, torch.Tensor] = {}
    if cfg.method in ("heads", "ffn"):
        texts = _calib(cfg, calib, data, model_dir) if cfg.importance == "taylor" else []
        scores = taylor_scores(model, tokenizer, texts, cfg) if texts else None
        if cfg.method == "heads":
            heads, details = prune_heads(model, cfg.amount, scores, heads)
        else:
            details = prune_ffn(model, cfg.amount, scores)
    elif cfg.method == "2:4":
        masks = semi_structured_masks(model)
        gpu = detect().sparse_gpu
        details = {"pattern": "2:4", "speedup": (
            f"none on CPU (dense kernels); on {gpu.describe()} through torch.sparse.to_sparse_semi_structured" if gpu else
            "none on CPU (dense kernels), and this machine has no CUDA GPU with 2:4 sparse tensor cores (compute "
            f"capability >= 8.0) for torch.sparse.to_sparse_semi_structured: {describe()}")}
    elif cfg.schedule == "oneshot":
        masks = magnitude_masks(model, cfg.amount, cfg.scope)
    if cfg.recovery_steps > 0:
        data.require(("train",), f"prune --recovery-steps {cfg.recovery_steps} (pass --recovery-data)")
        inputs = data.inputs("train", model_dir)
        teacher = load_model(model_dir)
        if cfg.method == "magnitude" and cfg.schedule == "gradual":
            masks, details["recovery"] = gradual_magnitude(model, teacher, tokenizer, cfg, inputs, folder.pooling or "mean")
        else:
            details["recovery"] = recover(model, teacher, tokenizer, inputs, cfg, masks, cfg.recovery_steps,
                                          _linears(model), folder.pooling or "mean")
    for name, lin in _linears(model):
        if name in masks:
            lin.weight.data.mul_(masks[name])
    if masks:
        details["sparsity"] = round(sparsity(model), 4)
        details["bytes_note"] = "zeros are stored densely: unstructured / 2:4 sparsity does not shrink model.safetensors"
    with output_dir(out_dir, cfg.overwrite) as tmp:
        save_pruned(model, model_dir, tmp, heads)
        report = finish_lever(tmp, "prune", cfg.method, model_dir, out_dir, cfg.result_dict(), before, details,
                              latency=cfg.measure, quality_fn=quality_fn)
    return report


def save_pruned(model: torch.nn.Module, src: Path, out: Path, heads: list[list[int]] | None) -> None:
    """Save in HF layout; head-pruned models record the kept heads in ``config.json``."""
    if heads is not None:
        model.config.__dict__[HEADS_KEY] = heads
    model.save_pretrained(out)
    model.config.__dict__.pop(HEADS_KEY, None)
    copy_side_files(src, out)


def _calib(cfg: PruneConfig, calib: list[Any] | None, data: LeverData, model_dir: Path) -> list[Any]:
    if calib is not None:
        return list(calib)[: cfg.calib_samples]
    if not data.source("calib"):
        raise EncoderkitError(f"importance=taylor needs calibration inputs of the {data.task} model: pass --calib-data "
                              "FILE (the task's data), or use --importance magnitude")
    return data.inputs("calib", model_dir, limit=cfg.calib_samples).texts


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    names = {m: n for n, m in model.named_modules()}
    return [(names[m], m) for layer in encoder_layers(model) for m in layer.modules() if isinstance(m, torch.nn.Linear)]


# -- unstructured and 2:4 -------------------------------------------------------------------
@torch.no_grad()
def magnitude_masks(model: torch.nn.Module, amount: float, scope: str) -> dict[str, torch.Tensor]:
    """Keep-masks (1 = kept) zeroing the ``amount`` smallest |w| of the encoder's Linear weights.

    ``scope="global"`` ranks all weights together, ``"layer"`` each matrix on its own; exactly
    ``floor(amount * n)`` entries are zeroed (ties broken by position).
    """
    lins = _linears(model)
    if scope == "layer":
        return {n: _keep_largest(lin.weight.abs(), amount) for n, lin in lins}
    flat = torch.cat([lin.weight.abs().flatten() for _, lin in lins])
    keep = _keep_largest(flat, amount)
    out, i = {}, 0
    for n, lin in lins:
        out[n] = keep[i:i + lin.weight.numel()].view_as(lin.weight)
        i += lin.weight.numel()
    return out


def _keep_largest(scores: torch.Tensor, amount: float) -> torch.Tensor:
    k = int(amount * scores.numel())
    mask = torch.ones(scores.numel(), dtype=scores.dtype)
    if k:
        mask[torch.argsort(scores.flatten(), stable=True)[:k]] = 0
    return mask.view_as(scores)


@torch.no_grad()
def semi_structured_masks(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """2:4 keep-masks: in each group of 4 consecutive input weights of a row, the 2 largest |w| kept."""
    out = {}
    for n, lin in _linears(model):
        o, i = lin.weight.shape
        check(i % 4 == 0, f"{n}: 2:4 sparsity needs in_features divisible by 4, got {i}")
        groups = lin.weight.abs().view(o, i // 4, 4)
        idx = groups.topk(2, dim=-1).indices
        mask = torch.zeros_like(groups).scatter_(-1, idx, 1.0)
        out[n] = mask.view(o, i)
    return out


def to_semi_structured_gpu(model: torch.nn.Module) -> int:
    """On CUDA: swap 2:4-sparse Linear weights for ``to_sparse_semi_structured`` tensors (fp16/bf16).

    Returns the number of converted layers. Raises on CPU: there is no semi-structured kernel.
    """
    from torch.sparse import to_sparse_semi_structured

    gpu = detect().sparse_gpu
    if gpu is None:
        raise EncoderkitError("2:4 semi-structured kernels need a CUDA GPU with sparse tensor cores (compute capability "
                              f">= 8.0); this machine: {describe()}. Without one the masked model runs dense")
    n = 0
    for _, lin in _linears(model):
        w = lin.weight.detach()
        w = w if w.dtype in (torch.float16, torch.bfloat16) else w.half()
        lin.weight = torch.nn.Parameter(to_sparse_semi_structured(w.cuda(gpu.index)), requires_grad=False)
        n += 1
    return n


def sparsity(model: torch.nn.Module) -> float:
    """Fraction of zeros over the encoder's Linear weights."""
    lins = _linears(model)
    total = sum(lin.weight.numel() for _, lin in lins)
    zeros = sum(int((lin.weight == 0).sum()) for _, lin in lins)
    return zeros / max(total, 1)


# -- structured: importance -----------------------------------------------------------------
def taylor_scores(model: torch.nn.Module, tokenizer: Any, texts: list[Any], cfg: PruneConfig) -> dict[str, torch.Tensor]:
    """Accumulated ``|w * dL/dw|`` (first-order Taylor) of every encoder Linear weight and bias.

    The loss is :func:`encoderkit.compress.recovery.self_target_loss`: the model against its own
    predictions (no labels needed) for every task's head.
    """
    params = {n: p for n, p in model.named_parameters() if ".encoder.layer." in f".{n}" or n.startswith("encoder.layer.")}
    scores = {n: torch.zeros_like(p) for n, p in params.items()}
    multi_label = is_multi_label(model)  # a sigmoid per label: its own predictions are a label set
    model.eval()
    for batch in progress(list(text_batches(tokenizer, texts, cfg.seq_len, cfg.batch_size)), desc="importance"):
        model.zero_grad(set_to_none=True)
        loss = self_target_loss(model(**batch), batch["attention_mask"], multi_label=multi_label)
        loss.backward()
        for n, p in params.items():
            if p.grad is not None:
                scores[n] += (p.detach() * p.grad).abs()
    model.zero_grad(set_to_none=True)
    return scores


def _score(scores: dict[str, torch.Tensor] | None, lin: torch.nn.Linear, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight score, bias score) of a Linear: Taylor scores when given, else |w|^2."""
    if scores is None:
        return lin.weight.detach().pow(2), lin.bias.detach().pow(2)
    return scores[f"{name}.weight"], scores[f"{name}.bias"]


@torch.no_grad()
def prune_heads(model: torch.nn.Module, amount: float, scores: dict[str, torch.Tensor] | None,
                previous: list[list[int]] | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """Remove ``round(amount * heads)`` attention heads from every layer (lowest importance first).

    Returns the heads kept per layer (indices into the original model's heads) and details.
    """
    layers = encoder_layers(model)
    _require_layout(model, layers, "heads", lambda layer: [getattr(layer.attention.self, p) for p in ("query", "key", "value")]
                    + [layer.attention.output.dense], "BERT's attention.self.query/key/value and attention.output.dense")
    names = {m: n for n, m in model.named_modules()}
    kept_all: list[list[int]] = []
    n_heads_orig = model.config.num_attention_heads
    d = model.config.hidden_size // n_heads_orig
    for li, layer in enumerate(layers):
        att = layer.attention
        h = att.self.num_attention_heads
        current = previous[li] if previous else list(range(h))
        score = torch.zeros(h)
        for proj in ("query", "key", "value"):
            lin = getattr(att.self, proj)
            w, b = _score(scores, lin, names[lin])
            score += w.sum(1).view(h, d).sum(1) + b.view(h, d).sum(1)
        w, _ = _score(scores, att.output.dense, names[att.output.dense])
        score += w.sum(0).view(h, d).sum(1)
        n_keep = max(1, h - round(amount * h))
        keep_local = sorted(torch.argsort(score, descending=True, stable=True)[:n_keep].tolist())
        kept_all.append([current[k] for k in keep_local])
    from encoderkit.compress.packing import shrink_heads

    local = [[(previous[li] if previous else list(range(n_heads_orig))).index(k) for k in kept] for li, kept in enumerate(kept_all)]
    shrink_heads(model, local, d)
    return kept_all, {"heads_per_layer": [len(k) for k in kept_all], "heads_kept": kept_all}


def _require_layout(model: torch.nn.Module, layers: list, method: str, parts: Any, expected: str) -> None:
    """Refuse, naming the family, a model whose layers lack the modules ``prune --method {method}`` cuts."""
    try:
        for layer in layers:
            parts(layer)
    except AttributeError as e:
        family = getattr(model.config, "model_type", type(model).__name__)
        raise EncoderkitError(f"prune --method {method}: {family} models are not supported ({type(model).__name__} "
                              f"lacks {expected}: {e}); use --method magnitude, or distill to fewer layers") from e


@torch.no_grad()
def prune_ffn(model: torch.nn.Module, amount: float, scores: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Remove ``round(amount * intermediate_size)`` FFN neurons from every layer (lowest importance first).

    The same count per layer keeps ``config.intermediate_size`` valid, so the folder reloads in
    plain transformers.
    """
    layers = encoder_layers(model)
    _require_layout(model, layers, "ffn", lambda layer: [layer.intermediate.dense, layer.output.dense,
                                                         model.config.intermediate_size],
                    "BERT's intermediate.dense / output.dense and config.intermediate_size")
    names = {m: n for n, m in model.named_modules()}
    size = model.config.intermediate_size
    n_keep = max(1, size - round(amount * size))
    for layer in layers:
        up, down = layer.intermediate.dense, layer.output.dense
        wu, bu = _score(scores, up, names[up])
        wd, _ = _score(scores, down, names[down])
        if scores is None:  # magnitude: product of the neuron's in and out weight norms
            score = wu.sum(1).sqrt() * wd.sum(0).sqrt()
        else:
            score = wu.sum(1) + bu + wd.sum(0)
        keep = torch.sort(torch.argsort(score, descending=True, stable=True)[:n_keep]).values
        layer.intermediate.dense = slice_linear(up, keep, dim=0)
        layer.output.dense = slice_linear(down, keep, dim=1)
    model.config.intermediate_size = n_keep
    return {"intermediate_size": [size, n_keep]}


# -- recovery (the training itself: encoderkit.compress.recovery) ---------------------------------
def gradual_magnitude(model: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any, cfg: PruneConfig,
                      inputs: TaskInputs, pooling: str = "mean", stages: int = 4) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Magnitude pruning in ``stages`` steps on the cubic schedule ``s_k = amount * (1 - (1 - k/K)^3)``
    (Zhu & Gupta, 2017), with recovery fine-tuning between them; returns the final masks."""
    masks: dict[str, torch.Tensor] = {}
    logs = []
    for k in range(1, stages + 1):
        amount_k = cfg.amount * (1 - (1 - k / stages) ** 3)
        masks = magnitude_masks(model, amount_k, cfg.scope)
        with torch.no_grad():
            for name, lin in _linears(model):
                lin.weight.mul_(masks[name])
        logs.append({"sparsity": round(amount_k, 4), **recover(model, teacher, tokenizer, inputs, cfg, masks,
                                                               max(1, cfg.recovery_steps // stages), _linears(model), pooling)})
    return masks, {"stages": logs}


def run(cfg: PruneConfig) -> LeverReport:
    """Prune a model folder (unstructured, 2:4, attention heads, FFN neurons or vocabulary)."""
    check(bool(cfg.model) and bool(cfg.out), "prune: --model and --out are required")
    return prune(cfg.model, cfg, cfg.out)
