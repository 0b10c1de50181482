"""Extractive QA settings: one frozen object built once from the parsed stage config (flags and their
help: :class:`encoderkit.tasks.options.TaskDataOptions`; ``max_question_length`` is ``--max-query-length``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.common import pick, settle_max_length

DEFAULT_MAX_LENGTH = 256


@dataclass(frozen=True)
class QaOptions:
    """Window length and overlap, the answer-span search, which articles to read, and the question cut."""

    max_length: int = DEFAULT_MAX_LENGTH
    doc_stride: int = DEFAULT_MAX_LENGTH // 4
    max_answer_length: int = 30
    n_best: int = 20
    qa_split: str = "all"
    max_question_length: int = 64

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> QaOptions:
        """``--doc-stride 0`` becomes a quarter of the settled ``--max-length``."""
        max_length = settle_max_length(cfg.max_length, DEFAULT_MAX_LENGTH, folder)
        return pick(cls, cfg, max_length=max_length, doc_stride=cfg.doc_stride or max_length // 4,
                    max_question_length=cfg.max_query_length)

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> QaOptions:
        """The window, stride and span settings the model was fine-tuned with (``--max-length`` overrides the
        length)."""
        card = folder.card
        max_length = cfg.max_length or card.get("max_length", DEFAULT_MAX_LENGTH)
        return pick(cls, cfg, max_length=max_length,
                    doc_stride=card.get("doc_stride", cfg.doc_stride or max_length // 4),
                    max_answer_length=card.get("max_answer_length", cfg.max_answer_length),
                    max_question_length=card.get("max_question_length", cfg.max_query_length))
