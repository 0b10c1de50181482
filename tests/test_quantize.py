"""Quantize lever on a tiny classifier: real int8 / packed int4 bytes, reload and predict, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from encoderkit.compress.packing import QUANT_FILE, load_model
from encoderkit.compress.quantize import QuantizeConfig, quantize
from encoderkit.errors import EncoderkitError
from tests.conftest import WORDS, tiny_bert_config

TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 9)) for i in range(48)]


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification

    out = tmp_path_factory.mktemp("tiny_cls")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    BertForSequenceClassification(tiny_bert_config(len(tok), num_labels=2)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return load_model(folder)(**tok(TEXTS[:8], padding=True, return_tensors="pt")).logits


def _cfg(**kw) -> QuantizeConfig:
    return QuantizeConfig(measure=False, calib_samples=32, **kw)


@pytest.mark.parametrize(("method", "bits", "dtype", "packed"), [("dynamic", 8, torch.int8, False),
                                                                ("rtn", 4, torch.uint8, True),
                                                                ("gptq", 4, torch.uint8, True)])
def test_quantized_folder_stores_low_bit_weights_and_predicts(tiny_classifier, tmp_path, method, bits, dtype,
                                                              packed) -> None:
    out = tmp_path / "q"
    rep = quantize(tiny_classifier, _cfg(method=method, bits=bits, group_size=16), out, calib=TEXTS)
    assert not (out / "model.safetensors").exists()  # plain transformers must not load it silently
    with safe_open(str(out / QUANT_FILE), "pt") as f:
        keys = set(f.keys())
        q = f.get_tensor("bert.encoder.layer.0.intermediate.dense.weight.qweight")  # (64, 32) fp32 originally
    assert q.dtype == dtype and q.shape == ((64, 16) if packed else (64, 32))
    assert "bert.encoder.layer.0.intermediate.dense.weight" not in keys
    assert rep.after["weight_bytes"] < rep.before["weight_bytes"]
    cfg = json.loads((out / "config.json").read_text())["encoderkit_quantization"]
    assert cfg["method"] == method and cfg["layers"]["bert.encoder.layer.1.output.dense.weight"]["bits"] == bits
    ref, got = _logits(tiny_classifier), _logits(out)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert (got - ref).abs().max() < (0.05 if bits == 8 else 0.5)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert json.loads((out / "encoderkit.json").read_text())["stage"] == "quantize"


def test_gptq_folder_is_closer_to_fp32_than_rtn(tiny_classifier, tmp_path) -> None:
    ref = _logits(tiny_classifier)
    errs = {}
    for method in ("rtn", "gptq"):
        quantize(tiny_classifier, _cfg(method=method, bits=4, group_size=16), tmp_path / method, calib=TEXTS)
        errs[method] = float((_logits(tmp_path / method) - ref).pow(2).mean())
    assert errs["gptq"] < errs["rtn"], errs


def test_int4_embeddings_shrink_the_file(tiny_classifier, tmp_path) -> None:
    a = quantize(tiny_classifier, _cfg(method="rtn", bits=4, group_size=16), tmp_path / "a", calib=TEXTS)
    b = quantize(tiny_classifier, _cfg(method="rtn", bits=4, group_size=16, embeddings="int4"), tmp_path / "b",
                 calib=TEXTS)
    vocab, hidden = 153, 32
    assert a.after["weight_bytes"] - b.after["weight_bytes"] >= vocab * hidden * 4 * 0.7
    with safe_open(str(tmp_path / "b" / QUANT_FILE), "pt") as f:
        assert f.get_tensor("bert.embeddings.word_embeddings.weight.qweight").dtype == torch.uint8


def test_refuses_already_quantized_model(tiny_classifier, tmp_path) -> None:
    quantize(tiny_classifier, _cfg(method="dynamic"), tmp_path / "q")
    with pytest.raises(EncoderkitError, match="already quantized"):
        quantize(tmp_path / "q", _cfg(method="dynamic"), tmp_path / "qq")
    assert not (tmp_path / "qq").exists()


def test_bad_settings_are_clear_errors(tiny_classifier, tmp_path) -> None:
    with pytest.raises(EncoderkitError, match="not one of"):
        QuantizeConfig(method="awq")
    with pytest.raises(EncoderkitError, match="bits=4"):
        QuantizeConfig(method="dynamic", bits=4)
    with pytest.raises(EncoderkitError, match="fallback_layers needs ONNX"):
        QuantizeConfig(method="dynamic", fallback_layers=2)  # the torch format
    with pytest.raises(EncoderkitError, match="calib-data"):  # the sensitivity is measured on calibration inputs
        quantize(tiny_classifier, _cfg(method="dynamic", format="onnx", fallback_layers=2), tmp_path / "d")
    assert not (tmp_path / "d").exists()
    with pytest.raises(EncoderkitError, match="calib-data"):
        quantize(tiny_classifier, _cfg(method="gptq"), tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_qat_trains_through_fake_quant_and_stores_int8(tiny_classifier, tmp_path) -> None:
    data = tmp_path / "train.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(TEXTS)))
    rep = quantize(tiny_classifier, _cfg(method="qat", train_data=str(data), qat_steps=4, batch_size=8, lr=1e-3),
                   tmp_path / "qat")
    assert rep.details["qat"]["steps"] == 4 and rep.details["qat"]["kd_alpha"] == 0.5
    pure = quantize(tiny_classifier, _cfg(method="qat", train_data=str(data), qat_steps=2, batch_size=8, kd_alpha=1.0),
                    tmp_path / "qat-kd")
    assert pure.details["qat"]["kd_alpha"] == 1.0  # the fp32 model's logits only
    with pytest.raises(EncoderkitError, match="kd_alpha"):
        _cfg(method="qat", kd_alpha=1.5)
    with safe_open(str(tmp_path / "qat" / QUANT_FILE), "pt") as f:
        q = f.get_tensor("bert.encoder.layer.1.attention.self.query.weight.qweight")
    assert q.dtype == torch.int8
    trained = load_model(tmp_path / "qat").bert.encoder.layer[1].attention.self.query.weight
    original = load_model(tiny_classifier).bert.encoder.layer[1].attention.self.query.weight
    assert not torch.allclose(trained, original, atol=1e-4)  # the fine-tuning moved the weights


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"method": "dynamic", "format": "onnx"},
                                {"method": "dynamic", "format": "onnx", "fallback_layers": 2},
                                {"method": "static", "calib_method": "minmax", "fallback_layers": 2},
                                {"method": "static", "calib_method": "percentile", "batch_size": 8}])
def test_onnx_int8(tiny_classifier, tmp_path, kw) -> None:
    import onnx
    import onnxruntime as ort
    from transformers import AutoTokenizer

    out = tmp_path / "o"
    rep = quantize(tiny_classifier, QuantizeConfig(measure=True, calib_samples=32, **kw), out, calib=TEXTS)
    graph = onnx.load(str(out / "model.int8.onnx")).graph
    assert any(t.data_type == onnx.TensorProto.INT8 for t in graph.initializer)
    ops = {n.op_type for n in graph.node}
    assert ("DynamicQuantizeLinear" in ops) if kw["method"] == "dynamic" else ("QuantizeLinear" in ops)
    assert rep.details["output_rel_error"] < 0.3  # a broken graph is ~1; random tiny weights clip more
    assert rep.after["latency"]["runtime"].startswith("onnxruntime") and rep.after["latency"]["batch32"]["ms"] > 0
    if kw.get("fallback_layers"):  # the excluded nodes really stay fp32: no int8 weight feeds them
        assert len(rep.details["fp32_nodes"]) == 2
        names = set(rep.details["fp32_nodes"])
        kept = {n.name: n for n in graph.node if n.name in names}
        assert kept.keys() == names and all(n.op_type in ("MatMul", "Gemm") for n in kept.values())
        produced_by = {o: n.op_type for n in graph.node for o in n.output}
        floats = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
        assert all(any(i in floats for i in n.input) for n in kept.values())  # its weight stays fp32
        assert not any(produced_by.get(i) == "DynamicQuantizeLinear" for n in kept.values() for i in n.input)
        quantized = sum(n.op_type in ("MatMulInteger", "QLinearMatMul") or n.op_type in ("MatMul", "Gemm") and any(
            produced_by.get(i) == "DequantizeLinear" for i in n.input) for n in graph.node)
        assert quantized >= 2  # the others are still quantized
    tok = AutoTokenizer.from_pretrained(out)
    sess = ort.InferenceSession(str(out / "model.int8.onnx"), providers=["CPUExecutionProvider"])
    enc = tok(TEXTS[:4], padding=True, return_tensors="np")
    got = sess.run(None, {i.name: enc[i.name].astype("int64") for i in sess.get_inputs()})[0]
    assert got.shape == (4, 2)
    with pytest.raises(EncoderkitError, match="already quantized"):
        quantize(out, QuantizeConfig(measure=False), tmp_path / "again")


def test_onnx_int4_word_embeddings(tiny_classifier, tmp_path) -> None:
    """embeddings=int4 on ONNX: the word-embedding Gather becomes packed uint4 blocks
    (GatherBlockQuantized), the folder shrinks, and the model still predicts like INT8 alone."""
    import onnx
    import onnxruntime as ort
    from transformers import AutoTokenizer

    from encoderkit.compress.onnx_embeddings import dequantize_uint4, uint4_blocks

    w = np.random.default_rng(0).normal(size=(10, 64)).astype(np.float32)
    codes, scale, zero = uint4_blocks(w, 16)
    assert codes.max() <= 15 and scale.dtype == np.float16
    back = dequantize_uint4(codes, scale, zero, 16)
    step = scale.astype(np.float32).repeat(16, axis=1)
    assert (np.abs(back - w) <= step * 0.51 + 1e-6).all()  # round to nearest: within half a step

    outs = {}
    for emb in ("fp32", "int4"):
        outs[emb] = tmp_path / emb
        quantize(tiny_classifier,
                 QuantizeConfig(method="dynamic", format="onnx", embeddings=emb, group_size=16, measure=False),
                 outs[emb], calib=TEXTS)
    graph = onnx.load(str(outs["int4"] / "model.int8.onnx")).graph
    node = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    packed = next(t for t in graph.initializer if t.name == node.input[0])
    vocab, hidden = packed.dims
    assert hidden == 32 and vocab > 100
    # two codes a byte
    assert packed.data_type == onnx.TensorProto.UINT4 and len(packed.raw_data) == vocab * hidden // 2
    assert not any(t.name.startswith("bert.embeddings.word_embeddings.weight") and t.data_type == onnx.TensorProto.FLOAT
                   for t in graph.initializer if t.name != node.input[2])
    size = {k: (v / "model.int8.onnx").stat().st_size for k, v in outs.items()}
    assert size["fp32"] - size["int4"] >= vocab * hidden * 0.4  # uint8 -> uint4 + fp16 scales per 16 columns
    tok = AutoTokenizer.from_pretrained(outs["int4"])
    enc = tok(TEXTS[:8], padding=True, return_tensors="np")
    logits = {}
    for k, v in outs.items():
        sess = ort.InferenceSession(str(v / "model.int8.onnx"), providers=["CPUExecutionProvider"])
        logits[k] = sess.run(None, {i.name: enc[i.name].astype("int64") for i in sess.get_inputs()})[0]
    assert np.abs(logits["int4"] - logits["fp32"]).max() < 0.5
    assert (logits["int4"].argmax(-1) == logits["fp32"].argmax(-1)).mean() >= 0.75
    with pytest.raises(EncoderkitError, match="group-size"):
        QuantizeConfig(method="dynamic", format="onnx", embeddings="int4", group_size=48)


def test_cli_quantize_and_prune(tiny_classifier, tmp_path, capsys) -> None:
    from encoderkit.cli import main

    assert main(["quantize", "--model", str(tiny_classifier), "--out", str(tmp_path / "q"), "--method", "rtn",
                 "--bits", "4", "--group-size", "16", "--no-measure"]) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["encoderkit_quantization"]["bits"] == 4
    assert main(["prune", "--model", str(tiny_classifier), "--out", str(tmp_path / "p"), "--method", "ffn",
                 "--amount", "0.5", "--importance", "magnitude", "--no-measure"]) == 0
    assert json.loads((tmp_path / "p" / "config.json").read_text())["intermediate_size"] == 32
    assert main(["prune", "--model", str(tiny_classifier), "--out", str(tmp_path / "x"), "--amount", "1"]) == 2
    assert "[0, 1)" in capsys.readouterr().err


def test_head_pruned_model_quantizes_and_reloads(tiny_classifier, tmp_path) -> None:
    from encoderkit.compress.prune import PruneConfig, prune

    prune(tiny_classifier, PruneConfig(method="heads", amount=0.5, importance="magnitude", measure=False),
          tmp_path / "h")
    quantize(tmp_path / "h", _cfg(method="gptq", bits=4, group_size=16), tmp_path / "hq", calib=TEXTS)
    model = load_model(tmp_path / "hq")
    assert model.bert.encoder.layer[0].attention.self.query.weight.shape == (16, 32)
    ref, got = _logits(tmp_path / "h"), _logits(tmp_path / "hq")
    assert (got - ref).abs().max() < 0.5 and (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_head_and_ffn_pruned_model_goes_through_onnx_int8(tiny_classifier, tmp_path) -> None:
    """The planner puts head pruning before ONNX INT8: the smaller attention must survive the export."""
    import onnx

    from encoderkit.compress.prune import PruneConfig, prune

    prune(tiny_classifier, PruneConfig(method="heads", amount=0.5, importance="magnitude", measure=False),
          tmp_path / "h")
    prune(tmp_path / "h", PruneConfig(method="ffn", amount=0.5, importance="magnitude", measure=False), tmp_path / "hf")
    rep = quantize(tmp_path / "hf", QuantizeConfig(method="dynamic", format="onnx", measure=False), tmp_path / "q",
                   calib=TEXTS)
    graph = onnx.load(str(tmp_path / "q" / "model.int8.onnx")).graph
    shapes = {tuple(t.dims) for t in graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert (32, 16) in shapes and (32, 32) in shapes  # Q/K/V: 2 of 4 heads kept; FFN 64 -> 32
    assert rep.details["output_rel_error"] < 0.3


def test_qat_simulation_matches_the_torch_int8_runtime() -> None:
    """FakeQuantLinear trains against what the INT8 runtime computes: per-channel INT8 weights and
    dynamic activations with the x86 kernels' reduced range (0..127)."""
    from encoderkit.compress.quantize import FakeQuantLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(4, 10, 64) * 3
    ref = lin(x)
    simulated = FakeQuantLinear(lin)(x)
    runtime = torch.ao.quantization.quantize_dynamic(
        torch.nn.Sequential(lin), {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig},
        dtype=torch.qint8)(x)
    gap = (simulated - runtime).abs().mean() / (ref - runtime).abs().mean()
    assert gap < 0.4  # far closer to the runtime than fp32 is (with 0..255 activations it was 1.2: further)
