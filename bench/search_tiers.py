"""Search tiers on BEIR SciFact (test: 300 queries, the 5,183-document corpus), side by side in one process:
bytes per document, texts/s to index, ms per query and nDCG@10 of each tier, and the static first stage of the
tiered index (``index --first-stage-model``) against the full encoder alone.

Documents are not split (``--passage-tokens -1``: the full encoder truncates at its 256 tokens, the static model
reads every token). Rows:

- full encoder (``--model``, Predictor ``--backend``): one plain index (``--float16``), searched ``float`` exact,
  ``int8``, ``binary``, ``binary + int8 rescore`` (the default search: "the full encoder alone" below), that plus
  BM25 fusion, and with ``--rerank DIR`` that plus a cross-encoder on the top ``--rerank-top`` (its order alone, and
  fused
  with the first stage's: ``search --rerank-fuse``);
- static alone (``--static``, or distilled here from ``--model`` on the corpus with the defaults): a plain index of
  the static model, searched float exact and int8, and float fused with BM25 (reciprocal rank, what ``search
  --bm25`` does; no full encoder anywhere: its query+index ratio is computed as the tiered rows' are);
- the tiered index, lazy full codes: for each ``--multipliers`` M, a fresh build, then the queries: static int8
  candidates (M x 10) rescored by the full encoder's int8 codes, made the first time a document is a candidate.

Timing: each query alone (embedding + search, and for the lazy rows the full encoder's pass over new
candidates), ms per query = the median (the mean is printed too: the lazy rows' first queries pay for the codes).
"query+index" throughput ratio = (full encoder index build + its 300 default searches) / (tiered build + its 300
searches): what it costs to serve this workload from nothing. ``--subset`` N repeats it with the first N queries
only (a workload with fewer queries per document, fresh build). Index builds are timed once.

    nice -n 5 python bench/search_tiers.py --static /tmp/static        # last line: RESULT key=value ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "scifact" / "scifact_hf_export.zip"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=f"{DATA}#test", help="BEIR source PATH#SPLIT")
    ap.add_argument("--model", default="minilm", help="the full encoder")
    ap.add_argument("--static", default=None, help="a static folder distilled from --model (default: distil one here)")
    ap.add_argument("--fit-texts", type=int, default=None,
                    help="distil the static model here with this many fit texts (default: distill's own default)")
    ap.add_argument("--backend", default="auto", help="the full encoder's Predictor backend (auto: what index runs)")
    ap.add_argument("--multipliers", default="4,10", help="rescored candidates per result of the tiered rows")
    ap.add_argument("--subset", type=int, default=30, help="also time a workload of the first N queries (0: no)")
    ap.add_argument("--sparse", default=None, help="a finetune --task sparse folder (SPLADE) for the sparse rows")
    ap.add_argument("--sparse-backend", default="torch-bf16", help="the sparse model's Predictor backend")
    ap.add_argument("--rerank", default=None, help="a cross-encoder folder for the rerank row")
    ap.add_argument("--rerank-top", type=int, default=100)
    ap.add_argument("--work", default=None, help="folder for the indexes (default: a temporary one)")
    args = ap.parse_args()
    from encoderkit.compress.distill import DistillConfig
    from encoderkit.compress.distill import run as distill
    from encoderkit.data.beir import load_retrieval
    from encoderkit.hardware import describe, result_field
    from encoderkit.metrics.ranking import retrieval_scores
    from encoderkit.retrieval.first_stage import CALIBRATION_SAMPLE
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import Searcher, SearchSettings
    from encoderkit.tasks.common import resolve_model

    print(f"hardware: {describe()}", flush=True)
    data = load_retrieval(args.data)
    qids = list(data.qrels)
    texts = [data.queries[q] for q in qids]
    corpus = [str(args.data).split("#")[0]]
    model = str(resolve_model(args.model))
    tmp = tempfile.TemporaryDirectory()
    work = Path(args.work or tmp.name)
    rows: list[dict] = []

    def timed_queries(s: Searcher, st: SearchSettings, n: int | None = None) -> tuple[list[list[str]], list[float]]:
        hits, lat = [], []
        for t in texts[:n]:
            a = time.perf_counter()
            res = s.search([t], st)
            lat.append(time.perf_counter() - a)
            hits.append([h.doc_id for h in res[0].hits])
        return hits, lat

    def ndcg(hits: list[list[str]]) -> float:
        return retrieval_scores(dict(zip(qids, hits, strict=True)), data.qrels)["ndcg@10"]

    def row(name: str, bytes_doc: float, index_s: float | None, n_docs: int, hits, lat, **extra) -> dict:
        r = {"name": name, "bytes": bytes_doc, "texts_s": n_docs / index_s if index_s else None,
             "ms": 1000 * float(np.median(lat)), "ms_mean": 1000 * float(np.mean(lat)), "ndcg": ndcg(hits),
             "query_s": float(np.sum(lat)), "index_s": index_s, "lat": list(lat), **extra}
        rows.append(r)
        print(f"{name}: nDCG@10 {r['ndcg']:.4f}, {r['bytes']:.0f} bytes/doc, p50 {r['ms']:.2f} ms (mean "
              f"{r['ms_mean']:.2f}), "
              + (f"index {r['texts_s']:.1f} texts/s" if index_s else ""), flush=True)
        return r

    # -- the full encoder alone ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    st = index(IndexConfig(model=model, corpus=corpus, out=str(work / "full"), float16=True, backend=args.backend,
                           passage_tokens=-1)).stats
    full_index_s = time.perf_counter() - t0
    n = st["passages"]
    size = {k.removesuffix(".npy"): v / n for k, v in st["bytes"].items()}
    print(f"full index: {n} passages, {full_index_s:.0f} s", flush=True)
    s = Searcher.open(work / "full")
    full_rows = {}
    for name, setting, b in (("float exact (float16)", SearchSettings(first_stage="float", rescore="none"),
                              size["float16"]),
                             ("int8", SearchSettings(first_stage="int8", rescore="none"), size["int8"]),
                             ("dense binary", SearchSettings(first_stage="binary", rescore="none"), size["binary"]),
                             ("binary + int8 rescore 4x10", SearchSettings(), size["binary"] + size["int8"]),
                             ("binary + int8 rescore + BM25 fusion", SearchSettings(bm25=True),
                              size["binary"] + size["int8"])):
        if setting.bm25:
            s.search(["warm up"], setting)  # bm25s index built on first use, not timed
        full_rows[name] = row(name, b, full_index_s, n, *timed_queries(s, setting))
    if args.rerank:
        s = Searcher.open(work / "full", rerank=args.rerank)
        for fuse in (False, True):  # the cross-encoder's order alone, and fused with the order it reranked
            setting = SearchSettings(bm25=True, rerank_top=args.rerank_top, rerank_fuse=fuse)
            row(f"+ rerank top {args.rerank_top}" + (", fused with the first stage's order" if fuse else ""),
                size["binary"] + size["int8"], full_index_s, n, *timed_queries(s, setting))
    if args.sparse:  # an inverted index of the SPLADE vectors: alone, and fused with the default search and BM25
        t0 = time.perf_counter()
        sst = index(IndexConfig(model=str(args.sparse), corpus=corpus, out=str(work / "sparse"),
                                backend=args.sparse_backend,
                                passage_tokens=-1, batch_size=16)).stats
        sparse_s = time.perf_counter() - t0
        sbytes = sum(sst["bytes"].values()) / n
        row("sparse (SPLADE), inverted index", sbytes, sparse_s, n,
            *timed_queries(Searcher.open(work / "sparse"), SearchSettings()))
        s = Searcher.open(work / "full")
        s.fuse_with([work / "sparse"])
        setting = SearchSettings(bm25=True)
        s.search(["warm up"], setting)
        row("binary + int8 rescore + sparse + BM25 fusion", size["binary"] + size["int8"] + sbytes,
            full_index_s + sparse_s, n, *timed_queries(s, setting))
    default = full_rows["binary + int8 rescore 4x10"]
    best_full = full_rows["float exact (float16)"]["ndcg"]

    # -- static alone ----------------------------------------------------------------------------------------
    static = args.static
    distill_s = None
    if static is None:
        static = str(work / "static")
        t0 = time.perf_counter()
        fit = {} if args.fit_texts is None else {"fit_texts": args.fit_texts}
        distill(DistillConfig(teacher=model, out=static, to="static", train=corpus[0], **fit))
        distill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    st = index(IndexConfig(model=static, corpus=corpus, out=str(work / "static-idx"), float16=True,
                           passage_tokens=-1)).stats
    static_index_s = time.perf_counter() - t0
    ssize = {k.removesuffix(".npy"): v / n for k, v in st["bytes"].items()}
    s = Searcher.open(work / "static-idx")
    row("static (float16 exact)", ssize["float16"], static_index_s, n,
        *timed_queries(s, SearchSettings(first_stage="float", rescore="none")))
    row("static (int8)", ssize["int8"], static_index_s, n,
        *timed_queries(s, SearchSettings(first_stage="int8", rescore="none")))
    fused_setting = SearchSettings(first_stage="float", rescore="none", bm25=True)
    s.search(["warm up"], fused_setting)  # bm25s index built on first use, not timed
    static_bm25 = row("static (float16) + BM25 fusion, no full encoder", ssize["float16"], static_index_s, n,
                      *timed_queries(s, fused_setting))
    static_bm25["ratio"] = (full_index_s + default["query_s"]) / (static_index_s + static_bm25["query_s"])
    print(f"  static + BM25: nDCG@10 {static_bm25['ndcg'] / best_full:.1%} of the full encoder's float exact; "
          "query+index "
          f"throughput {static_bm25['ratio']:.2f}x the full encoder's (the static model's distillation not counted)",
          flush=True)
    if distill_s is not None:  # distilled here, on this corpus: counted as part of what serving it from nothing costs
        static_bm25["ratio_distilled"] = ((full_index_s + default["query_s"])
                                          / (distill_s + static_index_s + static_bm25["query_s"]))
        print(f"  counting the distillation ({distill_s:.0f} s): {static_bm25['ratio_distilled']:.2f}x", flush=True)

    # -- the tiered index: static int8 candidates, full int8 rescoring, lazy codes ---------------------------
    def tiered(out: Path) -> tuple[float, Searcher]:
        t0 = time.perf_counter()
        index(IndexConfig(model=model, corpus=corpus, out=str(out), first_stage_model=static, backend=args.backend,
                          passage_tokens=-1, rebuild=True))
        return time.perf_counter() - t0, Searcher.open(out)

    ratios = {}
    for m in [int(x) for x in args.multipliers.split(",") if x.strip()]:
        build_s, s = tiered(work / f"tier{m}")
        setting = SearchSettings(first_stage="int8", rescore="int8", rescore_multiplier=m)
        hits, lat = timed_queries(s, setting)
        embedded = len(s.tier.codes.row) - CALIBRATION_SAMPLE
        ratio = (full_index_s + default["query_s"]) / (build_s + float(np.sum(lat)))
        r = row(f"static int8 -> full int8 rescore {m}x10 (lazy)", ssize["binary"] + ssize["int8"] + size["int8"],
                build_s, n, hits, lat,
                embedded=embedded, ratio=ratio)
        ratios[m] = r
        print(f"  tiered {m}x10: build {build_s:.1f} s, 300 queries {np.sum(lat):.1f} s, {embedded} documents embedded "
              f"by the full encoder at query time (+{CALIBRATION_SAMPLE} at build); query+index throughput "
              f"{ratio:.2f}x the full encoder's; nDCG@10 {r['ndcg'] / best_full:.1%} of its float exact, "
              f"{r['ndcg'] / default['ndcg']:.1%} of its default search", flush=True)
        if args.subset:
            build_s, s = tiered(work / f"tier{m}-sub")
            _, lat = timed_queries(s, setting, args.subset)
            full_sub = full_index_s + float(np.sum(default["lat"][: args.subset]))
            r["ratio_subset"] = full_sub / (build_s + float(np.sum(lat)))
            print(f"  first {args.subset} queries only: query+index throughput {r['ratio_subset']:.2f}x", flush=True)

    print("\n| tier | bytes/doc | texts/s to index | ms per query (p50) | nDCG@10 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['bytes']:.0f} | {r['texts_s']:,.1f} | {r['ms']:.2f} | {r['ndcg']:.4f} |")
    with_distill = "given" if distill_s is None else f"{static_bm25['ratio_distilled']:.2f}"
    tier_fields = "tiers=none"
    if ratios:
        best_m = max(ratios, key=lambda m: (ratios[m]["ndcg"] / best_full >= 0.98, ratios[m]["ratio"]))
        b = ratios[best_m]
        tier_fields = (f"multiplier={best_m} ndcg10_tier={b['ndcg']:.4f} share_of_float={b['ndcg'] / best_full:.3f} "
                       f"throughput_ratio={b['ratio']:.2f}")
    extra = " ".join(f"ndcg10_tier{m}={r['ndcg']:.4f} ratio_tier{m}={r['ratio']:.2f} embedded_tier{m}={r['embedded']}"
                     + (f" ratio_tier{m}_first{args.subset}={r['ratio_subset']:.2f}" if "ratio_subset" in r else "")
                     for m, r in ratios.items())
    print(f"RESULT ndcg10_full_float={best_full:.4f} ndcg10_full_default={default['ndcg']:.4f} "
          f"ndcg10_static={rows[-len(ratios) - 2]['ndcg']:.4f} ndcg10_static_bm25={static_bm25['ndcg']:.4f} "
          f"share_static_bm25={static_bm25['ndcg'] / best_full:.3f} ratio_static_bm25={static_bm25['ratio']:.2f} "
          f"ratio_static_bm25_distilled={with_distill} "
          f"{tier_fields} {extra} "
          f"full_index_s={full_index_s:.0f} static_index_s={static_index_s:.1f} "
          f"distill_s={'given' if distill_s is None else f'{distill_s:.0f}'} docs={n} queries={len(qids)} "
          f"backend={args.backend} {result_field()}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
