"""Multilabel settings: one frozen object built once from the parsed stage config. The flags are classify's, read
with this task's defaults where left at classify's (label column ``labels``, separator ``|``); classify-only flags
are refused, not ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import AUTO, MEAN
from encoderkit.tasks.common import pick, settle_max_length

DEFAULT_MAX_LENGTH = 128
SEPARATOR = "|"
FLAG_DEFAULTS = {"label_column": "label", "label_separator": ","}  # TaskDataOptions' defaults (classify's)


def _refuse_classify_flags(cfg: Any) -> None:
    said = [(flag, why) for flag, on, why in (
        ("--text-pair-column", getattr(cfg, "text_pair_column", ""), "it classifies single texts"),
        ("--pooling mean", getattr(cfg, "pooling", AUTO) == MEAN,
         "it pools the first token, so plain transformers computes what encoderkit computes"),
        ("--audit-sheet", getattr(cfg, "audit_sheet", ""), "`encoderkit label` output has one label a line"),
        ("--drop-suspected", getattr(cfg, "drop_suspected", False), "`encoderkit label` output has one label a line"),
    ) if on]
    if said:
        flag, why = said[0]
        raise EncoderkitError(f"{flag} is a classify setting; the multilabel task does not take it ({why}): drop it")


def _changed(cfg: Any, name: str) -> str | None:
    """The flag's value when the user changed it from classify's default, else None."""
    value = getattr(cfg, name, FLAG_DEFAULTS[name])
    return value if value != FLAG_DEFAULTS[name] else None


@dataclass(frozen=True)
class MultilabelOptions:
    """Columns, separator and sequence length of a multi-label classifier. ``label_column`` empty: found
    in the file (the saved column, else ``labels``, else ``label``); ``text_column`` ``auto``: found as
    classify finds it."""

    text_column: str = "auto"
    label_column: str = ""
    label_separator: str = SEPARATOR
    max_length: int = DEFAULT_MAX_LENGTH

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> MultilabelOptions:
        _refuse_classify_flags(cfg)
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, DEFAULT_MAX_LENGTH, folder),
                    label_column=_changed(cfg, "label_column") or "",
                    label_separator=_changed(cfg, "label_separator") or SEPARATOR)

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> MultilabelOptions:
        """Scoring a saved model: its own length (unless ``--max-length`` asks for another) and separator."""
        max_length = getattr(cfg, "max_length", 0) or folder.card.get("max_length", DEFAULT_MAX_LENGTH)
        return pick(cls, cfg, max_length=max_length,
                    label_column=_changed(cfg, "label_column") or "",
                    label_separator=_changed(cfg, "label_separator") or folder.card.get("label_separator", SEPARATOR))
