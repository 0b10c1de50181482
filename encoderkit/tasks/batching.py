"""Batches of variable-length features: length bucketing for training, sorted order for inference.

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


def sorted_batches(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Inference batches of row indices, longest first (little padding; an OOM shows at once)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
