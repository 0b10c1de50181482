"""Bi-encoder settings: one frozen object built once from the parsed stage config (flags and their
help: :class:`encoderkit.tasks.options.TaskDataOptions` and the stage configs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import AUTO, task_pooling
from encoderkit.tasks.common import DEFAULT_MODEL, pick, settle_max_length


def default_max_length(folder: ModelFolder) -> int:
    """A sentence-transformers folder's own max_seq_length (cut to its positions), else 256."""
    return folder.max_length if folder.sentence_transformers else 256


@dataclass(frozen=True)
class EmbedOptions:
    """Sub-tokens per document and per query, pooling (``auto``: the folder's own, else mean), hard
    negatives (``mined`` by ``miner``), Matryoshka sizes and the contrastive loss's scale."""

    max_length: int = 256
    max_query_length: int = 64
    pooling: str = AUTO
    negatives: str = "sampled"
    num_negatives: int = 3
    miner: str = DEFAULT_MODEL
    matryoshka_dims: tuple[int, ...] = ()
    scale: float = 20.0
    audit_sheet: str = ""  # a pairs file's reviewed sheet: the pairs marked no are dropped (tasks/labeled.py)

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> EmbedOptions:
        """``--max-length`` settled against the model's positions; ``--pooling`` against the folder's own
        (:func:`encoderkit.models.pooling.task_pooling`): fine-tuning records the result in the card and
        ``1_Pooling/config.json``."""
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, default_max_length(folder), folder),
                    matryoshka_dims=tuple(sorted(set(cfg.matryoshka_dims))),
                    pooling=task_pooling(folder, "embed", getattr(cfg, "pooling", AUTO)))

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> EmbedOptions:
        """The folder's own lengths and pooling (``--max-length`` overrides the document length, ``--pooling`` the
        pooling: ``evaluate --pooling first`` scores the embeddings of the first token)."""
        card = folder.card
        return pick(cls, cfg, max_length=cfg.max_length or card.get("max_length") or default_max_length(folder),
                    max_query_length=card.get("max_query_length", cfg.max_query_length),
                    pooling=task_pooling(folder, "embed", getattr(cfg, "pooling", AUTO)))
