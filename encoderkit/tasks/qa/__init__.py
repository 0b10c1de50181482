"""Extractive question answering: ``data`` reads SQuAD, ``features`` featurises and decodes, ``train`` wires
fine-tuning and evaluation, ``options`` holds its settings; ``TASK`` is the task object."""

from encoderkit.tasks.qa.task import TASK

__all__ = ["TASK"]
