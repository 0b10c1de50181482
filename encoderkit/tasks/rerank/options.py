"""Cross-encoder reranking settings: one frozen object built once from the parsed stage config (flags
and their help: :class:`encoderkit.tasks.options.TaskDataOptions` and the stage configs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.common import DEFAULT_MODEL, pick, settle_max_length
from encoderkit.tasks.embed.mining import CANDIDATES

DEFAULT_MAX_LENGTH = 256


@dataclass(frozen=True)
class RerankOptions:
    """Sub-tokens per (query, passage) pair; on a BEIR source, the negatives (``sampled`` or ``mined``
    by ``miner``, ``num_negatives`` per group) and the first stage's ``candidates`` per query, whose
    queries the miner reads at ``max_query_length``."""

    max_length: int = DEFAULT_MAX_LENGTH
    max_query_length: int = 64
    negatives: str = "sampled"
    num_negatives: int = 3
    miner: str = DEFAULT_MODEL
    candidates: int = CANDIDATES
    audit_sheet: str = ""  # a pairs file's reviewed sheet: the pairs marked no are dropped (tasks/labeled.py)

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> RerankOptions:
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, DEFAULT_MAX_LENGTH, folder))

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> RerankOptions:
        """The pair length the model was fine-tuned with, unless ``--max-length`` asks for another."""
        return pick(cls, cfg, max_length=cfg.max_length or folder.card.get("max_length", DEFAULT_MAX_LENGTH))
