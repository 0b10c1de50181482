"""Classify settings: one frozen object built once from the parsed stage config (flags and their
help: :class:`encoderkit.tasks.options.TaskDataOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.common import pick, settle_max_length

DEFAULT_MAX_LENGTH = 128


def resolve_pooling(pooling: str, folder: ModelFolder) -> str:
    """``--pooling`` for classify: 'first' or 'mean'; ``auto``: a classifier folder's own, else 'first'."""
    if pooling != "auto":
        return pooling
    return folder.pooling if folder.task == "classify" and folder.pooling else "first"


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
    pooling: str = "first"
    audit_sheet: str = ""
    drop_suspected: bool = False

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> ClassifyOptions:
        """``--max-length`` settled against the model's positions; ``--pooling auto`` resolved."""
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, DEFAULT_MAX_LENGTH, folder),
                    pooling=resolve_pooling(cfg.pooling, folder))

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> ClassifyOptions:
        """Scoring a saved classifier: its own length (unless ``--max-length`` asks for another), its
        multi-label setting and its pooling."""
        return pick(cls, cfg, max_length=cfg.max_length or folder.card.get("max_length", DEFAULT_MAX_LENGTH),
                    multi_label=folder.config.get("problem_type") == "multi_label_classification",
                    pooling=folder.pooling or "first", audit_sheet="", drop_suspected=False)
