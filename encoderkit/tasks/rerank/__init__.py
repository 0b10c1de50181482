"""Cross-encoder reranking: ``data`` builds query groups, ``features`` makes and scores (query, passage) pairs,
``train`` wires listwise fine-tuning and evaluation; ``TASK`` is the task object."""

from encoderkit.tasks.rerank.task import TASK

__all__ = ["TASK"]
