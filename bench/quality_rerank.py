"""Cross-encoder (rerank) fine-tuning quality on SciFact against sentence-transformers' CrossEncoder trainer, side by
side, 3 seeds.

Both sides start from MiniLM (all-MiniLM-L6-v2, its encoder; a new one-logit head) and train on the same (training
claim, cited abstract) pairs (bench/quality_embed.py's ``scifact_subset``: by default all 919 judged pairs over a
corpus of 2,000 documents, those they and the test claims judge plus random others; ``--train-pairs`` a subset fixed
across seeds, ``--full`` the whole corpus), each with ``--num-negatives`` hard negatives mined by the base MiniLM
from the same corpus, for the same epochs, pair length and seed, and the same labelled pairs per optimizer step:

    encoderkit  ``finetune --task rerank --negatives mined`` with its defaults otherwise (a listwise softmax over
                1 positive + N negatives, drawn afresh each epoch from the miner's ranks 4-30); ``--batch-size B``
                groups, B x (1 + N) pairs a step.
    peer        CrossEncoder(num_labels=1) + CrossEncoderTrainer + BinaryCrossEntropyLoss(pos_weight=N) on
                positives and ``mine_hard_negatives(..., output_format="labeled-pair")`` negatives, as its training
                examples (bench/peers/st_trainer_worker.py); batches of B x (1 + N) labelled pairs.

Scoring, the same code for both folders: ``encoderkit evaluate --task rerank`` reranks the same first stage, the
base MiniLM's top ``--candidates`` documents per test claim (the corpus of ``scifact_subset``), at the shared pair
length, nDCG@10 with SciFact's test qrels (``--queries``: a seeded subset of the 300 claims, the same for both).
Wall time: each side's whole training call (model load, mining from an empty embedding cache, training, save). The
sides alternate job by job (seed even: encoderkit first) on ``--threads`` threads each.

    nice -n 15 python bench/quality_rerank.py --summary /tmp/rerank.json   # every training pair, 2,000 documents
    nice -n 15 python bench/quality_rerank.py --full --queries 0 --candidates 100 --max-length 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from encoderkit.hardware import describe, result_field
from encoderkit.train.finetune import FinetuneConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_common as qc
from quality_embed import common_args, ours_train, peer_train, score, seeds_of, setup


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap, train_pairs=0, docs=2000, max_length=128)
    ap.add_argument("--num-negatives", type=int, default=3, help="mined negatives per pair, both sides")
    ap.add_argument("--candidates", type=int, default=30, help="first-stage documents per query reranked")
    ap.set_defaults(queries=100, batch_size=8)
    args = ap.parse_args(argv)
    print(f"hardware: {describe()}", flush=True)
    model, python, scratch, data, pairs, corpus = setup(args, "quality_rerank_")
    k = args.num_negatives
    kw = {"miner": model, "candidates": args.candidates}
    first = score(model, data, "embed", 0, args.queries)  # the first stage alone, at the miner's own length
    print(f"first stage (base MiniLM) nDCG@10 {first['ndcg@10']:.4f}", flush=True)
    row = qc.Row(task="rerank", data="SciFact", metric="nDCG@10", peer_name="ST CrossEncoderTrainer BCE",
                 note=f"first stage {first['ndcg@10']:.4f}; top {args.candidates} of {len(corpus)} docs, "
                      f"{args.queries or 300} queries; {len(pairs)} pairs x (1 + {k} mined), pair length "
                      f"{args.max_length}, {args.epochs:g} epoch(s), {args.batch_size * (1 + k)} pairs a step")
    for seed in seeds_of(args.seeds):
        row.seeds.append(seed)
        for side in (["ours", "peer"] if seed % 2 == 0 else ["peer", "ours"]):
            out = scratch / f"{side}-rerank-{seed}"
            if side == "ours":
                cfg = FinetuneConfig(task="rerank", model=model, train=f"{data}#train", out=str(out), overwrite=True,
                                     seed=seed, epochs=args.epochs, batch_size=args.batch_size,
                                     max_length=args.max_length, negatives="mined", num_negatives=k, miner=model)
                row.ours_s.append(ours_train(cfg, scratch))
                row.ours.append(score(out, data, "rerank", args.max_length, args.queries, **kw)["ndcg@10"])
                print(f"seed {seed} encoderkit: nDCG@10 {row.ours[-1]:.4f} in {row.ours_s[-1]:.0f} s", flush=True)
            elif python is not None:
                row.peer_s.append(peer_train(python, {
                    "kind": "rerank", "model": model, "out": str(out), "pairs": pairs, "corpus": corpus,
                    "num_negatives": k, "seed": seed, "epochs": args.epochs, "batch_size": args.batch_size * (1 + k),
                    "max_length": args.max_length, "threads": args.threads}))
                row.peer.append(score(out, data, "rerank", args.max_length, args.queries, **kw)["ndcg@10"])
                print(f"seed {seed} peer: nDCG@10 {row.peer[-1]:.4f} in {row.peer_s[-1]:.0f} s", flush=True)
        qc.write_rows(args.summary, [row])  # so far, in case the run is cut short
    rows = [row]
    qc.print_rows(rows)
    print(f"{row.task}: {row.note}")
    qc.write_rows(args.summary, rows)
    print(f"RESULT first_stage_ndcg10={first['ndcg@10']:.4f} {' '.join(row.fields())} {result_field()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
