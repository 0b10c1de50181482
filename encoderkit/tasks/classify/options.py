"""Classify settings: one frozen object built once from the parsed stage config (flags and their
help: :class:`encoderkit.tasks.options.TaskDataOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import CLASSIFIER, default_pooling, task_pooling
from encoderkit.tasks.common import pick, settle_max_length

DEFAULT_MAX_LENGTH = 128


@dataclass(frozen=True)
class ClassifyOptions:
    """Columns, labels, sequence length and pooling of a classifier; ``audit_sheet`` /
    ``drop_suspected`` apply when training on ``encoderkit label`` output."""

    text_column: str = "auto"
    text_pair_column: str = ""
    label_column: str = "label"
    multi_label: bool = False
    label_separator: str = ","
    max_length: int = DEFAULT_MAX_LENGTH
    pooling: str = default_pooling(CLASSIFIER)
    audit_sheet: str = ""
    drop_suspected: bool = False

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> ClassifyOptions:
        """``--max-length`` settled against the model's positions; ``--pooling`` against the folder's own
        (:func:`encoderkit.models.pooling.task_pooling`: ``auto`` keeps a classifier's, else the first token)."""
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, DEFAULT_MAX_LENGTH, folder),
                    pooling=task_pooling(folder, "classify", cfg.pooling))

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> ClassifyOptions:
        """Scoring a saved classifier: its own length (unless ``--max-length`` asks for another), its
        multi-label setting and its pooling."""
        return pick(cls, cfg, max_length=cfg.max_length or folder.card.get("max_length", DEFAULT_MAX_LENGTH),
                    multi_label=folder.config.get("problem_type") == "multi_label_classification",
                    pooling=task_pooling(folder, "classify"), audit_sheet="", drop_suspected=False)
