"""What every task shares: opening a model folder and its tokenizer, running a model over sorted batches, and the
:class:`TaskRun` bundle that fine-tuning hands to the training engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.models.names import DEFAULT_MODEL, resolve_model  # noqa: F401 -- the stages' import
from encoderkit.models.tokenizer import load_tokenizer as load_fast_tokenizer
from encoderkit.tasks.batching import Batch
from encoderkit.tasks.inference import ModuleEngine, run_rows

T = TypeVar("T")


def open_model(name: str | Path, tokenizer: bool = True) -> ModelFolder:
    """The :class:`ModelFolder` of ``name`` (a folder or ``minilm``), checked complete; ``tokenizer=False``
    when a separate ``--tokenizer`` folder is given."""
    return ModelFolder.open(resolve_model(name), tokenizer=tokenizer)


def load_tokenizer(folder: Path | ModelFolder, tokenizer: str | None = None):
    """The folder's own fast tokenizer (or the one in ``tokenizer`` if given); a clear error when there is none."""
    if tokenizer:
        return load_fast_tokenizer(tokenizer)
    mf = folder if isinstance(folder, ModelFolder) else ModelFolder.open(folder, weights=False, tokenizer=False)
    return mf.tokenizer()


def settle_max_length(requested: int, default: int, folder: ModelFolder) -> int:
    """``--max-length``: the request (refused beyond the model's positions) or, when 0, the task's
    default cut to what the model takes."""
    positions = folder.positions
    if requested:
        if positions and requested > positions:
            raise EncoderkitError(f"--max-length {requested} is longer than the {positions} positions of "
                                  f"{folder.path}; use --max-length {positions} or less")
        return requested
    return min(default, positions) if positions else default


@dataclass(frozen=True)
class TrainData:
    """What fine-tuning hands a task's ``build`` beside its options: the data files, how much of them,
    the batch sizes, the seed of subsets/shuffling/negatives, and the metric that picks the checkpoint
    (``""``: the task's own). Built once from the parsed config (:func:`encoderkit.tasks.options.pick`)."""

    train: str
    dev: str = ""
    max_train_examples: int = 0
    max_dev_examples: int = 0
    batch_size: int = 32
    eval_batch_size: int = 128
    bucket: bool = True
    seed: int = 0
    metric: str = ""


@dataclass(frozen=True)
class EvalData:
    """What ``evaluate`` hands a task's ``evaluate_folder`` beside its options: the labelled data, a
    seeded subset size (0: all), the inference batch size and the seed."""

    data: str
    max_examples: int = 0
    batch_size: int = 64
    seed: int = 0


@dataclass
class TaskRun:
    """A task ready to train: the module, its loss, the training batches, a dev evaluation with
    its primary metric, how to save the trained module as a model folder, and the parameters that learn at
    another rate than ``--lr`` (``lr_scale``: a new head, which starts from random weights), and what an
    ``--audit-sheet`` did to the training data (``audit``: its counts, said in the run's summary)."""

    module: nn.Module
    loss_fn: Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]]
    source: Any
    evaluate: Callable[[nn.Module], dict[str, float]] | None
    primary: tuple[str, str]
    save: Callable[[nn.Module, Path], None]
    card: dict[str, Any] = field(default_factory=dict)
    num_train: int = 0
    lr_scale: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> multiplier of --lr
    audit: dict[str, Any] = field(default_factory=dict)


def output_layer(model: nn.Module, outputs: int, bias: bool = False) -> tuple[str, nn.Linear]:
    """The name and module of the model's last linear layer with ``outputs`` outputs (with a bias where ``bias``): a
    task head's output layer, e.g. ``classifier`` in BERT, ``classifier.out_proj`` in RoBERTa, ``qa_outputs`` (2)."""
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.out_features == outputs and (m.bias is not None or not bias)]
    if not found:
        raise EncoderkitError(f"{type(model).__name__} has no linear layer with {outputs} output(s)"
                              f"{' and a bias' if bias else ''}: not the head this task trains")
    return found[-1]


def head_name(model: nn.Module, outputs: int) -> str:
    """The top-level name of the head ending in the last linear layer with ``outputs`` outputs (what a new head's
    ``lr_scale`` names)."""
    return output_layer(model, outputs)[0].split(".")[0]


def run_batches(
    module: nn.Module,
    rows: Sequence[dict[str, np.ndarray]],
    pad_id: int,
    batch_size: int,
    outputs: Callable[[Any], tuple[torch.Tensor, ...] | torch.Tensor],
    keys: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids"),
    per_token: bool = False,
    desc: str = "",
) -> list[np.ndarray]:
    """``outputs(model_output)`` per row, in the rows' order (float32; ``per_token``: each row's padding cut off),
    from ``module`` run over length-sorted batches as the Predictor runs it. ``module`` may also be an engine
    (ONNX Runtime's) whose outputs are the task's graph outputs, which ``outputs`` picks from a torch model's
    output: a torch folder and its export are evaluated on one path."""
    if not isinstance(module, nn.Module):
        results = run_rows(module, [{k: r[k] for k in keys if k in r} for r in rows], pad_id, batch_size,
                           per_token=per_token, desc=desc)
        return [parts[0] if len(parts) == 1 else np.stack(parts) for parts in results]
    was_training = module.training
    module.eval()
    try:
        results = run_rows(ModuleEngine(module, outputs), [{k: r[k] for k in keys if k in r} for r in rows], pad_id,
                           batch_size, per_token=per_token, desc=desc)
    finally:
        if was_training:
            module.train()
    return [parts[0] if len(parts) == 1 else np.stack(parts) for parts in results]


def seeded_subset(items: list, limit: int, seed: int) -> list:
    """A seeded random subset of ``limit`` items (all when ``limit`` is 0), kept in their order."""
    if not limit or limit >= len(items):
        return items
    keep = np.sort(np.random.default_rng(seed).permutation(len(items))[:limit])
    return [items[i] for i in keep]


def check_labels(train_labels: set[str], dev_labels: Sequence[str], where: Sequence[str]) -> None:
    """Dev labels never seen in training are an error (the head has no output for them)."""
    for label, w in zip(dev_labels, where, strict=True):
        if label not in train_labels:
            raise EncoderkitError(
                f"{w}: label {label!r} does not occur in the training data (labels: "
                f"{', '.join(sorted(train_labels))}); a head cannot predict a label it never saw: fix the label, add "
                "training rows, or drop the dev row"
            )


def pick(cls: type[T], cfg: Any, **derived: Any) -> T:
    """An instance of the (frozen) options class ``cls``: each field from ``derived`` when given there,
    else from the stage config's field of that name, else the class default (a flag only one stage
    has, e.g. finetune's ``--negatives``). List values become tuples, so the options stay immutable."""
    values = {}
    for f in fields(cls):
        if f.name in derived:
            value = derived[f.name]
        elif hasattr(cfg, f.name):
            value = getattr(cfg, f.name)
        elif f.default is not MISSING:
            value = f.default
        else:
            raise TypeError(f"{type(cfg).__name__} has no {f.name!r} and {cls.__name__} has no default for it")
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)
