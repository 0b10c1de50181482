"""``encoderkit decide``: the break-even against hand arithmetic, a recommendation each way, the flags' weight,
and bad input (a missing or inconsistent sheet, a volume of zero, a negative price) refused with exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from encoderkit.cli import main
from encoderkit.errors import EncoderkitError
from encoderkit.label.decide import DecideConfig, run
from encoderkit.label.sheet import write_sheet


def _sheet(path: Path, n: int = 50, wrong: int = 5, gold_outside: bool = False) -> Path:
    rows = []
    for i in range(n):
        label = "pos" if i % 2 else "neg"
        gold = ("neu" if gold_outside and i == 0 else ("neg" if label == "pos" else "pos") if i < wrong else label)
        rows.append({"row": i, "text": f"text number {i}", "label": label, "gold": gold})
    write_sheet(path, rows)
    return path


def _ledger(path: Path) -> Path:
    path.write_text(json.dumps({"requests": 1000, "tokens": 200_000, "seconds": 800.0, "texts": 1000}))
    return path


def _cfg(tmp: Path, **kw) -> DecideConfig:
    base = {"sheet": str(_sheet(tmp / "sheet.csv")), "ledger": str(_ledger(tmp / "l.json")), "volume": 100.0,
            "machine_cost_per_hour": 0.5, "llm_price_per_call": 0.01, "encoder_metric": 0.9,
            "encoder_latency_ms": 3.6, "train_hours": 2.0, "audit_cost": 20.0}
    return DecideConfig(**{**base, **kw})


def _wilson_low(k: int, n: int) -> float:
    z, p = 1.959964, k / n
    return (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)


def test_break_even_matches_hand_arithmetic_and_high_volume_picks_the_encoder(tmp_path):
    r = run(_cfg(tmp_path)).report
    llm_per_call = 0.01
    enc_per_call = 0.5 * 0.0036 / 3600            # machine price/hour x seconds a request / 3600
    one_time = 1000 * 0.01 + 2.0 * 0.5 + 20.0     # labelling requests x price + training hours x price + audit
    be = one_time / (llm_per_call - enc_per_call)
    assert r["one_time"]["total"] == pytest.approx(one_time)
    assert r["encoder"]["cost_per_request"] == pytest.approx(enc_per_call)
    assert r["break_even"]["requests"] == pytest.approx(be)
    assert r["break_even"]["per_day"] == pytest.approx(be / 365)
    assert r["break_even"]["payback_days_at_volume"] == pytest.approx(one_time / ((llm_per_call - enc_per_call) * 100))
    assert r["llm"]["accuracy"] == 0.9 and r["llm"]["ci_low"] == pytest.approx(_wilson_low(45, 50), abs=1e-4)
    assert r["llm"]["latency_ms"] == pytest.approx(800.0)  # the ledger's seconds / requests
    assert r["llm"]["cost_per_day"] == pytest.approx(100 * 0.01)
    assert r["recommendation"] == "encoder" and any("reaches" in x for x in r["reasons"])


def test_low_volume_or_a_worse_encoder_picks_the_llm(tmp_path):
    low = run(_cfg(tmp_path, volume=5.0)).report  # break-even is about 8.5 requests/day
    assert low["recommendation"] == "llm" and any("does not reach" in x for x in low["reasons"])
    worse = run(_cfg(tmp_path, encoder_metric=0.5, volume=1e6)).report
    assert worse["recommendation"] == "llm" and any("is below" in x for x in worse["reasons"])


def test_price_per_1k_tokens_uses_the_ledgers_tokens(tmp_path):
    r = run(_cfg(tmp_path, llm_price_per_call=-1.0, llm_price_per_1k_tokens=0.002)).report
    per_call = 0.002 * 200 / 1000  # 200 tokens a request in the ledger
    assert r["llm"]["cost_per_request"] == pytest.approx(per_call)
    assert r["one_time"]["labelling"] == pytest.approx(200_000 / 1000 * 0.002)


def test_flags_are_weighed_and_said(tmp_path):
    closed = run(_cfg(tmp_path, volume=5.0, data_may_not_leave=True)).report
    assert closed["recommendation"] == "encoder"
    assert closed["flags_weighed"][0]["flag"] == "--data-may-not-leave"
    open_ = run(_cfg(tmp_path, volume=1e6, open_ended=True)).report
    assert open_["recommendation"] == "llm" and "decisive" in open_["flags_weighed"][0]["weighed_as"]
    unstable = run(_cfg(tmp_path, unstable_labels=True, label_changes=3)).report
    assert unstable["one_time"]["total"] == pytest.approx(4 * (1000 * 0.01 + 1.0 + 20.0))
    both = run(_cfg(tmp_path, open_ended=True, data_may_not_leave=True)).report
    assert both["recommendation"] == "local LLM"


def test_cli_prints_text_and_writes_json(tmp_path, capsys):
    _sheet(tmp_path / "sheet.csv")
    _ledger(tmp_path / "l.json")
    args = ["decide", "--sheet", str(tmp_path / "sheet.csv"), "--ledger", str(tmp_path / "l.json"), "--volume", "100",
            "--machine-cost-per-hour", "0.5", "--llm-price-per-call", "0.01", "--encoder-metric", "0.9",
            "--encoder-latency-ms", "3.6", "--train-hours", "2", "--output", str(tmp_path / "d.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("recommendation: encoder") and "break-even:" in out
    assert json.loads((tmp_path / "d.json").read_text())["recommendation"] == "encoder"


@pytest.mark.parametrize(("change", "says"), [
    ({"volume": 0.0}, "--volume"),
    ({"llm_price_per_call": -0.5}, "cannot be negative"),
    ({"machine_cost_per_hour": -1.0}, "cannot be negative"),
    ({"sheet": "missing.csv"}, "does not exist"),
    ({"llm_price_per_1k_tokens": 0.002}, "give the LLM's price once"),
])
def test_bad_input_is_refused(tmp_path, change, says):
    with pytest.raises(EncoderkitError, match=says):
        run(_cfg(tmp_path, **change))


def test_inconsistent_sheets_are_refused(tmp_path, capsys):
    unfilled = tmp_path / "empty.csv"
    write_sheet(unfilled, [{"row": 0, "text": "a", "label": "pos", "gold": ""}])
    with pytest.raises(EncoderkitError, match="no gold label filled"):
        run(_cfg(tmp_path, sheet=str(unfilled)))
    outside = _sheet(tmp_path / "outside.csv", gold_outside=True)
    with pytest.raises(EncoderkitError, match="'neu' is not one of the labels"):
        run(_cfg(tmp_path, sheet=str(outside)))
    twice = tmp_path / "twice.csv"
    write_sheet(twice, [{"row": 0, "text": "a", "label": "pos", "gold": "pos"},
                        {"row": 0, "text": "a", "label": "pos", "gold": "neg"}])
    with pytest.raises(EncoderkitError, match="appears 2 times"):
        run(_cfg(tmp_path, sheet=str(twice)))
    other = tmp_path / "labeled.jsonl"
    other.write_text(json.dumps({"text": "another text", "label": "pos", "labeller": "x"}) + "\n")
    with pytest.raises(EncoderkitError, match="does not match line 1"):
        run(_cfg(tmp_path, input=str(other)))
    args = ["decide", "--sheet", str(tmp_path / "nope.csv"), "--volume", "0", "--machine-cost-per-hour", "1",
            "--llm-price-per-call", "0.01"]
    assert main(args) == 2 and "--volume" in capsys.readouterr().err


def test_span_sheets_compare_span_sets(tmp_path):
    spans = [
        ('[{"text":"Ada","type":"PER"}]', '[{"type":"PER","text":"Ada"}]'),  # same set, other key order
        ('[{"text":"Ada","type":"PER"},{"text":"Paris","type":"LOC"}]', '[{"text":"Ada","type":"PER"}]'),
        ("[]", "[]"),
    ]
    sheet = tmp_path / "spans.csv"
    write_sheet(sheet, [{"row": i, "text": f"t{i}", "label": a, "gold": b} for i, (a, b) in enumerate(spans)])
    r = run(_cfg(tmp_path, sheet=str(sheet))).report
    assert r["llm"]["kind"] == "span or label sets" and (r["llm"]["correct"], r["llm"]["n"]) == (2, 3)


def test_the_encoder_folder_gives_its_metric_training_time_and_measured_latency(tmp_path, tiny_tokenizer_dir):
    from deploy_models import make_task_model

    from encoderkit.models.card import read_card, write_card

    folder = make_task_model(tmp_path, tiny_tokenizer_dir, "classify")
    card = read_card(folder)
    write_card(folder, "finetune", None, {}, {"dev": {"accuracy": 0.95}}, task="classify", labels=card["labels"],
               train_seconds=7200.0)
    r = run(_cfg(tmp_path, encoder=str(folder), encoder_metric=-1.0, encoder_latency_ms=-1.0, train_hours=-1.0,
                 latency_texts=5)).report
    enc = r["encoder"]
    assert enc["metric"] == 0.95 and enc["metric_name"] == "dev accuracy (card)" and enc["train_hours"] == 2.0
    assert enc["latency_ms"] > 0 and enc["latency_from"].startswith("measured here")
    assert r["encoder"]["cost_per_request"] == pytest.approx(0.5 * enc["latency_ms"] / 1000 / 3600)
    assert r["one_time"]["training"] == pytest.approx(2.0 * 0.5)
