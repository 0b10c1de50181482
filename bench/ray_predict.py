"""`encoderkit predict` in one process vs `--ray local` with 1 and 2 actors, on the same SST-2 sentences.

Each run writes its JSONL; the Ray outputs are checked against the single-process one (same order; the
largest difference of any vector is printed, 0 since Ray runs the local run's batches). Timed: the stage's own
``seconds`` (reading the model in the driver excluded; for Ray the
actors' start and model load included, as a user waits for them) and the whole call. Every actor gets 1 CPU
and 1 onnxruntime thread (``--threads 1``); the single-process run gets the same one thread, so 2 actors
against 1 shows what a second core buys.

    python bench/ray_predict.py --rows 2000            # MiniLM (all-MiniLM-L6-v2), ONNX INT8 (auto)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from encoderkit.hardware import describe, result_field

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--ray-batch", type=int, default=256)
    ap.add_argument("--backend", default="auto", help="auto: ONNX INT8 for an embed model (dynamic INT8: a row's "
                                                      "vector depends on its batch, see docs/deploy.md); onnx-fp32: "
                                                      "exact")
    args = ap.parse_args()

    import ray

    from encoderkit.inference.predictor import PredictConfig, run
    from encoderkit.tasks.common import resolve_model

    with open(DATA / "glue_sst2" / "train.tsv", encoding="utf-8", newline="") as f:
        texts = [r["sentence"].strip() for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    texts = [t for t in texts if t][: args.rows]
    model = str(resolve_model(args.model))
    print(f"hardware: {describe()}", flush=True)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    common = {"model": model, "input": str(tmp / "in.txt"), "threads": 1, "max_batch": 32, "backend": args.backend}
    run(PredictConfig(**common, output=str(tmp / "warm.jsonl")))  # the ONNX export, once, before any timing
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    res = run(PredictConfig(**common, output=str(tmp / "local.jsonl")))
    out["local_rows_s"], out["local_wall_s"] = len(texts) / res.seconds, time.perf_counter() - t0
    local = np.asarray([json.loads(x)["embedding"] for x in (tmp / "local.jsonl").read_text().splitlines()])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        for actors in (1, 2):
            t0 = time.perf_counter()
            res = run(PredictConfig(**common, output=str(tmp / f"ray{actors}.jsonl"), ray="auto", ray_actors=actors,
                                    ray_batch=args.ray_batch))
            out[f"ray{actors}_rows_s"], out[f"ray{actors}_wall_s"] = len(texts) / res.seconds, time.perf_counter() - t0
            got = np.asarray([json.loads(x)["embedding"]
                              for x in (tmp / f"ray{actors}.jsonl").read_text().splitlines()])
            out[f"ray{actors}_max_abs_diff"] = float(np.abs(got - local).max())
    finally:
        ray.shutdown()
    figures = " ".join(f"{k}={v:.4g}" for k, v in out.items())
    print(f"RESULT rows={len(texts)} model={args.model} backend={args.backend} {figures} {result_field()}")


if __name__ == "__main__":
    main()
