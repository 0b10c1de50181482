"""``--backend openvino``: OpenVINO's CPU runtime on a plain FP32 graph exported from the folder's weights, giving
the outputs ONNX Runtime FP32 gives (to its inference precision: bf16 on AMX / AVX512-BF16 CPUs); a folder of graphs
only runs its own; a graph OpenVINO cannot read and a missing OpenVINO are errors that say what to do."""

from __future__ import annotations

import builtins
import re

import numpy as np
import pytest
from deploy_models import export_task_model, make_task_model, tiny_root

from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import Predictor

TEXTS = ["the movie was great fun", "a dull and boring story", "love",
         "the worst plot of the year by far, said everyone"]


@pytest.fixture(scope="module")
def ov():
    return pytest.importorskip("openvino", reason='OpenVINO is an optional extra: pip install "encoderkit[openvino]"')


def tolerance(p: Predictor) -> float:
    return 0.05 if p.engine.precision == "bf16" else 1e-4  # bf16 keeps 8 bits of mantissa


@pytest.mark.parametrize("task", ["embed", "classify", "ner"])
def test_openvino_computes_what_onnx_runtime_fp32_computes(ov, task, tmp_path_factory, tiny_tokenizer_dir):
    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, task)
    ours = Predictor.load(folder, backend="openvino", threads=1)
    ref = Predictor.load(folder, backend="onnx-fp32", threads=1)
    assert ours.backend == "openvino" and ours.engine.precision in ("bf16", "f32")
    if task == "embed":
        a, b = ours.embed(TEXTS), ref.embed(TEXTS)
        assert a.shape == b.shape
        assert float((a * b).sum(1).min()) > 0.999
        return
    rows = ref.tokenizer(TEXTS, padding=True, return_tensors="np")
    inputs = {k: v.astype(np.int64) for k, v in rows.items()}
    for x, y in zip(ours.engine.run(inputs), ref.engine.run(inputs), strict=True):
        assert x.shape == y.shape and x.dtype == np.float32
        np.testing.assert_allclose(x, y, atol=tolerance(ours))


def test_a_folder_of_graphs_only_runs_its_own_graph(ov, tmp_path_factory, tiny_tokenizer_dir, tmp_path):
    """No weights to export a plain graph from: OpenVINO reads the folder's FP32 graph, fused for ONNX Runtime
    (--optimize: Attention, SkipLayerNormalization); an operator it cannot read (QAttention, from ONNX Runtime's
    INT8 quantiser, in a file named model.onnx) is an error that says what to do."""
    import shutil

    exported = export_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")  # --optimize: fused ops
    graph_only = tmp_path / "graph_only"
    shutil.copytree(exported, graph_only)
    for weights in graph_only.glob("*.safetensors"):
        weights.unlink()
    ours = Predictor.load(graph_only, backend="openvino", threads=1)
    ref = Predictor.load(graph_only, backend="onnx-fp32", threads=1)
    inputs = {k: v.astype(np.int64) for k, v in ref.tokenizer(TEXTS, padding=True, return_tensors="np").items()}
    np.testing.assert_allclose(ours.engine.run(inputs)[0], ref.engine.run(inputs)[0], atol=tolerance(ours))
    shutil.copyfile(graph_only / "model.int8.onnx", graph_only / "model.onnx")
    with pytest.raises(EncoderkitError, match="OpenVINO cannot run .*model.onnx"):
        Predictor.load(graph_only, backend="openvino")


def _without(module: str, monkeypatch) -> None:
    """Importing ``module`` (or a submodule) fails from here on, as if it were not installed."""
    real_import = builtins.__import__

    def missing(name, *args, **kwargs):
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named '{module}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)


def test_without_openvino_the_error_names_the_install(tmp_path_factory, tiny_tokenizer_dir, monkeypatch):
    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    _without("openvino", monkeypatch)
    with pytest.raises(EncoderkitError, match=r'pip install "encoderkit\[openvino\]"'):
        Predictor.load(folder, backend="openvino")


def test_a_corpus_runs_several_batches_at_once_in_order(ov, tmp_path_factory, tiny_tokenizer_dir):
    """Many batches go to OpenVINO's streams together (run_many); every text still gets its own vector."""
    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    texts = [" ".join(TEXTS[i % 4].split()[: 1 + i % 7]) + f" {i}" for i in range(60)]
    ours = Predictor.load(folder, backend="openvino", threads=2, max_batch=4)
    assert ours.engine.in_flight > 1
    calls = []
    run_many = ours.engine.run_many
    ours.engine.run_many = lambda batches: calls.append(len(batches)) or run_many(batches)
    a = ours.embed(texts)
    b = Predictor.load(folder, backend="onnx-fp32", threads=1, max_batch=4).embed(texts)
    assert calls and max(calls) > 1
    assert float((a * b).sum(1).min()) > 0.999


def test_run_rows_hands_an_engine_with_streams_its_batches_together():
    """The protocol, without OpenVINO: an engine with ``in_flight`` gets that many batches per run_many call,
    and each row gets back its own output."""
    from encoderkit.tasks.inference import run_rows

    class Streams:
        in_flight = 3

        def __init__(self):
            self.sizes = []

        def run(self, inputs):
            return [inputs["input_ids"].sum(1, keepdims=True).astype(np.float32)]

        def run_many(self, batches):
            self.sizes.append(len(batches))
            return [self.run(b) for b in batches]

    rows = [{"input_ids": np.arange(1, 2 + i % 5, dtype=np.int64)} for i in range(20)]
    engine = Streams()
    out = run_rows(engine, rows, 0, 2)
    assert engine.sizes and max(engine.sizes) == 3
    assert [float(o[0][0]) for o in out] == [float(r["input_ids"].sum()) for r in rows]


@pytest.fixture(scope="module")
def nncf(ov):
    return pytest.importorskip("nncf", reason='NNCF comes with the openvino extra: pip install "encoderkit[openvino]"')


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_openvino_int8_quantises_once_per_calibration_and_stays_close_to_fp32(nncf, task, tmp_path_factory,
                                                                            tiny_tokenizer_dir, monkeypatch, capsys):
    from pathlib import Path

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path_factory.mktemp("ov_cache")))  # graphs made by this test alone
    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, task)
    calls = []
    quantize = nncf.quantize
    monkeypatch.setattr(nncf, "quantize", lambda *a, **k: calls.append(1) or quantize(*a, **k))
    ours = Predictor.load(folder, backend="openvino-int8", threads=1, calibration=TEXTS * 4)
    assert ours.backend == "openvino-int8" and calls == [1]
    assert capsys.readouterr().out == ""  # NNCF's progress goes to stderr: stdout is the command's own
    xml = Path(ours.engine.path).read_text(encoding="utf-8")
    assert "FakeQuantize" in xml  # activations really are quantised, not a plain fp32 graph
    Predictor.load(folder, backend="openvino-int8", threads=1, calibration=TEXTS * 4)
    assert calls == [1]  # the same calibration: the cached graph
    other = Predictor.load(folder, backend="openvino-int8", threads=1)  # data-free: the default calibration
    assert calls == [1, 1] and other.engine.path != ours.engine.path
    from encoderkit.inference import engines

    monkeypatch.setattr(engines, "default_calibration", lambda *a, **k: pytest.fail("made again on a cache hit"))
    assert Predictor.load(folder, backend="openvino-int8", threads=1).engine.path == other.engine.path
    ref = Predictor.load(folder, backend="onnx-fp32", threads=1)
    if task == "embed":
        a, b = ours.embed(TEXTS), ref.embed(TEXTS)
        assert a.shape == b.shape and float((a * b).sum(1).mean()) > 0.95
        return
    inputs = {k: v.astype(np.int64) for k, v in ref.tokenizer(TEXTS, padding=True, return_tensors="np").items()}
    x, y = ours.engine.run(inputs)[0], ref.engine.run(inputs)[0]
    assert x.shape == y.shape and float(np.abs(x - y).max()) < 0.25 * float(np.abs(y).max()) + 0.05


def test_vocabulary_calibration_is_seeded_and_uses_no_special_tokens_inside(tmp_path_factory, tiny_tokenizer_dir):
    from encoderkit.inference.engines import vocabulary_batches
    from encoderkit.models.folder import ModelFolder

    folder = ModelFolder.open(make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed"))
    a, b = vocabulary_batches(folder), vocabulary_batches(folder)
    assert len(a) == 16 and all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True))
    tok = folder.tokenizer()
    special = set(tok.all_special_ids)
    lengths = {x["input_ids"].shape[1] for x in a}
    assert min(lengths) >= 8 and max(lengths) <= folder.max_length and len(lengths) > 4
    for x in a:
        assert (x["input_ids"][:, 0] == tok.cls_token_id).all() and (x["input_ids"][:, -1] == tok.sep_token_id).all()
        assert not special & set(np.unique(x["input_ids"][:, 1:-1]).tolist())


def test_default_calibration_is_half_vocabulary_half_builtin_prose(tmp_path_factory, tiny_tokenizer_dir):
    from encoderkit.data.builtin_corpus import stdlib_docstrings
    from encoderkit.inference.engines import _calibration_docs, default_calibration, vocabulary_batches
    from encoderkit.models.folder import ModelFolder

    folder = ModelFolder.open(make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed"))
    a, b = default_calibration(folder), default_calibration(folder)
    assert len(a) == 24 and all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True))
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a[:8], vocabulary_batches(folder, 64)))
    tok = folder.tokenizer()
    docs = {" ".join(tok.tokenize(d))[:40] for _, _, d in stdlib_docstrings()}
    rows = [" ".join(tok.convert_ids_to_tokens(row[1:][row[1:] != tok.pad_token_id][:-1].tolist()))
            for x in a[8:] for row in x["input_ids"]]
    real, spans = rows[:64], rows[64:]
    assert all(r[:40] in docs for r in real)  # texts of builtin:stdlib, tokenised as texts are
    # and 64 short spans of them (1-5 words), so that the shortest texts are calibrated for too
    every = [d for _, _, d in stdlib_docstrings()]
    taken = " ".join(tok.tokenize(" ".join(every[i] for i in _calibration_docs(len(every)))))
    assert len(spans) == 64 and all(s in taken for s in spans)
    assert sum(len(tok.tokenize(s)) <= 6 for s in spans) >= 4  # some as short as texts get


def test_without_nncf_the_error_names_the_install(tmp_path_factory, tiny_tokenizer_dir, monkeypatch):
    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    _without("nncf", monkeypatch)
    with pytest.raises(EncoderkitError,
                       match=r'openvino-int8 needs OpenVINO and NNCF .*pip install "encoderkit\[openvino\]"'):
        Predictor.load(folder, backend="openvino-int8")


def test_lengths_are_padded_to_a_few_shapes_and_outputs_cut_back(ov, tmp_path_factory, tiny_tokenizer_dir):
    """OpenVINO prepares kernels per input shape: token axes are padded (mask 0) to a multiple of 8, and a
    per-token output comes back at the caller's length with what ONNX Runtime computes on the unpadded rows."""
    from encoderkit.inference.engines import OPENVINO_LENGTH_STEP

    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "ner")
    ours = Predictor.load(folder, backend="openvino", threads=1)
    ref = Predictor.load(folder, backend="onnx-fp32", threads=1)
    for length in (3, 8, 11):
        ids = np.full((2, length), 5, dtype=np.int64)
        mask = np.ones_like(ids)
        mask[1, length - 1:] = 0
        feed = ours.engine._feed({"input_ids": ids, "attention_mask": mask})
        width = -(-length // OPENVINO_LENGTH_STEP) * OPENVINO_LENGTH_STEP
        assert feed["input_ids"].shape == feed["attention_mask"].shape == (2, width)
        assert feed["attention_mask"][:, length:].sum() == 0
        feed = {"input_ids": ids, "attention_mask": mask}
        (x,), (y,) = ours.engine.run(feed), ref.engine.run(feed)
        assert x.shape == y.shape == (2, length, y.shape[-1])
        np.testing.assert_allclose(x[mask.astype(bool)], y[mask.astype(bool)], atol=tolerance(ours))


def test_a_bent_openvino_int8_graph_is_refused_and_auto_falls_back(nncf, tmp_path_factory, tiny_tokenizer_dir,
                                                                   monkeypatch):
    """The static INT8 graph is checked against FP32 when it is made (cosine on check texts outside the calibration,
    kept beside it); below 0.99 mean / 0.95 min an explicit --backend openvino-int8 is an error naming the figures and
    --backend openvino, and auto runs OpenVINO's own graph instead, saying why."""
    from encoderkit import hardware
    from encoderkit.hardware import Hardware
    from encoderkit.inference import engines
    from encoderkit.inference.policy import resolve
    from encoderkit.models.folder import ModelFolder
    from tests.test_hardware import VNNI_NO_BF16

    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    graph, record = engines.openvino_int8_check(ModelFolder.open(folder))  # the real check, kept beside the graph
    assert record["ok"] and record["texts"] == 80 and record["min"] >= 0.95
    assert (graph.parent / engines.FIDELITY_FILE).is_file()
    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(VNNI_NO_BF16, threads=2))
    monkeypatch.setattr(engines, "openvino_ready", lambda: True)
    good = resolve(folder)
    assert good.backend == "openvino-int8" and "cosine to FP32 " in good.reason and "80 check texts" in good.reason

    real = engines.fidelity
    monkeypatch.setattr(engines, "CHECK_TEXTS", "bent")  # a new check (not the kept record), whose record says so

    def bent(folder, engine, *a, **k):  # the static INT8 graph (model.xml) bends; OpenVINO's own graph does not
        record = real(folder, engine, *a, **k)
        return {**record, "on": "bent", "mean": 0.98, "min": 0.5716, "ok": False} if engine.path.suffix == ".xml" \
            else record

    monkeypatch.setattr(engines, "fidelity", bent)
    figures = r"cosine to FP32 0\.9800 mean / 0\.5716 min on 80 check texts, below the 0\.99 mean / 0\.95 min kept"
    with pytest.raises(EncoderkitError, match=rf"bends its outputs \({figures}\), so it is refused; use --backend "
                                              "openvino"):
        Predictor.load(folder, backend="openvino-int8", threads=1)
    auto = Predictor.load(folder, threads=1)
    assert auto.backend == "openvino" and auto.choice.calibration is None
    assert re.search(rf"its static INT8 graph was refused for this folder \({figures}\)", auto.backend_reason)
