"""The HF Trainer's side of bench/quality_classify.py and bench/quality_ner.py, run in the peers' own venv (it never
imports encoderkit): one job as JSON on stdin, its result as JSON on the last stdout line, logs on stderr.

A job: {"task": "classify" | "ner", "model", "train", "dev", "test" (file paths), "seed", "epochs", "batch_size",
"max_length", "threads", "scratch"} and optionally {"lr", "warmup", "weight_decay"} (controlled runs only).

As transformers' examples do it, with the Trainer's own defaults (AdamW lr 5e-5, linear decay, no warmup, weight
decay 0, gradient clipping 1.0, fp32) except the shared settings (epochs, batch, max length, seed):

* classify (run_glue / the text-classification guide): ``AutoModelForSequenceClassification``, texts truncated at
  max length, dynamic padding (``DataCollatorWithPadding``); accuracy.
* ner (run_ner): ``AutoModelForTokenClassification``, words tokenised with ``is_split_into_words`` and truncated at
  max length, the label on each word's first sub-token and -100 on the others (``label_all_tokens`` False),
  ``DataCollatorForTokenClassification``; entity P/R/F1 by seqeval's default mode over the positions whose label is
  not -100 (run_ner's ``compute_metrics``). The CoNLL files' IOB1 tags are converted to IOB2 first (the Hub's
  conll2003 ships IOB2) and the -DOCSTART- lines are dropped. Words cut off by the truncation are not scored in
  run_ner's way (``f1``); ``f1_all_words`` also counts them, predicted O, and ``cut_words`` says how many there were.

With a dev file: evaluation and a checkpoint every epoch, ``load_best_model_at_end`` on the dev metric (f1 /
accuracy), as encoderkit keeps its best dev checkpoint. ``train_s``: the whole training call (model load,
tokenisation of train and dev, ``Trainer.train()`` with its dev evaluations and checkpoints), the test scoring left
out, as the encoderkit side counts its ``finetune`` call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from datasets import Dataset  # noqa: TID253 -- this venv is the peer's own
from seqeval.metrics import f1_score, precision_score, recall_score
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)


def read_tsv(path: str) -> tuple[list[str], list[str]]:
    lines = Path(path).read_text(encoding="utf-8").split("\n")[1:]
    rows = [line.split("\t") for line in lines if line]
    return [t.strip() for t, _ in rows], [y.strip() for _, y in rows]


def iob1_to_iob2(tags: list[str]) -> list[str]:
    out, prev = [], "O"
    for tag in tags:
        if tag.startswith("I-") and (prev == "O" or prev[2:] != tag[2:]):
            tag = "B-" + tag[2:]
        out.append(tag)
        prev = tag
    return out


def read_conll(path: str) -> list[tuple[list[str], list[str]]]:
    sents, words, tags = [], [], []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):
        cells = line.split()
        if not cells or cells[0] == "-DOCSTART-":
            if words:
                sents.append((words, iob1_to_iob2(tags)))
            words, tags = [], []
            continue
        words.append(cells[0])
        tags.append(cells[-1])
    if words:
        sents.append((words, iob1_to_iob2(tags)))
    return sents


def arguments(job: dict, metric: str, has_dev: bool) -> TrainingArguments:
    extra = {}
    if "lr" in job:
        extra["learning_rate"] = job["lr"]
    if "warmup" in job:
        extra["warmup_steps"] = job["warmup"]  # a float below 1: a fraction of the steps
    if "weight_decay" in job:
        extra["weight_decay"] = job["weight_decay"]
    per_epoch = "epoch" if has_dev else "no"
    return TrainingArguments(
        output_dir=job["scratch"], num_train_epochs=job["epochs"], per_device_train_batch_size=job["batch_size"],
        per_device_eval_batch_size=64, seed=job["seed"], eval_strategy=per_epoch, save_strategy=per_epoch,
        load_best_model_at_end=has_dev, metric_for_best_model=metric if has_dev else None, greater_is_better=True,
        save_total_limit=1 if has_dev else None, report_to="none", disable_tqdm=True, logging_steps=50,
        use_cpu=True, **extra)


def run_classify(job: dict) -> dict:
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(job["model"])
    texts, labels = read_tsv(job["train"])
    names = sorted(set(labels))
    index = {n: i for i, n in enumerate(names)}

    def dataset(path: str) -> Dataset:
        x, y = read_tsv(path)
        enc = tok(x, truncation=True, max_length=job["max_length"])
        return Dataset.from_dict({**enc, "labels": [index[v] for v in y]})

    set_seed(job["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(
        job["model"], num_labels=len(names), id2label=dict(enumerate(names)), label2id=index)
    train = Dataset.from_dict({**tok(texts, truncation=True, max_length=job["max_length"]),
                               "labels": [index[v] for v in labels]})
    dev = dataset(job["dev"]) if job.get("dev") else None

    def metrics(p) -> dict:
        return {"accuracy": float((np.argmax(p.predictions, axis=-1) == p.label_ids).mean())}

    trainer = Trainer(model=model, args=arguments(job, "accuracy", dev is not None), train_dataset=train,
                      eval_dataset=dev, processing_class=tok, data_collator=DataCollatorWithPadding(tok),
                      compute_metrics=metrics)
    trainer.train()
    seconds = time.perf_counter() - t0
    out = trainer.predict(dataset(job["test"]))
    return {"accuracy": metrics(out)["accuracy"], "train_s": seconds, "steps": trainer.state.global_step,
            "best_checkpoint": trainer.state.best_model_checkpoint}


def run_ner(job: dict) -> dict:
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(job["model"])
    train_sents = read_conll(job["train"])
    names = ["O"] + sorted({t for _, tags in train_sents for t in tags} - {"O"}, key=lambda t: (t[2:], t[:1]))
    index = {n: i for i, n in enumerate(names)}

    def dataset(sents: list[tuple[list[str], list[str]]]) -> Dataset:
        enc = tok([w for w, _ in sents], truncation=True, max_length=job["max_length"], is_split_into_words=True)
        all_labels = []
        for i, (_, tags) in enumerate(sents):
            prev, row = None, []
            for k in enc.word_ids(i):
                row.append(-100 if k is None or k == prev else index.get(tags[k], 0))
                prev = k
            all_labels.append(row)
        return Dataset.from_dict({**enc, "labels": all_labels})

    def tags_of(p) -> tuple[list[list[str]], list[list[str]]]:
        pred = np.argmax(p.predictions, axis=-1)
        gold_tags, pred_tags = [], []
        for ps, ls in zip(pred, p.label_ids, strict=True):
            keep = ls != -100
            gold_tags.append([names[v] for v in ls[keep]])
            pred_tags.append([names[v] for v in ps[keep]])
        return gold_tags, pred_tags

    def metrics(p) -> dict:
        gold, pred = tags_of(p)
        return {"precision": precision_score(gold, pred), "recall": recall_score(gold, pred),
                "f1": f1_score(gold, pred)}

    set_seed(job["seed"])
    model = AutoModelForTokenClassification.from_pretrained(
        job["model"], num_labels=len(names), id2label=dict(enumerate(names)), label2id=index)
    train = dataset(train_sents)
    dev = dataset(read_conll(job["dev"])) if job.get("dev") else None
    trainer = Trainer(model=model, args=arguments(job, "f1", dev is not None), train_dataset=train,
                      eval_dataset=dev, processing_class=tok, data_collator=DataCollatorForTokenClassification(tok),
                      compute_metrics=metrics)
    trainer.train()
    seconds = time.perf_counter() - t0
    test_sents = read_conll(job["test"])
    out = trainer.predict(dataset(test_sents))
    scores = metrics(out)
    gold, pred = tags_of(out)  # the words the truncation cut off: gold as in the file, predicted O
    cut = 0
    for i, (words, tags) in enumerate(test_sents):
        missing = len(words) - len(gold[i])
        cut += missing
        gold[i] = gold[i] + tags[len(gold[i]):]
        pred[i] = pred[i] + ["O"] * missing
    return {**scores, "f1_all_words": f1_score(gold, pred), "cut_words": cut, "train_s": seconds,
            "steps": trainer.state.global_step, "best_checkpoint": trainer.state.best_model_checkpoint}


def main() -> None:
    answer, sys.stdout = sys.stdout, sys.stderr  # what the Trainer prints must not mix with the answer
    job = json.loads(sys.stdin.read())
    torch.set_num_threads(int(job.get("threads", 1)))
    out = run_ner(job) if job["task"] == "ner" else run_classify(job)
    answer.write(json.dumps(out) + "\n")
    answer.flush()


if __name__ == "__main__":
    main()
