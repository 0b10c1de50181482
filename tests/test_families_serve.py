"""The compatibility matrix, serve column: for each encoder family, the five fine-tuned tiny folders of
the matrix (``families.tuned``: classify, ner, qa, rerank, embed) are loaded as ``encoderkit serve`` loads
them (``load_models``, backend ``auto``: ONNX FP32, INT8 for embed (OpenVINO's static INT8 on an AVX-512 VNNI
CPU without AMX), exported once into the cache) and served
by one real uvicorn server on 127.0.0.1; a request to each endpoint must answer what ``encoderkit predict``
(backend ``auto``) writes for the same inputs. A family x task that cannot be served must be refused when
the server starts, with an EncoderkitError naming the family and ``serve`` (SERVE_REFUSED; none today).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from encoderkit.deploy.serve import BackgroundServer, create_app, load_models
from encoderkit.inference.policy import resolve
from tests import families
from tests.families import FAMILIES, TASKS, numbers, predict_records, strings

bpe_tokenizer_dir, family_dir, tuned = families.bpe_tokenizer_dir, families.family_dir, families.tuned  # the fixtures

# (family, task) -> the refusal expected when serve loads that folder. Empty: every family serves every task.
SERVE_REFUSED: dict[tuple[str, str], str] = {}


def served_records(http: httpx.Client, task: str, inputs: Path) -> list[dict]:
    """What the server answers for ``inputs`` (predict's input file), in predict's record shape."""
    if inputs.suffix == ".jsonl":
        rows = [json.loads(line) for line in inputs.read_text().splitlines()]
    else:
        texts = inputs.read_text().splitlines()

    def post(path: str, body: dict) -> dict:
        r = http.post(path, json={**body, "model": task})
        assert r.status_code == 200, (path, r.text)
        assert r.json()["model"] == task
        return r.json()

    if task == "classify":
        return post("/v1/classify", {"texts": texts})["results"]
    if task == "ner":
        return [{"entities": e} for e in post("/v1/extract", {"texts": texts})["results"]]
    if task == "qa":
        return post("/v1/answer", {"questions": [r["question"] for r in rows],
                                   "contexts": [r["context"] for r in rows]})["results"]
    if task == "rerank":
        return [{"ranking": post("/v1/rerank", {"query": r["query"], "passages": r["passages"]})["results"]}
                for r in rows]
    return [{"embedding": v} for v in post("/v1/embed", {"texts": texts})["embeddings"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_served_and_answers_like_predict(family, tuned, tmp_path, monkeypatch) -> None:
    from encoderkit.errors import EncoderkitError

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))  # serve and predict share its ONNX exports
    folders = {task: tuned(family, task) for task in TASKS}
    for task in TASKS:
        refused = SERVE_REFUSED.get((family, task))
        if refused:
            with pytest.raises(EncoderkitError, match=refused):
                load_models([f"{task}={folders[task][0]}"])
    able = [t for t in TASKS if (family, t) not in SERVE_REFUSED]
    models = load_models([f"{task}={folders[task][0]}" for task in able])  # as `encoderkit serve --model t=DIR ...`
    embed_int8 = resolve(folders["embed"][0]).backend  # ONNX Runtime's, or OpenVINO's on its CPU class
    assert embed_int8 in ("onnx-int8", "openvino-int8")
    assert {t: m.backend for t, m in models.items()} == {t: embed_int8 if t == "embed" else "onnx-fp32" for t in able}
    with BackgroundServer(create_app(models)) as url, httpx.Client(base_url=url, timeout=60) as http:
        health = http.get("/health").json()["models"]
        assert {t: h["task"] for t, h in health.items()} == {t: t for t in able}
        for task in able:
            folder, inputs = folders[task]
            expected = predict_records(folder, inputs, "auto", tmp_path / f"{task}.jsonl")
            got = served_records(http, task, inputs)
            assert len(got) == len(expected) > 0, task
            for a, b in zip(got, expected):
                np.testing.assert_allclose(numbers(a), numbers(b), atol=1e-5, err_msg=f"{family} {task}")
                assert strings(a) == strings(b), (family, task)
