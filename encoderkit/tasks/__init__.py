"""Task heads: one package per task, each exporting its task object ``TASK`` (:mod:`encoderkit.tasks.protocol`),
registered by one line in :mod:`encoderkit.models.heads`::

    tasks/<task>/                 classify, ner, qa, rerank, embed
        __init__.py               TASK: the task object every stage dispatches through
        task.py                   its class (attributes and the protocol's methods)
        data.py                   reading the task's data files into examples
        features.py               examples -> token rows, model outputs -> predictions (numpy + a fast
                                  tokenizer; the model behind an injected engine)
        options.py                the task's one frozen options class (only its own settings), built
                                  once from the parsed stage config: ``for_training`` / ``for_folder``
        train.py                  ``build(data, options, tokenizer, folder) -> TaskRun`` (fine-tuning
                                  wiring) and ``evaluate_folder(folder, tokenizer, data, options)``
    tasks/ (shared)               protocol (Task), registry, batching, common (TaskRun, TrainData,
                                  EvalData, pick), inference (engines), options (the flat task flags of
                                  finetune/evaluate), tabular (TSV/CSV/JSONL rows), labeled
                                  (``encoderkit label`` output), tags (IOB1/IOB2/BIOES), margin_mse (a
                                  cross-encoder's margins as a dual encoder's target: sparse, adapt)
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

from encoderkit.errors import EncoderkitError
from encoderkit.models.heads import TASKS

if TYPE_CHECKING:
    from encoderkit.tasks.protocol import Task

__all__ = ["TASKS", "get_task"]


@cache
def get_task(name: str | None) -> Task:
    """The task object of a registered task name (``tasks/<name>/__init__.py``'s ``TASK``)."""
    if name not in TASKS:
        what = f"task {name!r}" if name else "a model whose task cannot be told"
        raise EncoderkitError(f"{what} is not one of {', '.join(TASKS)} (fine-tune a model for one of them, or set "
                              "'task' in its encoderkit.json)")
    return importlib.import_module(f"{__name__}.{name}").TASK
