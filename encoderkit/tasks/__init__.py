"""Task heads: one package per task (registered by one line in :mod:`encoderkit.models.heads`), each exporting its
task object ``TASK`` (:mod:`encoderkit.tasks.protocol`) and holding ``task``, ``data`` (files -> examples),
``features`` (examples -> token rows, outputs -> predictions), ``options`` (its frozen settings) and ``train``
(fine-tuning wiring and evaluation). The modules beside them are shared by every task.
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
