"""Sparse (SPLADE) settings: one frozen object built once from the parsed stage config. The data flags are the
embed task's; the FLOPS regulariser and ``--cross-encoder`` have their own; embed-only flags are refused, not
silently ignored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import AUTO
from encoderkit.tasks.common import DEFAULT_MODEL, pick, settle_max_length

DEFAULT_MAX_LENGTH = 256
# SPLADE v2 (Formal et al. 2021, SPLADE-max): lambda_q 3e-4, lambda_d 1e-4, reached by a quadratic warm-up
FLOPS_QUERY = 3e-4
FLOPS_DOC = 1e-4


def _refuse_embed_flags(cfg: Any) -> None:
    said = [flag for flag, on in (
        ("--matryoshka-dims", bool(getattr(cfg, "matryoshka_dims", []))),
        ("--pooling mean/first", getattr(cfg, "pooling", AUTO) != AUTO),
        ("--text-pair-column", bool(getattr(cfg, "text_pair_column", ""))),
    ) if on]
    if said:
        raise EncoderkitError(f"{said[0]} is not a sparse setting: a SPLADE vector is the max over tokens of "
                              "log(1 + relu(MLM logits)), one weight per vocabulary entry; drop the flag")


@dataclass(frozen=True)
class SparseOptions:
    """Sub-tokens per document and per query, hard negatives (``mined`` by ``miner``, as embed mines them), and
    the FLOPS regulariser: its weights for queries and documents, reached by a quadratic warm-up over
    ``flops_warmup`` micro-batches (0: one epoch); ``cross_encoder``: a rerank folder whose margins the model
    learns (MarginMSE) instead of in-batch negatives ("": contrastive)."""

    max_length: int = DEFAULT_MAX_LENGTH
    max_query_length: int = 64
    negatives: str = "sampled"
    num_negatives: int = 3
    miner: str = DEFAULT_MODEL
    flops_query: float = FLOPS_QUERY
    flops_doc: float = FLOPS_DOC
    flops_warmup: int = 0
    cross_encoder: str = ""

    def __post_init__(self) -> None:
        if self.flops_query < 0 or self.flops_doc < 0 or self.flops_warmup < 0:
            raise EncoderkitError("--flops-query, --flops-doc and --flops-warmup must be >= 0")

    @classmethod
    def for_training(cls, cfg: Any, folder: ModelFolder) -> SparseOptions:
        """``--max-length`` settled against the model's positions (default 256)."""
        _refuse_embed_flags(cfg)
        default = folder.max_length if folder.sentence_transformers else DEFAULT_MAX_LENGTH
        return pick(cls, cfg, max_length=settle_max_length(cfg.max_length, min(default, DEFAULT_MAX_LENGTH), folder))

    @classmethod
    def for_folder(cls, cfg: Any, folder: ModelFolder) -> SparseOptions:
        """The folder's own lengths (``--max-length`` overrides the document length)."""
        card = folder.card
        return pick(cls, cfg, max_length=getattr(cfg, "max_length", 0) or card.get("max_length") or folder.max_length,
                    max_query_length=card.get("max_query_length", getattr(cfg, "max_query_length", 64)))
