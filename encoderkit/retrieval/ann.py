"""faiss indexes over the packed binary codes, the binary first stage (Hamming distance): exact ``IndexBinaryFlat``
at any size (hardware popcount; without faiss, :func:`encoderkit.retrieval.codes.hamming`, same results), and past
``--ann-threshold`` passages the approximate ``IndexBinaryIVF``, which scans a fixed share of its cells
(:func:`nprobe`) so that its recall does not fall as the index grows. Timings and the HNSW tried first:
docs/search.md ("Scale")."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from encoderkit.errors import EncoderkitError

# Passages past which an index builds the IVF (``encoderkit index --ann-threshold``): below it the exact scan with
# int8 rescoring is fast enough and keeps more of the top-10 (docs/search.md, "Scale").
ANN_THRESHOLD = 2_000_000
PROBE_SHARE = 0.3  # cells scanned per query, as a share of the IVF's cells (smaller shares: docs/search.md, "Scale")
MIN_PROBE = 8


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise EncoderkitError("the approximate first stage needs faiss: pip install 'encoderkit[search]'") from e
    return faiss


@functools.cache
def available() -> bool:
    """Whether faiss is installed (looked up once: the exact binary stage asks on every search)."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def nprobe(nlist: int) -> int:
    """Cells an IVF of ``nlist`` cells scans per query: PROBE_SHARE of them, at least MIN_PROBE (all of a small one)."""
    return min(nlist, max(MIN_PROBE, int(np.ceil(PROBE_SHARE * nlist))))


def build_binary_flat(codes: np.ndarray):
    """An exact IndexBinaryFlat holding a copy of ``codes`` (N, B) uint8."""
    index = _faiss().IndexBinaryFlat(codes.shape[1] * 8)
    index.add(np.ascontiguousarray(codes))
    return index


def build_binary_ivf(codes: np.ndarray, seed: int = 0):
    """An IndexBinaryIVF over ``codes`` (N, B) uint8 with sqrt(N) cells (at most 1,024), k-means (8 iterations)
    on up to 16 codes per cell: faiss trains binary k-means in float, so training time grows with sample x cells,
    and a rough clustering is enough for cells that are probed many at a time."""
    faiss = _faiss()
    n, nbytes = codes.shape
    nlist = max(1, min(1024, int(np.sqrt(n))))
    quantizer = faiss.IndexBinaryFlat(nbytes * 8)
    index = faiss.IndexBinaryIVF(quantizer, nbytes * 8, nlist)
    index.cp.seed = seed
    index.cp.niter = 8
    rng = np.random.default_rng(seed)
    sample = codes[np.sort(rng.choice(n, size=min(n, 16 * nlist), replace=False))]
    index.train(np.ascontiguousarray(sample))
    index.add(np.ascontiguousarray(codes))
    index.nprobe = nprobe(nlist)
    return index


def save(index, path: Path) -> None:
    _faiss().write_index_binary(index, str(path))


def load(path: Path):
    index = _faiss().read_index_binary(str(path))
    index.nprobe = nprobe(index.nlist)
    return index


def search(index, q_codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (Q, k) of the nearest codes, nearest first, and their Hamming distances (Q, k) float32;
    rows are -1 (distances inf) where fewer than k were found."""
    dist, idx = index.search(np.ascontiguousarray(q_codes), k)
    dist = dist.astype(np.float32)
    dist[idx < 0] = np.inf
    return idx, dist
