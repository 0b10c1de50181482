"""``serve --index`` follows index updates: a new generation is switched to whole, while requests flow, without a
restart and without a failed request (it used to keep serving the deleted old generation until restarted)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from deploy_models import make_task_model, tiny_root
from test_search_index import _cfg, _corpus, _doc

from encoderkit.retrieval.index import run as index


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


def test_an_index_update_is_served_without_a_restart_or_a_failed_request(embed_dir, tmp_path):
    from encoderkit.deploy.guard import Limits
    from encoderkit.deploy.serve import BackgroundServer, create_app
    from encoderkit.retrieval.http import search_routes

    out, corpus = tmp_path / "idx", tmp_path / "c.jsonl"
    docs = {f"d{i}": _doc(i) for i in range(20)}
    index(_cfg(embed_dir, _corpus(corpus, docs), out))
    first_gen = (out / "CURRENT").read_text().strip()
    hook = search_routes([f"docs={out}"], backend="torch-fp32", poll_s=0.05)
    app = create_app({}, Limits(max_chars=500), extra_routes=(hook,))
    query = {"query": "zebra quartz lantern", "k": 30, "rescore": "none"}
    statuses: list[int] = []
    seen: list[set[str]] = []
    spans: list[tuple[float, float, set[str]]] = []  # each answered request: start, end, its documents
    stop = threading.Event()
    with BackgroundServer(app) as url:
        def ask() -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                while not stop.is_set():
                    start = time.monotonic()
                    r = c.post("/v1/search", json=query)
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        seen.append({h["doc_id"] for h in r.json()["hits"]})
                        spans.append((start, time.monotonic(), seen[-1]))

        clients = [threading.Thread(target=ask) for _ in range(3)]
        for t in clients:
            t.start()
        try:
            time.sleep(0.3)
            # the update: d3 goes, "new" comes; it writes a new generation and removes the old one's folder
            update = {k: v for k, v in docs.items() if k != "d3"} | {"new": "zebra quartz lantern " * 3}
            index(_cfg(embed_dir, _corpus(corpus, update), out))
            assert (out / "CURRENT").read_text().strip() != first_gen and not (out / first_gen).exists()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (seen and "new" in seen[-1]):
                time.sleep(0.05)
            time.sleep(0.3)  # and it stays switched
        finally:
            stop.set()
            for t in clients:
                t.join(30)
        r = httpx.get(url + "/search/results", params={"q": "zebra quartz lantern", "k": 30}, timeout=30)  # the page
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert "new" not in seen[0] and "d3" in seen[0]  # before: the first generation
    assert "new" in seen[-1] and "d3" not in seen[-1]  # after: the update, with nothing restarted
    switched = min(end for _, end, docs in spans if "new" in docs)
    after = [docs for start, _, docs in spans if start > switched]
    assert after and all("new" in d and "d3" not in d for d in after)  # whole, and never back
    assert r.status_code == 200 and ">new &middot;" in r.text and ">d3 &middot;" not in r.text
