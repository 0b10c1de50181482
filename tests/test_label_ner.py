"""``label --task ner`` against the local chat-completions server: spans asked as JSON, checked against the text
(invented ones counted and dropped), cached and resumed like classification; the output trains `finetune --task ner`
and the audit reports span agreement with Wilson intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_server import ChatServer

from encoderkit.errors import EncoderkitError

pytest.importorskip("openai")

from encoderkit.label.report import ReportConfig
from encoderkit.label.report import run as report
from encoderkit.label.run import LabelConfig, run
from encoderkit.label.sample import SampleConfig
from encoderkit.label.sample import run as sample
from encoderkit.label.sheet import read_sheet, write_sheet
from encoderkit.tasks.ner.data import read_ner

ANSWERS = {
    "ada lovelace wrote code in london": '[{"text": "ada lovelace", "type": "PER"}, {"text": "london", "type": "LOC"}]',
    "alan turing lived in paris": 'Sure! [{"text": "alan turing", "type": "PER"}, {"text": "Berlin", "type": "LOC"}]',
    "grace hopper liked london": '[{"text": "grace hopper", "type": "PER"}, {"text": "london", "type": "CITY"}]',
    "the code ran": "[]",
    "london and paris": '[{"text": "london", "type": "LOC"}, {"text": "paris", "type": "LOC"}, '
                        '{"text": "ndon", "type": "LOC"}]',
}


def _input(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _cfg(tmp: Path, url: str, inp: Path, **kw) -> LabelConfig:
    base = {"input": str(inp), "labels": "PER,LOC", "task": "ner", "output": str(tmp / "labeled.jsonl"),
            "endpoint": url, "llm": ["sim"], "backoff": 0.01, "retries": 2, "concurrency": 2, "timeout": 5.0}
    return LabelConfig(**{**base, **kw})


def _reply(text, n, body):
    if text == "ada lovelace wrote code in london" and n == 1:
        return "I think there are two people."  # no JSON list: asked again
    if text == "nothing parses here":
        return "no entities, sorry"
    return ANSWERS[text]


def _label(tmp_path: Path) -> tuple[list[dict], object, int]:
    texts = [*ANSWERS, "nothing parses here"]
    with ChatServer(_reply) as srv:
        res = run(_cfg(tmp_path, srv.url, _input(tmp_path / "in.jsonl", texts)))
        sent = len(srv.answered)
        run(_cfg(tmp_path, srv.url, tmp_path / "in.jsonl", overwrite=True))  # a rerun: all from the cache
        assert len(srv.answered) == sent
        prompt = srv.requests and srv.requests[0]
    assert prompt in texts  # the chat server found the text in the NER prompt
    out = [json.loads(x) for x in (tmp_path / "labeled.jsonl").read_text().splitlines()]
    return out, res, sent


def test_spans_are_checked_against_the_text_and_invented_ones_dropped(tmp_path):
    out, res, sent = _label(tmp_path)
    by = {r["text"]: r for r in out}
    ada = by["ada lovelace wrote code in london"]
    assert ada["entities"] == [{"start": 0, "end": 12, "label": "PER"}, {"start": 27, "end": 33, "label": "LOC"}]
    assert json.loads(ada["label"]) == [{"text": "ada lovelace", "type": "PER"}, {"text": "london", "type": "LOC"}]
    turing = by["alan turing lived in paris"]  # "Berlin" is not in the text: refused, never an entity
    assert turing["entities"] == [{"start": 0, "end": 11, "label": "PER"}]
    assert turing["refused"] == [{"text": "Berlin", "type": "LOC", "why": "not in the text"}]
    hopper = by["grace hopper liked london"]  # a type not asked for
    assert [e["label"] for e in hopper["entities"]] == ["PER"] and hopper["refused"][0]["why"] == "type not asked for"
    both = by["london and paris"]  # "ndon" is inside a word: not on word edges
    assert len(both["entities"]) == 2 and both["refused"][0]["text"] == "ndon"
    assert by["the code ran"]["entities"] == [] and by["the code ran"]["label"] == "[]"
    assert by["nothing parses here"]["label"] is None and "entities" not in by["nothing parses here"]
    assert res.counts == {"texts_with_spans": 4, "spans": 6, "refused_spans": 3, "unlabeled": 1}
    assert sent == 8  # 6 texts + one re-ask for ada + one for the answer that never parses
    # finetune's reader: unlabeled lines dropped (not read as "no entity"), refused spans absent from the tags
    sents = {" ".join(s.words): s.tags for s in read_ner(tmp_path / "labeled.jsonl")}
    assert "nothing parses here" not in sents and len(sents) == 5
    assert sents["alan turing lived in paris"] == ["B-PER", "I-PER", "O", "O", "O"]


def test_the_audit_reports_span_agreement_with_intervals(tmp_path):
    _label(tmp_path)
    sample(SampleConfig(input=str(tmp_path / "labeled.jsonl"), n=10, output=str(tmp_path / "sheet.csv")))
    rows = read_sheet(tmp_path / "sheet.csv")
    assert len(rows) == 5  # the unlabeled line is never sampled
    for r in rows:  # the reviewer agrees except on Turing's text, where paris is a LOC too
        r["gold"] = r["label"]
        if r["text"] == "alan turing lived in paris":
            r["gold"] = '[{"text": "alan turing", "type": "PER"}, {"text": "paris", "type": "LOC"}]'
    write_sheet(tmp_path / "sheet.csv", rows)
    rep = report(ReportConfig(input=str(tmp_path / "labeled.jsonl"), sheet=str(tmp_path / "sheet.csv"))).report
    lab = rep["labeller"]
    assert (lab["correct"], lab["n"]) == (4, 5) and lab["ci_low"] < 0.8 < lab["ci_high"]
    assert lab["per_type"]["PER"]["accuracy"] == 1.0 and lab["per_type"]["LOC"]["correct"] == 4
    assert rep["refused_spans"] == 3 and "cost" in lab
    rows[0]["gold"] = "PER: ada"  # not a span list
    write_sheet(tmp_path / "sheet.csv", rows)
    with pytest.raises(EncoderkitError, match="not a JSON list of spans"):
        report(ReportConfig(input=str(tmp_path / "labeled.jsonl"), sheet=str(tmp_path / "sheet.csv")))


def test_ner_needs_the_endpoint_labeller(tmp_path):
    with pytest.raises(EncoderkitError, match="--labeller endpoint"):
        LabelConfig(input="x.txt", labels="PER", task="ner", output=str(tmp_path / "o.jsonl"), labeller="embed",
                    model="minilm")


def test_finetune_ner_trains_on_the_labelled_spans(tmp_path, tiny_bert_dir, capsys):
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    _label(tmp_path)
    res = finetune(FinetuneConfig(task="ner", model=str(tiny_bert_dir), train=str(tmp_path / "labeled.jsonl"),
                                  out=str(tmp_path / "ner"), max_steps=2, batch_size=4, max_length=16, stride=4))
    card = json.loads((res.out / "encoderkit.json").read_text())
    assert card["task"] == "ner" and card["train_examples"] == 5
    assert set(card["labels"]) == {"O", "B-PER", "I-PER", "B-LOC", "I-LOC"}
    assert "--allow unaudited-labels" in capsys.readouterr().err  # label output without an audit sheet


@pytest.mark.parametrize("flag", [{"audit_sheet": "sheet.csv"}, {"drop_suspected": True}])
def test_audit_flags_a_task_cannot_apply_are_refused_not_ignored(tmp_path, tiny_bert_dir, flag):
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    _label(tmp_path)
    with pytest.raises(EncoderkitError, match="--task ner does not read `encoderkit label` output"):
        finetune(FinetuneConfig(task="ner", model=str(tiny_bert_dir), train=str(tmp_path / "labeled.jsonl"),
                                out=str(tmp_path / "ner"), max_steps=2, batch_size=4, max_length=16, **flag))
    assert not (tmp_path / "ner").exists()


SETS = {"a goal in the final vote": '["sports", "politics"]', "the senate vote": '["Politics", "weather"]',
        "sunny today": "[]", "a late goal": 'Labels: ["sports"]'}


def test_multilabel_sets_are_labelled_audited_and_trained_on(tmp_path, tiny_bert_dir):
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    def reply(text, n, body):
        return "sports and politics" if text == "no list here" else SETS[text]

    with ChatServer(reply) as srv:
        res = run(_cfg(tmp_path, srv.url, _input(tmp_path / "in.jsonl", [*SETS, "no list here"]), task="multilabel",
                       labels="sports,politics"))
    by = {r["text"]: r for r in (json.loads(x) for x in (tmp_path / "labeled.jsonl").read_text().splitlines())}
    assert by["a goal in the final vote"]["labels"] == ["sports", "politics"]
    assert by["the senate vote"]["labels"] == ["politics"] and by["the senate vote"]["refused"] == ["weather"]
    assert by["sunny today"]["labels"] == ["none"] and by["sunny today"]["label"] == "[]"
    assert by["no list here"]["label"] is None and "labels" not in by["no list here"]
    assert res.counts == {"sports": 2, "politics": 2, "none": 1, "refused_labels": 1, "unlabeled": 1}
    sheet = tmp_path / "sheet.csv"
    rows = [{"row": i, "text": t, "label": by[t]["label"], "gold": by[t]["label"]} for i, t in enumerate(SETS)]
    rows[1]["gold"] = '["politics", "sports"]'  # the reviewer adds sports to the senate vote
    write_sheet(sheet, rows)
    lab = report(ReportConfig(input=str(tmp_path / "labeled.jsonl"), sheet=str(sheet))).report["labeller"]
    assert (lab["correct"], lab["n"]) == (3, 4)
    assert lab["per_type"]["politics"]["correct"] == 4 and lab["per_type"]["sports"]["correct"] == 3
    ft = finetune(FinetuneConfig(task="multilabel", model=str(tiny_bert_dir), train=str(tmp_path / "labeled.jsonl"),
                                 out=str(tmp_path / "ml"), max_steps=1, batch_size=4))
    card = json.loads((ft.out / "encoderkit.json").read_text())
    assert card["train_examples"] == 4 and set(card["labels"]) == {"sports", "politics"}
