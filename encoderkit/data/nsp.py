"""Segment pairs for BERT's next-sentence objective: pure, seeded, read from a token store.

Each document is cut into windows of ``seq_len - 3`` tokens, one ``[CLS] A [SEP] B [SEP]`` example each: A the
window's head, B its rest (label 0) or, half the time, as many tokens of another document (label 1), so the pair's
length does not tell the label. Every draw hashes ``(seed, epoch, window)``, as the
:class:`~encoderkit.data.masking.Masker` does: the same pairs whatever the batch or process layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from encoderkit.config import check
from encoderkit.data.prepare import splitmix64

_SALT = np.uint64(0x6E73705F70616972)  # "nsp_pair": keeps these draws apart from the masker's


@dataclass(frozen=True)
class PairDraws:
    """One batch's pairs, each (B,) int64: A is ``tokens[a_start : a_start + a_len]`` of document
    ``a_doc``, B is ``tokens[b_start : b_start + b_len]`` of document ``b_doc``; ``label`` 0 where B
    is the true next segment, 1 where it is random."""

    a_doc: np.ndarray
    a_start: np.ndarray
    a_len: np.ndarray
    b_doc: np.ndarray
    b_start: np.ndarray
    b_len: np.ndarray
    label: np.ndarray


def uniforms(seed: int, epoch: int, index: np.ndarray, streams: int) -> np.ndarray:
    """(streams, B) uniform draws in [0, 1) that depend only on (seed, epoch, index, stream)."""
    key = splitmix64(np.array([seed & (2**64 - 1)], dtype=np.uint64) ^ _SALT)
    key = splitmix64(key ^ np.array([epoch & (2**64 - 1)], dtype=np.uint64))
    row = splitmix64(key ^ splitmix64(np.asarray(index, dtype=np.int64).astype(np.uint64)))  # (B,)
    bits = splitmix64(row[None, :] ^ splitmix64(np.arange(1, streams + 1, dtype=np.uint64))[:, None])
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def cut_windows(offsets: np.ndarray, doc_ids: np.ndarray, body: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc, start, length) of every window, each (N,) int64: each document of ``doc_ids`` cut into
    consecutive windows of ``body`` tokens; windows shorter than 2 tokens are left out."""
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    lengths = offsets[doc_ids + 1] - offsets[doc_ids]  # (D,)
    per_doc = -(-lengths // body)  # (D,)
    doc = np.repeat(doc_ids, per_doc)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)  # window number inside its document
    start = offsets[doc] + k * body
    length = np.minimum(body, offsets[doc + 1] - start)
    keep = length >= 2
    return doc[keep], start[keep], length[keep]


class PairBuilder:
    """Builds NSP examples from a token store's documents.

    tokens: (T,) ids of every document back to back; offsets: (n_docs + 1,); doc_ids: the documents
    the A segments come from; pool: the documents a random B is drawn from (default: ``doc_ids``;
    at least two). ``builder(index, epoch)`` returns ``input_ids``, ``token_type_ids`` (B, seq_len)
    and ``next_sentence_label`` (B,) long tensors."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, doc_ids: np.ndarray, *, seq_len: int,
                 ids: dict[str, int], seed: int, pool: np.ndarray | None = None) -> None:
        check(seq_len >= 5, f"next-sentence pairs need seq_len >= 5 ([CLS] A [SEP] B [SEP]), got {seq_len}")
        self.tokens, self.offsets = tokens, np.asarray(offsets, dtype=np.int64)
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.cls, self.sep, self.pad = int(ids["cls"]), int(ids["sep"]), int(ids["pad"])
        self.doc, self.start, self.length = cut_windows(self.offsets, np.asarray(doc_ids), self.seq_len - 3)
        self.pool = np.unique(np.asarray(doc_ids if pool is None else pool, dtype=np.int64))
        check(len(self.pool) >= 2, "next-sentence prediction needs at least two documents (B is drawn from another "
                                   f"document than A), the split has {len(self.pool)}; prepare the corpus with more "
                                   "documents (--doc-split blank_line or line)")
        check(len(self.doc) > 0, "no document has two tokens or more: nothing to build next-sentence pairs from")
        check(bool(np.isin(self.doc, self.pool).all()), "every A document must be in the pool of random documents")

    def __len__(self) -> int:
        return len(self.doc)

    def draw(self, index: np.ndarray, epoch: int) -> PairDraws:
        """Where each example's A and B come from (pure: a function of seed, epoch and index)."""
        index = np.asarray(index, dtype=np.int64)
        u = uniforms(self.seed, epoch, index, 4)  # (4, B)
        doc, start, n = self.doc[index], self.start[index], self.length[index]
        a_len = 1 + np.minimum((u[0] * (n - 1)).astype(np.int64), n - 2)
        label = (u[1] < 0.5).astype(np.int64)
        # a random other document: a uniform position among the pool's P - 1 documents other than A's
        pos_a = np.searchsorted(self.pool, doc)
        k = np.minimum((u[2] * (len(self.pool) - 1)).astype(np.int64), len(self.pool) - 2)
        other = self.pool[k + (k >= pos_a)]
        need = n - a_len
        other_len = self.offsets[other + 1] - self.offsets[other]
        room = np.maximum(other_len - need, 0)
        other_start = self.offsets[other] + np.minimum((u[3] * (room + 1)).astype(np.int64), room)
        is_random = label == 1
        return PairDraws(
            a_doc=doc, a_start=start, a_len=a_len,
            b_doc=np.where(is_random, other, doc),
            b_start=np.where(is_random, other_start, start + a_len),
            b_len=np.where(is_random, np.minimum(need, other_len), need),
            label=label,
        )

    def __call__(self, index: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
        d = self.draw(index, epoch)
        B, L = len(d.label), self.seq_len
        ids = np.full((B, L), self.pad, dtype=np.int64)
        types = np.zeros((B, L), dtype=np.int64)
        for r in range(B):
            a = np.asarray(self.tokens[d.a_start[r]:d.a_start[r] + d.a_len[r]], dtype=np.int64)
            b = np.asarray(self.tokens[d.b_start[r]:d.b_start[r] + d.b_len[r]], dtype=np.int64)
            row = np.concatenate([[self.cls], a, [self.sep], b, [self.sep]])
            ids[r, :len(row)] = row
            types[r, len(a) + 2:len(row)] = 1
        return {"input_ids": torch.from_numpy(ids), "token_type_ids": torch.from_numpy(types),
                "next_sentence_label": torch.from_numpy(d.label)}
