"""A real multi-label set from CoNLL-2003: which entity types (PER, ORG, LOC, MISC) a sentence contains.

Builds ``train.tsv`` / ``dev.tsv`` / ``test.tsv`` (``text``, ``labels`` joined by ``|``, ``none`` for a sentence
without entities) from ``eng.train``, ``eng.testa`` and ``eng.testb`` (``-DOCSTART-`` lines dropped), fine-tunes
MiniLM (``--task multilabel``: a sigmoid per type, per-type thresholds chosen on dev) on a seeded subset for a
short run, evaluates it at the saved thresholds on dev (which chose them: slightly optimistic) and on test
(which did not: the figure to quote), and compares with two baselines that need no model: all-off (no label
ever) and the most frequent type on every sentence. ``dev_at_0.5`` is the untuned dev figure.

    nice -n 5 python bench/multilabel_conll.py --out /tmp/mlc              # ~2000 sentences, 1 epoch
    nice -n 5 python bench/multilabel_conll.py --out /tmp/mlc --train-examples 0 --epochs 2

``--scheme fine`` builds a many-label set instead (:func:`build_fine_tsv`: 66 labels, a coarse and a fine one per
sentence, as a question-classification set has) and trains it with finetune's own defaults (``--lr 0`` keeps
them; ``--epochs`` too), the setting where a sigmoid head used to end at the labels' prior:

    nice -n 5 python bench/multilabel_conll.py --out /tmp/mlf --scheme fine --train-examples 0 --epochs 3 --lr 0
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from encoderkit.hardware import describe, result_field
from encoderkit.tasks.multilabel.features import scores

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data")) / "conll2003"
TYPES = ("LOC", "MISC", "ORG", "PER")


def build_tsv(src: Path, out: Path) -> list[list[str]]:
    """One row per sentence of a CoNLL file: its words and the sorted set of its entity types."""
    from encoderkit.tasks.ner.data import read_ner

    sets, lines = [], ["text\tlabels"]
    for s in read_ner(src):
        if s.words[:1] == ["-DOCSTART-"]:
            continue
        types = sorted({t[2:] for t in s.tags if t != "O"})
        sets.append(types)
        lines.append(" ".join(s.words).replace("\t", " ") + "\t" + ("|".join(types) or "none"))
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sets


def entities(words: list[str], tags: list[str]) -> list[tuple[str, str]]:
    """The (type, text) of each entity of an IOB1/IOB2 sentence."""
    out: list[tuple[str, list[str]]] = []
    prev = "O"
    for w, t in zip(words, tags, strict=True):
        if t != "O" and prev != "O" and prev[2:] == t[2:] and t.startswith("I-"):
            out[-1][1].append(w)
        elif t != "O":
            out.append((t[2:], [w]))
        prev = t
    return [(typ, " ".join(ws)) for typ, ws in out]


def build_fine_tsv(src: Path, out: Path, keep: set[str] | None = None, min_count: int = 30) -> list[list[str]]:
    """A many-label set, coarse and fine as a question-classification set is: the sentences with exactly one
    entity, labelled with its type (``LOC``) and its type with the entity's first letter (``LOC:G``); only the
    fine labels of ``keep`` (default: those of ``min_count`` sentences or more here, 62 in eng.train at 30) and
    their sentences are kept, so every row has 2 of the labels."""
    from encoderkit.tasks.ner.data import read_ner

    rows = []
    for s in read_ner(src):
        found = entities(s.words, s.tags) if s.words[:1] != ["-DOCSTART-"] else []
        if len(found) == 1:
            typ, text = found[0]
            rows.append((" ".join(s.words).replace("\t", " "), [typ, f"{typ}:{text[0].upper()}"]))
    if keep is None:
        counts = Counter(labels[1] for _, labels in rows)
        keep = {k for k, n in counts.items() if n >= min_count}
    rows = [(text, labels) for text, labels in rows if labels[1] in keep]
    out.write_text("\n".join(["text\tlabels", *(f"{t}\t{'|'.join(ls)}" for t, ls in rows)]) + "\n", encoding="utf-8")
    return [labels for _, labels in rows]


def baselines(train: list[list[str]], dev: list[list[str]]) -> dict[str, dict[str, float]]:
    names = sorted({t for s in train for t in s})
    gold = np.array([[t in s for t in names] for s in dev])
    top = Counter(t for s in train for t in s).most_common(1)[0][0]
    return {"all_off": scores(gold, np.zeros_like(gold)),
            f"always_{top}": scores(gold, np.tile([t == top for t in names], (len(dev), 1)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--train-examples", type=int, default=2000, help="seeded subset of training sentences (0: all 14k)")
    ap.add_argument("--dev-examples", type=int, default=0, help="seeded subset of dev sentences (0: all 3,250)")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4, help="0: finetune's default")
    ap.add_argument("--scheme", choices=("types", "fine"), default="types",
                    help="types: the 4 entity types a sentence holds; fine: 66 labels, coarse and fine")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)

    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    args.out.mkdir(parents=True, exist_ok=True)
    if args.scheme == "fine":
        train_sets = build_fine_tsv(DATA / "eng.train", args.out / "train.tsv")
        keep = {s[1] for s in train_sets}
        dev_sets = build_fine_tsv(DATA / "eng.testa", args.out / "dev.tsv", keep)
        test_sets = build_fine_tsv(DATA / "eng.testb", args.out / "test.tsv", keep)
    else:
        train_sets = build_tsv(DATA / "eng.train", args.out / "train.tsv")
        dev_sets = build_tsv(DATA / "eng.testa", args.out / "dev.tsv")
        test_sets = build_tsv(DATA / "eng.testb", args.out / "test.tsv")
    print(f"train {len(train_sets)} sentences, dev {len(dev_sets)}; dev label sets: "
          f"{dict(Counter('|'.join(s) or 'none' for s in dev_sets).most_common(6))}", flush=True)

    t0 = time.perf_counter()
    res = finetune(FinetuneConfig(
        model=args.model, task="multilabel", train=str(args.out / "train.tsv"), dev=str(args.out / "dev.tsv"),
        out=str(args.out / "model"), overwrite=True, epochs=args.epochs, batch_size=32, seed=0,
        **({"lr": args.lr} if args.lr else {}),
        max_train_examples=args.train_examples, max_dev_examples=args.dev_examples, max_length=64))
    train_s = time.perf_counter() - t0
    ev = evaluate(EvaluateConfig(model=str(res.out), data=str(args.out / "dev.tsv"), max_examples=args.dev_examples,
                                 max_length=64))
    test = evaluate(EvaluateConfig(model=str(res.out), data=str(args.out / "test.tsv"), max_length=64))
    card = json.loads((res.out / "encoderkit.json").read_text())
    base = baselines(train_sets, test_sets)
    print(json.dumps({"dev_at_thresholds": ev.metrics, "dev_at_0.5": res.metrics, "test_at_thresholds": test.metrics,
                      "thresholds": card["thresholds"], "test_baselines": base}, indent=1))
    best_base = max(base.items(), key=lambda kv: kv[1]["micro_f1"])
    m = test.metrics
    print("RESULT bench=multilabel_conll " + " ".join([
        f"model={args.model}", f"scheme={args.scheme}", f"train_examples={card.get('train_examples')}",
        f"epochs={args.epochs}", f"test_examples={m['examples']}", f"test_micro_f1={m['micro_f1']:.4f}",
        f"test_macro_f1={m['macro_f1']:.4f}", f"test_subset_accuracy={m['subset_accuracy']:.4f}",
        f"dev_micro_f1={ev.metrics['micro_f1']:.4f}", f"dev_micro_f1_at_0.5={res.metrics['micro_f1']:.4f}",
        f"baseline={best_base[0]}",
        f"baseline_micro_f1={best_base[1]['micro_f1']:.4f}", f"baseline_macro_f1={best_base[1]['macro_f1']:.4f}",
        f"all_off_subset_accuracy={base['all_off']['subset_accuracy']:.4f}", f"train_s={train_s:.0f}",
        result_field()]))


if __name__ == "__main__":
    main()
