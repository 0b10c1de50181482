"""Label SST-2 sentences, audit, fine-tune on the labels: does the encoder beat its labeller?

Two labellers, each run end to end through the CLI (every command is printed):

* ``--part embed`` (offline): the zero-shot embed labeller (MiniLM, label descriptions only) on
  ``--n`` training sentences (a seeded subset) and on dev; ``audit suspect``; MiniLM fine-tuned on the
  labels, and again after dropping the suspected errors. Dev accuracy of each, against the gold.
* ``--part sim`` (a SIMULATED LLM): ``tests/chat_server.py`` answers each sentence with its gold label,
  flipped with a class-dependent probability (negatives ``--flip-neg``, positives ``--flip-pos``;
  about 15% overall). Labelled through ``--labeller endpoint``; ``audit suspect --features both``; ``audit sample``;
  the sheet's gold column is filled with the true labels (standing in for the human reviewer);
  ``audit report``; fine-tunes on the raw labels and on the cleaned ones (audited corrections
  applied, suspects dropped); ``audit report --encoder`` for the decision table.

Each step is skipped when its output exists, so a rerun resumes. Sizes are stated in the RESULT line.

    nice -n 5 python bench/label_sst2.py --part embed --out /tmp/lr
    nice -n 5 python bench/label_sst2.py --part sim --out /tmp/lr
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from encoderkit.hardware import describe, result_field
from encoderkit.label.records import read_labeled
from encoderkit.models.card import read_card
from encoderkit.tasks.common import seeded_subset
from encoderkit.tasks.tabular import read_rows

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data")) / "glue_sst2"
EK = [sys.executable, "-m", "encoderkit.cli", "--threads", "1"]
DESC = ["0=a negative, bad review", "1=a positive, good review"]


def sh(args: list[str], out: Path | None = None) -> None:
    """Run one encoderkit command (printed) unless its output already exists."""
    if out is not None and out.exists():
        print(f"# exists, skipped: {out}", flush=True)
        return
    print("$ encoderkit --threads 1 " + " ".join(f"'{a}'" if " " in a else a for a in args), flush=True)
    subprocess.run(EK + args, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def dev_accuracy(model: Path) -> float:
    return read_card(model)["metrics"]["dev"]["accuracy"]


def finetune(train: Path, out: Path, args: argparse.Namespace, *extra: str) -> float:
    sh(["finetune", "--task", "classify", "--train", str(train), "--dev", str(DATA / "dev.tsv"), "--out", str(out),
        "--epochs", str(args.epochs), "--lr", "5e-5", "--batch-size", "32", "--warmup", "0.06", *extra], out)
    return dev_accuracy(out)


def flags(recs: list[dict], truth: list[str]) -> tuple[np.ndarray, np.ndarray]:
    wrong = np.array([r["label"] != t for r, t in zip(recs, truth, strict=True)])
    return wrong, np.array([bool(r.get("suspect")) for r in recs])


def part_embed(args: argparse.Namespace, out: Path) -> dict:
    train, dev = out / "embed_train.jsonl", out / "embed_dev.jsonl"
    common = ["--labeller", "embed", "--model", "minilm", "--labels", "0,1", "--descriptions", *DESC]
    sh(["label", "--input", str(DATA / "train.tsv"), "--max-examples", str(args.n), "--output", str(train), *common],
       train)
    sh(["label", "--input", str(DATA / "dev.tsv"), "--output", str(dev), *common], dev)
    sus = out / "embed_train_suspect.jsonl"
    sh(["audit", "suspect", "--input", str(train), "--output", str(sus)], sus)
    recs = read_labeled(sus)
    wrong, flagged = flags(recs, [r["input_label"] for r in recs])
    res = {"n": len(recs), "labeller_dev": np.mean([r["label"] == r["input_label"] for r in read_labeled(dev)]),
           "labeller_train": 1 - wrong.mean(), "suspects": int(flagged.sum()),
           "suspect_precision": (wrong & flagged).sum() / max(flagged.sum(), 1),
           "suspect_recall": (wrong & flagged).sum() / wrong.sum(),
           "kept_label_accuracy": 1 - wrong[~flagged].mean()}
    res["encoder_raw_dev"] = finetune(train, out / "enc_embed_raw", args)
    res["encoder_dropped_dev"] = finetune(sus, out / "enc_embed_dropped", args, "--drop-suspected")
    return res


def fill_gold(sheet: Path, gold: list[str]) -> None:
    """The simulated reviewer: the sheet's gold column gets the true label of each row."""
    with open(sheet, newline="", encoding="utf-8") as f:
        srows = list(csv.DictReader(f))
    for r in srows:
        r["gold"] = gold[int(r["row"])]
    with open(sheet, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(srows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(srows)


def part_sim(args: argparse.Namespace, out: Path) -> dict:
    rows = [r.fields for r in read_rows(DATA / "train.tsv")]
    keep = seeded_subset(list(range(len(rows))), args.n, 0)  # the subset `label --max-examples` takes
    table, truth = {}, {}
    for split, chosen, seed in (("train", [rows[i] for i in keep], 1),
                                ("dev", [r.fields for r in read_rows(DATA / "dev.tsv")], 2)):
        rng = np.random.default_rng(seed)
        for r in chosen:
            text, gold = r["sentence"], r["label"]
            flip = rng.random() < (args.flip_neg if gold == "0" else args.flip_pos)
            table[text], truth[text] = ("1" if gold == "0" else "0") if flip else gold, gold
    (out / "sim_table.jsonl").write_text("".join(json.dumps({"text": t, "answer": a}) + "\n" for t, a in table.items()))
    labeled, labeled_dev = out / "sim_train.jsonl", out / "sim_dev.jsonl"
    if not (labeled.exists() and labeled_dev.exists()):
        port = str(args.port)
        server = subprocess.Popen([sys.executable, str(REPO / "tests" / "chat_server.py"), "--table",
                                   str(out / "sim_table.jsonl"), "--port", port], stdout=subprocess.PIPE)
        server.stdout.readline()  # "serving ..."
        common = ["--labeller", "endpoint", "--endpoint", f"http://127.0.0.1:{port}/v1", "--llm", "simulated-llm",
                  "--labels", "0,1", "--descriptions", "0=negative", "1=positive", "--concurrency", "4"]
        try:
            sh(["label", "--input", str(DATA / "train.tsv"), "--max-examples", str(args.n), "--output", str(labeled),
                *common], labeled)
            sh(["label", "--input", str(DATA / "dev.tsv"), "--output", str(labeled_dev), *common], labeled_dev)
        finally:
            server.terminate()
            server.wait()
    sus = out / "sim_train_suspect.jsonl"
    sh(["audit", "suspect", "--input", str(labeled), "--output", str(sus), "--features", "both"], sus)
    recs = read_labeled(sus)
    gold = [truth[r["text"]] for r in recs]
    wrong, flagged = flags(recs, gold)
    sheet = out / "sim_sheet.csv"
    if not sheet.exists():
        sh(["audit", "sample", "--input", str(sus), "--n", str(args.audit), "--output", str(sheet)], sheet)
        fill_gold(sheet, gold)
    with open(sheet, newline="", encoding="utf-8") as f:
        srows = list(csv.DictReader(f))
    top = srows[:round(0.15 * len(srows))]
    sheet_flips = sum(r["gold"] != r["label"] for r in srows)
    top_flips = sum(r["gold"] != r["label"] for r in top)
    report = out / "sim_report.json"
    sh(["audit", "report", "--input", str(sus), "--sheet", str(sheet), "--ledger", f"{labeled}.ledger.json",
        "--output", str(report)], report)
    rep = json.loads(report.read_text())["labeller"]
    true_acc = 1 - wrong.mean()
    res = {"n": len(recs), "flips": int(wrong.sum()), "labeller_true_accuracy": true_acc,
           "audit_n": rep["n"], "audit_accuracy": rep["accuracy"], "ci_low": rep["ci_low"], "ci_high": rep["ci_high"],
           "ci_contains_truth": rep["ci_low"] <= true_acc <= rep["ci_high"],
           "top15_rows": len(top), "top15_flips": top_flips, "sheet_flips": sheet_flips,
           "top15_precision": top_flips / max(len(top), 1), "top15_recall": top_flips / max(sheet_flips, 1),
           "suspects": int(flagged.sum()), "suspect_precision": (wrong & flagged).sum() / max(flagged.sum(), 1),
           "suspect_recall": (wrong & flagged).sum() / wrong.sum()}
    res["encoder_raw_dev"] = finetune(labeled, out / "enc_sim_raw", args)
    res["encoder_clean_dev"] = finetune(sus, out / "enc_sim_clean", args, "--audit-sheet", str(sheet),
                                        "--drop-suspected")
    # the decision on gold neither model was trained on: every dev sentence, "audited" with its gold label
    dev_sheet = out / "sim_dev_sheet.csv"
    if not dev_sheet.exists():
        sh(["audit", "sample", "--input", str(labeled_dev), "--n", "100000", "--output", str(dev_sheet)], dev_sheet)
        fill_gold(dev_sheet, [truth[r["text"]] for r in read_labeled(labeled_dev)])
    decision = out / "sim_decision.json"
    sh(["audit", "report", "--input", str(labeled_dev), "--sheet", str(dev_sheet), "--ledger", f"{labeled}.ledger.json",
        "--encoder", str(out / "enc_sim_clean"), "--price-per-1k-tokens", str(args.price_per_1k_tokens),
        "--cpu-hour-price", str(args.cpu_hour_price), "--output", str(decision)], decision)
    d = json.loads(decision.read_text())
    print(json.dumps(d, indent=1))
    res.update(dev_labeller=d["labeller"]["accuracy"], dev_encoder=d["encoder"]["accuracy"],
               labeller_cost_1M=d["labeller"]["cost"].get("cost_per_1M"),
               encoder_cost_1M=d["encoder"]["cost"].get("cost_per_1M"),
               encoder_cpu_s_1M=d["encoder"]["cost"]["cpu_seconds_per_1M"],
               labeller_tokens_1M=d["labeller"]["cost"]["tokens_per_1M"])
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("embed", "sim"), required=True)
    p.add_argument("--out", default="runs/label_sst2")
    p.add_argument("--n", type=int, default=4000, help="training sentences to label (seeded subset)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--audit", type=int, default=400, help="sim: sheet size")
    p.add_argument("--flip-neg", type=float, default=0.20)
    p.add_argument("--flip-pos", type=float, default=0.11)
    p.add_argument("--port", type=int, default=8089)
    p.add_argument("--price-per-1k-tokens", type=float, default=0.00015, help="e.g. $0.15 per 1M input tokens")
    p.add_argument("--cpu-hour-price", type=float, default=0.05, help="one cloud CPU core-hour")
    args = p.parse_args()
    print(f"hardware: {describe()}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = part_embed(args, out) if args.part == "embed" else part_sim(args, out)
    res["minutes"] = (time.perf_counter() - t0) / 60
    print("RESULT part=" + args.part + " " + " ".join(
        f"{k}={round(v, 4) if isinstance(v, (float, np.floating)) else v}"
        for k, v in res.items()) + " " + result_field())


if __name__ == "__main__":
    main()
