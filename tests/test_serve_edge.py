"""The service's edge over real HTTP: a bad text is refused before it joins a batch (so it never fails its
neighbours), random bodies never get a 5xx, auth comes before parsing, slow clients are timed out."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random

import httpx
import pytest
from deploy_models import served_predictors

from encoderkit.deploy.guard import Limits
from encoderkit.deploy.serve import BackgroundServer, create_app

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
ENDPOINTS = {
    "/v1/classify": ("texts", "text_pairs"),
    "/v1/extract": ("texts",),
    "/v1/answer": ("questions", "contexts"),
    "/v1/rerank": ("query", "passages"),
    "/v1/embed": ("texts",),
}


@pytest.fixture(scope="module")
def predictors(tmp_path_factory, tiny_tokenizer_dir):
    return served_predictors(tmp_path_factory, tiny_tokenizer_dir, max_batch=64)


@pytest.fixture(scope="module")
def url(predictors):
    # a long wait and a large batch, so that concurrent requests share one model call
    app = create_app(predictors, Limits(max_body_bytes=20_000, max_texts=8, max_chars=300, token=TOKEN),
                     max_batch=64, max_wait_ms=100)
    with BackgroundServer(app) as u:
        yield u


def _poisoned_round(url: str, path: str, good: bytes, bad: bytes) -> tuple[list[int], httpx.Response]:
    def post(body: bytes) -> httpx.Response:
        return httpx.post(url + path, content=body, headers=AUTH, timeout=60)

    with cf.ThreadPoolExecutor(31) as pool:
        goods = [pool.submit(post, good) for _ in range(15)]
        poisoned = pool.submit(post, bad)
        goods += [pool.submit(post, good) for _ in range(15)]
        return [f.result().status_code for f in goods], poisoned.result()


@pytest.mark.parametrize("path,good,bad,field", [
    ("/v1/embed", b'{"texts": ["a good movie"]}', b'{"texts": ["fine", "x\\ud800y"]}', "texts[1]"),
    ("/v1/classify", b'{"texts": ["a", "b"], "text_pairs": ["c", "d"]}',
     b'{"texts": ["a", "b"], "text_pairs": ["c", "\\udfff"]}', "text_pairs[1]"),
    ("/v1/rerank", b'{"query": "fun", "passages": ["a fun movie"]}', b'{"query": "\\ud83d", "passages": ["x"]}',
     "query"),
    ("/v1/answer", b'{"questions": ["who?"], "contexts": ["the man"]}',
     b'{"questions": ["who?"], "contexts": ["\\ud800\\ud800"]}', "contexts[0]"),
])
def test_one_poisoned_request_never_fails_its_neighbours(url, path, good, bad, field):
    statuses, poisoned = _poisoned_round(url, path, good, bad)
    assert statuses == [200] * 30
    if poisoned.status_code == 200:  # a request with good items too: the bad one fails alone, in its place
        err = poisoned.json()["errors"][0]
        assert err["param"] == field and poisoned.json()[
            "embeddings" if path == "/v1/embed" else "results"][err["index"]] is None
    else:  # every item bad (or the one query): the request fails
        assert poisoned.status_code == 422, poisoned.text
        err = poisoned.json()["error"]
    assert err["code"] == "invalid_text" and field in err["message"] and "surrogate" in err["message"]
    # a valid surrogate pair (an emoji written as two escapes) is a normal text
    ok = httpx.post(url + "/v1/embed", content=b'{"texts": ["smile \\ud83d\\ude00"]}', headers=AUTH, timeout=60)
    assert ok.status_code == 200


# -- fuzz: a seeded generator of random unicode, nesting and wrong types ------------------------------

def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.15:
        return "".join(chr(rng.randrange(0xD800, 0xE000)) for _ in range(rng.randint(1, 3)))  # lone surrogates
    if kind < 0.25:
        return "".join(chr(rng.choice([0, 0xFEFF, 0x200B, 0xFFFE, 0x10FFFF, 0x202E, 0x1F600]))
                       for _ in range(rng.randint(1, 4)))
    if kind < 0.35:
        return rng.choice(["", " ", "\n\t", "a" * 400])
    alphabet = [chr(rng.randrange(0x20, 0x3000)) for _ in range(8)] + list("good bad movie ")
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, 10**30, 1.5, -0.0])
    if kind in (3, 4, 5):
        return _text(rng)
    if kind in (6, 7):
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_text(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _body(rng: random.Random, fields: tuple[str, ...]) -> bytes:
    if rng.random() < 0.1:  # not JSON at all, or JSON that is not an object
        return rng.choice([bytes(rng.randrange(256) for _ in range(rng.randint(0, 30))), b"[]", b"null", b'"x"',
                           b"1e999"])
    body = {}
    for f in fields:
        r = rng.random()
        if r < 0.55:
            n = rng.randint(0, 10)
            body[f] = _text(rng) if f == "query" else [_text(rng) for _ in range(n)]
        elif r < 0.85:
            body[f] = _value(rng)
    if rng.random() < 0.3:
        body[rng.choice(["model", "top_k", "dim", "normalize", "extra"])] = _value(rng)
    # ensure_ascii writes lone surrogates as \\udXXX escapes, as a client in another language would
    return json.dumps(body, ensure_ascii=True).encode()


def test_random_request_bodies_never_get_a_5xx(url):
    rng = random.Random(18)
    seen: dict[int, int] = {}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        for _ in range(400):
            path = rng.choice(sorted(ENDPOINTS))
            r = client.post(path, content=_body(rng, ENDPOINTS[path]))
            assert r.status_code < 500, (path, r.status_code, r.text)
            assert "error" in r.json() or r.status_code == 200
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert client.post("/v1/classify", json={"texts": ["still alive"]}).status_code == 200
        assert 'status="5' not in client.get("/metrics").text
    assert seen.get(200, 0) > 10 and seen.get(422, 0) > 50  # the generator reaches both valid and invalid bodies


# -- slow and idle clients, auth before parsing, /health ----------------------------------------------

@pytest.fixture(scope="module")
def strict_url(predictors):
    """A server with short timeouts and room for four connections."""
    from encoderkit.deploy.protocol import server_options

    app = create_app({"classify": predictors["classify"]}, Limits(token=TOKEN, body_timeout_s=1.0), max_wait_ms=1)
    with BackgroundServer(app, **server_options(head_timeout_s=1.0, keep_alive_s=1.0, max_connections=4)) as u:
        yield u


def _connect(url: str):
    import socket

    host, port = url.rsplit("/", 1)[-1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(s) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def test_a_stalled_body_gets_408_and_others_are_served_meanwhile(strict_url):
    import time

    s = _connect(strict_url)
    s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"texts\": [")  # then nothing
    start = time.monotonic()
    ok = httpx.post(strict_url + "/v1/classify", json={"texts": ["a good movie"]}, headers=AUTH, timeout=10)
    assert ok.status_code == 200 and time.monotonic() - start < 0.9  # served while the other stalls
    answer = _read_all(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert time.monotonic() - start < 5


def test_idle_and_trickling_connections_are_closed_and_free_their_slots(strict_url):
    import time

    idle = [_connect(strict_url) for _ in range(3)]  # connect and send nothing
    trickle = _connect(strict_url)
    # with 4 connections open (the limit), a working client still gets in: the connection that has waited longest
    # for a request head is closed to make room ...
    assert httpx.get(strict_url + "/health", timeout=10).status_code == 200
    assert _read_all(idle[0]) == b""
    start = time.monotonic()
    for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: 1\r\n", b"X-B: 2\r\n", b"X-C: 3\r\n"):
        try:
            trickle.sendall(part)  # a header every 0.4 s never completes the head
        except OSError:
            break
        time.sleep(0.4)
    for s in [*idle, trickle]:
        assert _read_all(s) == b""  # closed by the server without an answer
        s.close()
    assert time.monotonic() - start < 5
    # ... and once the head timeout has closed them, the slots are free again
    assert httpx.get(strict_url + "/health", timeout=10).status_code == 200


def test_the_token_is_checked_before_the_body_is_parsed(url):
    no_token = {"content-type": "application/json"}
    for body in (b"{", b'{"texts": 5}', b'{"bogus": 1}', b"\xff\xfe"):
        r = httpx.post(url + "/v1/classify", content=body, headers=no_token, timeout=10)
        assert r.status_code == 401, (body, r.text)
        err = r.json()["error"]  # encoderkit's code/message and OpenAI's type/param, no schema details
        assert err == {"code": "unauthorized", "message": err["message"], "type": "authentication_error", "param": None}
        assert "texts" not in r.text
    wrong = httpx.post(url + "/v1/embed", content=b"[]", headers={**no_token, "Authorization": "Bearer nope"},
                       timeout=10)
    assert wrong.status_code == 401
    assert httpx.post(url + "/v1/classify", content=b"{", headers=AUTH, timeout=10).status_code == 400  # with a token


def test_health_shows_no_paths(url, predictors):
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["models"]["classify"]["task"] == "classify"
    text = r.text
    for p in predictors.values():
        assert str(p.folder) not in text and str(p.folder.name) not in text
    assert '"/' not in text and "folder" not in text


def test_serve_help_lists_the_connection_settings(capsys):
    from encoderkit import cli

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--head-timeout-s", "--body-timeout-s", "--keep-alive-s", "--max-connections", "--max-head-bytes",
                 "--max-connections-per-client", "--max-queue-texts", "--max-queue-wait-s", "--fair-tokens"):
        assert flag in out


# -- the CLI readers: the same check where JSONL texts come in ----------------------------------------

def test_a_lone_surrogate_in_jsonl_training_data_is_named_by_file_and_line(tmp_path, tiny_bert_dir, capsys):
    from encoderkit.cli import main

    rows = [{"sentence": "a good movie", "label": "pos"}, {"sentence": "a dull movie", "label": "neg"}] * 4
    lines = [json.dumps(r) for r in rows]
    lines[2] = '{"sentence": "fine \\ud800 film", "label": "pos"}'
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(lines) + "\n")
    code = main(["finetune", "--model", str(tiny_bert_dir), "--task", "classify", "--train", str(train),
                 "--out", str(tmp_path / "out"), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"{train}:3: field 'sentence' has a lone surrogate (U+D800) at character 5" in err
