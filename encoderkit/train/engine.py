"""The one training loop: AdamW, warmup + decay, accumulation, clipping, autocast, checkpoints,
exact resume, held-out evaluation and data-parallel training, written out plainly.

Usage (fine-tuning, distillation and pretraining all do this)::

    result = fit(module, loss_fn, IndexedBatches(len(ds), 32, make_batch), TrainSettings(max_steps=1000), run_dir,
                 evaluate=lambda m: {"loss": ...}, primary=("loss", "min"))

``loss_fn(module, batch) -> (loss, logs)`` calls ``module(...)`` itself, so data-parallel hooks fire. A
:class:`BatchSource` yields the exact micro-batches asked for (``source(epoch, start, stride)``) and dropout is
seeded per global micro-batch, so resume is exact without replaying data or saving RNG state, and one process with
``grad_accum=2`` does the same arithmetic as two with 1.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from encoderkit.config import StageConfig, arg
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import native_bf16
from encoderkit.io import write_text_atomic
from encoderkit.progress import note, progress
from encoderkit.train import checkpoint as ckpt
from encoderkit.train import distributed as dist_util
from encoderkit.train import step_speed

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], "tuple[torch.Tensor, dict[str, float]]"]
EvalFn = Callable[[nn.Module], "dict[str, float]"]


@dataclass
class TrainSettings:
    """Optimisation settings shared by every training stage.

    ``batch_size`` is the micro-batch per process; the global batch of one optimizer step is
    ``batch_size * grad_accum * world_size``. ``warmup`` below 1 is a fraction of the total
    steps, 1 or more a number of steps. Training stops at ``max_steps`` if it is set (> 0),
    else after ``epochs`` passes over the batch source.
    """

    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup: float = 0.06
    schedule: str = "linear"  # linear | cosine | constant (after warmup)
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of lr
    max_steps: int = 0
    epochs: float = 1.0
    batch_size: int = 32
    grad_accum: int = 1
    clip_norm: float = 1.0  # 0 disables clipping
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    eval_every: int = 0  # 0: evaluate only at the end
    save_every: int = 0  # 0: checkpoint only at the end
    keep_last: int = 2
    log_every: int = 10
    seed: int = 0
    # speed settings: never change results beyond float tolerance
    bf16: bool | None = None  # None: on where the hardware has native bf16 (CUDA, AVX512-BF16/AMX CPUs)
    compile: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.schedule not in ("linear", "cosine", "constant"):
            raise EncoderkitError(f"schedule must be linear, cosine or constant, got {self.schedule!r}")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise EncoderkitError("set max_steps > 0 or epochs > 0 (how long to train)")
        for name in ("batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise EncoderkitError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise EncoderkitError(f"lr must be a positive number, got {self.lr}")
        self.betas = tuple(self.betas)  # type: ignore[assignment]

    def result_dict(self) -> dict[str, Any]:
        """Settings that change results (compared on resume); speed settings left out."""
        d = asdict(self)
        for k in ("bf16", "compile", "progress", "eval_every", "save_every", "keep_last", "log_every"):
            d.pop(k)
        d["betas"] = list(self.betas)
        return d


@dataclass
class TrainArgs(StageConfig):
    """The :class:`TrainSettings` as documented stage-config fields (flags and config-file keys).
    Stage configs subclass it and call :meth:`train_settings`."""

    lr: float = arg(5e-4, help="Peak learning rate (AdamW).")
    weight_decay: float = arg(0.01, help="AdamW weight decay (not on biases and norms).")
    warmup: float = arg(0.06, help="Warmup: a fraction of the steps if < 1, else a number of steps.")
    schedule: str = arg("linear", help="Decay after warmup.", choices=("linear", "cosine", "constant"))
    max_steps: int = arg(0, help="Optimizer steps to train; 0: use --epochs.")
    epochs: float = arg(1.0, help="Passes over the training data (when --max-steps is 0).")
    batch_size: int = arg(32, help="Micro-batch per process; global batch = batch x grad-accum x processes.")
    grad_accum: int = arg(1, help="Micro-batches accumulated per optimizer step.")
    clip_norm: float = arg(1.0, help="Clip the gradient norm to this; 0 disables.")
    eval_every: int = arg(0, help="Evaluate on held-out data every N steps (0: only at the end).")
    save_every: int = arg(0, help="Checkpoint every N steps (0: only at the end and on a new best).")
    keep_last: int = arg(2, help="Step checkpoints kept (the best is kept besides).")
    log_every: int = arg(10, help="Steps between lines of metrics.jsonl.")
    seed: int = arg(0, help="Seed for initialisation, data order, masking and dropout.")
    bf16: str = arg("auto", help="bf16 autocast with fp32 master weights; auto: on where bf16 is native "
                    "(CUDA, AVX512-BF16/AMX CPUs).", choices=("auto", "on", "off"), speed=True)
    compile: bool = arg(False, help="torch.compile the training module.", speed=True)

    def train_settings(self) -> TrainSettings:
        return TrainSettings(
            lr=self.lr, weight_decay=self.weight_decay, warmup=self.warmup, schedule=self.schedule,
            max_steps=self.max_steps, epochs=self.epochs, batch_size=self.batch_size, grad_accum=self.grad_accum,
            clip_norm=self.clip_norm, eval_every=self.eval_every, save_every=self.save_every,
            keep_last=self.keep_last, log_every=self.log_every, seed=self.seed,
            bf16={"auto": None, "on": True, "off": False}[self.bf16], compile=self.compile,
        )


class BatchSource(Protocol):
    """Micro-batches of one epoch, addressable by position (see the module docstring)."""

    def __len__(self) -> int: ...

    def __call__(self, epoch: int, start: int, stride: int) -> Iterator[Batch]: ...


@dataclass
class IndexedBatches:
    """A :class:`BatchSource` over ``num_examples`` rows: a seeded permutation per epoch, cut
    into micro-batches of ``batch_size`` (the last partial one dropped), each built by
    ``make_batch(row_indices (b,) int64 ndarray, epoch) -> dict of tensors``."""

    num_examples: int
    batch_size: int
    make_batch: Callable[[np.ndarray, int], Batch]
    seed: int = 0
    shuffle: bool = True

    def __len__(self) -> int:
        return self.num_examples // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_examples, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples).astype(np.int64)

    def __call__(self, epoch: int, start: int, stride: int) -> Iterator[Batch]:
        order = self.order(epoch)
        for i in range(start, len(self), stride):
            yield self.make_batch(order[i * self.batch_size : (i + 1) * self.batch_size], epoch)


@dataclass
class FitResult:
    """What :func:`fit` returns: steps done, the last logged training values, the last
    evaluation, the best evaluation by the primary metric, and where the checkpoints are."""

    steps: int
    train_logs: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    best_metrics: dict[str, float] = field(default_factory=dict)
    last_checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    tokens_per_s: float | None = None  # of the steps run in this call; None when none ran (a finished run resumed)
    seconds: float = 0.0
    start_step: int = 0  # where this call started (the resumed checkpoint's step, else 0)


def lr_factor(step: int, total: int, warmup_steps: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based): linear warmup to 1, then
    linear/cosine decay to ``min_ratio`` at ``total`` (or constant)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def param_groups(module: nn.Module, weight_decay: float,
                 lr_scale: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases and norm weights (parameters with < 2 dims). ``lr_scale``:
    parameter-name prefix -> multiplier of the learning rate (a new head learning faster than the pretrained
    encoder); those parameters get groups of their own, each with its ``lr_scale``."""
    scales = dict(lr_scale or {})
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {(1.0, True): [], (1.0, False): []}
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        scale = next((v for k, v in scales.items() if name == k or name.startswith(k + ".")), 1.0)
        groups.setdefault((scale, p.ndim >= 2), []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decays else 0.0, "lr_scale": scale}
            for (scale, decays), ps in groups.items() if ps or scale == 1.0]


def _batch_tokens(batch: Batch) -> int:
    """Real (unpadded) tokens of a batch; a paired batch (``q_attention_mask`` + ``p_attention_mask``) counts both
    sides."""
    masks = [v for k, v in batch.items() if k.endswith("attention_mask") and torch.is_tensor(v)]
    if masks:
        return sum(int(m.sum()) for m in masks)
    ids = batch.get("input_ids")
    return int(ids.numel()) if ids is not None else len(next(iter(batch.values())))


def _to(batch: Batch, device: torch.device) -> Batch:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def fit(
    module: nn.Module,
    loss_fn: LossFn,
    source: BatchSource,
    settings: TrainSettings,
    run_dir: str | Path,
    *,
    evaluate: EvalFn | None = None,
    primary: tuple[str, str] = ("loss", "min"),
    fingerprint: dict[str, Any] | None = None,
    resume: bool = False,
    stop_at: int | None = None,
    device: torch.device | str | None = None,
    lr_scale: Mapping[str, float] | None = None,
) -> FitResult:
    """Train ``module`` in place and return a :class:`FitResult`.

    ``fingerprint``: what makes a run this run (stage config, data fingerprint); stored in every
    checkpoint, and ``resume=True`` refuses a checkpoint whose fingerprint or result settings
    differ. Without ``resume`` a run dir that already holds checkpoints is refused.
    ``evaluate(module) -> metrics`` runs on rank 0 under ``torch.no_grad`` with the module in
    eval mode; ``primary = (metric name, "min"|"max")`` picks the best checkpoint.
    ``stop_at``: end (with a checkpoint) after this optimizer step, as a time-limited job would;
    the schedule still runs to the full length, and a later ``resume=True`` call continues.
    ``lr_scale``: parameter-name prefix -> multiplier of ``settings.lr`` (see :func:`param_groups`).
    After ``fit`` the module holds the weights of the last step (not the best; load
    ``result.best_checkpoint`` with :func:`checkpoint.load_weights` for that).
    """
    run_dir = Path(run_dir)
    dist = dist_util.current()
    device = torch.device(device) if device is not None else dist.device
    if primary[1] not in ("min", "max"):
        raise EncoderkitError(f"primary metric mode must be 'min' or 'max', got {primary[1]!r}")
    per_step = settings.grad_accum * dist.world_size
    steps_per_epoch = len(source) // per_step
    if steps_per_epoch < 1:
        raise EncoderkitError(
            f"the data gives {len(source)} micro-batches per epoch, fewer than one optimizer step needs "
            f"({settings.grad_accum} accumulation x {dist.world_size} processes); use more data or a smaller batch"
        )
    total = settings.max_steps if settings.max_steps > 0 else max(1, int(settings.epochs * steps_per_epoch))
    warmup_steps = int(settings.warmup * total) if settings.warmup < 1 else int(settings.warmup)
    identity = {"settings": settings.result_dict(), "fingerprint": fingerprint or {}, "world_size": dist.world_size}

    module.to(device)
    optimizer = torch.optim.AdamW(
        param_groups(module, settings.weight_decay, lr_scale), lr=settings.lr, betas=settings.betas, eps=settings.eps,
        fused=step_speed.fused_adamw(module, device),
    )
    store = ckpt.CheckpointStore(run_dir / "checkpoints", keep_last=settings.keep_last, is_writer=dist.is_main)
    start_step, best = 0, None
    if store.latest() is not None and not resume:
        raise EncoderkitError(
            f"{run_dir} already holds checkpoints ({store.latest()}); pass --resume to continue that run "
            "or choose another run folder / --overwrite"
        )
    state: dict[str, Any] = {}
    if resume and store.latest() is not None:
        state = store.load(store.latest(), module, optimizer, identity)
        start_step, best = state["step"], state.get("best")
        if dist.is_main and start_step >= total:
            note(f"{run_dir}: the run already finished ({start_step} of {total} steps); nothing left to train")
    elif resume and dist.is_main:
        note(f"--resume: {store.root} holds no checkpoint, so training starts from step 0")

    use_bf16 = native_bf16(device) if settings.bf16 is None else settings.bf16
    train_module: nn.Module = dist_util.wrap(module, dist)
    if settings.compile:
        train_module = torch.compile(train_module)  # type: ignore[assignment]
    log_path = run_dir / "metrics.jsonl"
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _keep_rows_up_to(log_path, start_step)

    result = FitResult(steps=start_step, best_metrics=(best or {}).get("metrics", {}), start_step=start_step,
                       train_logs=state.get("train_logs") or {}, eval_metrics=state.get("eval") or {})
    result.last_checkpoint = store.latest()
    result.best_checkpoint = store.best_path() if best else None
    bar = _progress(settings, dist.is_main, start_step, total)
    t0, tokens_seen, window = time.perf_counter(), 0, {}
    devices = [device.index or 0] if device.type == "cuda" else []
    module.train()
    with (torch.random.fork_rng(devices=devices), step_speed.training_attention(module, device),
          step_speed.quick_dropout(module, device),
          step_speed.embedding_grad_buffer(module, device, enabled=dist.world_size == 1 and not settings.compile)):
        step = start_step
        batches = _stream(source, steps_per_epoch, per_step, dist, step, total)
        while step < total:
            for g in optimizer.param_groups:
                g["lr"] = settings.lr * g.get("lr_scale", 1.0) * lr_factor(step, total, warmup_steps,
                                                                           settings.schedule, settings.min_lr_ratio)
            logs_sum: dict[str, float] = {}
            for a in range(settings.grad_accum):
                micro_index, batch = next(batches)
                torch.manual_seed(settings.seed * 1_000_003 + micro_index)
                tokens_seen += _batch_tokens(batch)  # counted on the host copy: no device sync per mask
                batch = _to(batch, device)
                sync = a == settings.grad_accum - 1
                autocast = torch.autocast(device.type, torch.bfloat16, enabled=use_bf16)
                with dist_util.maybe_no_sync(train_module, sync), autocast:
                    loss, logs = loss_fn(train_module, batch)
                if not torch.isfinite(loss.detach()):
                    _non_finite(step, loss, store)
                (loss / settings.grad_accum).backward()
                for k, v in {"loss": float(loss.detach()), **logs}.items():
                    logs_sum[k] = logs_sum.get(k, 0.0) + float(v) / settings.grad_accum
            if settings.clip_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(module.parameters(), settings.clip_norm)
                logs_sum["grad_norm"] = float(norm)
                if not math.isfinite(float(norm)):
                    _non_finite(step, norm, store)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            logs_sum = dist.mean_dict(logs_sum)
            for k, v in logs_sum.items():
                window[k] = window.get(k, 0.0) + v
            window["_n"] = window.get("_n", 0) + 1
            elapsed = time.perf_counter() - t0
            result.tokens_per_s = tokens_seen * dist.world_size / max(elapsed, 1e-9)
            if step % settings.log_every == 0 or step == total:
                n = window.pop("_n")
                result.train_logs = {k: v / n for k, v in window.items()}
                window = {}
                record = {"step": step, "lr": optimizer.param_groups[0]["lr"], **result.train_logs,
                          "tokens_per_s": round(result.tokens_per_s, 1)}
                _append_jsonl(log_path, record, dist.is_main)
                if bar is not None:
                    bar.set_postfix(loss=f"{result.train_logs['loss']:.4f}", tok_s=f"{result.tokens_per_s:,.0f}")
            if bar is not None:
                bar.update(1)
            last = step == total
            pause = stop_at is not None and step >= stop_at and not last
            do_eval = evaluate is not None and (last or (settings.eval_every > 0 and step % settings.eval_every == 0))
            is_best = False
            if do_eval:
                result.eval_metrics = _evaluate(module, evaluate, dist, use_bf16, device)
                evals = {f"eval_{k}": v for k, v in result.eval_metrics.items()}
                _append_jsonl(log_path, {"step": step, **evals}, dist.is_main)
                is_best = _better(result.eval_metrics, best, primary)
                if is_best:
                    best = {"step": step, "metrics": result.eval_metrics}
                    result.best_metrics = result.eval_metrics
            if last or pause or (settings.save_every > 0 and step % settings.save_every == 0) or is_best:
                state = {"step": step, "epoch": step // steps_per_epoch, "identity": identity, "best": best,
                         "train_logs": result.train_logs, "eval": result.eval_metrics, "total_steps": total}
                result.last_checkpoint = store.save(step, module, optimizer, state, is_best=is_best)
                if is_best:
                    result.best_checkpoint = store.best_path()
            dist.barrier()
            if pause:
                break
    if bar is not None:
        bar.close()
    result.steps = step
    result.seconds = time.perf_counter() - t0
    module.eval()
    return result


def _stream(source: BatchSource, steps_per_epoch: int, per_step: int, dist: dist_util.DistInfo,
            step: int, total: int) -> Iterator[tuple[int, Batch]]:
    """Yield ``(global micro-batch index, batch)`` for this rank from optimizer step ``step`` on,
    starting a new epoch (fresh shuffle / masks) every ``steps_per_epoch`` steps."""
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        first = in_epoch * per_step + dist.rank
        limit = steps_per_epoch * per_step  # the remainder micro-batches of the epoch are dropped
        index = first
        for batch in source(epoch, first, dist.world_size):
            if index >= limit:
                break
            yield epoch * limit + index, batch
            index += dist.world_size
        step = (epoch + 1) * steps_per_epoch


def _non_finite(step: int, value: torch.Tensor, store: ckpt.CheckpointStore) -> None:
    last = store.latest()
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    raise EncoderkitError(
        f"training stopped: non-finite loss or gradient ({float(value.detach())}) at optimizer step {step + 1}; "
        f"{kept}. Lower --lr, raise --warmup, or check the data; then rerun (with --resume to continue)"
    )


@torch.no_grad()
def _evaluate(module: nn.Module, evaluate: EvalFn, dist: dist_util.DistInfo, use_bf16: bool,
              device: torch.device) -> dict[str, float]:
    metrics: dict[str, float] = {}
    if dist.is_main:
        module.eval()
        with torch.autocast(device.type, torch.bfloat16, enabled=use_bf16):
            metrics = {k: float(v) for k, v in evaluate(module).items()}
        module.train()
    return dist.broadcast_obj(metrics)


def _better(metrics: dict[str, float], best: dict[str, Any] | None, primary: tuple[str, str]) -> bool:
    name, mode = primary
    if name not in metrics:
        raise EncoderkitError(f"the evaluation returned {sorted(metrics)}, not the primary metric {name!r}")
    if best is None:
        return True
    old = best["metrics"][name]
    return metrics[name] < old if mode == "min" else metrics[name] > old


def _keep_rows_up_to(log: Path, step: int) -> None:
    """Drop the rows of ``metrics.jsonl`` after ``step`` (all of them for a fresh start): a run resumed from a
    checkpoint logs the steps after it again, and must not leave two rows per step."""
    if not log.is_file():
        return
    lines = log.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a kill
    if kept != lines:
        write_text_atomic(log, "".join(x + "\n" for x in kept))


def _append_jsonl(path: Path, record: dict[str, Any], is_main: bool) -> None:
    if not is_main:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()}) + "\n")


def _progress(settings: TrainSettings, is_main: bool, start: int, total: int):
    if not (settings.progress and is_main):
        return None
    keep = bool(os.environ.get("ENCODERKIT_KEEP_BARS"))
    return progress(total=total, initial=start, desc="train", unit="step", leave=keep)
