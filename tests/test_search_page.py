"""The search page of ``serve --index`` over HTTP: the frame is public, the results need the token, the hits are
the Searcher's, the query's terms are marked and every text is escaped."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from deploy_models import make_task_model, tiny_root
from fastapi.testclient import TestClient
from test_search_index import _cfg, _corpus, _doc

from encoderkit.retrieval.index import run as index
from encoderkit.retrieval.page import highlight
from encoderkit.retrieval.search import Searcher, SearchSettings

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HOSTILE = "python <script>alert(1)</script> & <b>data</b> movies"


def search_app(tmp_path, embed_dir, token: str | None = TOKEN, names: tuple[str, ...] = ("docs",),
               docs: dict[str, str] | None = None):
    """``serve``'s app over a tiny embed model and one index (by default of 20 documents, d3 holding HTML),
    served under each of ``names``."""
    from encoderkit.deploy.guard import Limits
    from encoderkit.deploy.serve import create_app
    from encoderkit.inference.predictor import Predictor
    from encoderkit.retrieval.http import search_routes

    out = tmp_path / "idx"
    docs = docs or {f"d{i}": _doc(i) for i in range(20)} | {"d3": HOSTILE}
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, passage_tokens=64, overlap=8))
    hook = search_routes([f"{n}={out}" for n in names], backend="torch-fp32")
    app = create_app({"emb": Predictor.load(embed_dir, backend="torch-fp32")}, Limits(max_chars=500, token=token),
                     extra_routes=(hook,))
    return app, out


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


def test_highlight_marks_the_query_words_and_escapes_everything_else():
    assert highlight("Python's <data> & pythons", "python DATA x") == (
        "<mark>Python</mark>&#x27;s &lt;<mark>data</mark>&gt; &amp; <mark>pythons</mark>")
    assert highlight("a <b>", "") == "a &lt;b&gt;"
    assert highlight("database", "data") == "database"  # whole words (and plurals) only
    assert highlight("x", "<script>") == "x"


def test_search_page_needs_the_token_for_results_and_shows_the_searchers_hits(tmp_path, embed_dir):
    app, out = search_app(tmp_path, embed_dir, names=("docs", "other"))
    c = TestClient(app)
    frame = c.get("/search")
    assert frame.status_code == 200 and "<input id=q" in frame.text and "python" not in frame.text
    assert c.get("/search/results", params={"q": "python data"}).status_code == 401
    assert c.get("/search/results", params={"q": "python"}, headers={"Authorization": "Bearer no"}).status_code == 401
    r = c.get("/search/results", params={"q": "python data", "k": 20, "index": "docs"}, headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    want = Searcher.open(out, backend="torch-fp32").search(["python data"], SearchSettings(k=20))[0]
    body = r.text
    positions = [body.index(f"<span class=doc>{h.doc_id} ") for h in want.hits]
    assert positions == sorted(positions) and len(positions) == 20
    assert f"<span class=score>{want.hits[0].score:.4f}</span>" in body
    assert ("<mark>python</mark> &lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;<mark>data</mark>&lt;/b&gt;"
            in body)
    assert "<script>" not in body and "<b>data" not in body
    assert "index <b>docs</b>" in body and "data-index='other'" in body
    for params, code in [({"q": ""}, 422), ({"q": "x" * 501}, 422), ({"q": "x", "index": "nope"}, 404),
                         ({"q": "x", "k": 0}, 422), ({"q": "x", "k": "many"}, 422)]:
        r = c.get("/search/results", params=params, headers=AUTH)
        assert r.status_code == code, (params, r.text)
        assert {"code", "message"} <= set(r.json()["error"])


def test_search_page_without_a_token_configured_is_open(tmp_path, embed_dir):
    app, _ = search_app(tmp_path, embed_dir, token=None)
    r = TestClient(app).get("/search/results", params={"q": "movie"})
    assert r.status_code == 200 and "<mark>movie" in r.text
