"""Batch independence, the contract of every backend and task (issue 51): a text's output is the same alone, in one
batch, and beside other texts of other lengths (embed: cosine >= 0.9999; classify: the label; ner and qa: the spans),
through the Predictor, through `predict` (one text per request against all in one file) and through `search` (a
query's top 10 alone and beside other queries). ONNX Runtime's dynamic INT8 scales activations per call, so its engine
runs such a graph one text at a time: the last test shows the batched run would break the contract."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from deploy_models import export_task_model, tiny_root
from test_search_index import _cfg, _corpus, _doc

from encoderkit.inference.predictor import Predictor

BACKENDS = ["torch-fp32", "onnx-fp32", "onnx-int8"] + (
    ["openvino", "openvino-int8"] if importlib.util.find_spec("openvino") and importlib.util.find_spec("nncf") else [])
TEXTS = ["short one", "a longer text about the weather in Paris and the trains that run late on Sundays",
         "John lives in Berlin", "x", "data " * 40]
NEIGHBOURS = ["an unrelated neighbour " * 12, "tiny", "Maria flew to Rome on Tuesday with her brother and sister"]
QUESTIONS = [("Where does John live?", "John lives in Berlin and works in Potsdam."),
             ("Who flew?", "Maria flew to Rome on Tuesday, " + "then home again " * 10)]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer_dir):
    """One exported tiny folder per task: weights (torch, OpenVINO) plus model.onnx and model.int8.onnx."""
    root = tiny_root(tmp_path_factory)
    return {t: export_task_model(root, tiny_tokenizer_dir, t) for t in ("embed", "classify", "ner", "qa")}


def _ways(run, items: list, neighbours: list) -> list[list]:
    """``run`` on each item alone, on all in one batch, and beside neighbours (reversed, so that lengths differ)."""
    alone = [run([x])[0] for x in items]
    together = run(items)
    mixed = run([*neighbours, *items[::-1]])[len(neighbours):][::-1]
    return [alone, together, mixed]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_gives_a_text_its_output_whatever_its_batch(folders, backend):
    p = Predictor.load(folders["embed"], backend=backend, threads=1, max_batch=4)
    alone, together, mixed = (np.stack(v) for v in _ways(lambda t: list(p.embed(t)), TEXTS, NEIGHBOURS))
    assert _cos(alone, together).min() >= MIN_COSINE and _cos(alone, mixed).min() >= MIN_COSINE

    c = Predictor.load(folders["classify"], backend=backend, threads=1, max_batch=4)
    runs = _ways(c.classify, TEXTS, NEIGHBOURS)
    labels = [[r["label"] for r in run] for run in runs]
    assert labels[0] == labels[1] == labels[2]
    scores = [np.array([r["score"] for r in run]) for run in runs]
    assert np.abs(scores[0] - scores[1]).max() < 1e-3 and np.abs(scores[0] - scores[2]).max() < 1e-3

    n = Predictor.load(folders["ner"], backend=backend, threads=1, max_batch=4)
    spans = [[[(e["start"], e["end"], e["label"]) for e in ents] for ents in run]
             for run in _ways(n.extract, TEXTS, NEIGHBOURS)]
    assert spans[0] == spans[1] == spans[2]

    q = Predictor.load(folders["qa"], backend=backend, threads=1, max_batch=4)

    def answer(pairs: list) -> list:
        return q.answer([a for a, _ in pairs], [b for _, b in pairs])

    answers = [[(r["start"], r["end"]) for r in run] for run in _ways(answer, QUESTIONS, QUESTIONS[::-1])]
    assert answers[0] == answers[1] == answers[2]


def test_predict_one_query_per_request_equals_all_in_one_file(folders, tmp_path):
    """The default backend (auto, this CPU's) through `predict`: each query in a file of its own against all in one."""
    from encoderkit.inference.predictor import PredictConfig
    from encoderkit.inference.predictor import run as predict

    texts = [_doc(i) for i in range(7)]

    def vectors(lines: list[str], name: str) -> np.ndarray:
        (tmp_path / f"{name}.txt").write_text("".join(f"{t}\n" for t in lines))
        res = predict(PredictConfig(model=str(folders["embed"]), input=str(tmp_path / f"{name}.txt"),
                                    output=str(tmp_path / f"{name}.jsonl"), max_batch=4))
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return res.engine.backend, np.array([next(v for v in r.values() if isinstance(v, list)) for r in rows])

    backend, together = vectors(texts, "all")
    alone = np.concatenate([vectors([t], f"one{i}")[1] for i, t in enumerate(texts)])
    assert alone.shape == together.shape and _cos(alone, together).min() >= MIN_COSINE, backend


def test_search_top10_of_a_query_alone_equals_beside_others(folders, tmp_path):
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import Searcher, SearchSettings

    out = tmp_path / "idx"
    index(_cfg(folders["embed"], _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(40)}), out,
               backend="auto"))
    searcher = Searcher.open(out)
    queries = [_doc(i, 4) for i in (3, 11, 25)] + ["python data", "x"]
    settings = SearchSettings(k=10)
    together = [[h.doc_id for h in r.hits] for r in searcher.search(queries, settings)]
    alone = [[h.doc_id for h in searcher.search([q], settings)[0].hits] for q in queries]
    assert alone == together and all(len(hits) == 10 for hits in alone)


def test_dynamic_int8_runs_one_text_at_a_time_because_batched_it_would_bend(folders):
    """The INT8 graph quantises activations per call: run batched, a text's vector moves with its neighbours."""
    p = Predictor.load(folders["embed"], backend="onnx-int8", threads=1, max_batch=8)
    assert p.engine.per_row
    alone = np.stack([p.embed([t])[0] for t in TEXTS])
    assert np.array_equal(alone, p.embed([*NEIGHBOURS, *TEXTS])[len(NEIGHBOURS):])  # one at a time: the same bits
    p.engine.per_row = False  # what ONNX Runtime computes on a padded batch: one scale over all its texts
    batched = p.embed([*NEIGHBOURS, *TEXTS])[len(NEIGHBOURS):]
    assert np.abs(alone - batched).max() > 1e-5  # batched, its vector moves with its neighbours


@pytest.mark.parametrize("backend", ["onnx-int8", "torch-bf16"])
def test_a_lower_precision_backend_is_checked_against_fp32_and_refused_when_it_bends(folders, backend, monkeypatch):
    """ONNX Runtime's INT8 and torch bf16 are checked like OpenVINO's static INT8 (issue 51, item 3): the cosine of
    the folder's vectors to the FP32 graph's on the check texts, kept in a cache folder; below the kept bounds the
    backend is refused with the figures and the backends that would work."""
    from encoderkit.errors import EncoderkitError
    from encoderkit.inference import engines

    seen = []
    real = engines.fidelity
    monkeypatch.setattr(engines, "fidelity", lambda *a, **k: seen.append(1) or real(*a, **k))
    Predictor.load(folders["embed"], backend=backend, threads=1)  # the real check passes on the tiny model
    Predictor.load(folders["embed"], backend=backend, threads=1)  # and is kept: not run again
    Predictor.load(folders["classify"], backend=backend, threads=1)  # other tasks: judged by dev-row agreement
    assert len(seen) <= 1

    monkeypatch.setattr(engines, "INT8_FIDELITY", (0.99, 1.01))  # a new bound: a new check, which no graph meets
    with pytest.raises(EncoderkitError, match=rf"--backend {backend} bends this folder's vectors \(cosine to FP32 "
                                              r"[0-9.]+ mean / [0-9.]+ min on \d+ check texts, below the 0\.99 mean / "
                                              r"1\.01 min kept\), so it is refused; use --backend onnx-fp32"):
        Predictor.load(folders["embed"], backend=backend, threads=1)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.startswith(("onnx", "openvino"))])
def test_a_lane_gives_a_text_the_same_output_as_the_engine_on_every_thread(folders, backend):
    """serve runs long texts on a second session of the engine with one thread of its own, beside short batches on
    another (``engine.lane``, :func:`encoderkit.deploy.serve.lanes`): a text's vector is the same bits whichever
    computed it, alone or in a batch."""
    import copy

    p = Predictor.load(folders["embed"], backend=backend, threads=2, max_batch=4)
    one = copy.copy(p)
    one.engine = p.engine.lane(1)
    assert one.engine is not p.engine and one.engine.threads == 1
    texts = [*NEIGHBOURS, *TEXTS]
    for run in (lambda r: np.stack(r.embed(texts)), lambda r: np.stack([r.embed([t])[0] for t in texts])):
        wide, lane = run(p), run(one)
        assert np.array_equal(wide, lane), (backend, float(np.abs(wide - lane).max()))
