"""The endpoint labeller against a real chat-completions server on 127.0.0.1 (tests/chat_server.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chat_server import ChatServer

from encoderkit.errors import EncoderkitError

pytest.importorskip("openai")

from encoderkit.label.run import LabelConfig, run

REPO = Path(__file__).resolve().parents[1]
TABLE = {"a great film": "positive", "a dull film": "negative", "what a bore": "Negative.",
         "loved every minute": "Label: positive", "fine i guess": "positive", "so so": "negative"}


def write_input(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def cfg(tmp: Path, url: str, inp: Path, **kw) -> LabelConfig:
    base = {"input": str(inp), "labels": "negative,positive", "output": str(tmp / "labeled.jsonl"), "endpoint": url,
            "llm": ["sim"], "backoff": 0.01, "retries": 3, "concurrency": 3, "timeout": 5.0}
    return LabelConfig(**{**base, **kw})


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_endpoint_labels_through_malformed_answers_429_500_and_slow_replies(tmp_path):
    def reply(text, n, body):
        if text == "a great film" and n == 1:
            return "hmm, hard to say"          # unparseable: asked again
        if text == "a dull film" and n == 1:
            return ("status", 429)
        if text == "what a bore" and n <= 2:
            return ("status", 500)
        if text == "fine i guess":
            return ("sleep", 0.3, "positive")
        if text == "gibberish":
            return "banana"                    # never a label: recorded unlabeled, raw kept
        return TABLE[text]

    texts = [*TABLE, "gibberish"]
    with ChatServer(reply) as srv:
        res = run(cfg(tmp_path, srv.url, write_input(tmp_path / "in.jsonl", texts)))
        out = read(tmp_path / "labeled.jsonl")
        answered = len(srv.answered)
        # a rerun sends nothing: every answer (unparseable ones too) is cached
        run(cfg(tmp_path, srv.url, tmp_path / "in.jsonl", overwrite=True))
        assert len(srv.answered) == answered
    assert [r["label"] for r in out] == ["positive", "negative", "negative", "positive", "positive", "negative", None]
    assert [r["text"] for r in out] == texts and [r["id"] for r in out] == list(range(len(texts)))
    assert out[0]["labeller"] == "endpoint:sim" and out[0]["confidence"] is None
    assert out[-1]["raw"] == ["banana", "banana"]  # first answer + one parse retry
    # answered = 6 texts + 1 re-ask of "a great film" + 2 for gibberish
    assert answered == 9 and res.ledger["requests"] == 9 and res.ledger["sent_this_run"] == 9
    assert res.ledger["prompt_tokens"] > 0 and res.ledger["seconds"] >= 0.3
    assert res.counts == {"negative": 3, "positive": 3, "unlabeled": 1}


def test_samples_vote_and_agreement_is_the_confidence(tmp_path):
    def reply(text, n, body):
        return "negative" if body.get("seed") == 2 else "positive"  # 2 of 3 samples say positive

    with ChatServer(reply) as srv:
        run(cfg(tmp_path, srv.url, write_input(tmp_path / "in.jsonl", ["x", "y"]), samples=3))
        assert len(srv.answered) == 6
    out = read(tmp_path / "labeled.jsonl")
    assert [r["label"] for r in out] == ["positive", "positive"]
    assert [r["confidence"] for r in out] == [pytest.approx(2 / 3, abs=1e-3)] * 2


def test_several_labellers_vote(tmp_path):
    with ChatServer(lambda text, n, body: "negative" if body["model"] == "small" else "positive") as srv:
        run(cfg(tmp_path, srv.url, write_input(tmp_path / "in.jsonl", ["x"]), llm=["big", "small", "other"]))
        assert sorted(srv.answered) == ["x"] * 3
    (rec,) = read(tmp_path / "labeled.jsonl")
    assert rec["label"] == "positive" and rec["confidence"] == pytest.approx(2 / 3, abs=1e-3)
    assert rec["labeller"] == "endpoint:big+small+other"


KILLED_CHILD = """
import json, sys
from encoderkit.label.run import LabelConfig, run
run(LabelConfig(**json.loads(sys.argv[1])))
"""


def test_killed_run_resumes_without_repeating_a_request(tmp_path):
    texts = [f"text number {i}" for i in range(10)]
    hang = {"on": True}

    def reply(text, n, body):
        if hang["on"] and text == "text number 5":
            return ("hang",)
        return "positive" if int(text.split()[-1]) % 2 else "negative"

    inp = write_input(tmp_path / "in.jsonl", texts)
    with ChatServer(reply) as srv:
        args = {"input": str(inp), "labels": "negative,positive", "output": str(tmp_path / "labeled.jsonl"),
                "endpoint": srv.url, "llm": ["sim"], "concurrency": 1, "backoff": 0.01}
        child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, json.dumps(args)], stderr=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 60
        while "text number 5" not in srv.requests:  # hanging on the sixth request
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child.kill()
        child.wait()
        assert not (tmp_path / "labeled.jsonl").exists() and len(srv.answered) == 5
        hang["on"] = False
        res = run(LabelConfig(**args))
    assert sorted(srv.answered) == sorted(texts)  # each text answered exactly once over both runs
    assert res.ledger["requests"] == 10 and res.ledger["sent_this_run"] == 5
    assert [r["label"] for r in read(tmp_path / "labeled.jsonl")] == ["negative", "positive"] * 5


def test_endpoint_down_is_a_clear_error_and_keeps_what_was_answered(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", ["a great film", "a dull film"])
    with ChatServer(lambda text, n, body: TABLE[text]) as srv:
        url = srv.url
        run(cfg(tmp_path, url, inp, output=str(tmp_path / "first.jsonl"), cache=str(tmp_path / "cache.sqlite")))
    more = write_input(tmp_path / "more.jsonl", ["a great film", "a dull film", "so so"])
    with pytest.raises(EncoderkitError, match="cannot reach the endpoint .*rerun the same command to resume"):
        run(cfg(tmp_path, url, more, cache=str(tmp_path / "cache.sqlite"), retries=1))
    with ChatServer(lambda text, n, body: TABLE[text]) as srv2:
        res = run(cfg(tmp_path, srv2.url, more, cache=str(tmp_path / "cache.sqlite")))
        assert srv2.answered == ["so so"]  # the two answered before the outage came from the cache
    assert res.counts == {"negative": 2, "positive": 1, "unlabeled": 0}


def test_a_server_speaking_another_schema_or_path_is_a_clear_error(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", ["a great film"])
    with ChatServer(lambda text, n, body: ("raw", {"result": "positive"})) as srv:
        with pytest.raises(EncoderkitError, match="does not speak the chat-completions schema"):
            run(cfg(tmp_path, srv.url, inp))
        with pytest.raises(EncoderkitError, match="HTTP 404.*check --endpoint"):
            run(cfg(tmp_path, srv.url.removesuffix("/v1") + "/nothing/here", inp))
    assert not (tmp_path / "labeled.jsonl").exists()


def test_bad_label_sets_input_and_template_are_clear_errors(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", ["a great film"], field="body_text")
    url = "http://127.0.0.1:9/v1"
    with pytest.raises(EncoderkitError, match="given twice"):
        cfg(tmp_path, url, inp, labels="pos,neg,Pos")
    with pytest.raises(EncoderkitError, match="one label"):
        cfg(tmp_path, url, inp, labels="pos")
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"body_text": "a great film", "note": "seen twice"}) + "\n")
    with pytest.raises(EncoderkitError, match=r"cannot tell which column holds the text .*--text-field"):
        run(cfg(tmp_path, url, two))
    with pytest.raises(EncoderkitError, match="no field 'sentence'.*--text-field"):
        run(cfg(tmp_path, url, inp, text_field="sentence"))
    template = tmp_path / "prompt.txt"
    template.write_text("Pick one of {labels} for this review.")
    with pytest.raises(EncoderkitError, match=r"prompt.txt has no \{text\} placeholder"):
        run(cfg(tmp_path, url, inp, text_field="body_text", template=str(template)))


def test_prompt_holds_labels_descriptions_and_examples_and_answers_parse_to_labels(tmp_path):
    from encoderkit.label.prompt import DEFAULT_TEMPLATE, parse_answer, render

    p = render(DEFAULT_TEMPLATE, "a {braced} text", ["neg", "pos"], {"neg": "a bad review"}, [("loved it", "pos")])
    assert "neg, pos" in p and "- neg: a bad review" in p and "Text: loved it\nLabel: pos" in p
    assert p.endswith("Text: a {braced} text\nLabel:")
    labels = ["negative", "positive"]
    assert [parse_answer(a, labels) for a in ["Positive", " 'negative'.", "Label: positive", "**negative**",
                                               "positive\nbecause it is upbeat", "I'd say negative overall"]] == [
        "positive", "negative", "positive", "negative", "positive", "negative"]
    assert [parse_answer(a, labels) for a in ["", None, "neutral", "positive or negative", "positively"]] == [None] * 5
    seen = []

    def reply(text, n, body):
        seen.append(body["messages"][-1]["content"])
        return "pos"

    (tmp_path / "shots.jsonl").write_text(json.dumps({"text": "what a joy", "label": "pos"}) + "\n")
    with ChatServer(reply) as srv:
        run(cfg(tmp_path, srv.url, write_input(tmp_path / "in.jsonl", ["x"]), labels="neg,pos",
                descriptions=["pos=a good review"], examples=str(tmp_path / "shots.jsonl")))
    assert "- pos: a good review" in seen[0] and "Text: what a joy\nLabel: pos" in seen[0]
    (tmp_path / "shots.jsonl").write_text(json.dumps({"text": "meh", "label": "neutral"}) + "\n")
    with pytest.raises(EncoderkitError, match="label 'neutral'.*--examples is not one of neg, pos"):
        run(cfg(tmp_path, "http://127.0.0.1:9/v1", tmp_path / "in.jsonl", labels="neg,pos",
                examples=str(tmp_path / "shots.jsonl"), overwrite=True))


def test_cli_reports_a_bad_label_set_and_a_down_endpoint_with_exit_2(tmp_path, capsys):
    from encoderkit.cli import main

    inp = write_input(tmp_path / "in.jsonl", ["a great film"])
    assert main(["label", "--input", str(inp), "--labels", "pos,pos", "--output", str(tmp_path / "o.jsonl"),
                 "--endpoint", "http://127.0.0.1:9/v1", "--llm", "m"]) == 2
    assert "pos given twice" in capsys.readouterr().err
    assert main(["label", "--input", str(inp), "--labels", "neg,pos", "--output", str(tmp_path / "o.jsonl"),
                 "--endpoint", "http://127.0.0.1:9/v1", "--llm", "m", "--retries", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the endpoint http://127.0.0.1:9/v1" in err and "Traceback" not in err


def test_a_reply_slower_than_the_timeout_is_retried(tmp_path):
    def reply(text, n, body):
        return ("sleep", 1.5, "positive") if n == 1 else "negative"

    with ChatServer(reply) as srv:
        res = run(cfg(tmp_path, srv.url, write_input(tmp_path / "in.jsonl", ["x"]), timeout=0.3))
        assert srv.requests == ["x", "x"]
    assert res.counts["negative"] == 1 and res.ledger["requests"] == 1  # the timed-out reply is never recorded


def test_label_finds_the_text_field_as_finetune_finds_its_text_column(tmp_path):
    from encoderkit.label.records import read_texts
    from encoderkit.tasks.tabular import find_text_column, read_rows

    for name, rows in {"by name, any case": [{"id": 1, "Review": "a great film", "Title": "x"}],
                       "the only text column": [{"id": 1, "body_text": "a great film", "score": "0.5"}]}.items():
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        texts, _ = read_texts(path, "")
        assert texts == ["a great film"], name
        assert rows[0][find_text_column(read_rows(path), path)[0]] == "a great film", name
