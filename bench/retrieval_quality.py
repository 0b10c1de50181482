"""Retrieval quality on BEIR SciFact (test: 300 queries, 339 judgments): our bi-encoder path vs
sentence-transformers, same model (all-MiniLM-L6-v2 as shipped), exact search, nDCG@10.

Both encode ``title + " " + text`` per document (as BEIR does) with the model's max_seq_length
(256), queries the same way, and rank by cosine similarity. Ours must match sentence-transformers
within 0.005 nDCG@10.

    python bench/retrieval_quality.py                  # the whole corpus (5,183 documents)
    python bench/retrieval_quality.py --max-docs 1000  # judged documents + random others (quicker)
Last line: RESULT ndcg10_ours=... ndcg10_st=... diff=... docs=... queries=...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "scifact" / "scifact_hf_export.zip"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=f"{DATA}#test", help="BEIR source PATH#SPLIT")
    p.add_argument("--model", default="minilm")
    p.add_argument("--max-docs", type=int, default=0,
                   help="keep every judged document plus random others up to this many (0: all)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from encoderkit.data.beir import load_retrieval
    from encoderkit.hardware import describe, result_field
    from encoderkit.metrics.ranking import retrieval_scores
    from encoderkit.tasks.common import load_tokenizer, resolve_model
    from encoderkit.tasks.embed.exact import retrieve, search
    from encoderkit.tasks.embed.features import folder_max_length, load_bi_encoder

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)
    folder = resolve_model(args.model)
    data = load_retrieval(args.data)
    if args.max_docs and args.max_docs < len(data.corpus):
        judged = {d for rels in data.qrels.values() for d in rels}
        others = sorted(set(data.corpus) - judged)
        rng = np.random.default_rng(args.seed)
        keep = judged | set(rng.choice(others, size=max(0, args.max_docs - len(judged)), replace=False).tolist())
        data.corpus = {d: v for d, v in data.corpus.items() if d in keep}
    max_length = folder_max_length(folder) or 256

    t0 = time.perf_counter()
    ranked = retrieve(load_bi_encoder(folder), load_tokenizer(folder), data, max_length, max_length, args.batch_size,
                      progress=True)
    ours = retrieval_scores(ranked, data.qrels)
    t_ours = time.perf_counter() - t0
    print(f"ours: {ours} ({t_ours:.0f} s)", file=sys.stderr)

    t0 = time.perf_counter()
    st = SentenceTransformer(str(folder), device="cpu")
    doc_ids, qids = list(data.corpus), list(data.qrels)
    docs = st.encode([data.doc_text(d) for d in doc_ids], batch_size=args.batch_size, normalize_embeddings=True,
                     show_progress_bar=True)
    queries = st.encode([data.queries[q] for q in qids], batch_size=args.batch_size, normalize_embeddings=True)
    ref = retrieval_scores(search(queries, docs, doc_ids, qids, 100), data.qrels)
    t_ref = time.perf_counter() - t0
    print(f"sentence-transformers: {ref} ({t_ref:.0f} s)", file=sys.stderr)
    diff = ours["ndcg@10"] - ref["ndcg@10"]
    print(f"RESULT ndcg10_ours={ours['ndcg@10']:.4f} ndcg10_st={ref['ndcg@10']:.4f} diff={diff:+.4f} "
          f"recall100_ours={ours['recall@100']:.4f} recall100_st={ref['recall@100']:.4f} "
          f"docs={len(data.corpus)} queries={len(data.qrels)} s_ours={t_ours:.0f} s_st={t_ref:.0f} {result_field()}")
    return 0 if abs(diff) <= 0.005 else 1


if __name__ == "__main__":
    sys.exit(main())
