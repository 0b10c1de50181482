"""Bi-encoder embeddings: ``data`` builds (query, positive, negatives) groups, ``features`` encodes and saves,
``train`` wires fine-tuning and evaluation; ``TASK`` is the task object."""

from encoderkit.tasks.embed.task import TASK

__all__ = ["TASK"]
