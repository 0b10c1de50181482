"""NER settings: one frozen object built once from the parsed stage config (flags and their help:
:class:`encoderkit.tasks.options.TaskDataOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.common import pick, settle_max_length

DEFAULT_MAX_LENGTH = 128


@dataclass(frozen=True)
class NerOptions:
    """Sub-tokens per window, sub-tokens shared by consecutive windows, and the tag scheme of the files."""

    max_length: int = DEFAULT_MAX_LENGTH
    stride: int = 32
    tag_scheme: str = "auto"

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> NerOptions:
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, DEFAULT_MAX_LENGTH, folder))

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> NerOptions:
        """The window length and stride the model was fine-tuned with (``--max-length`` overrides the length)."""
        card = folder.card
        return pick(cls, cfg, max_length=cfg.max_length or card.get("max_length", DEFAULT_MAX_LENGTH),
                    stride=card.get("stride", cfg.stride))
