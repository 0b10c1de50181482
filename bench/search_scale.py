"""Search speed at 1M vectors: binary first stage + int8 rescoring vs exact float search.

The 1M vectors are SYNTHETIC (384-d, MiniLM's dimension; unit Gaussian vectors, queries are
noisy copies of random rows): they measure speed and memory only. Quality (the overlap of the
top-10 with exact float search) is measured on REAL embeddings: the float16 vectors of a SciFact
index built by bench/search_scifact.py (--real DIR) with the 300 test queries.

Compared, one query at a time, one thread:
* float exact: numpy (queries . float32 matrix, then a partial sort) and faiss IndexFlatIP;
* binary + int8 rescore (4 x 10 candidates): exact numpy Hamming, and the faiss binary IVF the
  index uses past its ANN threshold.

    OMP_NUM_THREADS=1 nice python bench/search_scale.py --n 1000000 --real /tmp/scifact-idx
Last line: RESULT key=value ...
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from encoderkit.hardware import describe, result_field

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pcts(times: list[float]) -> tuple[float, float]:
    return 1000 * float(np.percentile(times, 50)), 1000 * float(np.percentile(times, 99))


def timed(fn, queries: np.ndarray) -> tuple[list[float], list]:
    times, out = [], []
    for i in range(len(queries)):
        t = time.perf_counter()
        out.append(fn(queries[i : i + 1]))
        times.append(time.perf_counter() - t)
    return times, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dims", type=int, default=384)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--real", default="/tmp/scifact-idx", help="a SciFact index with --float16 (bench/search_scifact.py)")
    ap.add_argument("--real-only", action="store_true", help="only the overlap on real embeddings")
    args = ap.parse_args()
    import faiss

    faiss.omp_set_num_threads(1)

    from encoderkit.retrieval import ann
    from encoderkit.retrieval.codes import binary_codes, int8_calibration, int8_codes
    from encoderkit.retrieval.search import Searcher, SearchSettings
    from encoderkit.retrieval.store import Generation

    print(f"hardware: {describe()}", flush=True)
    st = SearchSettings(10, "binary", "int8", 4)
    if args.real_only:
        line = {f"real_overlap_{k}": v for k, v in real_overlaps(args.real, st).items()}
        print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in line.items()) + " " + result_field())
        return 0
    print(f"SYNTHETIC vectors for speed: {args.n:,} x {args.dims} unit Gaussian float32 ({args.n * args.dims * 4 / 2**30:.2f} GiB)",
          flush=True)
    rng = np.random.default_rng(0)
    base_rss = rss_mb()
    x = np.empty((args.n, args.dims), dtype=np.float32)
    for s in range(0, args.n, 100_000):
        blk = rng.standard_normal((min(100_000, args.n - s), args.dims), dtype=np.float32)
        x[s : s + len(blk)] = blk / np.linalg.norm(blk, axis=1, keepdims=True)
    rows = rng.choice(args.n, args.queries, replace=False)
    q = x[rows] + 0.6 * rng.standard_normal((args.queries, args.dims), dtype=np.float32) / np.sqrt(args.dims)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    float_rss = rss_mb() - base_rss

    t = time.perf_counter()
    flat = faiss.IndexFlatIP(args.dims)
    flat.add(x)
    t_flat = time.perf_counter() - t
    t = time.perf_counter()
    cal = int8_calibration(x[:: max(1, args.n // 100_000)])
    codes8 = np.concatenate([int8_codes(x[s : s + 100_000], cal) for s in range(0, args.n, 100_000)])
    bits = np.concatenate([binary_codes(x[s : s + 100_000]) for s in range(0, args.n, 100_000)])
    t_codes = time.perf_counter() - t
    t = time.perf_counter()
    ivf = ann.build_binary_ivf(bits)
    t_ivf = time.perf_counter() - t
    print(f"build: binary+int8 codes {t_codes:.1f} s, binary IVF {t_ivf:.1f} s, faiss flat {t_flat:.1f} s", flush=True)

    gen = Generation({"dims": args.dims, "model": {"fingerprint": "synthetic"}}, [{"id": str(i), "doc_id": str(i), "text": ""}
                                                                                 for i in range(args.n)],
                     {"binary": bits, "int8": codes8, "int8_calibration": cal})
    s_exact = Searcher(gen, Path("."))
    s_ivf = Searcher(gen, Path("."))
    s_ivf._ivf = ivf

    def float_numpy(qq):
        sc = qq @ x.T
        top = np.argpartition(-sc[0], 10)[:10]
        return top[np.argsort(-sc[0, top])]

    res = {}
    res["float_numpy"] = timed(float_numpy, q)
    res["float_faiss_flat"] = timed(lambda qq: flat.search(qq, 10)[1][0], q)
    res["binary_exact_rescore"] = timed(lambda qq: s_exact.dense(qq, st, 40)[0][0][:10], q)
    res["binary_ivf_rescore"] = timed(lambda qq: s_ivf.dense(qq, st, 40)[0][0][:10], q)
    ref = [set(r.tolist()) for r in res["float_numpy"][1]]
    print(f"\nRSS: float32 matrix {float_rss:.0f} MB; binary codes {bits.nbytes / 2**20:.0f} MB (in RAM), int8 "
          f"{codes8.nbytes / 2**20:.0f} MB (memory-mapped from disk in the index); process now {rss_mb():.0f} MB", flush=True)
    print(f"\n{'method (1M synthetic, 1 query, 1 thread)':44s} p50 ms   p99 ms   speed-up vs numpy float (p50)  overlap@10 (synthetic)")
    base = pcts(res["float_numpy"][0])[0]
    summary = {}
    for name, (times, out) in res.items():
        p50, p99 = pcts(times)
        ov = np.mean([len(set(np.asarray(o).tolist()) & r) / 10 for o, r in zip(out, ref, strict=True)])
        summary[name] = (p50, p99, ov)
        print(f"{name:44s} {p50:7.2f}  {p99:7.2f}  {base / p50:6.1f}x  {ov:.3f}", flush=True)

    real_overlap = real_overlaps(args.real, st) if args.real else {}
    f50 = summary["float_numpy"][0]
    line = {"n": args.n, "float_numpy_p50_ms": f50, "float_faiss_p50_ms": summary["float_faiss_flat"][0],
            "binary_exact_rescore_p50_ms": summary["binary_exact_rescore"][0],
            "binary_ivf_rescore_p50_ms": summary["binary_ivf_rescore"][0],
            "speedup_exact": f50 / summary["binary_exact_rescore"][0], "speedup_ivf": f50 / summary["binary_ivf_rescore"][0],
            "build_ivf_s": t_ivf, **{f"real_overlap_{k}": v for k, v in real_overlap.items()}}
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items())
          + " " + result_field())
    return 0


def real_overlaps(real: str, st) -> dict[str, float]:
    """Overlap@10 of binary + int8 rescore (exact and IVF) with exact float search, on real SciFact embeddings."""
    from encoderkit.retrieval import ann
    from encoderkit.retrieval.beir import load_retrieval
    from encoderkit.retrieval.search import Searcher

    s_real = Searcher.open(real, runtime="onnx-fp32", threads=1)
    g = s_real.gen
    vec = np.asarray(g.arrays["float16"], dtype=np.float32)
    data = load_retrieval("/work/shared/data/scifact/scifact_hf_export.zip#test")
    qv = s_real.embed([data.queries[k] for k in data.qrels]).vectors
    exact = [set(np.argsort(-(vec @ qq), kind="stable")[:10].tolist()) for qq in qv]
    out = {}
    s_exact = Searcher(g, Path(real))
    s_exact._ivf = None
    s_real._ivf = ann.build_binary_ivf(np.asarray(g.arrays["binary"]))
    for name, srch in (("binary_exact_rescore", s_exact), ("binary_ivf_rescore", s_real)):
        got = srch.dense(qv, st, 40)[0][:, :10]
        out[name] = float(np.mean([len(set(r.tolist()) & e) / 10 for r, e in zip(got, exact, strict=True)]))
    print(f"overlap@10 with exact float on REAL embeddings (SciFact, {len(vec)} MiniLM passages, 300 test queries, "
          f"passage level): " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()), flush=True)
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
