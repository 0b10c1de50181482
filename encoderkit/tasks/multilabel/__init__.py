"""Multi-label classification (several labels per text, a threshold per label): ``data`` reads label sets,
``features`` decodes probabilities and picks thresholds, ``train`` wires fine-tuning and evaluation."""


def __getattr__(name: str):
    """``TASK``, the task object (:mod:`encoderkit.tasks.multilabel.task`), imported on first use."""
    if name == "TASK":
        from encoderkit.tasks.multilabel.task import TASK

        return TASK
    raise AttributeError(name)
