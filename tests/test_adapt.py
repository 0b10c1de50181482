"""``encoderkit adapt`` on tiny models and the local chat-completions server (tests/chat_server.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from chat_server import ChatServer
from deploy_models import make_task_model, tiny_root
from kill import run_until_then_kill

from encoderkit.adapt.passages import Passage
from encoderkit.adapt.queries import QueryLog, offline_queries, parse_queries, positive_text
from encoderkit.adapt.run import AdaptConfig, run
from encoderkit.errors import EncoderkitError

WORDS = ["python", "data", "movie", "story", "fun", "great", "dull", "film"]
N = 24


def _text(i: int) -> str:
    w = lambda j: WORDS[(i * 3 + j * (1 + i % 5)) % len(WORDS)]
    return f"{w(0)} {w(1)} {i}. Then {w(2)} {w(3)} {w(4)} {i % 7}. And {w(5)} {w(6)} {w(7)} {w(1)}."


def _corpus(path: Path, n: int = N) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "title": f"{WORDS[i % 8]} {WORDS[(i + 3) % 8]} title {i}",
                                        "text": _text(i)}) + "\n" for i in range(n)))
    return path


def _full(i: int) -> str:
    return f"{WORDS[i % 8]} {WORDS[(i + 3) % 8]} title {i} {_text(i)}"


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


def _cfg(embed_dir: Path, corpus: Path, out: Path, **kw) -> AdaptConfig:
    base = {"model": str(embed_dir), "corpus": str(corpus), "out": str(out), "batch_size": 8, "max_steps": 3,
            "queries_per_passage": 2, "num_negatives": 1, "lr": 1e-3, "save_every": 0, "bf16": False,
            "retries": 0, "backoff": 0.01, "timeout": 10.0, "concurrency": 2, "block": 4}
    return AdaptConfig(**{**base, **kw})


def _reply(i: int) -> str:
    """What the simulated LLM answers for passage i: mostly queries (with the usual numbering and a header), some
    empty answers (i % 7 == 3), some garbage (i % 7 == 5)."""
    if i % 7 == 3:
        return ""
    if i % 7 == 5:
        return "!!!\n---\n42"
    return f"Here are 2 queries:\n1. {WORDS[i % 8]} {WORDS[(i + 1) % 8]} {i}\n2. \"what {WORDS[(i + 2) % 8]} story\""


EMPTY = sum(1 for i in range(N) if i % 7 == 3)
GARBAGE = sum(1 for i in range(N) if i % 7 == 5)
TEXTS = {_full(i): i for i in range(N)}


def test_parse_queries_reads_lists_and_skips_what_is_not_a_query():
    assert parse_queries("Here are 3 queries:\n1. python data\n2) movie story fun\n- \"dull film\"", 3) == [
        "python data", "movie story fun", "dull film"]
    assert parse_queries('["a b", "c d", "a b"]', 5) == ["a b", "c d"]  # a JSON list, duplicates dropped
    assert parse_queries("Query 1: python data\nQuery 2: fun film", 1) == ["python data"]  # at most n
    assert parse_queries("", 3) == [] and parse_queries("   \n", 3) == [] and parse_queries("!!!\n42\n---", 3) == []
    assert parse_queries(None, 3) == []


def test_offline_queries_title_then_sentences_taken_out_of_the_positive():
    p = Passage("x", "A study of film", "Background first here. Then the result was great fun. Last we saw dull data.")
    qs = offline_queries(p, 2, ("title", "sentence"))
    assert qs[0] == "A study of film" and qs[1] in ("Then the result was great fun.", "Last we saw dull data.")
    assert offline_queries(p, 2, ("title", "sentence")) == qs  # seeded by the passage id
    assert qs[1] not in positive_text(p, qs[1]) and "Background first here." in positive_text(p, qs[1])
    assert positive_text(p, "A study of film").startswith("Background")
    assert offline_queries(Passage("y", "", "Too short."), 3, ("title", "sentence")) == []  # nothing reads as a query


def test_query_log_drops_a_line_torn_by_a_kill(tmp_path):
    log = QueryLog(tmp_path / "q.jsonl", {"n": 2})
    log.add([{"id": "a", "queries": ["x y"], "status": "ok"}])
    with open(tmp_path / "q.jsonl", "ab") as f:
        f.write(b'{"id": "b", "quer')  # a kill in the middle of a block's write
    again = QueryLog(tmp_path / "q.jsonl", {"n": 2})
    assert list(again.records) == ["a"]
    again.add([{"id": "b", "queries": ["z w"], "status": "ok"}])
    assert list(QueryLog(tmp_path / "q.jsonl", {"n": 2}).records) == ["a", "b"]
    with pytest.raises(EncoderkitError, match="other query settings"):
        QueryLog(tmp_path / "q.jsonl", {"n": 3})


def test_endpoint_queries_skip_empty_and_garbage_and_train_an_embed_folder(tmp_path, embed_dir):
    from encoderkit.inference.predictor import Predictor
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import SearchConfig
    from encoderkit.retrieval.search import run as search

    corpus = _corpus(tmp_path / "corpus.jsonl")
    queries = tmp_path / "q.tsv"
    queries.write_text("".join(f"q{i}\t{WORDS[i % 8]} {WORDS[(i + 3) % 8]} title\n" for i in range(6)))
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(6)))
    with ChatServer(lambda text, n, body: _reply(TEXTS[text])) as srv:
        res = run(_cfg(embed_dir, corpus, tmp_path / "out", generator="endpoint", endpoint=srv.url, llm="sim",
                       eval_queries=str(queries), eval_qrels=str(qrels)))
        assert body_ok(srv)
    assert Counter(srv.answered) == Counter(list(TEXTS))  # one request per passage
    g = res.generation
    assert (g["skipped_empty"], g["skipped_unparsable"]) == (EMPTY, GARBAGE)
    assert g["with_queries"] == N - EMPTY - GARBAGE and g["queries"] == 2 * g["with_queries"]
    assert g["requests_sent"] == N
    out = tmp_path / "out"
    logged = [json.loads(x) for x in (out / "adapt" / "queries.jsonl").read_text().splitlines()[1:]]
    assert {r["id"]: r["queries"] for r in logged}["d0"] == ["python data 0", "what movie story"]
    assert {r["status"] for r in logged if not r["queries"]} == {"empty", "unparsable"}
    rows = [json.loads(x) for x in (out / "adapt" / "train.jsonl").read_text().splitlines()]
    assert (len(rows) == g["queries"]
            and all(len(r["negatives"]) == 1 and r["negatives"][0] != r["positive"] for r in rows))
    assert res.training["steps"] == 3 and res.training["loss"] == "mnrl"
    assert set(res.before) >= {"ndcg@10"} and set(res.after) >= {"ndcg@10"}
    card = json.loads((out / "encoderkit.json").read_text())
    assert (card["stage"] == "adapt" and card["task"] == "embed"
            and card["metrics"]["queries"]["queries"] == g["queries"])
    # an embed folder that index and search accept, with other vectors than the model it started from
    texts = ["python data story", "dull film fun"]
    a = Predictor.load(embed_dir, backend="torch-fp32").embed(texts)
    b = Predictor.load(out, backend="torch-fp32").embed(texts)
    assert a.shape == b.shape and not np.allclose(a, b, atol=1e-4)
    index(IndexConfig(model=str(out), corpus=[str(corpus)], out=str(tmp_path / "idx"), backend="torch-fp32"))
    hits = search(SearchConfig(index=str(tmp_path / "idx"), query="python data", backend="torch-fp32", k=3)).results[0]
    assert len(hits["hits"]) == 3 and hits["hits"][0]["doc_id"].startswith("d")


def body_ok(srv: ChatServer) -> bool:
    return len(srv.requests) == len(srv.answered)  # no 4xx/5xx was needed


KILLED_CHILD = """
import json, sys
from encoderkit.adapt.run import AdaptConfig, run
run(AdaptConfig(**json.loads(sys.argv[1])))
"""


def test_a_killed_run_resumes_without_asking_again(tmp_path, embed_dir):
    corpus = _corpus(tmp_path / "corpus.jsonl")
    marker = tmp_path / "hung"
    state = {"phase": 1}

    def reply(text, n, body):
        if state["phase"] == 1 and len(srv.answered) >= 12:
            marker.touch()
            return ("hang",)  # the child is killed while these wait
        return _reply(TEXTS[text])

    with ChatServer(reply) as srv:
        cfg = _cfg(embed_dir, corpus, tmp_path / "out", generator="endpoint", endpoint=srv.url, llm="sim")
        args = {**cfg.result_dict(), "concurrency": 2, "block": 4, "timeout": 30.0, "save_every": 0, "bf16": False}
        run_until_then_kill(KILLED_CHILD, args, marker, tmp_path, threads=1)
        first = list(srv.answered)
        assert 12 <= len(first) < N and (tmp_path / ".out.partial" / "adapt" / "queries.jsonl").is_file()
        state["phase"] = 2
        res = run(AdaptConfig(**{**args, "resume": True}))
        assert set(srv.answered) == set(TEXTS)  # every passage answered over both runs
        # asked twice: at most the requests in flight at the kill (sent by the server, not yet in the answer cache)
        assert len(srv.answered) - N <= args["concurrency"]
    assert res.generation["requests_sent"] == len(srv.answered) - len(first) < N - len(first) + args["concurrency"] + 1
    assert res.generation["passages"] == N and res.generation["skipped_empty"] == EMPTY
    assert (tmp_path / "out" / "encoderkit.json").is_file() and not (tmp_path / ".out.partial").exists()


def test_gpl_trains_with_cross_encoder_margins(tmp_path, embed_dir, tmp_path_factory, tiny_tokenizer_dir):
    ce = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "rerank")
    corpus = _corpus(tmp_path / "corpus.jsonl")
    res = run(_cfg(embed_dir, corpus, tmp_path / "out", cross_encoder=str(ce), ce_margin=-100.0, num_negatives=2))
    rows = [json.loads(x) for x in (tmp_path / "out" / "adapt" / "train.jsonl").read_text().splitlines()]
    assert rows and all(len(r["margins"]) == len(r["negatives"]) == 2 for r in rows)
    assert res.training["loss"] == "margin-mse" and res.training["steps"] == 3
    # the margins are the cross-encoder's: recompute one
    from encoderkit.tasks.margin_mse import open_cross_encoder
    from encoderkit.tasks.rerank.features import score_pairs

    model, tok, length = open_cross_encoder(str(ce))
    r = rows[0]
    s = score_pairs(model, tok, r["query"], [r["positive"], *r["negatives"]], length)
    assert np.allclose(r["margins"], [s[0] - s[1], s[0] - s[2]], atol=1e-4)


def test_offline_generator_takes_titles_and_sentences(tmp_path, embed_dir):
    corpus = _corpus(tmp_path / "corpus.jsonl")
    res = run(_cfg(embed_dir, corpus, tmp_path / "out", offline_kinds=["title", "sentence"], max_length=24))
    assert res.generation["with_queries"] == N and res.generation["requests_sent"] == 0
    # --max-length is a training setting: the folder searches at the model's own length (its 128 positions)
    out = tmp_path / "out"
    assert json.loads((out / "encoderkit.json").read_text())["max_length"] == 128
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 128
    assert json.loads((out / "encoderkit.json").read_text())["config"]["max_length"] == 24
    rows = [json.loads(x) for x in (tmp_path / "out" / "adapt" / "train.jsonl").read_text().splitlines()]
    titles = {f"{WORDS[i % 8]} {WORDS[(i + 3) % 8]} title {i}" for i in range(N)}
    assert sum(r["query"] in titles for r in rows) == N  # one title per passage ...
    assert all(r["query"] not in r["positive"] for r in rows)  # ... and what became a query left the positive


def test_bad_input_is_refused_clearly(tmp_path, embed_dir, tmp_path_factory, tiny_tokenizer_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": "a", "text": "  "}) + "\n")
    with pytest.raises(EncoderkitError, match="zero passages"):
        run(_cfg(embed_dir, empty, tmp_path / "o1"))
    (tmp_path / "none.jsonl").write_text("")
    with pytest.raises(EncoderkitError, match="zero passages"):
        run(_cfg(embed_dir, tmp_path / "none.jsonl", tmp_path / "o2"))
    corpus = _corpus(tmp_path / "corpus.jsonl")
    clf = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    with pytest.raises(EncoderkitError, match="'classify' model; adapt fine-tunes a transformer embedding model"):
        run(_cfg(clf, corpus, tmp_path / "o3"))
    with pytest.raises(EncoderkitError, match="--cross-encoder .* is a 'embed' model; GPL needs a cross-encoder"):
        run(_cfg(embed_dir, corpus, tmp_path / "o4", cross_encoder=str(embed_dir)))
    never = pytest.raises(EncoderkitError, match=f"no passage .* got a query \\({N} empty, 0 unparsable")
    with ChatServer(lambda text, n, body: "") as srv, never:  # an endpoint that never answers a query: a clear stop
        run(_cfg(embed_dir, corpus, tmp_path / "o5", generator="endpoint", endpoint=srv.url, llm="sim"))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()
