"""``audit review --web`` over HTTP: the token, leases, the 409s (two tabs, a hand-edited sheet), atomic answers
from concurrent reviewers on a real uvicorn, undo, and the terminal review picking up a web-written sheet."""

from __future__ import annotations

import csv
import io
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from encoderkit.errors import EncoderkitError
from encoderkit.label.review import ReviewConfig, review
from encoderkit.label.sheet import read_sheet, write_sheet
from encoderkit.label.web import ReviewDesk, create_review_app

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LABELS = ["neg", "pos"]


def make_sheet(path: Path, n: int = 4) -> Path:
    texts = ["first text", "second <b>text</b> & more", "third text", "fourth text"]
    rows = [{"row": 10 + i, "text": texts[i] if i < len(texts) else f"text number {i}", "label": LABELS[i % 2],
             "confidence": 0.9 - i / (2 * n), "suspicion": "", "suspect": "", "gold": ""} for i in range(n)]
    write_sheet(path, rows)
    return path


def gold(path: Path) -> list[str]:
    return [r["gold"] for r in read_sheet(path)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sheet(tmp_path) -> Path:
    return make_sheet(tmp_path / "sheet.csv")


def client(sheet: Path, token: str | None = TOKEN, clock=None, lease_s: float = 600.0) -> TestClient:
    desk = ReviewDesk(sheet, LABELS, lease_s, **({"clock": clock} if clock else {}))
    return TestClient(create_review_app(desk, token))


def post(c: TestClient, path: str, **body):
    return c.post(path, json=body, headers=AUTH)


def shown(view: dict) -> dict:
    return {"row": view["row"], "text_sha": view["text_sha"], "label": view["label"]}


def test_token_is_required_on_every_request_for_the_sheet_and_the_page_holds_no_data(sheet):
    c = client(sheet)
    page = c.get("/")
    assert page.status_code == 200 and "first text" not in page.text and "sheet.csv" not in page.text
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}):
        r = c.post("/api/next", json={"tab": "tab-aaaaaaaa"}, headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["code"] == "unauthorized"
    r = c.post("/api/answer", json={"tab": "tab-aaaaaaaa", "row": "10", "text_sha": "x", "label": "neg", "gold": "neg"})
    assert r.status_code == 401 and gold(sheet) == ["", "", "", ""]
    assert (c.post("/api/next", json={"tab": "tab-aaaaaaaa"}, headers={"Authorization": f"bearer {TOKEN}"}).status_code
            == 200)
    assert client(sheet, token=None).post("/api/next", json={"tab": "tab-aaaaaaaa"}).status_code == 200


def test_accept_pick_skip_undo_write_the_sheet_and_count_progress(sheet):
    c = client(sheet)
    tab = {"tab": "tab-aaaaaaaa", "who": "alice"}
    v = post(c, "/api/next", **tab).json()
    assert v["row"] == "10" and v["label"] == "neg" and "first text" in v["html"] and "0.900" in v["html"]
    assert v["progress"] == {"filled": 0, "total": 4, "agree": 0, "accuracy": None}
    v = post(c, "/api/answer", **tab, **shown(v), gold="neg").json()       # accept
    assert gold(sheet) == ["neg", "", "", ""]
    assert v["row"] == "11" and "second &lt;b&gt;text&lt;/b&gt; &amp; more" in v["html"]  # escaped
    v = post(c, "/api/answer", **tab, **shown(v), gold="neg").json()       # 1: a correction (labeller said pos)
    assert gold(sheet) == ["neg", "neg", "", ""]
    assert v["progress"] == {"filled": 2, "total": 4, "agree": 1, "accuracy": 0.5}
    assert "answered <b>2</b> of <b>4</b>" in v["html"] and "accuracy so far 0.500" in v["html"]
    v = post(c, "/api/skip", **tab, row=v["row"]).json()                    # skip row 12
    assert v["row"] == "13" and gold(sheet) == ["neg", "neg", "", ""]
    v = post(c, "/api/undo", **tab).json()                                  # undo the answer to row 11
    assert v["row"] == "11" and gold(sheet) == ["neg", "", "", ""] and "undone" in v["message"]
    v = post(c, "/api/answer", **tab, **shown(v), gold="pos").json()
    v = post(c, "/api/answer", **tab, **shown(v), gold="pos").json()       # row 13 (12 stays skipped)
    assert v["done"] and gold(sheet) == ["neg", "pos", "", "pos"] and "1 skipped here" in v["html"]
    v = post(c, "/api/revisit", **tab).json()
    assert v["row"] == "12"
    r = post(c, "/api/answer", **tab, **shown(v), gold="maybe")
    assert r.status_code == 422 and "not one of the labels" in r.json()["error"]["message"]
    assert post(c, "/api/next", tab="short").status_code == 422
    assert gold(sheet) == ["neg", "pos", "", "pos"]


def test_a_row_held_by_one_reviewer_is_never_handed_to_another_until_its_lease_runs_out(sheet):
    clock = Clock()
    c = client(sheet, clock=clock, lease_s=600)
    a = post(c, "/api/next", tab="tab-aaaaaaaa", who="alice").json()
    b = post(c, "/api/next", tab="tab-bbbbbbbb", who="bob").json()
    assert (a["row"], b["row"]) == ("10", "11")
    assert post(c, "/api/next", tab="tab-aaaaaaaa").json()["row"] == "10"   # asking again renews, same row
    # bob answers alice's row without having been given it: refused, the holder named
    r = post(c, "/api/answer", tab="tab-bbbbbbbb", **shown(a), gold="neg")
    assert (r.status_code == 409 and r.json()["error"]["code"] == "held"
            and "held by alice" in r.json()["error"]["message"])
    assert gold(sheet) == ["", "", "", ""]
    clock.t += 601                                                            # both leases ran out
    carol = post(c, "/api/next", tab="tab-cccccccc", who="carol").json()
    assert carol["row"] == "10"
    r = post(c, "/api/answer", tab="tab-aaaaaaaa", who="alice", **shown(a), gold="neg")
    assert r.status_code == 409 and "held by carol" in r.json()["error"]["message"]
    assert post(c, "/api/answer", tab="tab-bbbbbbbb", **shown(b), gold="pos").status_code == 200  # lapsed, untaken
    assert post(c, "/api/answer", tab="tab-cccccccc", **shown(carol), gold="neg").status_code == 200
    assert gold(sheet) == ["neg", "pos", "", ""]


def test_two_tabs_answering_the_same_row_the_second_is_refused_and_named(sheet):
    c = client(sheet)
    first = post(c, "/api/next", tab="tab-dupdupdu", who="alice").json()
    second = post(c, "/api/next", tab="tab-dupdupdu", who="alice").json()  # a duplicated tab: same id, same row
    assert first["row"] == second["row"] == "10"
    assert post(c, "/api/answer", tab="tab-dupdupdu", who="alice", **shown(first), gold="neg").status_code == 200
    r = post(c, "/api/answer", tab="tab-dupdupdu", who="alice", **shown(second), gold="pos")
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "already_answered"
    assert "sheet.csv:2: row 10 was already answered 'neg' by alice" in err["message"]
    assert gold(sheet) == ["neg", "", "", ""]


def test_a_sheet_edited_by_hand_while_the_page_is_open_is_refused_and_named(sheet):
    c = client(sheet)
    v = post(c, "/api/next", tab="tab-aaaaaaaa").json()
    rows = read_sheet(sheet)
    rows[0]["text"] = "first text, edited in a spreadsheet"
    write_sheet(sheet, rows)
    before = sheet.read_bytes()
    r = post(c, "/api/answer", tab="tab-aaaaaaaa", **shown(v), gold="neg")
    assert r.status_code == 409 and r.json()["error"]["code"] == "sheet_changed"
    assert "sheet.csv:2: the text of row 10 is not the text shown" in r.json()["error"]["message"]
    assert sheet.read_bytes() == before
    v = post(c, "/api/next", tab="tab-aaaaaaaa").json()                       # the page reloads the row as it is
    assert "edited in a spreadsheet" in v["html"]
    rows[0]["label"] = "pos"
    write_sheet(sheet, rows)
    r = post(c, "/api/answer", tab="tab-aaaaaaaa", **shown(v), gold="neg")
    assert r.status_code == 409 and "row 10's label is now 'pos', not the 'neg' shown" in r.json()["error"]["message"]
    write_sheet(sheet, rows[1:])
    r = post(c, "/api/answer", tab="tab-aaaaaaaa", **{**shown(v), "label": "pos"}, gold="neg")
    assert r.status_code == 409 and "row 10 is no longer in the sheet" in r.json()["error"]["message"]
    assert gold(sheet) == ["", "", ""]


def test_concurrent_reviewers_on_a_real_server_lose_no_answer_and_readers_never_see_a_partial_sheet(tmp_path):
    import httpx

    from encoderkit.deploy.serve import BackgroundServer

    sheet = make_sheet(tmp_path / "sheet.csv", n=40)
    app = create_review_app(ReviewDesk(sheet, LABELS), TOKEN)
    answered: dict[str, list[str]] = {}
    errors: list[str] = []
    stop = threading.Event()

    def reviewer(k: int, url: str) -> None:
        tab = f"tab-{k:08d}"
        mine = answered.setdefault(tab, [])
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as h:
            v = h.post("/api/next", json={"tab": tab}).json()
            while not v["done"]:
                r = h.post("/api/answer", json={"tab": tab, **shown(v), "gold": LABELS[k % 2]})
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                mine.append(v["row"])
                v = r.json()

    def reader() -> None:
        while not stop.is_set():
            if len(read_sheet(sheet)) != 40:
                errors.append("a partial sheet was read")

    with BackgroundServer(app) as url:
        watcher = threading.Thread(target=reader)
        watcher.start()
        threads = [threading.Thread(target=reviewer, args=(k, url)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stop.set()
        watcher.join(timeout=30)
    assert not errors
    rows = read_sheet(sheet)
    given = [row for rows_of_tab in answered.values() for row in rows_of_tab]
    assert sorted(given) == sorted(r["row"] for r in rows)  # each row answered exactly once
    by_row = {r["row"]: r["gold"] for r in rows}
    for tab, mine in answered.items():
        assert all(by_row[row] == LABELS[int(tab[-1]) % 2] for row in mine)  # nobody's answer overwritten
    assert sum(1 for m in answered.values() if m) >= 2  # the reviewers really shared the sheet


def test_the_terminal_review_continues_a_sheet_written_by_the_web_page_and_back(sheet):
    c = client(sheet)
    v = post(c, "/api/next", tab="tab-aaaaaaaa").json()
    v = post(c, "/api/answer", tab="tab-aaaaaaaa", **shown(v), gold="neg").json()
    post(c, "/api/answer", tab="tab-aaaaaaaa", **shown(v), gold="neg")
    out = io.StringIO()
    result = review(sheet, read_sheet(sheet), LABELS, io.StringIO("a\nq\n"), out)  # one key per line (not a tty)
    assert "[3/4] third text" in out.getvalue() and result.reviewed == 3 and result.corrected == 1
    assert gold(sheet) == ["neg", "neg", "neg", ""]
    with open(sheet, newline="") as f:
        assert next(csv.reader(f)) == ["row", "text", "label", "confidence", "suspicion", "suspect", "gold"]
    v = post(c, "/api/next", tab="tab-bbbbbbbb").json()                       # and back to the page
    assert v["row"] == "13" and v["progress"]["filled"] == 3


def test_review_config_checks_the_web_settings(sheet):
    with pytest.raises(EncoderkitError, match="--lease-s must be at least 120"):
        ReviewConfig(sheet=str(sheet), web=True, lease_s=5)
    with pytest.raises(EncoderkitError, match="not a TCP port"):
        ReviewConfig(sheet=str(sheet), web=True, port=70000)
