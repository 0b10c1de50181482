"""Compact codes for unit embeddings, and exact search over them (pure numpy).

* binary: one bit per dimension (``x > 0``), packed 8 to a byte (N, ceil(D/8)) uint8: 32x smaller
  than float32. Search is by Hamming distance (popcount of XOR): :func:`hamming` here is the numpy
  reference and the fallback without faiss; the index scans with faiss (:mod:`.ann`), which is faster.
* int8: per-dimension ranges ``lo, hi`` (the calibration, (2, D) float32, measured on the corpus
  embeddings as sentence-transformers' ``quantize_embeddings`` does) map each value to one of 256
  levels: 4x smaller. A float query scores against the dequantized codes (asymmetric), an int8
  query against the codes themselves (symmetric, the plain int8 first stage).
* float16: 2x smaller, scored as float32.
"""

from __future__ import annotations

import numpy as np


def binary_codes(x: np.ndarray) -> np.ndarray:
    """(N, D) float -> (N, ceil(D/8)) uint8, bit set where the value is positive."""
    return np.packbits(np.asarray(x) > 0, axis=1)


def int8_calibration(x: np.ndarray) -> np.ndarray:
    """(N, D) float -> (2, D) float32: each dimension's min and max over the corpus."""
    x = np.asarray(x, dtype=np.float32)
    lo, hi = x.min(axis=0), x.max(axis=0)
    return np.stack([lo, np.maximum(hi, lo + 1e-6)]).astype(np.float32)


def int8_codes(x: np.ndarray, calibration: np.ndarray) -> np.ndarray:
    """(N, D) float -> (N, D) int8 in [-128, 127]; values outside the calibrated range are clipped."""
    lo, hi = calibration
    step = (hi - lo) / 255.0
    return np.clip(np.rint((np.asarray(x, dtype=np.float32) - lo) / step) - 128, -128, 127).astype(np.int8)


def int8_dequantize(codes: np.ndarray, calibration: np.ndarray) -> np.ndarray:
    lo, hi = calibration
    return lo + (codes.astype(np.float32) + 128.0) * ((hi - lo) / 255.0)


def stored_codes(x: np.ndarray, calibration: np.ndarray, float16: bool) -> dict[str, np.ndarray]:
    """The arrays an index stores for unit vectors ``x`` (N, D): binary and int8 codes, and float16 copies."""
    out = {"binary": binary_codes(x), "int8": int8_codes(x, calibration)}
    if float16:
        out["float16"] = np.asarray(x).astype(np.float16)
    return out


def hamming(q: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Hamming distances (Q, N) between packed codes q (Q, B) and codes (N, B)."""
    if codes.shape[1] % 8 == 0:  # 8 bytes at a time
        q, codes = np.ascontiguousarray(q).view(np.uint64), np.ascontiguousarray(codes).view(np.uint64)
    out = np.zeros((q.shape[0], codes.shape[0]), dtype=np.int32)
    for i in range(q.shape[0]):
        out[i] = np.bitwise_count(codes ^ q[i]).sum(axis=1, dtype=np.int32)
    return out


def top_k(scores: np.ndarray, k: int, largest: bool = True) -> np.ndarray:
    """Indices (Q, min(k, N)) of the k best of each row of scores (Q, N), best first; ties keep
    the lower index first (a stable order, so results are reproducible)."""
    n = scores.shape[1]
    k = min(k, n)
    if k == 0:
        return np.zeros((scores.shape[0], 0), dtype=np.int64)
    s = -scores if largest else scores
    out = np.empty((s.shape[0], k), dtype=np.int64)
    for i in range(s.shape[0]):
        # everything up to the k-th value (ties included), then a stable sort: lower index first among equals
        kth = np.partition(s[i], k - 1)[k - 1] if k < n else np.inf
        cand = np.flatnonzero(s[i] <= kth)
        out[i] = cand[np.argsort(s[i, cand], kind="stable")[:k]]
    return out
