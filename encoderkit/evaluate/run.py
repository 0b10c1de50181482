"""``encoderkit evaluate``: the task metrics of a model folder on labelled data, printed as JSON.

The task comes from ``--task``, else from the folder (:class:`encoderkit.models.folder.ModelFolder`'s one rule).
Feature settings saved with the model are reused; an explicit ``--max-length`` overrides the saved one. ``--pooling``
applies to an embed model only (:func:`encoderkit.models.pooling.task_pooling`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from encoderkit.config import arg
from encoderkit.errors import EncoderkitError
from encoderkit.inference.engines import TORCH_INT8, open_engine
from encoderkit.inference.policy import resolve
from encoderkit.models.folder import ModelFolder
from encoderkit.models.heads import PRETRAINED
from encoderkit.models.pooling import task_pooling
from encoderkit.progress import note
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.common import EvalData, open_model, pick
from encoderkit.tasks.options import TaskDataOptions
from encoderkit.train.pretrain import evaluate_folder


@dataclass
class EvaluateConfig(TaskDataOptions):
    """Evaluate a model folder on a task's labelled data."""

    task: str = arg("", help="Task (default: from the folder's encoderkit.json or its architecture). 'mlm': held-out "
                    "masked-LM loss/accuracy/perplexity on a token store from `encoderkit data prepare` (--data STORE; "
                    "--max-examples caps the blocks).", choices=("",) + TASKS + (PRETRAINED,))
    model: str = arg(help="Model folder to evaluate ('minilm' = all-MiniLM-L6-v2).", required=True)
    data: str = arg(help="Labelled data in the task's format (see `encoderkit finetune --help`); mlm: a token store "
                         "folder.", required=True)
    tokenizer: str = arg("", help="Tokenizer folder (default: the model folder's own).")
    max_examples: int = arg(0, help="Evaluate a seeded random subset of this many examples (0: all); rerank/embed: "
                                    "of the judged queries, searching the whole corpus.")
    mask_rate: float = arg(0.15, help="mlm: fraction of tokens picked for prediction (80/10/10 as in pretraining).")
    miner: str = arg("minilm", help="rerank: bi-encoder that proposes the top-100 candidates on a BEIR source.")
    batch_size: int = arg(64, help="Inference batch size.", speed=True)


@dataclass
class EvaluateResult:
    model: str
    task: str
    data: str
    metrics: dict[str, Any]
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "data": self.data, "seconds": round(self.seconds, 1),
                **self.metrics}


def run(cfg: EvaluateConfig) -> EvaluateResult:
    """Print the task metrics (JSON) of a model folder on labelled data."""
    folder = open_model(cfg.model, tokenizer=not cfg.tokenizer)
    t0 = time.perf_counter()
    task = cfg.task or folder.task
    # the MLM head has no task object: pretraining owns its held-out evaluation (no compressed engine)
    engine, runtime = compressed_engine(folder, task) if task != PRETRAINED else (None, "")
    if engine is not None:
        note(f"{folder.path}: evaluating it as the compression measurer does ({runtime})")
    task, metrics = folder_metrics(folder, cfg, engine)
    return EvaluateResult(str(folder.path), task, cfg.data, metrics, time.perf_counter() - t0)


def compressed_engine(folder: ModelFolder, task: str | None, threads: int | None = None,
                      max_batch: int = 32) -> tuple[Any, str]:
    """(engine, what it is) that measures a compressed folder, for ``evaluate`` and the compression measurer alike:
    the engine policy's ``evaluate`` rule (:func:`encoderkit.inference.policy.pick_backend`); ``(None, "torch
    fp32")`` for the folder's torch model as it loads. ``max_batch`` is the caller's, not the engine's."""
    choice = resolve(folder, "evaluate", task=task)
    if choice.backend is None:
        return None, "torch fp32"
    engine = open_engine(folder, choice, task=task, threads=threads)
    return engine, choice.backend if choice.backend == TORCH_INT8 else f"deploy {choice.backend}"


def folder_metrics(folder: ModelFolder, cfg: EvaluateConfig, engine: Any = None) -> tuple[str, dict[str, Any]]:
    """The task and its metrics for ``folder`` on ``cfg.data``: the one evaluation path, used by
    ``encoderkit evaluate`` and by the compression measurer. ``engine`` runs the model (an object with
    ``run(inputs) -> outputs``: ONNX Runtime on the folder's graph, a torch INT8 model...); None: the
    folder's torch model, as ``evaluate`` runs it."""
    if cfg.max_length:
        saved = folder.card.get("max_length")
        if saved and saved != cfg.max_length:
            note(f"{folder.path}: scoring at --max-length {cfg.max_length}, but the model was fine-tuned at {saved}; "
                 "quality can drop at a length the model has not seen")
    task = cfg.task or folder.task
    if task is None:
        raise EncoderkitError(f"{folder.path}: cannot tell the task from encoderkit.json or config.json "
                              f"(architectures {folder.config.get('architectures') or 'missing'}); pass --task")
    # --pooling: an embedding is scored pooled as asked; a classifier or static table only as it records
    task_pooling(folder, task, cfg.pooling, scoring=True)
    tokenizer = folder.tokenizer(cfg.tokenizer or None)
    if task == PRETRAINED:  # no task object: the held-out masked-LM figures are pretraining's own
        if engine is not None:
            raise EncoderkitError(f"{folder.path}: an MLM model is measured with its torch weights only")
        return task, evaluate_folder(folder, tokenizer, cfg.data, cfg)
    task_object = get_task(task)
    # the task's options: the folder's saved settings, an explicit --max-length winning
    options = task_object.options_for_folder(cfg, folder)
    return task, task_object.evaluate_folder(folder, tokenizer, pick(EvalData, cfg), options, engine=engine)
