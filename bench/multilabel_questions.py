"""Multi-label with many labels on questions: encoderkit's defaults against the HF Trainer and a frozen-feature probe.

The set is built here from SQuAD v1.1 dev (``../shared/data/squad_v1.1``; nothing is shipped): each question gets a
coarse label, its wh-type (``WHAT``, ``WHO``, ``WHICH``, ``WHEN``, ``WHERE``, ``QUANTITY`` for how many/much, ``HOW``,
``WHY``, ``OTHER``: the first wh-word in the question) and a fine one, the title of the article it was asked on
(``title:Super_Bowl_50``, 48 of them): 57 labels, two per question, as a question-classification set (TREC's coarse
and fine classes) has. The questions are shuffled with ``--seed`` and split into train / dev / test.

Three results on the same test questions, each scored as micro-F1 over the label sets:

* ``probe``: logistic regression (one-vs-rest, C=10) on the frozen model's mean-pooled, normalised embeddings,
  threshold 0.3: the reference that shows what the frozen features already hold;
* ``encoderkit``: ``finetune --task multilabel`` with its defaults (``--dev`` given), then ``predict`` on the test
  questions; the score is computed from predict's output file;
* ``hf_trainer``: ``AutoModelForSequenceClassification(problem_type="multi_label_classification")`` trained by
  ``transformers.Trainer`` with the same base, epochs, batch and max length (its own default LR and schedule), scored
  at 0.5 (what a user of it gets) and at the one threshold best on dev (``hf_trainer_dev_threshold``).

    nice -n 10 python bench/multilabel_questions.py --out /tmp/mlq
    nice -n 10 python bench/multilabel_questions.py --out /tmp/mlq --train-examples 1500 --skip hf   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from encoderkit.hardware import describe, result_field
from encoderkit.tasks.multilabel.features import GRID, scores

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data")) / "squad_v1.1"
WH = re.compile(r"\b(how many|how much|what|which|whom|whose|who|when|where|why|how)\b", re.IGNORECASE)
COARSE = {"how many": "QUANTITY", "how much": "QUANTITY", "whom": "WHO", "whose": "WHO"}


def wh_type(question: str) -> str:
    """The coarse label: the question's first wh-word, grouped (``OTHER`` when it has none)."""
    m = WH.search(question)
    word = m.group(1).lower() if m else "other"
    return COARSE.get(word, word.upper())


def questions(src: Path) -> list[tuple[str, list[str]]]:
    """Every SQuAD question with its two labels: the wh-type and ``title:<article>``."""
    with zipfile.ZipFile(src) as z:
        data = json.load(z.open("dev-v1.1.json"))
    # a comma in a label reads as labels joined the wrong way (Jacksonville,_Florida): dropped
    return [(" ".join(q["question"].split()), [wh_type(q["question"]), "title:" + a["title"].replace(",", "")])
            for a in data["data"] for p in a["paragraphs"] for q in p["qas"]]


def build_sets(out: Path, seed: int, train: int, dev: int, test: int) -> dict[str, list[tuple[str, list[str]]]]:
    """``train.tsv`` / ``dev.tsv`` / ``test.tsv`` (``text``, ``labels`` joined by ``|``) and ``test.jsonl`` (the
    test questions as predict's input), split by question after a seeded shuffle."""
    rows = questions(DATA / "dev-v1.1.json.zip")
    random.Random(seed).shuffle(rows)
    sets = {"train": rows[:train], "dev": rows[train:train + dev], "test": rows[train + dev:train + dev + test]}
    out.mkdir(parents=True, exist_ok=True)
    for name, part in sets.items():
        lines = ["text\tlabels", *(f"{q}\t{'|'.join(ls)}" for q, ls in part)]
        (out / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "test.jsonl").write_text("".join(json.dumps({"text": q}) + "\n" for q, _ in sets["test"]), encoding="utf-8")
    return sets


def targets(part: list[tuple[str, list[str]]], names: list[str]) -> np.ndarray:
    return np.array([[n in ls for n in names] for _, ls in part], dtype=bool)


def embed(model_dir: str, texts: list[str], max_length: int) -> np.ndarray:
    """Mean-pooled, L2-normalised embeddings of the frozen model (plain transformers)."""
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 128):
            b = tok(texts[i:i + 128], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            h, m = model(**b).last_hidden_state, b["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out).numpy()


def probe(model_dir: str, sets, names: list[str], max_length: int) -> tuple[float, float]:
    """Test micro-F1 and seconds of the frozen-feature probe (one-vs-rest logistic regression, C=10, at 0.3)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.multiclass import OneVsRestClassifier

    t0 = time.perf_counter()
    x_train = embed(model_dir, [q for q, _ in sets["train"]], max_length)
    clf = OneVsRestClassifier(LogisticRegression(C=10, max_iter=1000)).fit(x_train, targets(sets["train"], names))
    probs = clf.predict_proba(embed(model_dir, [q for q, _ in sets["test"]], max_length))
    return scores(targets(sets["test"], names), probs >= 0.3)["micro_f1"], time.perf_counter() - t0


def ours(args, sets, names: list[str]) -> tuple[float, float, dict]:
    """``finetune --task multilabel`` with its defaults, then ``predict`` on the test questions: test micro-F1 from
    predict's output, the seconds of both, and the card."""
    from encoderkit.inference.predictor import PredictConfig
    from encoderkit.inference.predictor import run as predict
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    t0 = time.perf_counter()
    extra = {"epochs": args.epochs} if args.epochs else {}
    res = finetune(FinetuneConfig(model=args.model, task="multilabel", train=str(args.out / "train.tsv"),
                                  dev=str(args.out / "dev.tsv"), out=str(args.out / "model"), overwrite=True,
                                  seed=args.seed, max_length=args.max_length, **extra))
    predict(PredictConfig(model=str(res.out), input=str(args.out / "test.jsonl"),
                          output=str(args.out / "test_predictions.jsonl"), overwrite=True))
    seconds = time.perf_counter() - t0
    got = [json.loads(line)["labels"] for line in (args.out / "test_predictions.jsonl").read_text().splitlines()]
    pred = np.array([[n in ls for n in names] for ls in got], dtype=bool)
    card = json.loads((res.out / "encoderkit.json").read_text())
    return scores(targets(sets["test"], names), pred)["micro_f1"], seconds, card


def hf_trainer(args, sets, names: list[str]) -> tuple[float, float, float]:
    """The HF Trainer on the same base, epochs, batch and max length: test micro-F1 at 0.5, at the one threshold
    best on dev, and its seconds (training and both predictions)."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_dir, num_labels=len(names), problem_type="multi_label_classification",
        id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})

    def dataset(part) -> Dataset:
        enc = tok([q for q, _ in part], truncation=True, max_length=args.max_length)
        return Dataset.from_dict({**enc, "labels": targets(part, names).astype(np.float32).tolist()})

    targs = TrainingArguments(output_dir=str(args.out / "hf"), num_train_epochs=args.epochs or 3.0,
                              per_device_train_batch_size=32, per_device_eval_batch_size=128, seed=args.seed,
                              save_strategy="no", report_to=[], logging_steps=50, use_cpu=True)
    trainer = Trainer(model=model, args=targs, train_dataset=dataset(sets["train"]), processing_class=tok)
    trainer.train()

    def probs(part) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-trainer.predict(dataset(part)).predictions))

    dev_p, test_p = probs(sets["dev"]), probs(sets["test"])
    dev_y, test_y = targets(sets["dev"], names), targets(sets["test"], names)
    best = max(GRID, key=lambda t: scores(dev_y, dev_p >= t)["micro_f1"])
    return (scores(test_y, test_p >= 0.5)["micro_f1"], scores(test_y, test_p >= best)["micro_f1"],
            time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--train-examples", type=int, default=5000)
    ap.add_argument("--dev-examples", type=int, default=1000)
    ap.add_argument("--test-examples", type=int, default=2000)
    ap.add_argument("--epochs", type=float, default=0.0, help="0: finetune's default (the peer runs the same)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], choices=("probe", "ours", "hf"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)

    from encoderkit.tasks.common import open_model

    args.model_dir = str(open_model(args.model).path)
    sets = build_sets(args.out, args.seed, args.train_examples, args.dev_examples, args.test_examples)
    names = sorted({x for _, ls in sets["train"] for x in ls})
    print(f"train {len(sets['train'])} questions, dev {len(sets['dev'])}, test {len(sets['test'])}; "
          f"{len(names)} labels", flush=True)
    fields = [f"model={args.model}", f"labels={len(names)}", f"train={len(sets['train'])}",
              f"test={len(sets['test'])}", f"epochs={args.epochs or 'default'}"]
    if "probe" not in args.skip:
        f1, s = probe(args.model_dir, sets, names, args.max_length)
        print(f"probe (frozen mean-pooled features, logistic regression C=10, at 0.3): test micro-F1 {f1:.4f}, "
              f"{s:.0f} s", flush=True)
        fields += [f"probe_micro_f1={f1:.4f}", f"probe_s={s:.0f}"]
    if "ours" not in args.skip:
        f1, s, card = ours(args, sets, names)
        print(f"encoderkit finetune + predict: test micro-F1 {f1:.4f}, {s:.0f} s (steps {card['steps']}, threshold "
              f"{sorted(set(card['thresholds'].values()))}, head {card.get('head')})", flush=True)
        fields += [f"encoderkit_micro_f1={f1:.4f}", f"encoderkit_s={s:.0f}"]
    if "hf" not in args.skip:
        f1, f1_dev, s = hf_trainer(args, sets, names)
        print(f"HF Trainer: test micro-F1 {f1:.4f} at 0.5, {f1_dev:.4f} at the dev-best threshold, {s:.0f} s",
              flush=True)
        fields += [f"hf_trainer_micro_f1={f1:.4f}", f"hf_trainer_dev_threshold_micro_f1={f1_dev:.4f}",
                   f"hf_trainer_s={s:.0f}"]
    print("RESULT bench=multilabel_questions " + " ".join([*fields, f"threads={args.threads}", result_field()]))


if __name__ == "__main__":
    main()
