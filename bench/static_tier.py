"""Static tier on BEIR SciFact (test: 300 queries): a static embedding model distilled from all-MiniLM-L6-v2 on
the SciFact corpus (`encoderkit distill --to static`) against MiniLM itself, side by side in one process.

For each frequency weighting asked for, the static model is distilled without the fit (``--fit-texts 0``), then with
the better weighting and the fit on ``--fit-texts`` corpus pieces (the default); each is distilled (its time
reported), loaded through the
Predictor (what index, search and serve run) and used to encode the whole corpus (``title + " " + text``, whole
texts: a static model reads every token); MiniLM encodes the same corpus with ``SentenceTransformer.encode`` fp32
(max_seq_length 256, batch 32), once; the static encodings are timed as the fastest of 3 calls. Both rank by exact
cosine search; nDCG@10 on the test qrels.

    python bench/static_tier.py                          # sif and zipf, 256 dimensions
    python bench/static_tier.py --weightings sif --dims 128
Last line: RESULT weighting=... fit_texts=... ndcg10_static=... ndcg10_minilm=... ratio=... speedup=... (targets: ratio
>= 0.85,
speedup >= 100)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "scifact" / "scifact_hf_export.zip"


def encode_timed(encode, texts: list[str], repeat: int = 1) -> tuple[object, float]:
    """(vectors, texts per second) of the fastest of ``repeat`` calls (a shared machine's other jobs only slow)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = encode(texts)
        best = min(best, time.perf_counter() - t0)
    return out, len(texts) / max(best, 1e-9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=f"{DATA}#test", help="BEIR source PATH#SPLIT")
    p.add_argument("--teacher", default="minilm")
    p.add_argument("--weightings", default="sif,zipf", help="comma-separated: sif, zipf, none")
    p.add_argument("--dims", type=int, default=256)
    p.add_argument("--fit-texts", type=int, default=20000, help="the fitted model's corpus pieces (0: no fitted model)")
    p.add_argument("--batch-size", type=int, default=32, help="MiniLM's encode batch")
    args = p.parse_args()
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from encoderkit.compress.distill import DistillConfig
    from encoderkit.compress.distill import run as distill
    from encoderkit.data.beir import load_retrieval
    from encoderkit.hardware import describe, result_field
    from encoderkit.inference.predictor import Predictor
    from encoderkit.metrics.ranking import retrieval_scores
    from encoderkit.tasks.common import resolve_model
    from encoderkit.tasks.embed.exact import search

    print(f"hardware: {describe()}", flush=True)
    data = load_retrieval(args.data)
    doc_ids, qids = list(data.corpus), list(data.qrels)
    docs = [data.doc_text(d) for d in doc_ids]
    queries = [data.queries[q] for q in qids]
    corpus = str(args.data).split("#")[0]

    def ndcg(q: np.ndarray, d: np.ndarray) -> float:
        return retrieval_scores(search(q, d, doc_ids, qids, 100), data.qrels)["ndcg@10"]

    rows = {}
    runs = [(w.strip(), 0) for w in args.weightings.split(",") if w.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        while runs:
            weighting, fit = runs.pop(0)
            out = Path(tmp) / f"{weighting}-{fit}"
            t0 = time.perf_counter()
            distill(DistillConfig(teacher=args.teacher, out=str(out), to="static", train=corpus, dims=args.dims,
                                  weighting=weighting, fit_texts=fit))
            distill_s = time.perf_counter() - t0
            static = Predictor.load(out, max_batch=256)
            d_vec, tps = encode_timed(static.embed, docs, repeat=3)  # 1-2 s a call; MiniLM's one call takes minutes
            score = ndcg(static.embed(queries), d_vec)
            st_static = SentenceTransformer(str(out), device="cpu")
            st_vec, st_tps = encode_timed(partial(st_static.encode, batch_size=256, normalize_embeddings=True), docs,
                                          repeat=3)
            agree = float(np.min(np.sum(st_vec * d_vec, axis=1)))
            rows[(weighting, fit)] = (score, tps, st_tps, distill_s, agree)
            if not runs and fit == 0 and args.fit_texts:
                runs.append((max(rows, key=lambda r: rows[r][0])[0], args.fit_texts))
            print(f"static {weighting} fit_texts={fit}: nDCG@10 {score:.4f}, encoderkit {tps:,.0f} texts/s, "
                  "sentence-transformers "
                  f"{st_tps:,.0f} texts/s, distilled in {distill_s:.0f} s, min cosine ST vs encoderkit {agree:.6f}",
                  flush=True)

    st = SentenceTransformer(str(resolve_model(args.teacher)), device="cpu")
    t_vec, t_tps = encode_timed(lambda t: st.encode(t, batch_size=args.batch_size, normalize_embeddings=True), docs)
    t_score = ndcg(st.encode(queries, batch_size=args.batch_size, normalize_embeddings=True), t_vec)
    print(f"MiniLM fp32 (SentenceTransformer.encode): nDCG@10 {t_score:.4f}, {t_tps:,.1f} texts/s", flush=True)

    last = list(rows)[-1]
    score, tps, st_tps, distill_s, agree = rows[last]
    others = " ".join(f"ndcg10_{w}_fit{f}={v[0]:.4f}" for (w, f), v in rows.items())
    print(f"RESULT weighting={last[0]} fit_texts={last[1]} ndcg10_static={score:.4f} ndcg10_minilm={t_score:.4f} "
          f"ratio={score / t_score:.3f} "
          f"texts_s_static={tps:.0f} texts_s_static_st={st_tps:.0f} texts_s_minilm={t_tps:.1f} "
          f"speedup={tps / t_tps:.0f} distill_s={distill_s:.0f} min_cos_st={agree:.5f} {others} docs={len(docs)} "
          f"queries={len(qids)} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
