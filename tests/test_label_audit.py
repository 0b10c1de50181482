"""Audit: Wilson intervals and confusion on hand-computed cases, the stratified sheet, suspicion,
the report's bad input, and training rows from labeled.jsonl with the audit applied."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from encoderkit.errors import EncoderkitError
from encoderkit.label.sample import SampleConfig, allocate
from encoderkit.label.sample import run as sample
from encoderkit.label.stats import agreement, wilson
from encoderkit.tasks.labeled import labelled_rows
from encoderkit.tasks.tabular import read_rows


def test_wilson_matches_hand_computed_intervals():
    # 8/10: p=.8, z=1.96: centre (.8+.19208)/1.38416=.71674, half 1.96*sqrt(.016+.009604)/1.38416=.22658
    lo, hi = wilson(8, 10)
    assert (lo, hi) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    lo, hi = wilson(0, 20)  # all wrong: the interval still has width, z^2/(n+z^2) = 3.8415/23.8415
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    lo, hi = wilson(50, 100)
    # 1.96*sqrt(.0025+.000096)/1.038415
    assert 0.5 - lo == pytest.approx(hi - 0.5) and hi == pytest.approx(0.5962, abs=1e-4)


def test_agreement_confusion_counts_by_hand():
    gold = ["neg", "neg", "pos", "pos", "pos"]
    pred = ["neg", "pos", "pos", "pos", None]
    r = agreement(gold, pred, ["neg", "pos"])
    assert r["accuracy"] == 0.6 and r["n"] == 5 and r["correct"] == 3
    assert r["confusion"] == {"neg": {"neg": 1, "pos": 1, "unlabeled": 0}, "pos": {"neg": 0, "pos": 2, "unlabeled": 1}}
    assert r["per_class"]["pos"] == {"gold": 3, "recall": 0.6667, "precision": 0.6667}
    assert r["per_class"]["neg"] == {"gold": 2, "recall": 0.5, "precision": 1.0}
    assert (r["ci_low"], r["ci_high"]) == tuple(round(x, 4) for x in wilson(3, 5))


def write_labeled(path: Path, n: int = 60, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        lab = "pos" if i % 3 else "neg"
        recs.append({"text": f"text {i}", "label": lab if i != 7 else None, "confidence": round(float(rng.random()), 3),
                     "labeller": "sim", "suspicion": round(float(rng.random()), 3), "suspect": bool(i % 10 == 1)})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_allocation_is_proportional_and_never_exceeds_a_stratum():
    assert allocate([50, 30, 20], 10) == [5, 3, 2]
    assert allocate([1, 1, 98], 10) == [0, 0, 10] or sum(allocate([1, 1, 98], 10)) == 10
    assert allocate([3, 2], 10) == [3, 2]
    take = allocate([7, 5, 3], 6)
    assert sum(take) == 6 and all(t <= s for t, s in zip(take, [7, 5, 3], strict=True))


def test_sample_sheet_is_stratified_ordered_by_suspicion_with_empty_gold(tmp_path):
    recs = write_labeled(tmp_path / "labeled.jsonl")
    res = sample(SampleConfig(input=str(tmp_path / "labeled.jsonl"), n=30, output=str(tmp_path / "sheet.csv")))
    rows = sheet_rows(tmp_path / "sheet.csv")
    assert res.rows == 30 and len({r["row"] for r in rows}) == 30
    assert all(r["gold"] == "" for r in rows) and "7" not in {r["row"] for r in rows}  # unlabeled never sampled
    assert [float(r["suspicion"]) for r in rows] == sorted((float(r["suspicion"]) for r in rows), reverse=True)
    assert all(r["text"] == recs[int(r["row"])]["text"] and r["label"] == recs[int(r["row"])]["label"] for r in rows)
    labelled = [r for r in recs if r["label"]]
    share_neg = sum(r["label"] == "neg" for r in labelled) / len(labelled)  # 20 of 59
    assert sum(r["label"] == "neg" for r in rows) == pytest.approx(30 * share_neg, abs=2)
    with pytest.raises(EncoderkitError, match="exists"):
        sample(SampleConfig(input=str(tmp_path / "labeled.jsonl"), n=30, output=str(tmp_path / "sheet.csv")))


def sheet_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def fill(sheet: Path, golds: dict[int, str]) -> None:
    rows = sheet_rows(sheet)
    for r in rows:
        r["gold"] = golds.get(int(r["row"]), r["gold"])
    with open(sheet, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_report_accuracy_on_audited_items_and_gold_outside_the_label_set(tmp_path):
    from encoderkit.label.report import ReportConfig
    from encoderkit.label.report import run as report

    recs = write_labeled(tmp_path / "labeled.jsonl")
    sample(SampleConfig(input=str(tmp_path / "labeled.jsonl"), n=10, output=str(tmp_path / "sheet.csv")))
    rows = sheet_rows(tmp_path / "sheet.csv")
    wrong = {int(rows[0]["row"]), int(rows[1]["row"])}
    golds = {int(r["row"]): ("neg" if r["label"] == "pos" else "pos") if int(r["row"]) in wrong else r["label"]
             for r in rows[:8]}  # 8 audited, 2 of them wrong; 2 left blank
    fill(tmp_path / "sheet.csv", golds)
    (tmp_path / "labeled.jsonl.ledger.json").write_text(json.dumps(
        {"requests": 60, "prompt_tokens": 5400, "completion_tokens": 60, "tokens": 5460, "seconds": 30.0, "texts": 60}))
    out = report(ReportConfig(input=str(tmp_path / "labeled.jsonl"), sheet=str(tmp_path / "sheet.csv"),
                              price_per_1k_tokens=0.5)).report
    lab = out["labeller"]
    assert (out["audited"] == 8 and lab["accuracy"] == 0.75
            and (lab["ci_low"], lab["ci_high"]) == tuple(round(x, 4) for x in wilson(6, 8)))
    assert lab["cost"] == {"requests_per_text": 1.0, "tokens_per_1M": 91_000_000, "seconds_per_1M": 500_000,
                           "cost_per_1M": 45_500.0}
    assert recs[0]["text"] == "text 0"
    fill(tmp_path / "sheet.csv", {int(rows[9]["row"]): "Positive"})
    with pytest.raises(EncoderkitError,
                       match=r"sheet.csv:11: gold label 'Positive' is not one of the labels \(neg, pos\)"):
        report(ReportConfig(input=str(tmp_path / "labeled.jsonl"), sheet=str(tmp_path / "sheet.csv")))


def test_sheet_errors_name_the_line_a_row_starts_on_past_multi_line_cells(tmp_path):
    """A quoted text cell holding line breaks (a review pasted with its paragraphs) makes a row span several lines:
    errors name the line the row starts on, not its index."""
    from encoderkit.label.report import ReportConfig
    from encoderkit.label.report import run as report
    from encoderkit.label.sheet import read_sheet

    recs = [{"text": "one\ntwo\nthree" if i == 0 else f"text {i}", "label": "pos", "labeller": "sim"} for i in range(3)]
    (tmp_path / "labeled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    sheet = tmp_path / "sheet.csv"
    sheet.write_text('row,text,label,gold\n0,"one\ntwo\nthree",pos,pos\n1,text 1,pos,pos\n2,text 2,pos,Positive\n')
    assert [r.line for r in read_sheet(sheet)] == [2, 5, 6]
    with pytest.raises(EncoderkitError, match=r"sheet.csv:6: gold label 'Positive' is not one of the labels"):
        report(ReportConfig(input=str(tmp_path / "labeled.jsonl"), sheet=str(sheet)))
    sheet.write_text('row,text,label,gold\n0,"one\ntwo\nthree",pos,pos\n1,text 9,pos,pos\n')
    with pytest.raises(EncoderkitError, match=r"sheet.csv:5: row 1 does not match line 2"):
        report(ReportConfig(input=str(tmp_path / "labeled.jsonl"), sheet=str(sheet)))


def test_encoder_cost_records_the_predictors_engine():
    from encoderkit.inference.policy import EngineChoice
    from encoderkit.label.report import encoder_cost

    class Fake:
        choice = EngineChoice("onnx-int8", None, "INT8: the embed task's rule")

        def classify(self, texts):
            return [{"label": "pos"} for _ in texts]

    cost = encoder_cost(Fake(), ["a", "b", "c"], 0.0)
    assert cost["engine"] == {"backend": "onnx-int8", "calibration": None, "reason": "INT8: the embed task's rule"}
    assert "backend" not in cost and cost["measured_on"] == 3


def test_training_rows_apply_audit_drop_unlabeled_and_suspects(tmp_path):
    recs = write_labeled(tmp_path / "labeled.jsonl", n=30)
    sheet = tmp_path / "sheet.csv"
    sheet.write_text("row,text,label,gold\n0,text 0,neg,pos\n1,text 1,pos,pos\n2,text 2,pos,\n")
    rows = read_rows(tmp_path / "labeled.jsonl")
    plain = labelled_rows(rows, tmp_path / "labeled.jsonl")
    assert len(plain) == 29 and all(r.fields["label"] for r in plain)  # line 7 unlabeled
    fixed = labelled_rows(rows, tmp_path / "labeled.jsonl", str(sheet), drop_suspected=True)
    by_text = {r.fields["text"]: r.fields["label"] for r in fixed}
    assert by_text["text 0"] == "pos"              # the audit's correction
    assert "text 1" in by_text                     # suspect (1 % 10 == 1) but audited: kept
    assert "text 11" not in by_text and "text 21" not in by_text  # suspects dropped
    assert len(fixed) == 29 - 2
    assert recs[0]["label"] == "neg"
    sheet.write_text("row,text,label,gold\n0,text 0,neg,maybe\n")
    with pytest.raises(EncoderkitError, match=r"sheet.csv:2: gold label 'maybe' is not one of the labels"):
        labelled_rows(rows, tmp_path / "labeled.jsonl", str(sheet))
    sheet.write_text("row,text,label,gold\n3,another text,neg,pos\n")
    with pytest.raises(EncoderkitError, match="does not match a line"):
        labelled_rows(rows, tmp_path / "labeled.jsonl", str(sheet))
    tsv = tmp_path / "plain.tsv"
    tsv.write_text("sentence\tlabel\nok\t1\n")
    with pytest.raises(EncoderkitError, match="not the output of `encoderkit label`"):
        labelled_rows(read_rows(tsv), tsv, drop_suspected=True)


def test_suspicion_finds_flipped_labels(tmp_path):
    pytest.importorskip("cleanlab")
    from encoderkit.label.suspicion import SuspectConfig
    from encoderkit.label.suspicion import run as suspect

    rng = np.random.default_rng(0)
    pos, neg = ["great", "fun", "best", "love", "superb"], ["dull", "boring", "worst", "awful", "bland"]
    filler = ["the", "movie", "film", "story", "was", "a", "this", "plot", "acting", "cast"]
    recs, flipped = [], []
    for i in range(300):
        lab = "pos" if i % 2 else "neg"
        words = list(rng.choice(filler, 5)) + list(rng.choice(pos if lab == "pos" else neg, 2))
        flip = rng.random() < 0.1
        flipped.append(flip)
        recs.append({"text": " ".join(rng.permutation(words)),
                     "label": ("neg" if lab == "pos" else "pos") if flip else lab,
                     "confidence": None, "labeller": "sim"})
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = suspect(SuspectConfig(input=str(tmp_path / "l.jsonl"), output=str(tmp_path / "s.jsonl")))
    out = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    sus = np.array([r["suspect"] for r in out])
    flipped = np.array(flipped)
    assert res.suspects == sus.sum()
    assert (sus & flipped).sum() / flipped.sum() >= 0.8       # recall
    assert (sus & flipped).sum() / max(sus.sum(), 1) >= 0.6   # precision (base rate 0.1)
    score = np.array([r["suspicion"] for r in out])
    assert score[flipped].mean() > score[~flipped].mean() + 0.3


def test_finetune_trains_on_labeled_jsonl_with_the_audit_applied(tmp_path, tiny_bert_dir):
    import torch

    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    recs = []
    for i in range(40):
        lab = "pos" if i % 2 else "neg"
        recs.append({"text": f"the {'great' if lab == 'pos' else 'dull'} movie {i}", "label": lab, "confidence": 0.9,
                     "labeller": "sim", "sentence": f"the {'great' if lab == 'pos' else 'dull'} movie {i}",
                     "suspect": i in (3, 4, 5)})
    recs[6]["label"] = None  # unlabeled: never trained on
    (tmp_path / "labeled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "sheet.csv").write_text("row,text,label,gold\n4,the dull movie 4,neg,pos\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nthe great movie\tpos\nthe dull movie\tneg\n")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = finetune(FinetuneConfig(model=str(tiny_bert_dir), train=str(tmp_path / "labeled.jsonl"),
                                      dev=str(tmp_path / "dev.tsv"), out=str(tmp_path / "out"), max_steps=2,
                                      batch_size=8, audit_sheet=str(tmp_path / "sheet.csv"), drop_suspected=True))
    finally:
        torch.set_num_threads(before)
    card = json.loads((res.out / "encoderkit.json").read_text())
    assert card["train_examples"] == 40 - 1 - 2  # unlabeled row 6 and suspects 3, 5 dropped; audited 4 kept
    assert card["labels"] == ["neg", "pos"] and card["config"]["audit_sheet"].endswith("sheet.csv")
