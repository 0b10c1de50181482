"""``encoderkit audit report``: the labeller's (and an encoder's) accuracy on the audited gold, with a 95% Wilson
interval, and what each costs per million requests: the labeller's from its ledger (``<input>.ledger.json``), the
encoder's from its process CPU time at one thread, timed here on ``--cost-texts`` texts. On a pairs file
(``label --task embed``/``rerank``): the share of audited queries that their passage answers, with its interval.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import Predictor
from encoderkit.io import check_output_file, read_json, recorded_path, write_json_atomic
from encoderkit.label.pairs import check_pair_rows, is_pairs_file, read_pairs, verdict
from encoderkit.label.records import parse_labels, read_labeled
from encoderkit.label.sheet import check_rows, gold_labels, numbered, read_sheet
from encoderkit.label.spans import is_span_cell, span_agreement, span_set
from encoderkit.label.stats import agreement, wilson
from encoderkit.models.card import read_card
from encoderkit.tasks import get_task
from encoderkit.tasks.tabular import read_rows

PER = 1_000_000


@dataclass
class ReportConfig(StageConfig):
    """Accuracy (Wilson 95%), confusion and cost per 1M requests of the labeller and an encoder."""

    input: str = arg(help="labeled.jsonl the sheet was drawn from.", required=True)
    sheet: str = arg(help="Reviewed sheet (CSV) with gold labels.", required=True)
    encoder: str = arg("", help="A fine-tuned classify model folder to score on the same gold and cost.")
    labels: str = arg("", help="The label set, comma-separated (default: the labels in the input, and the encoder's).")
    ledger: str = arg("", help="The labelling ledger (default <input>.ledger.json).")
    price_per_1k_tokens: float = arg(0.0, help="Labeller price per 1,000 tokens (prompt + completion); 0: not priced.")
    cpu_hour_price: float = arg(0.0, help="Price of one CPU core-hour for the encoder; 0: not priced.")
    cost_texts: int = arg(500, help="Texts of the input on which the encoder's CPU time is measured.")
    output: str = arg("", help="Also write the report to this JSON file.")
    overwrite: bool = arg(False, help="Replace an existing --output file (never one of the inputs).")

    def validate(self) -> None:
        check(self.price_per_1k_tokens >= 0 and self.cpu_hour_price >= 0, "prices must be 0 or more")
        check(self.cost_texts >= 1, "cost_texts must be at least 1")


@dataclass
class ReportResult:
    report: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        return self.report


def labeller_cost(ledger: dict[str, Any], price_per_1k: float) -> dict[str, Any]:
    """Per 1M texts: tokens, request seconds (endpoint latency; CPU seconds for offline labellers), cost."""
    texts = max(int(ledger.get("texts") or ledger.get("requests") or 1), 1)
    tokens = float(ledger.get("tokens", 0)) / texts * PER
    offline = not ledger.get("tokens") and "cpu_seconds" in ledger and "sent_this_run" not in ledger
    seconds = float(ledger["cpu_seconds"] if offline else ledger.get("seconds", 0.0)) / texts * PER
    out: dict[str, Any] = {"requests_per_text": round(float(ledger.get("requests", texts)) / texts, 3),
                           "tokens_per_1M": round(tokens),
                           ("cpu_seconds_per_1M" if offline else "seconds_per_1M"): round(seconds)}
    if price_per_1k:
        out["cost_per_1M"] = round(tokens / 1000 * price_per_1k, 2)
    return out


def encoder_cost(predictor, texts: list[str], cpu_hour_price: float) -> dict[str, Any]:
    """CPU seconds per 1M texts of ``predictor.classify`` (one warm-up call excluded)."""
    predictor.classify(texts[:8])
    c0 = time.process_time()
    predictor.classify(texts)
    cpu = time.process_time() - c0
    per = cpu / len(texts) * PER
    out: dict[str, Any] = {"cpu_seconds_per_1M": round(per), "measured_on": len(texts),
                           "engine": predictor.choice.to_dict()}
    if cpu_hour_price:
        out["cost_per_1M"] = round(per / 3600 * cpu_hour_price, 2)
    return out


def seen_in_training(encoder: str | Path, texts: list[str]) -> int | None:
    """How many of ``texts`` the encoder was fine-tuned on (from its card's training file), or None
    when that file is not at hand: an encoder scored on texts it trained on, with the audited
    corrections as labels, looks better than it is."""
    config = read_card(encoder).get("config") or {}
    if not config.get("train"):
        return None
    # an absolute path is recorded relative to the card's folder (models.card), a typed relative one as typed
    train = next((p for p in (recorded_path(config["train"], encoder), Path(config["train"])) if p.is_file()), None)
    if train is None:
        return None
    column = config.get("text_column", "sentence")
    seen = {str(r.fields.get(column, "")).strip() for r in read_rows(train)}
    return sum(t.strip() in seen for t in texts)


def decide(lab: dict[str, Any], enc: dict[str, Any], lab_cost: dict[str, Any], enc_cost: dict[str, Any]) -> str:
    """The rule made concrete: the encoder replaces the labeller when it is not measurably less
    accurate on the audited gold (its accuracy reaches the labeller's interval) and costs less."""
    as_good = enc["accuracy"] is not None and lab["ci_low"] is not None and enc["accuracy"] >= lab["ci_low"]
    if "cost_per_1M" in lab_cost and "cost_per_1M" in enc_cost:
        cheaper = enc_cost["cost_per_1M"] < lab_cost["cost_per_1M"]
        why = f"cost per 1M {enc_cost['cost_per_1M']} vs {lab_cost['cost_per_1M']}"
    else:
        cheaper = None
        why = "no prices given"
    acc = f"accuracy {enc['accuracy']} vs {lab['accuracy']} [{lab['ci_low']}, {lab['ci_high']}]"
    if as_good and cheaper is not False:
        return f"encoder: {acc}; {why}"
    return f"labeller: {acc}; {why}"


def run(cfg: ReportConfig) -> ReportResult:
    """The report (printed; also written to --output)."""
    if cfg.output:  # before any work: never an input, an existing file only with --overwrite
        check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.input, cfg.sheet, cfg.ledger, cfg.encoder])
    if is_pairs_file(cfg.input):
        report = pair_report(cfg)
        if cfg.output:
            write_json_atomic(Path(cfg.output), report)
        return ReportResult(report)
    recs = read_labeled(cfg.input)
    rows = read_sheet(cfg.sheet)
    check_rows(cfg.sheet, rows, recs, cfg.input)
    if any(is_span_cell(r["label"]) or is_span_cell(r["gold"]) for r in rows):
        report = span_report(cfg, recs, rows)
        if cfg.output:
            write_json_atomic(Path(cfg.output), report)
        return ReportResult(report)
    predictor = None
    if cfg.encoder:
        predictor = Predictor.load(cfg.encoder, threads=1)
        if not get_task(predictor.task).single_label:  # the report compares one label per text with the labeller's
            raise EncoderkitError(f"--encoder {cfg.encoder} is a {predictor.task!r} model; give a classify model "
                                  "folder")
    if cfg.labels:
        labels = parse_labels(cfg.labels)
    else:
        labels = sorted({str(r["label"]) for r in recs if r["label"] not in (None, "")}
                        | set(predictor.info.labels if predictor else []))
    gold = gold_labels(cfg.sheet, rows, labels)
    if not gold:
        raise EncoderkitError(f"{cfg.sheet}: no gold label filled in; review it first (`encoderkit audit review`)")
    order = sorted(gold)
    golds = [gold[i] for i in order]
    ledger_file = Path(cfg.ledger or f"{cfg.input}.ledger.json")
    report: dict[str, Any] = {"input": cfg.input, "lines": len(recs), "audited": len(order),
                              "unlabeled_lines": sum(1 for r in recs if r["label"] in (None, "")),
                              "labeller": {"name": recs[0].get("labeller"),
                                           **agreement(golds, [_label(recs[i]) for i in order], labels)}}
    lab_cost = None
    if ledger_file.is_file():
        ledger = read_json(ledger_file, f"ledger {ledger_file} does not exist")
        lab_cost = labeller_cost(ledger, cfg.price_per_1k_tokens)
        report["labeller"]["cost"] = lab_cost
    if predictor is not None:
        preds = [p["label"] for p in predictor.classify([str(recs[i]["text"]) for i in order])]
        unknown = sorted(set(preds) - set(labels))
        if unknown:
            raise EncoderkitError(f"--encoder {cfg.encoder} predicts {unknown}, not in the label set {labels}")
        report["encoder"] = {"folder": cfg.encoder, **agreement(golds, preds, labels)}
        seen = seen_in_training(cfg.encoder, [str(recs[i]["text"]) for i in order])
        report["encoder"]["audited_texts_seen_in_training"] = seen
        texts = [str(r["text"]) for r in recs[:cfg.cost_texts]]
        enc_cost = encoder_cost(predictor, texts, cfg.cpu_hour_price)
        report["encoder"]["cost"] = enc_cost
        report["decision"] = decide(report["labeller"], report["encoder"], lab_cost or {}, enc_cost)
        if seen:
            report["decision"] += (f" (caution: the encoder was trained on {seen} of the {len(order)} audited texts; "
                                   "score it on gold it never saw, e.g. a sheet drawn from labelled dev data)")
    if cfg.output:
        write_json_atomic(Path(cfg.output), report)
    return ReportResult(report)


def span_report(cfg: ReportConfig, recs: list[dict[str, Any]], rows: list[dict[str, str]]) -> dict[str, Any]:
    """An NER sheet's report: the labeller's span sets against the gold ones (exact match per text and per entity
    type, each with its Wilson interval), and its cost from the ledger."""
    if cfg.encoder:
        raise EncoderkitError(f"--encoder: {cfg.sheet} holds spans; score an NER model with `encoderkit evaluate` on "
                              "gold data, and drop --encoder here")
    filled = [(n, r) for n, r in numbered(rows) if r["gold"]]
    if not filled:
        raise EncoderkitError(f"{cfg.sheet}: no gold filled in; write each audited text's spans in the gold column "
                              '([{"text": ..., "type": ...}], [] for none)')
    golds = [span_set(r["gold"], f"{cfg.sheet}:{n}") for n, r in filled]
    preds = [None if _label(recs[int(r["row"])]) is None else span_set(str(recs[int(r["row"])]["label"]),
                                                                       f"{cfg.input}:{int(r['row']) + 1}")
             for _, r in filled]
    refused = sum(len(r.get("refused") or []) for r in recs)
    report: dict[str, Any] = {"input": cfg.input, "lines": len(recs), "audited": len(filled),
                              "unlabeled_lines": sum(1 for r in recs if _label(r) is None),
                              "refused_spans": refused,
                              "labeller": {"name": recs[0].get("labeller"), **span_agreement(golds, preds)}}
    ledger_file = Path(cfg.ledger or f"{cfg.input}.ledger.json")
    if ledger_file.is_file():
        report["labeller"]["cost"] = labeller_cost(read_json(ledger_file, ""), cfg.price_per_1k_tokens)
    return report


def pair_report(cfg: ReportConfig) -> dict[str, Any]:
    """A pairs sheet's report: the share of audited queries whose passage answers them (the gold ``yes``), with its
    Wilson 95% interval; the screening counts and the cost from the ledger."""
    if cfg.encoder:
        raise EncoderkitError(f"--encoder: {cfg.input} is a pairs file; score an embed or rerank model with "
                              "`encoderkit evaluate` on judged queries, and drop --encoder here")
    recs = read_pairs(cfg.input)
    rows = read_sheet(cfg.sheet)
    check_pair_rows(cfg.sheet, rows, recs, cfg.input)
    filled = [(n, r) for n, r in numbered(rows) if r["gold"]]
    if not filled:
        raise EncoderkitError(f"{cfg.sheet}: no gold filled in; write yes in the gold column where the passage "
                              "answers the query, no where it does not")
    good = sum(verdict(r["gold"], f"{cfg.sheet}:{n}") for n, r in filled)
    lo, hi = wilson(good, len(filled))
    report: dict[str, Any] = {
        "input": cfg.input, "lines": len(recs), "audited": len(filled),
        "labeller": {"name": recs[0].get("labeller"), "n": len(filled), "correct": good,
                     "accuracy": round(good / len(filled), 4), "ci_low": round(lo, 4), "ci_high": round(hi, 4),
                     "measure": "share of audited queries their passage answers"}}
    ledger_file = Path(cfg.ledger or f"{cfg.input}.ledger.json")
    if ledger_file.is_file():
        ledger = read_json(ledger_file, "")
        if "screening" in ledger:
            report["screening"] = ledger["screening"]
        report["labeller"]["cost"] = labeller_cost(ledger, cfg.price_per_1k_tokens)
    return report


def _label(rec: dict[str, Any]) -> str | None:
    return None if rec["label"] in (None, "") else str(rec["label"])
