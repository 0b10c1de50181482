"""Engines, and the one rule that picks and opens one for a model folder.

An engine runs a model on padded token arrays: ``run(inputs: dict[str, int64 array (B, T)]) -> list[float32
array]``, the task's outputs in the order of ``task.outputs``. :class:`OnnxEngine` is ONNX Runtime on one
``.onnx`` file; :func:`torch_engine` is the eager transformers model (a
:class:`~encoderkit.tasks.inference.ModuleEngine`). The protocol, ``ModuleEngine`` and ``run_rows`` stay in
:mod:`encoderkit.tasks.inference` and are re-exported here: the tasks layer runs a training-time module with
them, and it may not import this package.

:func:`open_engine` is how every caller picks and opens an engine; :func:`pick_backend` is its rule, by policy:

* a backend name (``torch-fp32``, ``torch-bf16``, ``onnx-fp32``, ``onnx-int8``): that one;
* ``serve`` (the Predictor's ``backend="auto"``): ONNX INT8 for a task whose object says ``int8_by_default``
  (its own ``model.int8.onnx`` or an export of its weights), ONNX FP32 for the others; a folder holding only
  ``model.int8.onnx`` (no FP32 graph, no weights to export one from) runs on it;
* ``graph``: the folder's INT8 graph when it has one, else FP32 (its own, or exported once from its weights);
* ``evaluate`` (what ``evaluate`` and the compression measurer run on a compressed folder): the ``graph``
  rule when the folder has no torch weights; torch's dynamic INT8 model when its weights are 8-bit
  (``quantize --format torch``); else none: the folder's torch model as the task's evaluation loads it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from encoderkit.deploy.export import export_onnx, ort_session
from encoderkit.errors import EncoderkitError
from encoderkit.io import cache_dir, output_dir
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.inference import Engine, ModuleEngine, run_rows

__all__ = ["BACKENDS", "POLICIES", "TORCH_INT8", "Engine", "ModuleEngine", "OnnxEngine", "cached_export",
           "int8_by_default", "open_engine", "pick_backend", "run_rows", "serve_rule", "torch_engine"]

BACKENDS = ("torch-fp32", "torch-bf16", "onnx-fp32", "onnx-int8")  # what a caller may name explicitly
POLICIES = ("serve", "graph", "evaluate")  # what a caller may ask for instead (see the module docstring)
TORCH_INT8 = "torch int8-dynamic"  # the ``evaluate`` policy's name for torch's dynamic INT8 model


def int8_by_default(task: str) -> bool:
    """Whether the ``serve`` policy runs ``task`` on ONNX INT8 (the task object says; doctor states the rule)."""
    return bool(get_task(task).int8_by_default)


def pick_backend(folder: ModelFolder, policy: str, task: str | None = None) -> str | None:
    """The backend ``policy`` runs ``folder`` on (see the module docstring): a name in :data:`BACKENDS`,
    :data:`TORCH_INT8`, or None (``evaluate`` on a plain torch folder, or on 8-bit weights of a ``task``
    without a task object: the torch model as the evaluation loads it)."""
    if policy in BACKENDS:
        return policy
    if policy == "serve":
        if int8_by_default(folder.task):
            return "onnx-int8" if folder.onnx_int8 or folder.torch_weights else "onnx-fp32"
        only_int8 = folder.onnx_int8 is not None and folder.onnx_fp32 is None and folder.torch_weights is None
        return "onnx-int8" if only_int8 else "onnx-fp32"
    if policy == "graph":
        return "onnx-int8" if folder.onnx_int8 is not None else "onnx-fp32"
    if policy == "evaluate":
        if folder.torch_weights is None and (folder.onnx_int8 is not None or folder.onnx_fp32 is not None):
            return pick_backend(folder, "graph")
        quant = folder.quantization
        eight_bit = quant is not None and int(quant.get("bits", 8)) == 8
        return TORCH_INT8 if eight_bit and (task or folder.task) in TASKS else None
    raise EncoderkitError(f"engine policy {policy!r} is not one of {', '.join(BACKENDS + POLICIES)}")


def open_engine(folder: ModelFolder, policy: str, *, task: str | None = None, threads: int | None = None,
                spin: bool = True) -> tuple[Engine | None, str | None]:
    """(engine, backend) for ``folder`` under ``policy`` (:func:`pick_backend`). ``task`` (default: the
    folder's) names the head torch loads; a graph runs the task it was exported for. ``threads``/``spin``:
    ONNX Runtime's intra-op threads, and whether its idle threads spin. The engine is None when the backend is
    (``evaluate`` on a plain torch folder)."""
    backend = pick_backend(folder, policy, task)
    if backend is None:
        return None, None
    if backend.startswith("onnx"):
        folder.require_task(*TASKS)  # a graph runs the task it was exported for
        return OnnxEngine(cached_export(folder, backend == "onnx-int8"), folder.task, threads, spin), backend
    task = task or folder.task
    if backend == TORCH_INT8:
        return ModuleEngine(folder.load(task=task, int8_runtime=True), get_task(task).outputs), backend
    return torch_engine(folder, bf16=backend == "torch-bf16"), backend


def torch_engine(folder: ModelFolder, bf16: bool) -> ModuleEngine:
    """The eager transformers model as an engine: int64 arrays (B, T) in, the task's float32 outputs out."""
    import torch

    model = folder.load(task=folder.task, dtype=torch.bfloat16 if bf16 else None, attn="sdpa", frozen=True)
    return ModuleEngine(model, list(get_task(folder.task).outputs))


class OnnxEngine:
    """onnxruntime session on one ``.onnx`` file."""

    def __init__(self, path: Path, task: str, threads: int | None, spin: bool = True) -> None:
        self.session = ort_session(path, threads, spin)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.outputs = list(get_task(task).outputs)
        missing = set(self.outputs) - {o.name for o in self.session.get_outputs()}
        if missing or not {"input_ids", "attention_mask"} <= set(self.input_names):
            raise EncoderkitError(f"{path}: graph inputs/outputs do not match a {task} model "
                                  f"(missing {sorted(missing) or 'input_ids/attention_mask'}); re-run encoderkit export")

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        feed = {k: v for k, v in inputs.items() if k in self.input_names}
        if "token_type_ids" in self.input_names and "token_type_ids" not in feed:
            feed["token_type_ids"] = np.zeros_like(inputs["input_ids"])
        return self.session.run(self.outputs, feed)


def cached_export(folder: ModelFolder, int8: bool) -> Path:
    """The wanted ONNX file of ``folder``: its own, else one in a cache folder exported once from it."""
    own = folder.onnx(int8)
    if own:
        return own

    st = (folder.path / "config.json").stat()
    weights = [folder.torch_weights] if folder.torch_weights else []
    stamp = f"{folder.path.resolve()}|{st.st_mtime_ns}|{[(p.stat().st_size, p.stat().st_mtime_ns) for p in weights]}"
    out = cache_dir("onnx") / hashlib.sha256(stamp.encode()).hexdigest()[:16]
    cached = out / ("model.int8.onnx" if int8 else "model.onnx")
    if cached.is_file():
        return cached
    with output_dir(out, overwrite=True) as tmp:  # both graphs at once: the INT8 one is quantised from the FP32 trace
        copy_side_files(folder.path, tmp, weights=True)
        export_onnx(folder, tmp, optimize=True, int8=True)
    return cached


def serve_rule(tasks: tuple[str, ...] = TASKS) -> tuple[list[str], list[str]]:
    """(tasks the ``serve`` policy runs on ONNX FP32, tasks it runs on ONNX INT8): what doctor states."""
    int8 = [t for t in tasks if int8_by_default(t)]
    return [t for t in tasks if t not in int8], int8
