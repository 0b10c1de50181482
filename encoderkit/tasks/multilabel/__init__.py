"""Multi-label classification (several labels per text, a threshold per label): ``data`` reads label sets,
``features`` decodes probabilities and picks thresholds, ``train`` wires fine-tuning and evaluation."""

from encoderkit.tasks.multilabel.task import TASK

__all__ = ["TASK"]
