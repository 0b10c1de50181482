"""Bi-encoder embeddings: ``data`` builds (query, positive, negatives) groups, ``features`` encodes and saves, ``train`` wires fine-tuning and evaluation."""


def __getattr__(name: str):
    """``TASK``, the task object (:mod:`encoderkit.tasks.embed.task`), imported on first use: importing one of
    this package's modules (its features, say) does not import its training wiring."""
    if name == "TASK":
        from encoderkit.tasks.embed.task import TASK

        return TASK
    raise AttributeError(name)
