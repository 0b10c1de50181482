"""Batches of variable-length features: length bucketing for training, length-sorted batches for
inference (:func:`length_batches`, used by evaluation and the Predictor alike).

Features are kept as lists of 1-D int arrays (one per example) and padded per batch, so a batch
costs the length of its longest member, not the data set's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

Batch = dict[str, torch.Tensor]


def pad(seqs: Sequence[np.ndarray | list[int]], value: int = 0, width: int | None = None) -> torch.Tensor:
    """Right-pad 1-D sequences into an int64 tensor (B, T), T = the longest (or ``width``)."""
    width = width or max((len(s) for s in seqs), default=0)
    out = np.full((len(seqs), width), value, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return torch.from_numpy(out)


def encode_batch(rows: Sequence[dict[str, np.ndarray]], pad_id: int) -> Batch:
    """Pad ``input_ids`` / ``token_type_ids`` / per-token ``labels`` of a few rows into (B, T)
    tensors plus ``attention_mask``; scalar fields become (B,) tensors."""
    ids = [r["input_ids"] for r in rows]
    batch = {"input_ids": pad(ids, pad_id), "attention_mask": pad([np.ones(len(i), np.int64) for i in ids], 0)}
    if "token_type_ids" in rows[0]:
        batch["token_type_ids"] = pad([r["token_type_ids"] for r in rows], 0)
    for key in rows[0]:
        if key in batch or key == "input_ids":
            continue
        values = [r[key] for r in rows]
        if np.ndim(values[0]) == 1 and key == "labels" and len(values[0]) == len(ids[0]):
            batch[key] = pad(values, -100)  # per-token labels
        else:
            batch[key] = torch.as_tensor(np.stack([np.asarray(v) for v in values]))
    return batch


@dataclass
class BucketedBatches:
    """A BatchSource (see :mod:`encoderkit.train.engine`) with length bucketing.

    Each epoch: a seeded permutation of the rows; with ``bucket`` on, windows of
    ``bucket_factor * batch_size`` rows are sorted by length and cut into batches, and the order
    of the batches is shuffled, so batches hold similar lengths (less padding) while every epoch
    still sees a fresh mix. The last partial batch of an epoch is dropped.
    """

    lengths: np.ndarray
    batch_size: int
    make_batch: Callable[[np.ndarray, int], Batch]
    seed: int = 0
    bucket: bool = True
    bucket_factor: int = 50

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size

    def batches(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        n = len(self) * self.batch_size
        if self.bucket:
            window = self.batch_size * self.bucket_factor
            chunks = [order[i : i + window] for i in range(0, len(order), window)]
            order = np.concatenate([c[np.argsort(self.lengths[c], kind="stable")] for c in chunks])
        batches = [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        if self.bucket:
            # a chunk's tail can be short; drop the shortest batches only if sizes came out uneven
            batches = [b for b in batches if len(b) == self.batch_size]
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __call__(self, epoch: int, start: int, stride: int) -> Iterator[Batch]:
        batches = self.batches(epoch)
        for i in range(start, len(batches), stride):
            yield self.make_batch(batches[i], epoch)


@dataclass
class RotatingBatches:
    """A BatchSource whose epoch ``e`` is length-bucketed batches (as :class:`BucketedBatches`) over the
    rows ``fixed`` plus the row set ``sets[e % len(sets)]``: data that is partly new each epoch (a
    reranker's distillation: the training queries every epoch, a fresh sample of corpus titles each).
    Every set has the same size, so every epoch has the same number of batches."""

    lengths: np.ndarray
    fixed: np.ndarray
    sets: list[np.ndarray]
    batch_size: int
    make_batch: Callable[[np.ndarray, int], Batch]
    seed: int = 0

    def __post_init__(self) -> None:
        if len({len(s) for s in self.sets}) > 1:
            raise ValueError(f"RotatingBatches: the sets differ in size ({sorted({len(s) for s in self.sets})})")

    def rows(self, epoch: int) -> np.ndarray:
        return np.concatenate([self.fixed, self.sets[epoch % len(self.sets)]]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.rows(0)) // self.batch_size

    def __call__(self, epoch: int, start: int, stride: int) -> Iterator[Batch]:
        rows = self.rows(epoch)
        inner = BucketedBatches(self.lengths[rows], self.batch_size, lambda b, e: self.make_batch(rows[b], e),
                                seed=self.seed)
        return inner(epoch, start, stride)


def pad_arrays(rows: Sequence[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """Right-pad 1-D int rows into int64 arrays (B, T) plus ``attention_mask`` (the engines' input;
    ``token_type_ids`` only when the rows have them)."""
    ids = [r["input_ids"] for r in rows]
    out = {"input_ids": pad(ids, pad_id).numpy(),
           "attention_mask": pad([np.ones(len(i), np.int64) for i in ids], 0).numpy()}
    if "token_type_ids" in rows[0]:
        out["token_type_ids"] = pad([r["token_type_ids"] for r in rows], 0).numpy()
    return out


CALL_COST_TOKENS = 8  # one model call's fixed cost, in padded token slots (MiniLM INT8 on CPU: docs/deploy.md)


def length_batches(lengths: Sequence[int], max_batch: int, call_cost: int = CALL_COST_TOKENS,
                   step: int = 1) -> list[np.ndarray]:
    """Row indices grouped into model calls of at most ``max_batch`` rows, each group of similar lengths.
    ``step``: the engine pads the token axis to a multiple of it (OpenVINO: 8), so lengths count rounded up to it
    (rows of 9 and 16 tokens cost the same there: grouping them apart only adds calls).

    Rows are sorted by length and cut where the cost ``sum(call_cost + rows * longest)`` (padded token slots plus
    a fixed cost per call) is least, found exactly by dynamic programming: CPU compute grows with padded tokens,
    so a few batches of like lengths cost less than one padded to its longest."""
    step = max(1, step)
    rounded = -(-np.asarray(lengths, dtype=np.int64) // step) * step
    order = np.argsort(rounded, kind="stable")
    n = len(order)
    if n == 0:
        return []
    sorted_len = rounded[order]
    best = np.zeros(n + 1, dtype=np.int64)  # best[j]: least cost of the first j sorted rows
    cut = np.zeros(n + 1, dtype=np.int64)  # cut[j]: where the last group of that solution starts
    for j in range(1, n + 1):
        starts = np.arange(max(0, j - max_batch), j)
        costs = best[starts] + call_cost + (j - starts) * sorted_len[j - 1]
        k = int(np.argmin(costs[::-1]))  # ties: the longest group (the fewest calls)
        cut[j], best[j] = starts[len(starts) - 1 - k], costs[len(costs) - 1 - k]
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = int(cut[j])
    return groups[::-1]
