"""The registry of tasks: one line per task, naming its Hugging Face head.

This is the one place a task is registered. The folder reader (:mod:`encoderkit.models.folder`) reads it
to check a folder's ``task`` and to load its head; everything else reaches a task through its object,
:func:`encoderkit.tasks.get_task` (``tasks/<name>/__init__.py`` exports ``TASK``). Nothing here imports
a task package, so the models layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Head:
    """What a task's model folder holds: the transformers Auto class that loads it, what
    ``config.architectures`` ends with, and which pooling the folder records (``classifier``: a
    sequence classifier's ``classifier_pooling``, first token by default; ``sentence``:
    sentence-transformers' pooling module, mean by default; None: no pooling)."""

    auto_class: str
    suffix: str = ""
    pooling: str | None = None


HEADS: dict[str, Head] = {
    "mlm": Head("AutoModelForMaskedLM", "ForMaskedLM"),
    "classify": Head("AutoModelForSequenceClassification", "ForSequenceClassification", "classifier"),
    "ner": Head("AutoModelForTokenClassification", "ForTokenClassification"),
    "qa": Head("AutoModelForQuestionAnswering", "ForQuestionAnswering"),
    "rerank": Head("AutoModelForSequenceClassification", "ForSequenceClassification", "classifier"),
    "embed": Head("AutoModel", "", "sentence"),
    "multilabel": Head("AutoModelForSequenceClassification", "ForSequenceClassification", "classifier"),
    "sparse": Head("AutoModelForMaskedLM", "ForMaskedLM"),
}

PRETRAINED = "mlm"  # the pretraining head: a folder's task, but no task object (pretrain and evaluate --task mlm own it)
TASKS: tuple[str, ...] = tuple(name for name in HEADS if name != PRETRAINED)  # the fine-tunable, servable tasks
