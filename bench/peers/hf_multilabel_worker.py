"""The HF Trainer's side of bench/quality_multilabel.py, run in the peers' own venv (never encoderkit's).

A job (JSON on stdin): {"model", "names": [label, ...], "train" / "dev" / "test": [[text, [label, ...]], ...],
"epochs", "batch", "max_length", "seed", "threads"}. Out (the last stdout line): {"micro_f1_05": test micro-F1 at
0.5, what a user of the Trainer gets; "micro_f1": at the one threshold best on dev (0.05 ... 0.95), the peer at its
best; "threshold", "train_s": Trainer.train() alone}. The model is ``AutoModelForSequenceClassification`` with
``problem_type="multi_label_classification"`` (a sigmoid per label, BCE), trained by ``transformers.Trainer`` with
its own defaults (lr 5e-5, linear decay, no warm-up, no weight decay) and the job's epochs, batch and max length.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from datasets import Dataset  # noqa: TID253 -- this venv is the peer's own
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

GRID = np.round(np.arange(0.05, 0.951, 0.05), 2)


def micro_f1(gold: np.ndarray, pred: np.ndarray) -> float:
    tp, npred, ngold = int((gold & pred).sum()), int(pred.sum()), int(gold.sum())
    return 2 * tp / (npred + ngold) if npred + ngold else 0.0


def run(job: dict) -> dict:
    torch.set_num_threads(job["threads"])
    names = job["names"]
    index = {n: i for i, n in enumerate(names)}
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForSequenceClassification.from_pretrained(
        job["model"], num_labels=len(names), problem_type="multi_label_classification",
        id2label=dict(enumerate(names)), label2id=index)

    def targets(part: list) -> np.ndarray:
        y = np.zeros((len(part), len(names)), dtype=bool)
        for i, (_, labels) in enumerate(part):
            for label in labels:
                if label in index:
                    y[i, index[label]] = True
        return y

    def dataset(part: list) -> Dataset:
        enc = tok([t for t, _ in part], truncation=True, max_length=job["max_length"])
        return Dataset.from_dict({**enc, "labels": targets(part).astype(np.float32).tolist()})

    args = TrainingArguments(output_dir=job["scratch"], num_train_epochs=job["epochs"],
                             per_device_train_batch_size=job["batch"], per_device_eval_batch_size=128,
                             seed=job["seed"], save_strategy="no", report_to=[], logging_steps=50, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(job["train"]), processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

    def probs(part: list) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-trainer.predict(dataset(part)).predictions))

    dev_p, test_p = probs(job["dev"]), probs(job["test"])
    dev_y, test_y = targets(job["dev"]), targets(job["test"])
    best = float(max(GRID, key=lambda t: micro_f1(dev_y, dev_p >= t)))
    return {"micro_f1_05": micro_f1(test_y, test_p >= 0.5), "micro_f1": micro_f1(test_y, test_p >= best),
            "threshold": best, "train_s": train_s}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.stdin.read()))), flush=True)
