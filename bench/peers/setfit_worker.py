"""SetFit's side of bench/few_label.py, run in its own venv: JSON lines in (a job each), JSON lines out.

A job: {"model", "train": [[text, label], ...], "dev": [[text, label], ...], "seed", "pair_iterations",
"max_length", "threads"}. Out: {"accuracy", "train_s", "pairs"}: SetFit's Trainer with its defaults for a
classification head (CosineSimilarityLoss, one epoch, batch 16, body lr 2e-5, warm-up 10%, LogisticRegression),
``num_iterations`` set so that both sides train on as many pairs. ``train_s`` is Trainer.train() (the body and the
head), the model load left out.
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
from setfit import SetFitModel, Trainer, TrainingArguments


def run(job: dict) -> dict:
    torch.set_num_threads(job["threads"])
    names = sorted({y for _, y in job["train"]})
    index = {n: i for i, n in enumerate(names)}
    train = Dataset.from_dict({"text": [t for t, _ in job["train"]], "label": [index[y] for _, y in job["train"]]})
    model = SetFitModel.from_pretrained(job["model"])
    args = TrainingArguments(batch_size=16, num_epochs=1, num_iterations=job["pair_iterations"],
                             body_learning_rate=2e-5, seed=job["seed"], max_length=job["max_length"],
                             report_to="none", show_progress_bar=False, save_strategy="no",
                             output_dir=job["scratch"])
    trainer = Trainer(model=model, args=args, train_dataset=train)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    pred = np.asarray(model.predict([t for t, _ in job["dev"]], batch_size=64))
    gold = np.asarray([index.get(y, -1) for _, y in job["dev"]])
    return {"accuracy": float((pred == gold).mean()), "train_s": seconds,
            "pairs": 2 * job["pair_iterations"] * len(job["train"])}


def main() -> None:
    answers, sys.stdout = sys.stdout, sys.stderr  # what SetFit prints must not mix with the answers
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") == "quit":
            break
        try:
            out = run(msg)
        except Exception as e:  # noqa: BLE001 -- reported to the bench, which prints it
            out = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(out) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
