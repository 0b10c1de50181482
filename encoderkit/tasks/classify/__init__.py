"""Sequence classification (single texts or pairs; multi-class or multi-label): ``data`` reads labelled tables, ``features`` featurises and decodes, ``train`` wires fine-tuning and evaluation."""


def __getattr__(name: str):
    """``TASK``, the task object (:mod:`encoderkit.tasks.classify.task`), imported on first use: importing one of
    this package's modules (its features, say) does not import its training wiring."""
    if name == "TASK":
        from encoderkit.tasks.classify.task import TASK

        return TASK
    raise AttributeError(name)
