"""MarginMSE (Hofstätter et al. 2020): a cross-encoder's margins ``CE(q, pos) - CE(q, neg)``, scored once before
training (:func:`ce_margins`), as the target of a dual encoder's dot-product margins (:func:`margin_mse`): GPL in
``adapt`` and ``finetune --task sparse --cross-encoder``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.common import resolve_model
from encoderkit.tasks.rerank.features import score_pairs

CE_BATCH = 64  # (query, passage) pairs per cross-encoder forward pass


def open_cross_encoder(name: str, purpose: str = "GPL") -> tuple[Any, Any, int]:
    """(torch model, tokenizer, max length) of a rerank folder (``--cross-encoder name``); anything else is refused
    with what ``purpose`` needs."""
    folder = ModelFolder.open(resolve_model(name))
    task = get_task(folder.task) if folder.task in TASKS else None
    if task is None or task.endpoint != "rerank":
        raise EncoderkitError(f"--cross-encoder {name} is a {folder.task!r} model; {purpose} needs a cross-encoder "
                              "(a rerank folder: `encoderkit finetune --task rerank`, or a sentence-transformers "
                              "CrossEncoder with one output)")
    return folder.load(), folder.tokenizer(), min(folder.max_length or 256, 512)


def ce_margins(ce: tuple[Any, Any, int], queries: list[str], positives: list[str], negatives: list[list[str]],
               desc: str = "") -> list[list[float]]:
    """``CE(q, pos) - CE(q, neg)`` per negative of each query; every pair scored in batched passes (``desc``: show
    progress under that name)."""
    model, tok, max_length = ce
    qs, ps, spans = [], [], []
    for q, pos, negs in zip(queries, positives, negatives, strict=True):
        spans.append((len(ps), len(negs)))
        qs += [q] * (1 + len(negs))
        ps += [pos, *negs]
    with torch.inference_mode():
        scores = score_pairs(model, tok, qs, ps, max_length, CE_BATCH, desc=desc)
    return [[float(scores[a] - scores[a + 1 + j]) for j in range(n)] for a, n in spans]


def margin_mse(q: torch.Tensor, passages: torch.Tensor, margins: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H) and passages (B + B*k, H) (row i's positive at i, then row i's k negatives at B + i*k ...),
    margins (B, k): mean of (scale * (q.pos - q.neg) - margin)^2."""
    b, k = margins.shape
    pos = passages[:b]  # (B, H)
    neg = passages[b:].view(b, k, -1)  # (B, k, H)
    student = scale * ((q * pos).sum(-1, keepdim=True) - torch.einsum("bh,bkh->bk", q, neg))  # (B, k)
    return torch.nn.functional.mse_loss(student, margins.to(student.dtype))


def with_margins(make_batch: Callable[[np.ndarray, int], dict[str, Any]], margins: list[list[float]], k: int
                 ) -> Callable[[np.ndarray, int], dict[str, Any]]:
    """A pair batch maker (:func:`~encoderkit.tasks.embed.train.pair_batches`) whose batches also hold
    ``margins`` (B, k) float32: the first ``k`` margins of each row in the batch."""

    def make(idx: np.ndarray, epoch: int) -> dict[str, Any]:
        batch_margins = torch.tensor([margins[int(i)][:k] for i in idx], dtype=torch.float32)
        return {**make_batch(idx, epoch), "margins": batch_margins}

    return make

