"""Learned sparse retrieval (SPLADE): ``features`` pools an MLM head's logits into one vocabulary-sized vector
per text and holds the loss (in-batch contrastive + FLOPS), ``train`` wires fine-tuning and evaluation."""


def __getattr__(name: str):
    """``TASK``, the task object (:mod:`encoderkit.tasks.sparse.task`), imported on first use."""
    if name == "TASK":
        from encoderkit.tasks.sparse.task import TASK

        return TASK
    raise AttributeError(name)
