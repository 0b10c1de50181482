"""NER settings: one frozen object built once from the parsed stage config (flags and their help:
:class:`encoderkit.tasks.options.TaskDataOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.common import pick, settle_max_length

DEFAULT_MAX_LENGTH = 128
DEFAULT_STRIDE = 32


def folder_stride(card: dict[str, Any], max_length: int, requested: int = 0) -> int:
    """The sub-tokens a saved model's windows share: the stride it was fine-tuned with (its card), else the
    requested one (``--stride``), else 32 cut to a quarter of the window (so each window still moves on by
    most of its length). The one rule for evaluate and the Predictor."""
    return int(card.get("stride") or requested or min(DEFAULT_STRIDE, max_length // 4))


@dataclass(frozen=True)
class NerOptions:
    """Sub-tokens per window, sub-tokens shared by consecutive windows, and the tag scheme of the files."""

    max_length: int = DEFAULT_MAX_LENGTH
    stride: int = DEFAULT_STRIDE
    tag_scheme: str = "auto"

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> NerOptions:
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, DEFAULT_MAX_LENGTH, folder),
                    stride=cfg.stride or DEFAULT_STRIDE)

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> NerOptions:
        """The window length and stride the model was fine-tuned with (``--max-length`` overrides the length)."""
        card = folder.card
        max_length = cfg.max_length or card.get("max_length", DEFAULT_MAX_LENGTH)
        return pick(cls, cfg, max_length=max_length, stride=folder_stride(card, max_length, cfg.stride))
