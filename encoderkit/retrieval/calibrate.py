"""``encoderkit index --calibrate``: choose a precision and dimension on your own corpus, no labels.

Sample queries (a JSONL of ``{"query"}`` lines, or the first sentence of up to ``SAMPLE`` passages
drawn with a fixed seed), embed them, and for each precision x Matryoshka dimension measure:

* ``overlap@10``: the mean share of its top-10 documents that exact float32 search at the model's
  full dimension also returns (the label-free stand-in for quality);
* ``bytes_per_doc``: the bytes that setting stores per document (every array it reads);
* ``p50_ms``: the median search time of one query (embedding excluded; one thread).

The recommendation is the smallest ``bytes_per_doc`` whose overlap reaches ``--min-overlap``.
Sentences taken from the corpus find their own passage easily, so the overlap they give is an
optimistic stand-in; give real queries when you have them.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import Predictor, finish_embeddings
from encoderkit.io import write_json_atomic
from encoderkit.retrieval.codes import int8_calibration, stored_codes
from encoderkit.retrieval.search import QueryVectors, Searcher, SearchSettings, read_queries
from encoderkit.retrieval.store import Generation

SAMPLE = 200
LATENCY_QUERIES = 50
# name -> (first stage, rescore, bytes per dimension)
SETTINGS = {
    "float16": ("float", "none", 2.0),
    "int8": ("int8", "none", 1.0),
    "int8+float rescore": ("int8", "float", 3.0),
    "binary": ("binary", "none", 1 / 8),
    "binary+int8 rescore": ("binary", "int8", 1 + 1 / 8),
    "binary+float rescore": ("binary", "float", 2 + 1 / 8),
}
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def sample_queries(passages: list[dict[str, str]], path: str | None, seed: int = 0) -> list[str]:
    if path:
        return [q for _, q in read_queries(Path(path))]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(passages), size=min(SAMPLE, len(passages)), replace=False)
    return [" ".join(_SENTENCE.split(passages[i]["text"].strip())[0].split()[:40]) for i in sorted(picks)]


def dims_grid(full: int) -> list[int]:
    return [d for d in (full, full // 2, full // 4, full // 8) if d >= 16 or d == full]


def in_memory(vecs: np.ndarray, passages: list[dict[str, str]], fingerprint: str) -> Generation:
    """A generation holding every precision of unit vectors ``vecs`` (N, d)."""
    cal = int8_calibration(vecs)
    arrays = {**stored_codes(vecs, cal, float16=True), "int8_calibration": cal}
    return Generation({"dims": vecs.shape[1], "model": {"fingerprint": fingerprint}}, passages, arrays)


def calibrate(p: Predictor, full_vecs: np.ndarray, passages: list[dict[str, str]], queries_path: str | None,
              min_overlap: float, root: Path | None = None, k: int = 10, multiplier: int = 4) -> dict[str, Any]:
    """The report (see the module docstring), also written to ``root/calibration.json``."""
    queries = sample_queries(passages, queries_path)
    if not queries:
        raise EncoderkitError("--calibrate found no query to sample")
    q_full = finish_embeddings(p.embed_raw(queries), None, True)
    docs_per = len(passages) / max(1, len({x["doc_id"] for x in passages}))
    ref = Searcher(in_memory(full_vecs, passages, "calibrate"), Path("."))
    ref_top = [{h.doc_id for h in r.hits} for r in
               ref.search_vectors(QueryVectors(q_full, "calibrate"), SearchSettings(k, "float", "none", multiplier))]
    rows = []
    for d in dims_grid(full_vecs.shape[1]):
        s = Searcher(in_memory(finish_embeddings(full_vecs, d, True), passages, "calibrate"), Path("."))
        qv = QueryVectors(finish_embeddings(q_full, d, True), "calibrate")
        for name, (first, rescore, per_dim) in SETTINGS.items():
            st = SearchSettings(k, first, rescore, multiplier)
            res = s.search_vectors(qv, st)
            overlap = float(np.mean([len({h.doc_id for h in r.hits} & want) / k
                                     for r, want in zip(res, ref_top, strict=True)]))
            times = []
            for i in range(min(LATENCY_QUERIES, len(queries))):
                t = time.perf_counter()
                s.search_vectors(QueryVectors(qv.vectors[i : i + 1], "calibrate"), st)
                times.append(time.perf_counter() - t)
            rows.append({"precision": name, "dims": d, "overlap@10": round(overlap, 4),
                         "bytes_per_doc": round(per_dim * d * docs_per, 1),
                         "p50_ms": round(1000 * float(np.median(times)), 3)})
    ok = [r for r in rows if r["overlap@10"] >= min_overlap]
    best = min(ok, key=lambda r: (r["bytes_per_doc"], r["p50_ms"])) if ok else None
    report = {"queries": len(queries), "query_source": queries_path or "first sentences of sampled passages",
              "reference": f"exact float32 search at {full_vecs.shape[1]} dims", "min_overlap": min_overlap,
              "settings": rows, "recommended": best,
              "note": None if best else f"no setting reaches overlap {min_overlap}; keep float16 at full dims"}
    if root is not None:
        write_json_atomic(Path(root) / "calibration.json", report)
    return report
