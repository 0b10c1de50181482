"""Running a model over feature rows, whatever the engine (``run(inputs) -> [float32 arrays]``): evaluation, the
Predictor and training's dev evaluation all call :func:`run_rows`. :class:`ModuleEngine` (a torch module) lives
here, not in :mod:`encoderkit.inference.engines`, because the tasks layer may not import that package.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from encoderkit.progress import progress
from encoderkit.tasks.batching import length_batches, pad_arrays


class Engine(Protocol):
    """``run`` one padded batch. An engine that can run several batches at once (OpenVINO's streams) also has
    ``in_flight`` (how many to hand it together) and ``run_many(batches) -> [outputs per batch]``, in order. An
    engine that pads the token axis itself to a multiple of some step says so in ``length_step`` (batches are then
    grouped by lengths rounded up to it)."""

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]: ...


class ModuleEngine:
    """A torch module as an engine: the inputs it accepts, on its device; ``outputs`` names the output
    fields (``["logits"]``) or picks them from the model output (a function); float32 numpy out."""

    def __init__(self, module: torch.nn.Module, outputs: Sequence[str] | Callable[[Any], Any]) -> None:
        self.module = module
        self.outputs = outputs
        params = inspect.signature(module.forward).parameters
        self.input_names = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in params]

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        device = next(self.module.parameters()).device
        with torch.inference_mode():
            out = self.module(**{k: torch.from_numpy(v).to(device) for k, v in inputs.items() if k in self.input_names})
        picked = self.outputs(out) if callable(self.outputs) else tuple(out[name] for name in self.outputs)
        picked = picked if isinstance(picked, (tuple, list)) else (picked,)
        return [o.float().cpu().numpy() for o in picked]


def run_rows(engine: Engine, rows: Sequence[dict[str, np.ndarray]], pad_id: int, max_batch: int,
             per_token: bool = False, desc: str = "") -> list[list[np.ndarray]]:
    """Run ``engine`` on 1-D token rows in length-sorted batches (:func:`length_batches`); per row, in
    input order, each output with its padding cut off ((C,) per sequence, or (T_row, ...) with ``per_token``).
    ``desc``: show progress under that name (long runs: a teacher scoring a training set)."""
    results: list[list[np.ndarray]] = [[] for _ in rows]
    bar = progress(total=len(rows), desc=desc, unit="rows") if desc else None
    groups = length_batches([len(r["input_ids"]) for r in rows], max_batch, step=int(getattr(engine, "length_step", 1)))
    window = max(1, int(getattr(engine, "in_flight", 1)))  # an engine that runs calls at once gets them together
    for w in range(0, len(groups), window):
        part = groups[w : w + window]
        padded = [pad_arrays([rows[i] for i in idx], pad_id) for idx in part]
        for idx, outs in zip(part, engine.run_many(padded) if len(part) > 1 else [engine.run(padded[0])], strict=True):
            for j, i in enumerate(idx):
                n = len(rows[i]["input_ids"])
                results[i] = [o[j, :n] if per_token else o[j] for o in outs]
            if bar is not None:
                bar.update(len(idx))
    if bar is not None:
        bar.close()
    return results
