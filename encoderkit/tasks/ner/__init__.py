"""Named-entity recognition: ``data`` reads CoNLL/JSONL, ``features`` featurises and decodes, ``train`` wires
fine-tuning and evaluation, ``options`` holds its settings; ``TASK`` is the task object."""

from encoderkit.tasks.ner.task import TASK

__all__ = ["TASK"]
