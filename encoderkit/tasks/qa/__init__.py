"""Extractive question answering: ``data`` reads SQuAD, ``features`` featurises and decodes, ``train`` wires fine-tuning and evaluation. ``options`` holds its settings."""


def __getattr__(name: str):
    """``TASK``, the task object (:mod:`encoderkit.tasks.qa.task`), imported on first use: importing one of
    this package's modules (its features, say) does not import its training wiring."""
    if name == "TASK":
        from encoderkit.tasks.qa.task import TASK

        return TASK
    raise AttributeError(name)
