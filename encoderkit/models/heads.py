"""The registry of tasks, the one place a task is registered: one line per task, naming its Hugging Face head.
Nothing here imports a task package, so the models layer (the folder reader) may read it; everything else
reaches a task through :func:`encoderkit.tasks.get_task`.
"""

from __future__ import annotations

from dataclasses import dataclass

# the kinds of pooling record a head's folder holds (names, defaults and the rule: encoderkit.models.pooling)
CLASSIFIER = "classifier"  # a sequence classifier's config.json classifier_pooling
SENTENCE = "sentence"  # a sentence embedding's card / sentence-transformers pooling module


@dataclass(frozen=True)
class Head:
    """What a task's model folder holds: the transformers Auto class that loads it, what
    ``config.architectures`` ends with, and which pooling the folder records (:data:`CLASSIFIER`: a
    sequence classifier's ``classifier_pooling``; :data:`SENTENCE`: the card's or sentence-transformers'
    pooling module; None: no pooling; the defaults: :data:`encoderkit.models.pooling.DEFAULTS`)."""

    auto_class: str
    suffix: str = ""
    pooling: str | None = None


HEADS: dict[str, Head] = {
    "mlm": Head("AutoModelForMaskedLM", "ForMaskedLM"),
    "classify": Head("AutoModelForSequenceClassification", "ForSequenceClassification", CLASSIFIER),
    "ner": Head("AutoModelForTokenClassification", "ForTokenClassification"),
    "qa": Head("AutoModelForQuestionAnswering", "ForQuestionAnswering"),
    "rerank": Head("AutoModelForSequenceClassification", "ForSequenceClassification", CLASSIFIER),
    "embed": Head("AutoModel", "", SENTENCE),
    "multilabel": Head("AutoModelForSequenceClassification", "ForSequenceClassification", CLASSIFIER),
    "sparse": Head("AutoModelForMaskedLM", "ForMaskedLM"),
}

# the pretraining head: a folder's task, but no task object (pretrain and evaluate --task mlm own it)
PRETRAINED = "mlm"
TASKS: tuple[str, ...] = tuple(name for name in HEADS if name != PRETRAINED)  # the fine-tunable, servable tasks
