"""The tiered search index on BEIR SciFact (test: 300 queries, 339 judgments; the full 5,183-document
corpus): nDCG@10, recall@100, bytes per document and query latency for each stage setting, plus
the label-free calibration report next to the true nDCG@10 of every precision x dims setting.

    OMP_NUM_THREADS=1 nice python bench/search_scifact.py --model minilm --out /tmp/scifact-idx
    OMP_NUM_THREADS=1 nice python bench/search_scifact.py --model /work/runs/scifact-emb --out /tmp/ft-idx

nDCG@10 comes from a k=10 run and recall@100 from a k=100 run of the same setting (rescoring
4 x k candidates in both). Latency: one query at a time, search only (the query embedding, the
same for every row, is reported apart), one thread. bytes/doc counts every array a setting reads
(first stage + rescoring vectors) per document (documents are cut into passages of the model's
maximum length with 32 tokens of overlap). The retrieval metrics are checked against ranx on the
float run. Last line: RESULT key=value ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from encoderkit.hardware import describe, result_field

DATA = Path("/work/shared/data/scifact/scifact_hf_export.zip")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=f"{DATA}#test")
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--out", default="/tmp/scifact-idx")
    ap.add_argument("--backend", default="onnx-fp32", help="Predictor backend (onnx-fp32: the weights as shipped)")
    ap.add_argument("--rerank", default=None, help="a cross-encoder folder for the rerank rows")
    ap.add_argument("--rerank-latency-queries", type=int, default=30,
                    help="queries timed (uncached) for the rerank rows' latency; their quality uses all queries")
    ap.add_argument("--rerank-cache", default=None,
                    help="a JSON file of the cross-encoder's pair scores, read if it was written for the same model "
                         "(fingerprint) and written back after the rerank rows: a second table scores only its new "
                         "pairs")
    ap.add_argument("--threads", type=int, default=1, help="threads of the query model and the cross-encoder")
    ap.add_argument("--skip-calibration", action="store_true")
    ap.add_argument("--passage-tokens", type=int, default=0, help="0: the model's max length less 2; -1: no split")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from encoderkit.data.beir import load_retrieval
    from encoderkit.inference.predictor import finish_embeddings
    from encoderkit.metrics.ranking import retrieval_scores
    from encoderkit.retrieval.calibrate import SETTINGS, calibrate, dims_grid, in_memory
    from encoderkit.retrieval.index import IndexConfig, embed_texts
    from encoderkit.retrieval.index import run as build
    from encoderkit.retrieval.search import QueryVectors, Searcher, SearchSettings
    from encoderkit.tasks.common import resolve_model

    model = str(resolve_model(args.model))
    print(f"hardware: {describe()}", flush=True)
    data = load_retrieval(args.data)
    qids = list(data.qrels)
    texts = [data.queries[q] for q in qids]
    t0 = time.perf_counter()
    if not Path(args.out, "CURRENT").is_file():
        st = build(IndexConfig(model=model, corpus=[args.data], out=args.out, float16=True, backend=args.backend,
                               threads=args.threads,
                                passage_tokens=args.passage_tokens)).stats
        print(f"index: {st['documents']} documents, {st['passages']} passages, {time.perf_counter() - t0:.0f} s",
              flush=True)
    s = Searcher.open(args.out, backend=args.backend, rerank=args.rerank, threads=args.threads)
    cached = memoize_reranker(s, args.rerank_cache) if args.rerank else None
    n_docs = len({p["doc_id"] for p in s.gen.passages})
    per_doc = len(s.gen.passages) / n_docs
    d = s.gen.dims
    times = []
    for t in texts[:100]:
        a = time.perf_counter()
        s.embed([t])
        times.append(time.perf_counter() - a)
    qv = s.embed(texts)
    print(f"query embedding ({args.backend}, {args.threads} thread(s)): p50 {1000 * np.median(times):.1f} ms",
          flush=True)

    def run(st: SearchSettings, k: int) -> dict[str, list[str]]:
        st.k = k
        return {q: [h.doc_id for h in r.hits] for q, r in zip(qids, s.search_vectors(qv, st, texts), strict=True)}

    def latency(st: SearchSettings) -> tuple[float, float]:
        st.k = 10
        lat = []
        n = len(texts)
        if st.rerank_top:  # timed uncached on the first queries; the quality figures score every query once
            n, s.reranker.score_pairs = min(n, args.rerank_latency_queries), cached.__wrapped__
        for i in range(n):
            a = time.perf_counter()
            s.search_vectors(QueryVectors(qv.vectors[i : i + 1], qv.fingerprint), st, texts[i : i + 1])
            lat.append(time.perf_counter() - a)
        if st.rerank_top:
            s.reranker.score_pairs = cached
        return 1000 * float(np.percentile(lat, 50)), 1000 * float(np.percentile(lat, 99))

    rows = [("float exact (fp16 stored)", SearchSettings(first_stage="float", rescore="none"), 2 * d),
            ("int8", SearchSettings(first_stage="int8", rescore="none"), d),
            ("int8 + float rescore 4x", SearchSettings(first_stage="int8", rescore="float"), 3 * d),
            ("binary", SearchSettings(first_stage="binary", rescore="none"), d / 8),
            ("binary + int8 rescore 4x", SearchSettings(first_stage="binary", rescore="int8"), d / 8 + d),
            ("binary + float rescore 4x", SearchSettings(first_stage="binary", rescore="float"), d / 8 + 2 * d),
            ("float exact + BM25 fusion", SearchSettings(first_stage="float", rescore="none", bm25=True), 2 * d),
            ("binary + int8 rescore + BM25 fusion", SearchSettings(first_stage="binary", rescore="int8", bm25=True),
             d / 8 + d)]
    if args.rerank:
        rows += [("binary + int8 rescore + BM25 + rerank top 100",
                  SearchSettings(first_stage="binary", rescore="int8", bm25=True, rerank_top=100), d / 8 + d),
                 ("binary + int8 + BM25 + rerank 100, fused",
                  SearchSettings(first_stage="binary", rescore="int8", bm25=True, rerank_top=100, rerank_fuse=True),
                  d / 8 + d)]
    bm = {}
    for q, t in zip(qids, texts, strict=True):
        bm[q] = [doc for doc, _, _ in s._collapse(*s.bm25(t, 400))][:100]
    bm_scores = retrieval_scores(bm, data.qrels)
    print(f"\n{'setting':40s} nDCG@10  recall@100  bytes/doc  p50 ms  p99 ms  % of float", flush=True)
    print(f"{'BM25 alone (bm25s, passages)':40s} {bm_scores['ndcg@10']:.4f}   {bm_scores['recall@100']:.4f}",
          flush=True)
    results, base = {}, None
    for name, st, per_passage in rows:
        st.rescore_multiplier = 4  # the 4 x 10 candidates, whatever the index size's default
        m10 = retrieval_scores(run(st, 10), data.qrels)
        ranked100 = run(st, 100)
        m100 = retrieval_scores(ranked100, data.qrels)
        p50, p99 = latency(st)
        base = base or m10["ndcg@10"]
        results[name] = (m10["ndcg@10"], m100["recall@100"])
        print(f"{name:40s} {m10['ndcg@10']:.4f}   {m100['recall@100']:.4f}   {per_passage * per_doc:8.1f}  {p50:6.2f}  "
              f"{p99:6.2f}"
              f"  {100 * m10['ndcg@10'] / base:.1f}%", flush=True)
        if name.startswith("float exact (fp16"):
            check_ranx(ranked100, data.qrels, retrieval_scores(ranked100, data.qrels))

    if args.rerank and args.rerank_cache:
        cached.save()
    line = {"ndcg_float": results[rows[0][0]][0], "ndcg_binary_rescore": results["binary + float rescore 4x"][0],
            "ndcg_int8_rescore": results["int8 + float rescore 4x"][0], "ndcg_bm25": bm_scores["ndcg@10"],
            "ndcg_pipeline": results["binary + int8 rescore + BM25 fusion"][0]}
    if args.rerank:
        line["ndcg_rerank"] = results["binary + int8 rescore + BM25 + rerank top 100"][0]
        line["ndcg_full_pipeline"] = results["binary + int8 + BM25 + rerank 100, fused"][0]
    if not args.skip_calibration:
        print("\ncalibration (label-free) next to true nDCG@10; queries: first sentences of 200 sampled passages",
              flush=True)
        if s.gen.dims == s.gen.manifest["model_dims"]:  # the stored float16 vectors are the full-dims ones
            full = np.asarray(s.gen.arrays["float16"], dtype=np.float32)
        else:
            full = finish_embeddings(embed_texts(s.predictor, [p["text"] for p in s.gen.passages], "re-embed"), None,
                                     True)
        for source, qpath in (("sampled first sentences", None), ("the 300 test queries (labels unused)", "test")):
            if qpath == "test":
                qfile = Path(args.out) / "test_queries.jsonl"
                import json

                qfile.write_text("".join(json.dumps({"id": q, "query": t}) + "\n"
                                         for q, t in zip(qids, texts, strict=True)))
                qpath = str(qfile)
            rep = calibrate(s.predictor, full, s.gen.passages, qpath, 0.9)
            q_full = finish_embeddings(s.predictor.embed_raw(texts), None, True)
            print(f"\n-- overlap from {source}; recommended (min overlap 0.9): {rep['recommended']}", flush=True)
            print(f"{'precision':24s} dims  overlap@10  bytes/doc  p50 ms  true nDCG@10", flush=True)
            truth = {}
            for dims in dims_grid(full.shape[1]):
                ss = Searcher(in_memory(finish_embeddings(full, dims, True), s.gen.passages, "c"), Path("."))
                qq = QueryVectors(finish_embeddings(q_full, dims, True), "c")
                for name, (first, rescore, _) in SETTINGS.items():
                    res = ss.search_vectors(qq, SearchSettings(10, first, rescore, 4))
                    truth[(name, dims)] = retrieval_scores({q: [h.doc_id for h in r.hits]
                                                            for q, r in zip(qids, res, strict=True)},
                                                           data.qrels)["ndcg@10"]
            for r in rep["settings"]:
                print(f"{r['precision']:24s} {r['dims']:4d}  {r['overlap@10']:.3f}      {r['bytes_per_doc']:8.1f}  "
                      f"{r['p50_ms']:6.3f}  {truth[(r['precision'], r['dims'])]:.4f}", flush=True)
            ok = [r for r in rep["settings"]
                  if truth[(r["precision"], r["dims"])] >= 0.99 * truth[("float16", full.shape[1])]]
            by_labels = min(ok, key=lambda r: r["bytes_per_doc"])
            print(f"labels would pick (smallest within 1% of float nDCG@10): {by_labels['precision']} @ "
                  f"{by_labels['dims']}",
                  flush=True)
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in line.items())
          + f" docs={n_docs} passages={len(s.gen.passages)} dims={d} " + result_field())
    return 0


def memoize_reranker(s, path: str | None = None):
    """Cache the cross-encoder's score of each (query, passage) pair, so that the k=10 and k=100 runs
    of every rerank row score each pair once (the scores are deterministic); latency is timed uncached.
    With ``path``, the scores of an earlier run with the same cross-encoder (by fingerprint) are reused
    and ``cached.save()`` writes them all back (atomically; also every 2,000 new pairs, so that a run
    cut short resumes)."""
    import functools
    import hashlib
    import json

    from encoderkit.io import write_json_atomic
    from encoderkit.models.folder_files import model_fingerprint

    score = s.reranker.score_pairs
    fp = model_fingerprint(s.reranker.folder) if path else None
    memo: dict[str, float] = {}
    if path and Path(path).is_file():
        saved = json.loads(Path(path).read_text())
        if saved.get("model") == fp:
            memo.update(saved["scores"])
            print(f"rerank cache: {len(memo)} pair scores of this cross-encoder read from {path}", flush=True)

    def key(q: str, p: str) -> str:
        return hashlib.sha1(f"{q}\0{p}".encode()).hexdigest()

    saved_at = len(memo)

    @functools.wraps(score)
    def cached(queries, passages):
        keys = [key(q, p) for q, p in zip(queries, passages, strict=True)]
        todo = [i for i, k in enumerate(keys) if k not in memo]
        if todo:
            for i, v in zip(todo, score([queries[i] for i in todo], [passages[i] for i in todo]), strict=True):
                memo[keys[i]] = float(v)
            if path and len(memo) - saved_at >= 2000:  # a run cut short resumes from what it scored
                cached.save()
        return np.asarray([memo[k] for k in keys], dtype=np.float32)

    def save() -> None:
        nonlocal saved_at
        write_json_atomic(Path(path), {"model": fp, "scores": memo})
        saved_at = len(memo)

    cached.save = save
    s.reranker.score_pairs = cached
    return cached


def check_ranx(ranked: dict[str, list[str]], qrels: dict[str, dict[str, int]], ours: dict[str, float]) -> None:
    from ranx import Qrels, Run, evaluate

    run = Run({q: {d: float(len(docs) - i) for i, d in enumerate(docs)} for q, docs in ranked.items()})
    theirs = evaluate(Qrels({q: dict(r) for q, r in qrels.items()}), run, ["ndcg@10", "mrr@10", "recall@100"])
    for k, v in theirs.items():
        print(f"   ranx {k} {v:.6f} vs ours {ours[k]:.6f} (diff {abs(v - ours[k]):.2e})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
