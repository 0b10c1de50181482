"""Search speed at 1M vectors: the binary first stage + int8 rescoring vs exact float search.

The 1M vectors are SYNTHETIC (384-d, MiniLM's dimension; unit Gaussian vectors, queries are
noisy copies of random rows): they measure build time, memory and speed only. Quality (the
overlap of the top-10 passages with exact float search) is measured on REAL embeddings: the
float16 vectors of a SciFact index built by bench/search_scifact.py (--real DIR) with the 300 BEIR
test queries, with the same first stages: exact Hamming (faiss IndexBinaryFlat) and the binary IVF
as the index builds it at that size (sqrt(N) cells, the same share of them probed as at 1M).

Compared, one query at a time, one thread (set OMP_NUM_THREADS=1):
* float exact: numpy (query . float32 matrix, then a partial sort) and faiss IndexFlatIP;
* binary exact + int8 rescore: faiss IndexBinaryFlat (the index's exact first stage), and the
  numpy popcount it replaced (np.bitwise_count, the fallback without faiss);
* binary IVF + int8 rescore: the faiss IndexBinaryIVF the index builds past its ANN threshold.

    OMP_NUM_THREADS=1 nice python bench/search_scale.py --n 1000000 --real /tmp/scifact-idx
    OMP_NUM_THREADS=1 nice python bench/search_scale.py --real-only --real /tmp/scifact-idx
Last line: RESULT key=value ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from encoderkit.hardware import describe, result_field


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pcts(times: list[float]) -> tuple[float, float]:
    return 1000 * float(np.percentile(times, 50)), 1000 * float(np.percentile(times, 99))


def timed(fn, queries: np.ndarray) -> tuple[list[float], list]:
    fn(queries[:1])  # warm-up (first touch of pages, lazy indexes)
    times, out = [], []
    for i in range(len(queries)):
        t = time.perf_counter()
        out.append(fn(queries[i : i + 1]))
        times.append(time.perf_counter() - t)
    return times, out


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dims", type=int, default=384)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--multiplier", type=int, default=0,
                    help="rescore multiplier timed at --n (0: the index's default at that size)")
    ap.add_argument("--real", default="/tmp/scifact-idx",
                    help="a SciFact index with --float16 (bench/search_scifact.py); '' skips")
    ap.add_argument("--real-only", action="store_true", help="only the overlap on real embeddings")
    ap.add_argument("--multipliers", default="4,10,20,40", help="rescore multipliers whose real overlap is measured")
    ap.add_argument("--nprobes", default="",
                    help="extra IVF nprobe values timed at --n (the index's own is always timed)")
    args = ap.parse_args()
    import faiss

    faiss.omp_set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"hardware: {describe()}", flush=True)
    print(load(), flush=True)
    mults = [int(m) for m in args.multipliers.split(",")]
    if args.real_only:
        line = {f"real_overlap_{k}": v for k, v in real_overlaps(args.real, mults, shares(args)).items()}
        print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in line.items()) + " " + result_field())
        return 0
    line = synthetic(args)
    if args.real:
        line.update({f"real_overlap_{k}": v for k, v in real_overlaps(args.real, mults, shares(args)).items()})
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items())
          + " " + result_field())
    return 0


def synthetic(args) -> dict:
    import faiss

    from encoderkit.retrieval import ann
    from encoderkit.retrieval.codes import binary_codes, hamming, int8_calibration, int8_codes, top_k
    from encoderkit.retrieval.search import Searcher, SearchSettings, default_multiplier
    from encoderkit.retrieval.store import Generation

    n, d = args.n, args.dims
    mult = args.multiplier or default_multiplier(n)
    print(f"SYNTHETIC vectors for speed and memory: {n:,} x {d} unit Gaussian float32 ({n * d * 4 / 2**20:,.0f} MiB); "
          f"{args.queries} queries one at a time; rescoring {mult} x 10 candidates", flush=True)
    rng = np.random.default_rng(0)
    mem, build = {}, {}
    x = np.empty((n, d), dtype=np.float32)
    for s in range(0, n, 100_000):
        blk = rng.standard_normal((min(100_000, n - s), d), dtype=np.float32)
        x[s : s + len(blk)] = blk / np.linalg.norm(blk, axis=1, keepdims=True)
    rows = rng.choice(n, args.queries, replace=False)
    q = x[rows] + 0.6 * rng.standard_normal((args.queries, d), dtype=np.float32) / np.sqrt(d)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    mem["float32 matrix (numpy)"] = x.nbytes / 2**20  # (RSS also counts the generation's temporaries)

    def step(name, fn):
        r, t = rss_mb(), time.perf_counter()
        out = fn()
        build[name], mem[name] = time.perf_counter() - t, rss_mb() - r
        print(f"  built {name}: {build[name]:.1f} s, +{mem[name]:.0f} MiB resident ({load()})", flush=True)
        return out

    def float_flat():
        index = faiss.IndexFlatIP(d)
        index.add(x)
        return index

    flat = step("faiss IndexFlatIP", float_flat)
    cal = int8_calibration(x[:: max(1, n // 100_000)])
    bits = step("binary codes",
                lambda: np.concatenate([binary_codes(x[s : s + 100_000]) for s in range(0, n, 100_000)]))
    codes8 = step("int8 codes",
                  lambda: np.concatenate([int8_codes(x[s : s + 100_000], cal) for s in range(0, n, 100_000)]))
    bflat = step("faiss IndexBinaryFlat", lambda: ann.build_binary_flat(bits))
    ivf = step("faiss IndexBinaryIVF", lambda: ann.build_binary_ivf(bits))
    print(f"  IVF: {ivf.nlist} cells, nprobe {ivf.nprobe}", flush=True)

    gen = Generation({"dims": d, "model": {"fingerprint": "synthetic"}},
                     [{"id": str(i), "doc_id": str(i), "text": ""} for i in range(n)],
                     {"binary": bits, "int8": codes8, "int8_calibration": cal})
    s_exact, s_ivf = Searcher(gen, Path(".")), Searcher(gen, Path("."))
    s_exact._flat, s_ivf._ivf = bflat, ivf
    st = SearchSettings(10, "binary", "int8", mult)

    def float_numpy(qq):
        sc = qq @ x.T
        top = np.argpartition(-sc[0], 10)[:10]
        return top[np.argsort(-sc[0, top])]

    def numpy_popcount(qq):  # the first stage this replaced (and the fallback without faiss), then the same rescoring
        dist = hamming(binary_codes(qq), bits)
        cand = top_k(dist, 10 * mult, largest=False)[0]
        from encoderkit.retrieval.codes import int8_dequantize

        sc = int8_dequantize(codes8[cand], cal) @ qq[0]
        return cand[np.argsort(-sc, kind="stable")[:10]]

    methods = {
        "float exact, numpy": float_numpy,
        "float exact, faiss IndexFlatIP": lambda qq: flat.search(qq, 10)[1][0],
        f"binary exact (numpy bitwise_count) + int8 {mult}x10": numpy_popcount,
        f"binary exact (faiss IndexBinaryFlat) + int8 {mult}x10":
            lambda qq: s_exact.dense(qq, st, 10 * mult)[0][0][:10],
        f"binary IVF (nprobe {ivf.nprobe}/{ivf.nlist}) + int8 {mult}x10":
            lambda qq: s_ivf.dense(qq, st, 10 * mult)[0][0][:10],
    }
    own = ivf.nprobe
    for npr in [int(v) for v in args.nprobes.split(",") if v and int(v) != own]:
        methods[f"binary IVF (nprobe {npr}/{ivf.nlist}) + int8 {mult}x10"] = \
            lambda qq, npr=npr: (setattr(ivf, "nprobe", npr), s_ivf.dense(qq, st, 10 * mult)[0][0][:10],
                                 setattr(ivf, "nprobe", own))[1]
    res = {}
    for name, fn in methods.items():
        res[name] = timed(fn, q)
        print(f"  timed {name} ({load()})", flush=True)
    ref = [set(r.tolist()) for r in res["float exact, numpy"][1]]
    f50, f99 = pcts(res["float exact, numpy"][0])
    ff50 = pcts(res["float exact, faiss IndexFlatIP"][0])[0]
    print(f"\n{n:,} SYNTHETIC vectors, 1 query at a time, 1 thread; {load()}")
    print(f"{'method':58s} {'p50 ms':>8s} {'p99 ms':>8s} {'vs numpy':>9s} {'vs faiss':>9s}  overlap@10 (synthetic, "
          "meaningless)")
    summary = {}
    for name, (times, out) in res.items():
        p50, p99 = pcts(times)
        ov = float(np.mean([len(set(np.asarray(o).tolist()) & r) / 10 for o, r in zip(out, ref, strict=True)]))
        summary[name] = p50
        print(f"{name:58s} {p50:8.2f} {p99:8.2f} {f50 / p50:8.1f}x {ff50 / p50:8.1f}x  {ov:.3f}", flush=True)
    print("\nbuild s / resident MiB: " + "; ".join(f"{k} {build.get(k, 0):.1f} s {v:.0f} MiB" for k, v in mem.items()))
    print(f"(array sizes: float32 {x.nbytes / 2**20:.0f} MiB, binary {bits.nbytes / 2**20:.0f} MiB, int8 "
          f"{codes8.nbytes / 2**20:.0f} MiB; "
          "an index keeps binary in RAM and memory-maps int8 from disk)", flush=True)
    names = list(methods)
    return {"n": n, "multiplier": mult, "float_numpy_p50_ms": f50, "float_numpy_p99_ms": f99,
            "float_faiss_p50_ms": ff50,
            "binary_numpy_p50_ms": summary[names[2]], "binary_flat_p50_ms": summary[names[3]],
            "binary_ivf_p50_ms": summary[names[4]],
            "speedup_flat": f50 / summary[names[3]], "speedup_ivf": f50 / summary[names[4]],
            "build_ivf_s": build["faiss IndexBinaryIVF"], "nprobe": ivf.nprobe, "nlist": ivf.nlist}


def shares(args) -> list[float]:
    """The share of the 1M IVF's cells each --nprobes value scans (the real IVF probes the same shares too)."""
    nlist = max(1, min(1024, int(np.sqrt(args.n))))
    return [int(v) / nlist for v in args.nprobes.split(",") if v]


def real_overlaps(real: str, mults: list[int], extra_shares: list[float]) -> dict[str, float]:
    """Overlap@10 (passages) with exact float search on real SciFact embeddings, binary + int8 (and float) rescoring of
    m x 10 candidates after the exact and the IVF first stage."""
    from encoderkit.data.beir import load_retrieval
    from encoderkit.retrieval import ann
    from encoderkit.retrieval.search import Searcher, SearchSettings

    s = Searcher.open(real, backend="onnx-fp32", threads=1)
    g = s.gen
    vec = np.asarray(g.arrays["float16"], dtype=np.float32)
    data = load_retrieval("/work/shared/data/scifact/scifact_hf_export.zip#test")
    qv = s.embed([data.queries[k] for k in data.qrels]).vectors
    exact = [set(np.argsort(-(vec @ qq), kind="stable")[:10].tolist()) for qq in qv]
    s_exact, s_ivf = Searcher(g, Path(real)), Searcher(g, Path(real))
    s_exact._ivf = None
    s_ivf._ivf = ann.build_binary_ivf(np.asarray(g.arrays["binary"]))
    print(f"\noverlap@10 (passages) with exact float on REAL embeddings: SciFact, {len(vec):,} MiniLM passages, "
          f"{len(qv)} test queries; IVF as the index builds it at this size: {s_ivf._ivf.nlist} cells, "
          f"nprobe {s_ivf._ivf.nprobe} (the same share as at 1M)", flush=True)
    print(f"{'first stage':12s} {'rescore':8s} " + " ".join(f"{m:>5d}x10" for m in mults))
    out = {}
    ivf, own = s_ivf._ivf, s_ivf._ivf.nprobe
    for fname, srch, npr in [("exact", s_exact, own), ("ivf", s_ivf, own)] + [
            (f"ivf {sh:.0%}", s_ivf, max(1, round(sh * ivf.nlist))) for sh in extra_shares]:
        ivf.nprobe = npr
        for rescore in ("int8", "float"):
            vals = []
            for m in mults:
                got = srch.dense(qv, SearchSettings(10, "binary", rescore, m), 10 * m)[0][:, :10]
                v = float(np.mean([len(set(r.tolist()) & e) / 10 for r, e in zip(got, exact, strict=True)]))
                vals.append(v)
                out[f"{fname.replace(' ', '').replace('%', 'pct')}_{rescore}_{m}x"] = v
            print(f"{fname:12s} {rescore:8s} " + " ".join(f"{v:8.3f}" for v in vals), flush=True)
    ivf.nprobe = own
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
