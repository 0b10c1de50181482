"""Sequence classification (single texts or pairs; multi-class or multi-label): ``data`` reads labelled tables,
``features`` featurises and decodes, ``train`` wires fine-tuning and evaluation; ``TASK`` is the task object."""

from encoderkit.tasks.classify.task import TASK

__all__ = ["TASK"]
