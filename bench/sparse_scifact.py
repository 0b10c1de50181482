"""Learned sparse retrieval (SPLADE, ``finetune --task sparse``) on BEIR SciFact, side by side with BM25 (bm25s),
the dense all-MiniLM-L6-v2 and their reciprocal-rank fusions.

    nice -n 5 python bench/sparse_scifact.py --out /tmp/sparse-scifact

1. ``finetune --task sparse`` from all-MiniLM-L6-v2, which has no MLM head: the head is made from its tied word
   embeddings with a fresh (identity-initialised) transform, and starts sparse (its output bias set on 32
   training documents); trained on SciFact's training claims (judged (claim, abstract) pairs, in-batch
   negatives, FLOPS regulariser with SPLADE v2's weights and a one-epoch quadratic warm-up).
2. ``index`` of the test corpus with the sparse model (an inverted index) and with MiniLM (dense: binary first
   stage, int8 rescoring), both over the same documents; ``search`` of the 300 judged test claims.
3. nDCG@10 / recall@100: BM25 (bm25s over the dense index's passages, as bench/search_scifact.py), dense,
   sparse, dense + sparse fusion (``--fuse-with``), dense + BM25, sparse + BM25, all three.

On 2 shared CPU cores the full corpus (5,183 abstracts) costs the sparse model ~20 min to encode (its head
is a 384 x 30,522 product per token), so by default the corpus is a seeded subset: every judged test
document plus random others up to ``--corpus-docs`` (0: the whole corpus); every method searches the same
subset, so the figures compare, but they are higher than full-corpus BEIR figures. Last line:
``RESULT key=value ...`` with the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from encoderkit.hardware import describe, result_field

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact" / "scifact_hf_export.zip"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default="/tmp/sparse-scifact")
    ap.add_argument("--corpus-docs", type=int, default=1000, help="documents searched (judged ones + random); 0: all")
    ap.add_argument("--train-examples", type=int, default=480, help="training pairs (seeded subset; 0: all 919)")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-length", type=int, default=128, help="sub-tokens per document (training and index)")
    ap.add_argument("--passage-tokens", type=int, default=-1, help="index passages (-1: one per document, truncated)")
    ap.add_argument("--backend", default="torch-bf16", help="Predictor backend of the sparse model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from encoderkit.data.beir import load_retrieval
    from encoderkit.metrics.ranking import retrieval_scores, rrf_scores
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import Searcher, SearchSettings
    from encoderkit.tasks.common import resolve_model
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    print(f"hardware: {describe()}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    test = load_retrieval(f"{args.data}#test")
    judged = sorted({d for rels in test.qrels.values() for d in rels})
    others = [d for d in test.corpus if d not in set(judged)]
    if args.corpus_docs:
        rng = random.Random(args.seed)
        others = rng.sample(others, max(0, min(len(others), args.corpus_docs - len(judged))))
    keep = [d for d in test.corpus if d in set(judged) | set(others)]
    corpus = out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d, "text": test.doc_text(d)}) + "\n" for d in keep))
    print(f"corpus: {len(keep)} of {len(test.corpus)} documents ({len(judged)} judged), {len(test.qrels)} queries",
          flush=True)
    qids = list(test.qrels)
    texts = [test.queries[q] for q in qids]
    timings = {}

    model = out / "splade"
    t0 = time.perf_counter()
    if not (model / "encoderkit.json").is_file():
        res = finetune(FinetuneConfig(task="sparse", model=str(resolve_model("minilm")), train=f"{args.data}#train",
                                      out=str(model), epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                                      max_length=args.max_length, max_query_length=32, bf16=True,
                                      max_train_examples=args.train_examples, seed=args.seed, overwrite=True))
        print(f"finetune: {res.steps} steps, {res.seconds:.0f} s", flush=True)
    timings["train_s"] = time.perf_counter() - t0
    card = json.loads((model / "encoderkit.json").read_text())
    print(f"head: {card.get('head')}; train pairs {card.get('train_examples')}", flush=True)

    def build(name: str, folder: Path, **kw) -> Searcher:
        root = out / name
        if not (root / "CURRENT").is_file():
            t = time.perf_counter()
            st = index(IndexConfig(model=str(folder), corpus=[str(corpus)], out=str(root), threads=args.threads,
                                   **kw)).stats
            timings[f"index_{name}_s"] = time.perf_counter() - t
            print(f"index {name}: {st['passages']} passages, {timings[f'index_{name}_s']:.0f} s"
                  + (f", {st['mean_terms_per_passage']} terms/passage" if "mean_terms_per_passage" in st else ""),
                  flush=True)
        return Searcher.open(root, threads=args.threads)

    sparse = build("sparse", model, backend=args.backend, passage_tokens=args.passage_tokens, batch_size=16)
    dense = build("dense", resolve_model("minilm"), backend="onnx-fp32", passage_tokens=args.passage_tokens)
    depth = 100

    def run(s: Searcher, settings: SearchSettings) -> dict[str, list[str]]:
        t = time.perf_counter()
        results = s.search(texts, settings)
        return {"ranked": {q: [h.doc_id for h in r.hits] for q, r in zip(qids, results, strict=True)},
                "ms_per_query": 1000 * (time.perf_counter() - t) / len(texts)}

    runs = {"dense": run(dense, SearchSettings(k=depth)), "sparse": run(sparse, SearchSettings(k=depth))}
    bm = {q: [d for d, _, _ in dense._collapse(*dense.bm25(t, 4 * depth))][:depth]
          for q, t in zip(qids, texts, strict=True)}
    runs["bm25"] = {"ranked": bm, "ms_per_query": 0.0}

    def fuse(*names: str) -> dict[str, list[str]]:
        out_ = {}
        for q in qids:
            sc = rrf_scores([runs[n]["ranked"][q] for n in names])
            out_[q] = sorted(sc, key=lambda d: -sc[d])[:depth]
        return {"ranked": out_, "ms_per_query": sum(runs[n]["ms_per_query"] for n in names)}

    for combo in (("dense", "sparse"), ("dense", "bm25"), ("sparse", "bm25"), ("dense", "sparse", "bm25")):
        runs["+".join(combo)] = fuse(*combo)
    # the same fusion through the search API (--fuse-with), checked against the one above
    fused = Searcher.open(out / "dense", threads=args.threads)
    fused.fuse_with([out / "sparse"], args.threads)
    # its own order: 10 x 10 rescored candidates; the partner's: its top 100 documents (the runs below, same depths)
    api = run(fused, SearchSettings(k=10, rescore_multiplier=10))
    check = run(dense, SearchSettings(k=100, rescore_multiplier=1))["ranked"]
    want = {q: sorted(sc, key=lambda d: -sc[d])[:10]
            for q in qids for sc in [rrf_scores([check[q], runs["sparse"]["ranked"][q]])]}
    agree = sum(api["ranked"][q] == want[q] for q in qids) / len(qids)

    qrels = test.qrels
    print(f"\n{'method':28s} nDCG@10  recall@100  ms/query", flush=True)
    scores = {}
    for name, r in runs.items():
        m = retrieval_scores(r["ranked"], qrels)
        scores[name] = m
        print(f"{name:28s} {m['ndcg@10']:.4f}   {m['recall@100']:.4f}     {r['ms_per_query']:.1f}", flush=True)
    print(f"--fuse-with through the search API gives the same top 10 as the fusion above on {agree:.1%} of the queries")
    sp = sparse.sparse.matrix
    line = {f"ndcg_{k.replace('+', '_')}": v["ndcg@10"] for k, v in scores.items()}
    line.update({"recall100_sparse": scores["sparse"]["recall@100"], "recall100_dense": scores["dense"]["recall@100"],
                 "fuse_api_agreement": agree})
    ints = {"docs": len(keep), "queries": len(qids), "train_pairs": card.get("train_examples", 0),
            "terms_per_doc": round(sp.nnz / max(1, sp.shape[0]), 1), "max_length": args.max_length,
            **{k: round(v) for k, v in timings.items()}}
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in line.items()) + " "
          + " ".join(f"{k}={v}" for k, v in ints.items()) + " " + result_field(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
