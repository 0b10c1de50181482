"""Classification on SST-2 against the HF Trainer: the same MiniLM, training sentences, dev sentences, seed, epochs,
batch and max length on both sides; accuracy on the GLUE SST-2 dev set (872 sentences, never trained or selected
on) over seeds.

* encoderkit: ``finetune --task classify --train <subset> --dev <held-out training sentences>`` through its Python
  API with its defaults (the best dev checkpoint, one evaluation per epoch), then ``evaluate`` on GLUE dev.
* the HF Trainer (bench/peers/hf_classify_ner_worker.py, in the peers' venv): run_glue's recipe with the Trainer's
  defaults (lr 5e-5, linear, no warmup, weight decay 0; dynamic padding), one dev evaluation and checkpoint per
  epoch and ``load_best_model_at_end`` on dev accuracy, then ``Trainer.predict`` on GLUE dev.

GLUE ships no labelled SST-2 test set, so the checkpoint is picked on ``--dev-limit`` sentences of train.tsv held out
of the training subset (both drawn with one seed) and the GLUE dev set is the test. Wall time: each side's whole
training call (model load, tokenisation, training, dev evaluations, checkpoints; encoderkit's folder write too),
the test scoring left out. The sides alternate job by job (even seed: encoderkit first) on ``--threads`` threads.

    nice -n 15 python bench/quality_classify.py --summary /tmp/classify.json     # 3 seeds, the default subset
    nice -n 15 python bench/quality_classify.py --full --epochs 1 --seeds 0       # the whole training set
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from encoderkit.hardware import describe, result_field

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_common as qc
from quality_ner import common_args, finish, run_pairs

SST2 = qc.DATA / "glue_sst2"


def split(train_limit: int, dev_limit: int, tmp: Path, seed: int = 0) -> dict[str, Path]:
    """A training subset and a disjoint dev subset of train.tsv (``train_limit`` 0: every row not in dev), and
    GLUE dev as the test file."""
    lines = (SST2 / "train.tsv").read_text(encoding="utf-8").split("\n")
    head, rows = lines[0], [line for line in lines[1:] if line]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    dev, rest = order[:dev_limit], order[dev_limit:]
    train = rest[:train_limit] if train_limit else rest
    files = {}
    for name, idx in (("train", train), ("dev", dev)):
        files[name] = tmp / f"{name}.tsv"
        files[name].write_text(head + "\n" + "".join(rows[i] + "\n" for i in sorted(idx)), encoding="utf-8")
    files["test"] = SST2 / "dev.tsv"
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap)
    ap.add_argument("--train-limit", type=int, default=3000, help="training sentences (seeded subset)")
    ap.add_argument("--dev-limit", type=int, default=500, help="held-out training sentences that pick the checkpoint")
    args = ap.parse_args(argv)
    print(f"hardware: {describe()}", flush=True)
    if args.full:
        args.train_limit = 0
    with tempfile.TemporaryDirectory(prefix="quality_classify_") as name:
        tmp = Path(name)
        files = split(args.train_limit, args.dev_limit, tmp)
        sizes = {k: len(v.read_text(encoding="utf-8").strip().split("\n")) - 1 for k, v in files.items()}

        def say(got: dict[str, Any]) -> str:
            return f"test accuracy {got['accuracy']:.4f}, {got['steps']} steps, {got['train_s']:.0f} s"

        row = run_pairs("classify", "accuracy", files, args, tmp, say, sizes,
                        ("SST-2 dev", "accuracy", "held-out dev"))
    finish(row, sizes, args, result_field())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
