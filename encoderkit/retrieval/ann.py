"""The approximate binary first stage for large indexes: faiss ``IndexBinaryIVF`` over the packed
codes (k-means cells on Hamming space; a query scans ``nprobe`` cells). Below ``--ann-threshold``
passages the first stage is exact numpy Hamming search instead (:func:`encoderkit.retrieval.codes.hamming`).

usearch's HNSW was tried first: at one thread it adds ~1,400 binary vectors a second here, so 1M
would take over ten minutes to build; the IVF trains on a sample and builds in seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from encoderkit.errors import EncoderkitError

NPROBE = 32


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise EncoderkitError("the approximate first stage needs faiss: pip install 'encoderkit[search]'") from e
    return faiss


def build_binary_ivf(codes: np.ndarray, seed: int = 0):
    """An IndexBinaryIVF over ``codes`` (N, B) uint8 with sqrt(N) cells (at most 1,024), k-means (8 iterations)
    on up to 16 codes per cell: faiss trains binary k-means in float, so training time grows with sample x cells,
    and a rough clustering is enough for cells that are probed 32 at a time."""
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
    index.nprobe = NPROBE
    return index


def save(index, path: Path) -> None:
    _faiss().write_index_binary(index, str(path))


def load(path: Path):
    index = _faiss().read_index_binary(str(path))
    index.nprobe = NPROBE
    return index


def search(index, q_codes: np.ndarray, k: int) -> np.ndarray:
    """Row indices (Q, k) of the (approximately) nearest codes; -1 where fewer were found."""
    _, idx = index.search(np.ascontiguousarray(q_codes), k)
    return idx
