"""``encoderkit decide``: an encoder or the LLM, from the audit's numbers and the costs, with the break-even volume.

The arithmetic, all of it printed beside the result (and in the JSON):

- the LLM's cost per request: ``--llm-price-per-call``, or ``--llm-price-per-1k-tokens`` x the tokens of one request
  (``--tokens-per-request``, else the labelling ledger's tokens / requests);
- the encoder's cost per request: this machine's ``--machine-cost-per-hour`` x the encoder's seconds per request
  (its measured latency at one request a call) / 3600: the machine is paid for the seconds it works;
- the one-time cost: labelling (the ledger's requests, or ``--labelled-texts``, at the LLM's price) + training
  (``--train-hours``, else the encoder card's training time, x the machine's price) + ``--audit-cost``; with
  ``--unstable-labels`` it is paid once more for each of ``--label-changes`` changes of the label set;
- break-even: one-time cost / (LLM cost - encoder cost per request) requests, spread over ``--horizon-days``
  (requests per day); never when the encoder costs as much per request as the LLM.

The recommendation: the encoder when it is not measurably less accurate (its dev metric reaches the low end of the
LLM's audited Wilson interval) and the stated volume reaches break-even. ``--data-may-not-leave`` is decisive for
the encoder (a hosted LLM is ruled out whatever the numbers), ``--open-ended`` decisive for the LLM (an encoder head
needs a closed set of answers); both at once recommend an LLM run on one's own hardware.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import Predictor, predict_records
from encoderkit.io import check_output_file, read_json, write_json_atomic
from encoderkit.label.records import read_labeled
from encoderkit.label.sheet import check_rows, numbered, read_sheet, same_answer
from encoderkit.label.stats import wilson
from encoderkit.models.card import read_card
from encoderkit.tasks import get_task

UNSET = -1.0


@dataclass
class DecideConfig(StageConfig):
    """An encoder or the LLM: break-even volume, cost and latency at a volume, and a recommendation with reasons."""

    sheet: str = arg(help="The reviewed audit sheet (CSV from `audit sample`, gold filled): the LLM's accuracy.",
                     required=True)
    volume: float = arg(help="Requests per day the model will serve.", required=True)
    machine_cost_per_hour: float = arg(help="This machine's price per hour (what the encoder trains and serves on).",
                                       required=True)
    input: str = arg("", help="labeled.jsonl the sheet was drawn from (checks the sheet against it; its ledger "
                              "<input>.ledger.json gives the labelling requests, tokens and latency).")
    ledger: str = arg("", help="The labelling ledger (default <input>.ledger.json when --input is given).")
    encoder: str = arg("", help="The fine-tuned model folder: its card's dev metric and training time, and its "
                                "latency measured here on the sheet's texts.")
    encoder_metric: float = arg(UNSET, help="The encoder's dev metric (0-1) if not read from --encoder's card.")
    encoder_latency_ms: float = arg(UNSET, help="The encoder's milliseconds per request if not measured here.")
    latency_texts: int = arg(20, help="Texts of the sheet on which the encoder's latency is measured (one a call).")
    llm_price_per_call: float = arg(UNSET, help="The LLM's price per request.")
    llm_price_per_1k_tokens: float = arg(UNSET, help="The LLM's price per 1,000 tokens (prompt + completion).")
    tokens_per_request: float = arg(0.0, help="Tokens of one request with --llm-price-per-1k-tokens (0: the ledger's "
                                              "tokens / requests).")
    llm_latency_ms: float = arg(0.0, help="The LLM's milliseconds per request (0: the ledger's seconds / requests).")
    labelled_texts: int = arg(0, help="Requests the labelling took, when there is no ledger.")
    train_hours: float = arg(UNSET, help="Hours the fine-tuning took on this machine (default: the encoder card's "
                                         "training time).")
    audit_cost: float = arg(0.0, help="One-time cost of the hand audit (reviewer time), in the prices' currency.")
    horizon_days: float = arg(365.0, help="Days over which the one-time cost is to be paid back.")
    open_ended: bool = arg(False, help="The task is open-ended (no closed set of labels or spans): decisive for the "
                                       "LLM.")
    unstable_labels: bool = arg(False, help="The label set will change: the one-time cost is paid again per change "
                                            "(--label-changes).")
    label_changes: int = arg(4, help="With --unstable-labels: changes of the label set over --horizon-days.")
    data_may_not_leave: bool = arg(False, help="The data may not leave this organisation: decisive against a hosted "
                                               "LLM.")
    json: bool = arg(False, help="Print one JSON object instead of text.")
    output: str = arg("", help="Also write the report to this JSON file.")
    overwrite: bool = arg(False, help="Replace an existing --output file (never one of the inputs).")

    def validate(self) -> None:
        check(self.volume > 0, f"--volume {self.volume}: give the requests per day, more than 0")
        check(self.machine_cost_per_hour >= 0, f"--machine-cost-per-hour {self.machine_cost_per_hour}: a price "
                                               "cannot be negative")
        for name in ("llm_price_per_call", "llm_price_per_1k_tokens"):
            value = getattr(self, name)
            check(value == UNSET or value >= 0, f"--{name.replace('_', '-')} {value}: a price cannot be negative")
        check(self.audit_cost >= 0, f"--audit-cost {self.audit_cost}: a cost cannot be negative")
        check((self.llm_price_per_call == UNSET) != (self.llm_price_per_1k_tokens == UNSET),
              "give the LLM's price once: --llm-price-per-call or --llm-price-per-1k-tokens (with "
              "--tokens-per-request or a ledger)")
        check(self.tokens_per_request >= 0 and self.llm_latency_ms >= 0 and self.labelled_texts >= 0,
              "--tokens-per-request, --llm-latency-ms and --labelled-texts must be 0 or more")
        check(self.train_hours == UNSET or self.train_hours >= 0, "--train-hours must be 0 or more")
        check(self.encoder_latency_ms == UNSET or self.encoder_latency_ms >= 0, "--encoder-latency-ms must be 0 or "
                                                                                "more")
        check(self.encoder_metric == UNSET or 0 <= self.encoder_metric <= 1, "--encoder-metric is a share, 0 to 1")
        check(self.horizon_days > 0, "--horizon-days must be more than 0")
        check(self.label_changes >= 0 and self.latency_texts >= 1, "--label-changes must be 0 or more and "
                                                                   "--latency-texts at least 1")


@dataclass
class DecideResult:
    report: dict[str, Any]
    as_json: bool = False

    def text(self) -> str:
        return render(self.report)

    def summary(self) -> dict[str, Any] | str:
        return self.report if self.as_json else self.text()


def sheet_accuracy(path: str, input_path: str = "") -> dict[str, Any]:
    """The LLM's agreement with the gold on the filled rows of the sheet (exact match; a span sheet compares span
    sets), with its Wilson interval; a missing or inconsistent sheet is an error."""
    rows = read_sheet(path)
    if input_path:
        check_rows(path, rows, read_labeled(input_path), input_path)
    seen = Counter(r["row"] for r in rows)
    twice = sorted((int(k) for k, v in seen.items() if v > 1))
    if twice:
        raise EncoderkitError(f"{path}: row {twice[0]} appears {seen[str(twice[0])]} times; a sheet names each line "
                              "of labeled.jsonl once: draw it again with `encoderkit audit sample`")
    filled = [(n, r) for n, r in numbered(rows) if r["gold"]]
    if not filled:
        raise EncoderkitError(f"{path}: no gold label filled in; review it first (`encoderkit audit review`, or fill "
                              "the gold column)")
    labels = {r["label"] for r in rows if r["label"]}
    spans = any(r["label"].startswith("[") for r in rows)
    k = 0
    for n, r in filled:
        if not spans and labels and r["gold"] not in labels:
            raise EncoderkitError(f"{path}:{n}: gold label {r['gold']!r} is not one of the labels in the sheet "
                                  f"({', '.join(sorted(labels))}); correct the cell (labels are case-sensitive)")
        k += same_answer(r["label"], r["gold"], f"{path}:{n}")
    lo, hi = wilson(k, len(filled))
    return {"n": len(filled), "correct": k, "accuracy": round(k / len(filled), 4), "ci_low": round(lo, 4),
            "ci_high": round(hi, 4), "kind": "span or label sets" if spans else "labels"}


def encoder_facts(cfg: DecideConfig, texts: list[str]) -> dict[str, Any]:
    """The encoder's dev metric, training hours and milliseconds per request: given, else from its folder."""
    out: dict[str, Any] = {"folder": cfg.encoder or None, "metric": None, "metric_name": None,
                           "latency_ms": None, "latency_from": None, "train_hours": None}
    card = read_card(cfg.encoder) if cfg.encoder else {}
    if cfg.encoder_metric != UNSET:
        out.update(metric=cfg.encoder_metric, metric_name="given")
    elif card:
        dev = (card.get("metrics") or {}).get("dev") or {}
        names = [m for m in get_task(card["task"]).primary_metrics if m in dev] if card.get("task") else []
        if names:
            out.update(metric=float(dev[names[0]]), metric_name=f"dev {names[0]} (card)")
    if cfg.train_hours != UNSET:
        out["train_hours"] = cfg.train_hours
    elif card.get("train_seconds") is not None:
        out["train_hours"] = float(card["train_seconds"]) / 3600
    if cfg.encoder_latency_ms != UNSET:
        out.update(latency_ms=cfg.encoder_latency_ms, latency_from="given")
    elif cfg.encoder:
        out.update(latency_ms=measure_latency(cfg.encoder, texts[:cfg.latency_texts]),
                   latency_from=f"measured here, one text a call, median of {len(texts[:cfg.latency_texts])}")
    return out


def measure_latency(folder: str, texts: list[str]) -> float:
    """Median milliseconds of one single-text request to the folder's Predictor (one thread; a warm-up call
    first)."""
    p = Predictor.load(folder, threads=1)
    try:
        predict_records(p, [{"text": texts[0]}])
        times = []
        for t in texts:
            t0 = time.perf_counter()
            predict_records(p, [{"text": t}])
            times.append((time.perf_counter() - t0) * 1000)
    except (KeyError, TypeError, ValueError) as e:
        raise EncoderkitError(f"--encoder {folder}: its task {p.task!r} does not take single texts to time; give "
                              "--encoder-latency-ms") from e
    return round(statistics.median(times), 3)


def run(cfg: DecideConfig) -> DecideResult:
    """The report (printed; also written to --output)."""
    if cfg.output:  # before any work: never an input, an existing file only with --overwrite
        check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.sheet, cfg.input, cfg.ledger, cfg.encoder])
    llm = sheet_accuracy(cfg.sheet, cfg.input)
    ledger_file = Path(cfg.ledger or (f"{cfg.input}.ledger.json" if cfg.input else ""))
    if cfg.ledger and not ledger_file.is_file():
        raise EncoderkitError(f"ledger {ledger_file} does not exist; give the <output>.ledger.json `label` wrote")
    ledger = read_json(ledger_file, "") if cfg.ledger or (cfg.input and ledger_file.is_file()) else {}
    texts = [r["text"] for r in read_sheet(cfg.sheet) if r["text"].strip()]
    enc = encoder_facts(cfg, texts)
    report = compute(cfg, llm, ledger, enc)
    if cfg.output:
        write_json_atomic(Path(cfg.output), report)
    return DecideResult(report, cfg.json)


def compute(cfg: DecideConfig, llm: dict[str, Any], ledger: dict[str, Any], enc: dict[str, Any]) -> dict[str, Any]:
    """The arithmetic of the module docstring on the gathered facts."""
    requests = int(ledger.get("requests") or 0)
    tokens = float(ledger.get("tokens") or 0)
    if cfg.llm_price_per_call != UNSET:
        per_request, price_basis = cfg.llm_price_per_call, f"{cfg.llm_price_per_call} per call"
    else:
        tpr = cfg.tokens_per_request or (tokens / requests if requests and tokens else 0)
        if not tpr:
            raise EncoderkitError("--llm-price-per-1k-tokens needs the tokens of one request: give "
                                  "--tokens-per-request, or --input/--ledger with the labelling ledger")
        per_request = cfg.llm_price_per_1k_tokens * tpr / 1000
        price_basis = f"{cfg.llm_price_per_1k_tokens} per 1k tokens x {round(tpr, 1)} tokens"
    labelled = requests or cfg.labelled_texts
    if not labelled:
        raise EncoderkitError("the labelling's size is unknown: give --input (or --ledger) with the labelling "
                              "ledger, or --labelled-texts N")
    if cfg.llm_price_per_call == UNSET and requests and tokens and not cfg.tokens_per_request:
        labelling = tokens / 1000 * cfg.llm_price_per_1k_tokens  # the ledger's own tokens
    else:
        labelling = labelled * per_request
    llm_ms = cfg.llm_latency_ms or (float(ledger.get("seconds") or 0) / requests * 1000 if requests else 0)
    notes: list[str] = []
    if enc["latency_ms"] is None:
        raise EncoderkitError("the encoder's latency is unknown: give --encoder FOLDER (measured here) or "
                              "--encoder-latency-ms")
    train_hours = enc["train_hours"]
    if train_hours is None:
        train_hours = 0.0
        notes.append("training time unknown (no --train-hours, no training time on the card): counted as 0")
    enc_per_request = cfg.machine_cost_per_hour * enc["latency_ms"] / 1000 / 3600
    training = train_hours * cfg.machine_cost_per_hour
    once = labelling + training + cfg.audit_cost
    paid_times = 1 + (cfg.label_changes if cfg.unstable_labels else 0)
    one_time = once * paid_times
    saving = per_request - enc_per_request
    if saving > 0:
        be_requests = one_time / saving
        be_per_day = be_requests / cfg.horizon_days
        payback_days = one_time / (saving * cfg.volume)
    else:
        be_requests = be_per_day = payback_days = None
    as_good = None if enc["metric"] is None else enc["metric"] >= llm["ci_low"]
    if as_good is None:
        notes.append("accuracy not compared: give --encoder (its card's dev metric) or --encoder-metric")
    busy = cfg.volume * enc["latency_ms"] / 1000 / 86400
    report: dict[str, Any] = {
        "llm": {**llm, "cost_per_request": per_request, "price": price_basis, "latency_ms": round(llm_ms, 3) or None,
                "cost_per_day": cfg.volume * per_request},
        "encoder": {**{k: v for k, v in enc.items() if k != "train_hours"}, "train_hours": train_hours,
                    "cost_per_request": enc_per_request, "cost_per_day": cfg.volume * enc_per_request,
                    "machine_busy_share": round(busy, 4)},
        "one_time": {"labelling": labelling, "labelled_requests": labelled, "training": training,
                     "audit": cfg.audit_cost, "times_paid": paid_times, "total": one_time},
        "volume_per_day": cfg.volume, "horizon_days": cfg.horizon_days,
        "break_even": {"requests": be_requests, "per_day": be_per_day, "payback_days_at_volume": payback_days},
        "over_horizon": {"llm": cfg.volume * per_request * cfg.horizon_days,
                         "encoder": one_time + cfg.volume * enc_per_request * cfg.horizon_days},
        "notes": notes,
    }
    report.update(recommend(cfg, report, as_good))
    return report


def recommend(cfg: DecideConfig, r: dict[str, Any], as_good: bool | None) -> dict[str, Any]:
    """The choice, the reasons from the numbers, and how each qualitative flag was weighed."""
    llm, enc, be = r["llm"], r["encoder"], r["break_even"]
    reasons: list[str] = []
    interval = f"[{llm['ci_low']}, {llm['ci_high']}] on {llm['n']} audited"
    if as_good is None:
        reasons.append(f"accuracy: not compared (LLM {llm['accuracy']} {interval})")
    else:
        reasons.append(f"accuracy: encoder {enc['metric']} ({enc['metric_name']}) "
                       f"{'reaches' if as_good else 'is below'} the LLM's interval {interval}")
    if be["per_day"] is None:
        reasons.append(f"cost: the encoder costs {_money(enc['cost_per_request'])} a request, the LLM "
                       f"{_money(llm['cost_per_request'])}: it never breaks even")
        pays = False
    else:
        pays = cfg.volume >= be["per_day"]
        reasons.append(f"cost: break-even at {be['per_day']:,.1f} requests/day over {cfg.horizon_days:g} days "
                       f"({be['requests']:,.0f} requests); {cfg.volume:,.0f}/day "
                       f"{'reaches' if pays else 'does not reach'} it (paid back in "
                       f"{be['payback_days_at_volume']:,.1f} days)")
    if llm["latency_ms"]:
        reasons.append(f"latency: encoder {enc['latency_ms']:.1f} ms against the LLM's {llm['latency_ms']:.1f} ms a "
                       "request")
    weighed: list[dict[str, str]] = []
    if cfg.unstable_labels:
        weighed.append({"flag": "--unstable-labels", "weighed_as": f"in the numbers: the one-time cost counted "
                        f"{1 + cfg.label_changes} times (once + {cfg.label_changes} changes of the label set)"})
    if cfg.open_ended:
        weighed.append({"flag": "--open-ended", "weighed_as": "decisive for the LLM: an encoder head answers from a "
                                                              "closed set of labels or spans"})
    if cfg.data_may_not_leave:
        weighed.append({"flag": "--data-may-not-leave", "weighed_as": "decisive against a hosted LLM: the data "
                                                                      "cannot be sent to it, whatever the numbers"})
    if cfg.open_ended and cfg.data_may_not_leave:
        choice = "local LLM"
        reasons.insert(0, "open-ended and the data may not leave: an LLM run on your own hardware")
    elif cfg.open_ended:
        choice = "llm"
        reasons.insert(0, "open-ended task: the LLM")
    elif cfg.data_may_not_leave:
        choice = "encoder"
        reasons.insert(0, "the data may not leave: the encoder (on this machine)")
        if as_good is False:
            reasons.append("caution: the encoder is measurably less accurate; label and audit more before relying on "
                           "it")
    else:
        choice = "encoder" if pays and as_good is not False else "llm"
    return {"recommendation": choice, "reasons": reasons, "flags_weighed": weighed}


def _money(x: float) -> str:
    return f"{x:.6g}"


def render(r: dict[str, Any]) -> str:
    """The report as text (the JSON holds the same figures)."""
    llm, enc, once, be = r["llm"], r["encoder"], r["one_time"], r["break_even"]
    times = "" if once["times_paid"] == 1 else f" (x {once['times_paid']}: unstable labels)"
    lines = [
        f"recommendation: {r['recommendation']}",
        *[f"  - {x}" for x in r["reasons"]],
        *[f"  flag {w['flag']}: {w['weighed_as']}" for w in r["flags_weighed"]],
        "",
        (f"LLM: audited {llm['kind']} agreement {llm['accuracy']} [{llm['ci_low']}, {llm['ci_high']}] "
        f"({llm['correct']}/{llm['n']}); {_money(llm['cost_per_request'])} a request ({llm['price']}); "
        f"latency {llm['latency_ms'] or 'unknown'} ms"),
        (f"encoder: metric {enc['metric']} ({enc['metric_name'] or 'not given'}); latency {enc['latency_ms']} ms "
        f"({enc['latency_from']}); {_money(enc['cost_per_request'])} a request"),
        (f"one-time: labelling {_money(once['labelling'])} ({once['labelled_requests']} requests) + training "
        f"{_money(once['training'])} ({enc['train_hours']:.3g} h) + audit {_money(once['audit'])}{times} "
        f"= {_money(once['total'])}"),
        "break-even: " + ("never (the encoder costs as much per request)" if be["per_day"] is None else
                          f"{be['requests']:,.0f} requests = {be['per_day']:,.1f}/day over {r['horizon_days']:g} "
                          "days"),
        (f"at {r['volume_per_day']:,.0f} requests/day: LLM {_money(llm['cost_per_day'])}/day, encoder "
        f"{_money(enc['cost_per_day'])}/day (machine busy {enc['machine_busy_share']:.1%}); over the horizon LLM "
        f"{_money(r['over_horizon']['llm'])}, encoder {_money(r['over_horizon']['encoder'])} with the one-time "
         "cost"),
        *[f"note: {n}" for n in r["notes"]],
    ]
    return "\n".join(lines)
