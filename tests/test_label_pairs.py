"""``label --task embed`` / ``--task rerank`` against the local chat-completions server (tests/chat_server.py): the
LLM writes queries per passage with adapt's prompt, bad ones are counted and dropped, the pairs train `finetune
--task embed` and `--task rerank`, a killed run resumes from the cache, and the audit reports the share of good
queries with its interval."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chat_server import ChatServer
from deploy_models import make_task_model, tiny_root

from encoderkit.adapt.queries import QUERY_TEMPLATE, query_prompt, screen_queries
from encoderkit.errors import EncoderkitError

pytest.importorskip("openai")

from encoderkit.data.beir import read_triples
from encoderkit.label.report import ReportConfig
from encoderkit.label.report import run as report
from encoderkit.label.run import LabelConfig, run
from encoderkit.label.sample import SampleConfig
from encoderkit.label.sample import run as sample
from encoderkit.label.sheet import read_sheet, write_sheet

REPO = Path(__file__).resolve().parents[1]
TOPICS = ["python code", "movie story", "film data", "great model", "dull movie", "boring code", "best story",
          "worst film"]
N = len(TOPICS)


def _text(i: int) -> str:
    return (f"the {TOPICS[i]} was about time and love so they said it had all the good and bad of {i} "
            "when he was out with them")


def _full(i: int) -> str:
    return f"{TOPICS[i]} {i} {_text(i)}"  # title + text: the positive


PASSAGE = {_full(i): i for i in range(N)}


def _answer(i: int) -> str:
    """What the simulated LLM writes for passage i (3 queries asked for): 2-3 good queries, and in passage 1 an
    empty answer, in 2 a duplicate of passage 0's query, an empty bullet and a one-word line, in 3 a copy of the
    passage, a 40-word query and a fourth query beyond the three asked."""
    t = TOPICS[i]
    if i == 0:
        return "Here are 3 queries:\n1. python code time\n2. \"what python code love\"\n3. good and bad python"
    if i == 1:
        return ""
    if i == 2:
        return "1. Python code time\n2. \"\"\n3. film\n4. film data about love"
    if i == 3:
        return (f"the {t} was about time and love so they\n" + " ".join(["model"] * 40)
                + f"\ngreat model time\nwhat is a great model\nlove for a great model\nmodel of {i} good")
    return f"{t} {i}\nwhat {t} is about love"


def _corpus(path: Path, n: int = N) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "title": f"{TOPICS[i]} {i}", "text": _text(i)}) + "\n"
                            for i in range(n)))
    return path


def _cfg(tmp: Path, url: str, corpus: Path, **kw) -> LabelConfig:
    base = {"input": str(corpus), "task": "embed", "output": str(tmp / "pairs.jsonl"), "endpoint": url,
            "llm": ["sim"], "backoff": 0.01, "retries": 1, "concurrency": 2, "timeout": 10.0}
    return LabelConfig(**{**base, **kw})


def _reply(text, n, body):
    return _answer(PASSAGE[text])


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


def test_screening_counts_each_reason():
    s = screen_queries(_answer(3), 3, _full(3), max_words=32, copy_words=8)
    assert s.kept == ["great model time", "what is a great model", "love for a great model"]
    assert dict(s.dropped) == {"copied": 1, "too_long": 1, "extra": 1}
    s = screen_queries("1. a b c\n\n- \"\"\n* x\nHere you go:\nA B C\n42", 3)
    assert s.kept == ["a b c"] and dict(s.dropped) == {"empty": 1, "too_short": 1, "not_a_query": 2, "duplicate": 1}
    assert dict(screen_queries("  ", 3).dropped) == {"empty": 1}
    assert screen_queries(_answer(3), 3, _full(3), copy_words=0).kept[0].startswith("the great model")  # no check


def test_label_embed_writes_pairs_that_finetune_embed_trains_on(tmp_path, embed_dir, capsys):
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    corpus = _corpus(tmp_path / "passages.jsonl")
    prompts = {}

    def reply(text, n, body):
        prompts[PASSAGE[text]] = body["messages"][-1]["content"]
        return _reply(text, n, body)

    with ChatServer(reply) as srv:
        res = run(_cfg(tmp_path, srv.url, corpus))
        sent = len(srv.answered)
        again = run(_cfg(tmp_path, srv.url, corpus, overwrite=True))  # a rerun: every answer from the cache
        assert len(srv.answered) == sent == N
    assert prompts[0] == query_prompt(QUERY_TEMPLATE, 3, _full(0))  # adapt's prompt, from its one place
    assert again.ledger["sent_this_run"] == 0 and again.counts == res.counts
    c = res.counts
    assert (c["passages"], c["passages_with_queries"], c["pairs"]) == (N, 7, 3 + 1 + 3 + 2 * 4)
    assert {k: v for k, v in c.items() if k.startswith("dropped_")} == {
        "dropped_empty": 2, "dropped_not_a_query": 1, "dropped_too_short": 1, "dropped_too_long": 1,
        "dropped_copied": 1, "dropped_duplicate": 1, "dropped_extra": 1}
    assert c["negatives"] == "none" and res.summary()["queries"] == c
    err = capsys.readouterr().err
    assert "15 pairs from 7 of 8 passages" in err and "1 copied from the passage" in err
    rows = _read(tmp_path / "pairs.jsonl")
    assert [r["query"] for r in rows[:4]] == ["python code time", "what python code love", "good and bad python",
                                              "film data about love"]  # passage 2's "Python code time" dropped
    assert rows[0]["positive"] == _full(0) and rows[0]["passage_id"] == "p0" and rows[0]["labeller"] == "endpoint:sim"
    assert "negatives" not in rows[0] and not any(r["passage_id"] == "p1" for r in rows)
    ledger = json.loads((tmp_path / "pairs.jsonl.ledger.json").read_text())
    assert ledger["requests"] == N and ledger["texts"] == N and ledger["screening"]["pairs"] == 15
    assert len(read_triples(tmp_path / "pairs.jsonl")) == 15  # the reader finetune --task embed uses
    ft = finetune(FinetuneConfig(task="embed", model=str(embed_dir), train=str(tmp_path / "pairs.jsonl"),
                                 out=str(tmp_path / "emb"), max_steps=2, batch_size=4, max_length=32, bf16=False,
                                 allow=["unaudited-labels"]))
    card = json.loads((ft.out / "encoderkit.json").read_text())
    assert card["task"] == "embed" and card["train_examples"] == 15 and ft.steps == 2


def test_label_rerank_adds_negatives_that_finetune_rerank_trains_on(tmp_path, tiny_bert_dir, embed_dir):
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    corpus = _corpus(tmp_path / "passages.jsonl")
    with ChatServer(_reply) as srv:
        res = run(_cfg(tmp_path, srv.url, corpus, task="rerank"))
        mined = run(_cfg(tmp_path, srv.url, corpus, task="rerank", model=str(embed_dir), num_negatives=2,
                         output=str(tmp_path / "mined.jsonl"), cache=str(tmp_path / "pairs.jsonl.cache.sqlite")))
        assert len(srv.answered) == N  # the second run's answers all came from the first run's cache
    rows = _read(tmp_path / "pairs.jsonl")
    assert res.counts["negatives"] == "random" and res.counts["negatives_per_pair"] == 3
    assert all(len(r["negatives"]) == 3 == len(set(r["negatives"])) and r["positive"] not in r["negatives"]
               and set(r["negatives"]) <= set(PASSAGE) for r in rows)
    assert mined.counts["negatives"] == "mined" and "skipped_likely_positives" in mined.counts
    assert all(len(r["negatives"]) == 2 and r["positive"] not in r["negatives"]
               for r in _read(tmp_path / "mined.jsonl"))
    ft = finetune(FinetuneConfig(task="rerank", model=str(tiny_bert_dir), train=str(tmp_path / "pairs.jsonl"),
                                 out=str(tmp_path / "rr"), max_steps=1, batch_size=4, max_length=32, bf16=False,
                                 allow=["unaudited-labels"]))
    card = json.loads((ft.out / "encoderkit.json").read_text())
    assert card["task"] == "rerank" and card["train_examples"] == 15
    with ChatServer(_reply) as srv, pytest.raises(EncoderkitError, match="needs at least 4 passages"):
        run(_cfg(tmp_path, srv.url, _corpus(tmp_path / "three.jsonl", 3), task="rerank",
                 output=str(tmp_path / "few.jsonl")))


KILLED_CHILD = """
import json, sys
from encoderkit.label.run import LabelConfig, run
run(LabelConfig(**json.loads(sys.argv[1])))
"""


def test_a_killed_run_resumes_without_asking_an_answered_passage_again(tmp_path):
    corpus = _corpus(tmp_path / "passages.jsonl")
    hang = {"on": True}

    def reply(text, n, body):
        if hang["on"] and PASSAGE[text] == 5:
            return ("hang",)
        return _answer(PASSAGE[text])

    with ChatServer(reply) as srv:
        args = {"input": str(corpus), "task": "embed", "output": str(tmp_path / "pairs.jsonl"), "endpoint": srv.url,
                "llm": ["sim"], "concurrency": 1, "backoff": 0.01}
        child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, json.dumps(args)], stderr=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 120
        while _full(5) not in srv.requests:  # hanging on the sixth passage
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child.kill()
        child.wait()
        assert not (tmp_path / "pairs.jsonl").exists() and len(srv.answered) == 5
        hang["on"] = False
        res = run(LabelConfig(**args))
    assert sorted(srv.answered) == sorted(PASSAGE)  # each passage answered exactly once over both runs
    assert res.ledger["requests"] == N and res.ledger["sent_this_run"] == N - 5
    assert res.counts["pairs"] == 15


def test_the_audit_sheet_marks_queries_and_the_report_gives_the_share_of_good_ones(tmp_path):
    from encoderkit.label.review import review, sheet_labels

    corpus = _corpus(tmp_path / "passages.jsonl")
    with ChatServer(_reply) as srv:
        run(_cfg(tmp_path, srv.url, corpus))
    pairs, sheet = str(tmp_path / "pairs.jsonl"), tmp_path / "sheet.csv"
    res = sample(SampleConfig(input=pairs, n=10, output=str(sheet)))
    assert res.rows == 10 and res.strata == 3  # a passage's 1st, 2nd and 3rd queries
    assert sheet.read_text().splitlines()[0] == "row,query,text,label,gold"
    rows = read_sheet(sheet)
    lines = _read(tmp_path / "pairs.jsonl")
    assert all(r["query"] == lines[int(r["row"])]["query"] and r["text"] == lines[int(r["row"])]["positive"]
               and r["label"] == "yes" for r in rows)
    # the terminal reviewer shows the query and its passage; yes/no are its keys
    assert sheet_labels(sheet, rows, "") == ["yes", "no"]
    out = io.StringIO()
    review(sheet, rows, ["yes", "no"], io.StringIO("a\n2\n"), out)
    assert f"query: {rows[0]['query']}" in out.getvalue()
    rows = read_sheet(sheet)
    assert [r["gold"] for r in rows[:3]] == ["yes", "no", ""] and "query" in rows[0]  # the column survives
    for r in rows[2:]:
        r["gold"] = "Yes"
    rows[5]["gold"] = "no"
    write_sheet(sheet, rows)
    rep = report(ReportConfig(input=pairs, sheet=str(sheet), output=str(tmp_path / "rep.json"))).report
    lab = rep["labeller"]
    assert (lab["correct"], lab["n"]) == (8, 10) and lab["ci_low"] < 0.8 < lab["ci_high"]
    assert 0.4 < lab["ci_low"] and lab["ci_high"] < 1.0
    assert rep["screening"]["dropped_copied"] == 1 and "cost" in lab
    assert json.loads((tmp_path / "rep.json").read_text()) == rep
    rows[0]["gold"] = "maybe"
    write_sheet(sheet, rows)
    with pytest.raises(EncoderkitError, match="neither yes nor no"):
        report(ReportConfig(input=pairs, sheet=str(sheet)))
    rows[0]["gold"], rows[0]["query"] = "yes", "another query"
    write_sheet(sheet, rows)
    with pytest.raises(EncoderkitError, match="does not match line"):
        report(ReportConfig(input=pairs, sheet=str(sheet)))


def test_finetune_drops_the_pairs_the_audit_sheet_marks_no_and_counts_them(tmp_path, embed_dir, capsys):
    from encoderkit.tasks.common import TrainData
    from encoderkit.tasks.rerank.data import train_groups as rerank_groups
    from encoderkit.tasks.rerank.options import RerankOptions
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    corpus = _corpus(tmp_path / "passages.jsonl")
    with ChatServer(_reply) as srv:
        run(_cfg(tmp_path, srv.url, corpus))
    pairs, sheet = str(tmp_path / "pairs.jsonl"), tmp_path / "sheet.csv"
    sample(SampleConfig(input=pairs, n=10, output=str(sheet)))
    rows = read_sheet(sheet)
    for r in rows[:6]:
        r["gold"] = "yes"
    rows[1]["gold"], rows[4]["gold"] = "no", "No"  # two bad queries; rows[6:] not audited: kept
    write_sheet(sheet, rows)
    bad = {(rows[1]["query"], rows[1]["text"]), (rows[4]["query"], rows[4]["text"])}
    capsys.readouterr()
    ft = finetune(FinetuneConfig(task="embed", model=str(embed_dir), train=pairs, audit_sheet=str(sheet),
                                 out=str(tmp_path / "emb"), max_steps=1, batch_size=4, max_length=32, bf16=False))
    assert ft.summary()["audit"] == {"audit_sheet": str(sheet), "audited": 6, "dropped_no": 2}
    assert json.loads((ft.out / "encoderkit.json").read_text())["train_examples"] == 15 - 2
    assert "unaudited-labels" not in capsys.readouterr().err  # the file counts as audited
    audit: dict = {}
    kept = rerank_groups(TrainData(train=pairs), RerankOptions(audit_sheet=str(sheet)), audit)
    assert len(kept) == 13 and not bad & {(g.query, g.positive) for g in kept} and audit["dropped_no"] == 2
    rows[0]["gold"] = "maybe"
    write_sheet(sheet, rows)
    with pytest.raises(EncoderkitError, match=r"sheet.csv:2: gold 'maybe' is neither yes nor no"):
        rerank_groups(TrainData(train=pairs), RerankOptions(audit_sheet=str(sheet)))
    rows[0]["gold"], rows[0]["query"] = "yes", "another query"
    write_sheet(sheet, rows)
    with pytest.raises(EncoderkitError, match=r"sheet.csv:2: row .* does not match a line of .*pairs.jsonl"):
        rerank_groups(TrainData(train=pairs), RerankOptions(audit_sheet=str(sheet)))
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "labeller"}) + "\n"
                             for x in _read(tmp_path / "pairs.jsonl")))
    with pytest.raises(EncoderkitError, match=r"not the output of `encoderkit label --task embed\|rerank`"):
        rerank_groups(TrainData(train=str(plain)), RerankOptions(audit_sheet=str(sheet)))


def test_bad_pair_settings_are_clear_errors(tmp_path):
    url = "http://127.0.0.1:9/v1"
    corpus = _corpus(tmp_path / "passages.jsonl")
    with pytest.raises(EncoderkitError, match="writes queries, not labels"):
        _cfg(tmp_path, url, corpus, labels="a,b")
    with pytest.raises(EncoderkitError, match="--labeller endpoint"):
        _cfg(tmp_path, url, corpus, labeller="embed", model="minilm")
    with pytest.raises(EncoderkitError, match="asks one model once"):
        _cfg(tmp_path, url, corpus, samples=3)
    with pytest.raises(EncoderkitError, match="--task classify needs --labels"):
        _cfg(tmp_path, url, corpus, task="classify")
    with pytest.raises(EncoderkitError, match="--queries-per-passage"):
        _cfg(tmp_path, url, corpus, queries_per_passage=0)
    with ChatServer(lambda text, n, body: "") as srv, pytest.raises(EncoderkitError, match="no passage .* usable"):
        run(_cfg(tmp_path, srv.url, corpus))
