"""The one engine policy (encoderkit/inference/policy.py): its rule table on mocked CPUs, the refusal of an update on
another engine, the record's round trip, and that every place asks it once: search on an index's recorded engine,
serve's --backend reaching /v1/search, the Ray drivers handing their actors the resolved choice, and no other
module calling the rule's pieces."""

from __future__ import annotations

import ast
import json
import re
from functools import partial
from pathlib import Path

import pytest
from deploy_models import make_task_model, tiny_root
from test_search_index import _cfg, _corpus, _doc

from encoderkit import hardware
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import Hardware
from encoderkit.inference import engines
from encoderkit.inference import predictor as predictor_module
from encoderkit.inference.engines import CALIBRATION_TEXTS, DEFAULT_CALIBRATION
from encoderkit.inference.policy import RECORD_KEY, EngineChoice, recorded, resolve
from encoderkit.inference.predictor import Predictor
from encoderkit.ray_jobs import RayJob
from encoderkit.retrieval.index import run as index
from encoderkit.retrieval.store import current_folder
from tests.test_hardware import AVX2_ONLY, BF16_AMX, VNNI_NO_BF16

PACKAGE = Path(__file__).resolve().parents[1] / "encoderkit"


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


@pytest.fixture(scope="module")
def classify_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")


def cpu(kind: str) -> Hardware:
    return Hardware.from_cpuinfo(kind, threads=2)


def no_detect() -> Hardware:
    raise AssertionError("this choice must not depend on this machine's CPU")


def spy_loads(monkeypatch) -> list[tuple[dict, Predictor]]:
    """Every Predictor.load from now on: (its keyword arguments, the Predictor)."""
    seen: list[tuple[dict, Predictor]] = []
    load = Predictor.load.__func__

    def spy(cls, *args, **kwargs):
        p = load(cls, *args, **kwargs)
        seen.append((kwargs, p))
        return p

    monkeypatch.setattr(predictor_module.Predictor, "load", classmethod(spy))
    return seen


# -- the rule table ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task, kind, ready, backend, calibration, why", [
    ("embed", VNNI_NO_BF16, True, "openvino-int8", DEFAULT_CALIBRATION, "on OpenVINO's static INT8"),
    ("embed", VNNI_NO_BF16, False, "onnx-int8", None, 'pip install "encoderkit[openvino]"'),
    ("embed", VNNI_NO_BF16, False, "onnx-int8", None, "one text at a time"),
    ("embed", BF16_AMX, True, "openvino", None, "OpenVINO's bf16 graph: faithful and batch-independent"),
    ("embed", BF16_AMX, True, "openvino", None, "CPU class AMX, auto against the best peer: OpenVINO bf16 at parity"),
    ("embed", AVX2_ONLY, True, "openvino", None, "OpenVINO's fp32 graph: faithful and batch-independent"),
    ("embed", AVX2_ONLY, True, "openvino", None, "CPU class AVX2, auto against the best peer: not measured"),
    ("embed", BF16_AMX, False, "onnx-fp32", None, 'FP32 on ONNX Runtime: faithful and batch-independent'),
    ("embed", AVX2_ONLY, False, "onnx-fp32", None, 'OpenVINO is the faster choice: pip install "encoderkit[openvino]"'),
    ("classify", VNNI_NO_BF16, True, "onnx-fp32", None, "FP32: no INT8 agreement measured"),
    ("classify", AVX2_ONLY, True, "onnx-fp32", None, "FP32: this CPU has no VNNI/AMX int8"),
])
def test_auto_without_a_record_is_this_cpus_rule(embed_dir, classify_dir, monkeypatch, task, kind, ready, backend,
                                                 calibration, why):
    monkeypatch.setattr(engines, "openvino_ready", lambda: ready)
    monkeypatch.setattr(engines, "openvino_installed", lambda: ready)
    folder = embed_dir if task == "embed" else classify_dir
    choice = resolve(folder, "auto", hw=cpu(kind))
    assert (choice.backend, choice.calibration) == (backend, calibration) and why in choice.reason
    monkeypatch.setattr(hardware, "detect", lambda: cpu(kind))  # hw left out: this machine's, detected
    assert resolve(folder) == choice


def test_an_explicit_backend_is_that_backend(embed_dir, monkeypatch):
    monkeypatch.setattr(hardware, "detect", no_detect)
    assert resolve(embed_dir, "onnx-fp32") == EngineChoice("onnx-fp32", None, "--backend onnx-fp32 asked for")
    assert resolve(embed_dir, "openvino-int8").calibration == DEFAULT_CALIBRATION  # no texts: the named default
    texts = [f"text {i}" for i in range(CALIBRATION_TEXTS + 20)]
    given = resolve(embed_dir, "openvino-int8", calibration=texts)
    assert given.calibration == tuple(texts[:CALIBRATION_TEXTS]) and given.texts == texts[:CALIBRATION_TEXTS]
    assert resolve(embed_dir, "torch-fp32", calibration=texts).calibration is None  # only openvino-int8 takes texts
    with pytest.raises(EncoderkitError, match="backend 'gpu' is not one of auto"):
        resolve(embed_dir, "gpu")
    with pytest.raises(EncoderkitError, match="not a static embedding model"):
        resolve(embed_dir, "static")


def test_auto_with_a_record_is_the_record_whatever_this_cpu(embed_dir, monkeypatch):
    monkeypatch.setattr(hardware, "detect", no_detect)
    built = EngineChoice("openvino-int8", ("corpus head one", "corpus head two"), "--backend openvino-int8 asked for")
    for hw in (None, cpu(AVX2_ONLY), cpu(BF16_AMX)):
        assert resolve(embed_dir, "auto", built, hw=hw) is built
    assert resolve(embed_dir, "auto", built.to_dict()) == built  # the manifest's record as it is stored
    assert resolve(embed_dir, "openvino-int8", built, update="index idx") == built  # named again: its calibration too
    other = resolve(embed_dir, "onnx-fp32", built)  # a search may query on another engine
    assert (other.backend, other.calibration) == ("onnx-fp32", None)
    with pytest.raises(EncoderkitError, match="index idx was embedded with --backend openvino-int8, this run asks "
                                              r"onnx-fp32.*pass --backend openvino-int8 \(or auto\), or --rebuild"):
        resolve(embed_dir, "onnx-fp32", built, update="index idx")
    assert resolve(embed_dir, "onnx-fp32", None, update="index idx").backend == "onnx-fp32"  # --rebuild: no record


def test_a_resolved_choice_is_kept_as_it_is(embed_dir, monkeypatch):
    monkeypatch.setattr(hardware, "detect", no_detect)
    choice = EngineChoice("onnx-int8", None, "decided on the driver")
    assert resolve(embed_dir, choice) is choice
    assert resolve(embed_dir, choice, EngineChoice("torch-fp32", None, "a record"), update="index idx") is choice
    p = Predictor.load(embed_dir, backend=choice)
    assert p.choice is choice and (p.backend, p.backend_reason) == ("onnx-int8", "decided on the driver")


def test_the_record_round_trips_through_json():
    choices = (EngineChoice("openvino-int8", ("a", "b c"), "why"),
               EngineChoice("openvino-int8", DEFAULT_CALIBRATION, "auto"),
               EngineChoice("onnx-int8", None, "INT8: the embed task's rule"), EngineChoice(None, None, ""))
    for choice in choices:
        record = json.loads(json.dumps(choice.to_dict()))
        assert set(record) == {"backend", "calibration", "reason"}
        assert EngineChoice.from_dict(record) == choice and hash(EngineChoice.from_dict(record)) == hash(choice)
        assert recorded({"model": {}, RECORD_KEY: record}) == choice
    assert recorded({"model": {}}) is None and recorded(None) is None


# -- search, serve: the index's record ---------------------------------------------------------------------------

def test_search_auto_embeds_queries_on_the_builds_engine_not_this_cpus(embed_dir, tmp_path, monkeypatch):
    """Built on torch-fp32; on a CPU where auto alone would pick OpenVINO's static INT8, `search` (auto) still embeds
    its queries on torch-fp32, as the manifest records."""
    from encoderkit.retrieval.search import SearchConfig
    from encoderkit.retrieval.search import run as search

    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(12)}), out))
    manifest = json.loads((current_folder(out) / "manifest.json").read_text())
    assert manifest[RECORD_KEY] == {"backend": "torch-fp32", "calibration": None,
                                    "reason": "--backend torch-fp32 asked for"}
    assert "backend" not in manifest["model"] and "runtime" not in manifest["model"]
    monkeypatch.setattr(hardware, "detect", lambda: cpu(VNNI_NO_BF16))
    monkeypatch.setattr(engines, "openvino_ready", lambda: True)
    assert resolve(embed_dir).backend == "openvino-int8"  # what auto would pick here without the record
    seen = spy_loads(monkeypatch)
    assert search(SearchConfig(index=str(out), query="python data")).results[0]["hits"]
    assert seen[-1][1].choice == EngineChoice.from_dict(manifest[RECORD_KEY])


def test_search_auto_on_an_openvino_int8_index_uses_its_calibration(embed_dir, tmp_path, monkeypatch):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from encoderkit.retrieval.search import SearchConfig
    from encoderkit.retrieval.search import run as search

    docs = {f"d{i}": _doc(i) for i in range(CALIBRATION_TEXTS + 6)}
    out = tmp_path / "idx"
    seen = spy_loads(monkeypatch)
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, backend="openvino-int8"))
    built = seen[-1][1]
    assert built.choice.texts == list(docs.values())[:CALIBRATION_TEXTS]  # the corpus's head
    monkeypatch.setattr(hardware, "detect", lambda: cpu(AVX2_ONLY))  # auto alone: ONNX Runtime's INT8 here
    assert search(SearchConfig(index=str(out), query="python data", backend="auto")).results[0]["hits"]
    queries = seen[-1][1]
    assert queries.choice == built.choice and queries.engine.path == built.engine.path  # the same graph


def test_serve_backend_reaches_the_searcher_behind_v1_search(embed_dir, tmp_path, monkeypatch):
    import uvicorn

    from encoderkit.deploy import serve

    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(12)}), out))  # torch-fp32
    model = Predictor.load(embed_dir, backend="torch-fp32")
    monkeypatch.setattr(serve, "load_models", lambda *a, **k: {"emb": model})
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    seen = spy_loads(monkeypatch)
    serve.run(serve.ServeConfig(model=["emb=x"], index=[f"docs={out}"], backend="onnx-fp32"))
    assert apps and [p.choice for _, p in seen] == [EngineChoice("onnx-fp32", None, "--backend onnx-fp32 asked for")]
    seen.clear()
    serve.run(serve.ServeConfig(model=["emb=x"], index=[f"docs={out}"]))  # auto: the index's own engine
    assert [p.backend for _, p in seen] == ["torch-fp32"]


# -- Ray: the driver resolves once; each actor is handed the choice -----------------------------------------------

class LocalRay:
    """A RayJob stand-in that runs the actors' calls here, on "another machine": ``elsewhere()`` is called before
    each actor's model is made (a CPU where auto would pick otherwise)."""

    threads, address = 1, "local"

    def __init__(self, elsewhere) -> None:
        self.elsewhere, self.models = elsewhere, []

    def map_chunks(self, chunks, make, call):
        self.elsewhere()
        self.make = make
        model = make()
        self.models.append(model)
        for rows, groups in chunks:
            got = [None] * len(rows)
            for g in groups or [range(len(rows))]:
                for i, y in zip(g, call(model, [rows[i] for i in g]), strict=True):
                    got[i] = y
            yield got


@pytest.fixture
def other_machine(monkeypatch):
    """The driver runs on an AVX2 CPU (auto: OpenVINO's fp32 graph for embed); the actors on an AVX-512 VNNI one with
    OpenVINO, where auto would pick OpenVINO's static INT8."""
    monkeypatch.setattr(hardware, "detect", lambda: cpu(AVX2_ONLY))
    monkeypatch.setattr(engines, "openvino_ready", lambda: True)

    def elsewhere():
        monkeypatch.setattr(hardware, "detect", no_detect)  # an actor that picked again would ask its CPU

    ray = LocalRay(elsewhere)
    monkeypatch.setattr(RayJob, "of", classmethod(lambda cls, cfg: ray if cfg.ray else None))
    return ray


def test_predict_ray_actors_are_handed_the_drivers_choice(embed_dir, tmp_path, other_machine):
    from encoderkit.inference.predictor import PredictConfig
    from encoderkit.inference.predictor import run as predict

    (tmp_path / "in.txt").write_text("".join(f"{_doc(i)}\n" for i in range(9)))
    res = predict(PredictConfig(model=str(embed_dir), input=str(tmp_path / "in.txt"), output=str(tmp_path / "o.jsonl"),
                                ray="local"))
    assert isinstance(other_machine.make, partial)
    handed = other_machine.make.keywords["backend"]
    assert isinstance(handed, EngineChoice) and handed.backend == "openvino"  # resolved, not "auto"
    assert other_machine.models[0].choice == handed
    assert res.summary()["engine"] == handed.to_dict() and res.records == 9


def test_index_ray_actors_are_handed_the_builds_choice(embed_dir, tmp_path, other_machine):
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(12)}), out, backend="auto",
               ray="local"))
    handed = other_machine.make.keywords["backend"]
    assert isinstance(handed, EngineChoice) and handed.backend == "openvino"
    assert json.loads((current_folder(out) / "manifest.json").read_text())[RECORD_KEY] == handed.to_dict()


# -- nothing else decides ------------------------------------------------------------------------------------------

def _calls(name: str) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == name:
                    out.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return out


def test_only_the_policy_applies_the_auto_rule():
    for name in ("serve_choice", "pick_backend"):
        where = _calls(name)
        assert where and all(w.startswith("inference/policy.py:") for w in where), where
        assert not hasattr(engines, name)
    for path in sorted(PACKAGE.rglob("*.py")):  # open_engine is handed a choice, never a rule's name
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open_engine" and len(node.args) > 1:
                assert not isinstance(node.args[1], ast.Constant), f"{path}:{node.lineno}"


def test_the_runtime_name_is_gone_from_search_and_the_index_store():
    for rel in ("retrieval/search.py", "retrieval/http.py", "retrieval/store.py", "retrieval/index.py",
                "retrieval/sparse.py", "retrieval/first_stage.py"):
        assert not re.search(r"\bruntime\b", (PACKAGE / rel).read_text(encoding="utf-8")), rel
