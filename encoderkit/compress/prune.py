"""Pruning lever: model folder + :class:`PruneConfig` -> new model folder + report.

``magnitude`` (unstructured) and ``2:4`` zero weights, stored packed (:mod:`encoderkit.models.sparse`: values plus
2-bit positions, a bitmask or gaps), which saves bytes on disk but no CPU time (the report says so); ``heads``
and ``ffn`` cut whole heads or FFN neurons, the same number per layer so the config stays valid; ``vocab`` trims
the vocabulary (:mod:`encoderkit.compress.vocab`). Optional recovery fine-tuning learns the unpruned model's outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.sparse import to_sparse_semi_structured

from encoderkit.compress.measure import LeverReport, QualityFn, finish_lever, measure_folder, text_batches
from encoderkit.compress.packing import HEADS_KEY, is_quantized, load_model, shrink_heads
from encoderkit.compress.recovery import recover, self_target_loss
from encoderkit.compress.students import is_multi_label
from encoderkit.compress.task_data import LeverData, TaskInputs
from encoderkit.compress.vocab import prune_vocab
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import describe, detect
from encoderkit.io import output_dir
from encoderkit.models.anatomy import anatomy_of
from encoderkit.models.card import read_card, write_card
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.models.pooling import SENTENCE, default_pooling, task_pooling
from encoderkit.models.rebuild import encoder_layers, slice_linear
from encoderkit.models.sparse import SPARSE_FILE, SPARSE_KEY, save_sparse
from encoderkit.progress import progress

METHODS = ("magnitude", "2:4", "heads", "ffn", "vocab")


@dataclass
class PruneConfig(StageConfig):
    """Settings of the pruning lever (CLI: ``encoderkit prune``; recipe step ``lever: prune``)."""

    model: str = arg("", help="Model folder to prune (given by the recipe runner inside a recipe)")
    out: str = arg("", help="Output folder for the pruned model (given by the recipe runner inside a recipe)")
    method: str = arg("magnitude", help="magnitude | 2:4 | heads | ffn | vocab", choices=METHODS)
    amount: float = arg(0.5, help="Fraction removed, in [0, 1): of weights (magnitude), heads (heads), neurons (ffn)")
    scope: str = arg("global", help="magnitude: rank weights over all layers or within each layer",
                     choices=("global", "layer"))
    schedule: str = arg("oneshot", help="magnitude: prune at once, or gradually (cubic) over the recovery steps",
                        choices=("oneshot", "gradual"))
    importance: str = arg("taylor", help="heads/ffn: score by weight norms or first-order Taylor |w*grad| on "
                          "calibration data", choices=("magnitude", "taylor"))
    calib_data: str = arg("", help="The task's inputs for Taylor importance scores (its data file, read by the task's "
                          "reader; or a .txt of texts)")
    calib_samples: int = arg(128, help="Number of calibration texts")
    vocab_data: list[str] = arg([], help="vocab: the task's data files whose tokens are kept (train/dev/test, read by "
                                "the task's reader)")
    keep_tokens: int = arg(0, help="vocab: also keep the first N tokens of the old vocabulary (e.g. frequent pieces)")
    recovery_data: str = arg("", help="The task's training data for recovery fine-tuning (read by the task's reader)")
    recovery_steps: int = arg(0, help="Recovery fine-tuning steps (KD from the unpruned model's outputs, + the label "
                              "loss for labelled classify data)")
    kd_alpha: float = arg(0.5, help="Recovery loss = alpha * KD(outputs) + (1 - alpha) * label loss (classify data "
                          "with labels)")
    temperature: float = arg(2.0, help="KD temperature")
    lr: float = arg(3e-5, help="Recovery learning rate")
    batch_size: int = arg(32, help="Recovery / calibration batch size")
    seq_len: int = arg(0, help="Max tokens per example for recovery and calibration (0: the model's max length, the "
                       "length it serves at)")
    overwrite: bool = arg(False, help="Replace an existing output folder")
    seed: int = arg(0, help="Seed for calibration sampling and recovery")
    measure: bool = arg(True, help="Measure latency (batch 1 and 32, seq 128) before and after", speed=True)
    device: str = arg("cpu", help="Device for recovery / 2:4 semi-structured kernels", choices=("cpu", "cuda"),
                      speed=True)

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
            cfg.method in ("heads", "ffn") and cfg.importance == "taylor"
            and not (cfg.calib_data or cfg.recovery_data)):
        needs.append("calib")
    return tuple(needs)


def prune(model_dir: str | Path, config: PruneConfig, out_dir: str | Path, calib: list[Any] | None = None,
          quality_fn: QualityFn | None = None, data: LeverData | None = None) -> LeverReport:
    """Prune the model in ``model_dir`` as ``config`` says into ``out_dir``; ``calib`` overrides the calibration
    inputs of the importance scores, ``data`` gives the declared data fields (default: ``config``'s own files)."""

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if is_quantized(model_dir):
        raise EncoderkitError(f"{model_dir} is quantized; prune its unquantized parent first, then quantize")
    data = (data or LeverData.for_model(model_dir)).with_sources(train=config.recovery_data, calib=config.calib_data)
    folder = ModelFolder.open(model_dir)
    # the length it serves at
    cfg = config if config.seq_len else dataclasses.replace(config, seq_len=folder.max_length)
    if cfg.method == "vocab":
        return prune_vocab(model_dir, cfg, out_dir, quality_fn, data)
    before = measure_folder(model_dir, latency=cfg.measure, quality_fn=quality_fn)
    tokenizer = folder.tokenizer()
    model = folder.load()
    anatomy_of(model, f"prune --method {cfg.method}")  # a family without an anatomy entry: refused by name, first
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
            f"none on CPU (dense kernels); on {gpu.describe()} through torch.sparse.to_sparse_semi_structured"
            if gpu else
            "none on CPU (dense kernels), and this machine has no CUDA GPU with 2:4 sparse tensor cores (compute "
            f"capability >= 8.0) for torch.sparse.to_sparse_semi_structured: {describe()}")}
    elif cfg.schedule == "oneshot":
        masks = magnitude_masks(model, cfg.amount, cfg.scope)
    if cfg.recovery_steps > 0:
        data.require(("train",), f"prune --recovery-steps {cfg.recovery_steps} (pass --recovery-data)")
        inputs = data.inputs("train", model_dir)
        teacher = load_model(model_dir)
        pooling = task_pooling(folder, "embed")  # what an encoder's outputs are compared by (no logits)
        if cfg.method == "magnitude" and cfg.schedule == "gradual":
            masks, details["recovery"] = gradual_magnitude(model, teacher, tokenizer, cfg, inputs, pooling)
        else:
            details["recovery"] = recover(model, teacher, tokenizer, inputs, cfg, masks, cfg.recovery_steps,
                                          _linears(model), pooling)
    for name, lin in _linears(model):
        if name in masks:  # a plain zero, not w * 0 (-0.0 for a negative w, which the packing must keep)
            lin.weight.data.copy_(torch.where(masks[name].bool(), lin.weight.data, 0.0))
    if masks:
        details["sparsity"] = round(sparsity(model), 4)
    with output_dir(out_dir, cfg.overwrite) as tmp:
        details["loads_with"], packed = save_pruned(model, model_dir, tmp, heads,
                                                    [f"{n}.weight" for n in masks], cfg.method)
        if packed:
            details["packed"] = packed
            details["bytes_note"] = (f"{SPARSE_FILE}: {packed['packed']} pruned matrices packed into "
                                     f"{packed['packed_bytes']} bytes ({packed['dense_bytes']} dense), "
                                     f"{packed['bytes_per_nonzero']} bytes per non-zero weight")
        elif masks:
            details["bytes_note"] = "stored dense: at this sparsity no packing is smaller than the dense matrices"
        report = finish_lever(tmp, "prune", cfg.method, model_dir, out_dir, cfg.result_dict(), before, details,
                              latency=cfg.measure, quality_fn=quality_fn)
        write_card(tmp, **{**read_card(tmp), "loads_with": details["loads_with"]})
    return report


# how a head-pruned folder loads (the report's ``loads_with``): no family's config can say fewer heads of the same
# size, so plain transformers, which builds every block from the config, refuses its weights (a size mismatch)
HEADS_LOAD_NOTE = ("encoderkit only: config.json keeps {family}'s original head count, which its config cannot "
                   "change without changing the head size, and encoderkit_heads lists the heads kept per layer; "
                   "encoderkit.models.folder.ModelFolder.open(folder).load() (and every encoderkit stage) rebuilds the "
                   "cut blocks, while plain transformers' from_pretrained refuses the folder with a size mismatch")


# how a sparse-packed folder loads: plain transformers finds no model.safetensors (rather than loading zeros)
SPARSE_LOAD_NOTE = (f"encoderkit only: the pruned matrices are packed in {SPARSE_FILE} (layout: "
                    "encoderkit.models.sparse, docs/compress.md#packed-sparse-weights) and config.json's "
                    f"{SPARSE_KEY} says so; encoderkit.models.folder.ModelFolder.open(folder).load() and every "
                    "encoderkit stage unpack them exactly (encoderkit export writes a plain ONNX graph from it), while "
                    "plain transformers' from_pretrained finds no model.safetensors; for a dense HF folder: "
                    "ModelFolder.open(folder).load().save_pretrained(dir)")


def save_pruned(model: torch.nn.Module, src: Path, out: Path, heads: list[list[int]] | None,
                sparse: list[str] | None = None, method: str = "") -> tuple[str, dict[str, Any] | None]:
    """Save in HF layout; return how the folder loads and, when the ``sparse`` weights (state-dict names) were
    packed, what packing saved (:func:`encoderkit.models.sparse.save_sparse`). Head-pruned models record the kept
    heads in ``config.json`` (``encoderkit_heads``) and load through encoderkit only (:data:`HEADS_LOAD_NOTE`);
    so do packed ones (:data:`SPARSE_LOAD_NOTE`). A model too large for one ``model.safetensors`` stays dense."""
    note = "plain transformers (AutoModelFor*.from_pretrained) and encoderkit"
    if heads is not None:
        model.config.__dict__[HEADS_KEY] = heads
        note = HEADS_LOAD_NOTE.format(family=anatomy_of(model).family)
    model.save_pretrained(out)
    packed = None
    dense = out / "model.safetensors"
    if sparse and dense.is_file():
        packed = save_sparse(load_file(str(dense)), sparse, out / SPARSE_FILE)
        if packed["packed"]:
            dense.unlink()
            model.config.__dict__[SPARSE_KEY] = {"file": SPARSE_FILE, "method": method}
            model.config.save_pretrained(out)
            note = SPARSE_LOAD_NOTE + ("; " + note if heads is not None else "")
        else:
            (out / SPARSE_FILE).unlink()
            packed = None
    for key in (HEADS_KEY, SPARSE_KEY):
        model.config.__dict__.pop(key, None)
    copy_side_files(src, out)
    return note, packed


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
    """On CUDA: swap 2:4-sparse Linear weights for ``to_sparse_semi_structured`` tensors (fp16/bf16); returns the
    number of converted layers. Raises on CPU: there is no semi-structured kernel."""
    gpu = detect().sparse_gpu
    if gpu is None:
        raise EncoderkitError("2:4 semi-structured kernels need a CUDA GPU with sparse tensor cores (compute "
                              f"capability >= 8.0); this machine: {describe()}. Without one the masked model runs "
                              "dense")
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
def taylor_scores(model: torch.nn.Module, tokenizer: Any, texts: list[Any],
                  cfg: PruneConfig) -> dict[str, torch.Tensor]:
    """Accumulated ``|w * dL/dw|`` (first-order Taylor) of every encoder Linear weight and bias, the loss the model
    against its own predictions (:func:`encoderkit.compress.recovery.self_target_loss`, no labels needed)."""
    prefix = anatomy_of(model).layer_prefix(model)
    params = {n: p for n, p in model.named_parameters() if n.startswith(prefix)}
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


def _score(scores: dict[str, torch.Tensor] | None, lin: torch.nn.Linear,
           name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight score, bias score) of a Linear: Taylor scores when given, else |w|^2."""
    no_bias = torch.zeros(lin.out_features)
    if scores is None:
        return lin.weight.detach().pow(2), lin.bias.detach().pow(2) if lin.bias is not None else no_bias
    return scores[f"{name}.weight"], scores.get(f"{name}.bias", no_bias)


@torch.no_grad()
def prune_heads(model: torch.nn.Module, amount: float, scores: dict[str, torch.Tensor] | None,
                previous: list[list[int]] | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """Remove ``round(amount * heads)`` attention heads from every block (lowest importance first), wherever the
    family's anatomy puts the projections (separate Q/K/V or a fused ``Wqkv``).

    Returns the heads kept per layer (indices into the original model's heads) and details.
    """
    anatomy = anatomy_of(model, "prune --method heads")
    names = {m: n for n, m in model.named_modules()}
    d = anatomy.head_size(model.config)
    kept_all: list[list[int]] = []
    local: list[list[int]] = []
    for li, layer in enumerate(anatomy.blocks(model)):
        h = anatomy.block_heads(layer, d)
        current = previous[li] if previous else list(range(h))
        every = list(range(h))
        score = torch.zeros(h)
        for path, rows in anatomy.head_rows(layer, every, d).items():  # rows ordered [part][head][d]
            lin = layer.get_submodule(path)
            w, b = _score(scores, lin, names[lin])
            score += (w.sum(1) + b)[rows].view(-1, h, d).sum((0, 2))
        for path, cols in anatomy.head_columns(every, d).items():
            lin = layer.get_submodule(path)
            w, _ = _score(scores, lin, names[lin])
            score += w.sum(0)[cols].view(h, d).sum(1)
        n_keep = max(1, h - round(amount * h))
        keep_local = sorted(torch.argsort(score, descending=True, stable=True)[:n_keep].tolist())
        kept_all.append([current[k] for k in keep_local])
        local.append(keep_local)
    shrink_heads(model, local, d)
    return kept_all, {"heads_per_layer": [len(k) for k in kept_all], "heads_kept": kept_all}


@torch.no_grad()
def prune_ffn(model: torch.nn.Module, amount: float, scores: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Remove ``round(amount * ffn size)`` FFN neurons from every block (lowest importance first); a gated FFN
    (ModernBERT's ``Wi``) loses the input and gate rows of a neuron together.

    The same count per layer keeps the config's FFN size valid, so the folder reloads in plain transformers.
    """
    anatomy = anatomy_of(model, "prune --method ffn")
    names = {m: n for n, m in model.named_modules()}
    size = anatomy.ffn_size(model.config)
    n_keep = max(1, size - round(amount * size))
    for layer in anatomy.blocks(model):
        up, down = layer.get_submodule(anatomy.ffn_up), layer.get_submodule(anatomy.ffn_down)
        wu, bu = _score(scores, up, names[up])
        wd, _ = _score(scores, down, names[down])
        row, bias = wu.sum(1), bu
        if anatomy.gated:  # a neuron is its input row and its gate row
            row, bias = row[:size] + row[size:], bias[:size] + bias[size:]
        if scores is None:  # magnitude: product of the neuron's in and out weight norms
            score = row.sqrt() * wd.sum(0).sqrt()
        else:
            score = row + bias + wd.sum(0)
        keep = torch.sort(torch.argsort(score, descending=True, stable=True)[:n_keep]).values
        layer.set_submodule(anatomy.ffn_up, slice_linear(up, anatomy.ffn_rows(keep, size), dim=0))
        layer.set_submodule(anatomy.ffn_down, slice_linear(down, keep, dim=1))
    setattr(model.config, anatomy.ffn_key, n_keep)
    return {anatomy.ffn_key: [size, n_keep]}


# -- recovery (the training itself: encoderkit.compress.recovery) ---------------------------------
def gradual_magnitude(model: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any, cfg: PruneConfig,
                      inputs: TaskInputs, pooling: str = default_pooling(SENTENCE), stages: int = 4
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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
        logs.append({"sparsity": round(amount_k, 4),
                     **recover(model, teacher, tokenizer, inputs, cfg, masks, max(1, cfg.recovery_steps // stages),
                               _linears(model), pooling)})
    return masks, {"stages": logs}


def run(cfg: PruneConfig) -> LeverReport:
    """Prune a model folder (unstructured, 2:4, attention heads, FFN neurons or vocabulary)."""
    check(bool(cfg.model) and bool(cfg.out), "prune: --model and --out are required")
    return prune(cfg.model, cfg, cfg.out)
