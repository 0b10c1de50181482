"""Learned sparse retrieval (SPLADE): ``features`` pools an MLM head's logits into one vocabulary-sized vector
per text and holds the loss (in-batch contrastive + FLOPS), ``train`` wires fine-tuning and evaluation."""

from encoderkit.tasks.sparse.task import TASK

__all__ = ["TASK"]
