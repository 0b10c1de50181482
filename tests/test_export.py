"""ONNX export: parity with eager PyTorch per task, dynamic shapes, INT8 copy, refusals."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from deploy_models import TASK_CLASSES, export_task_model, make_task_model, tiny_root

from encoderkit.cli import main
from encoderkit.errors import EncoderkitError
from encoderkit.inference.export import OUTPUT_NAMES, ExportConfig, ort_session, run, torch_outputs
from encoderkit.models.card import read_card
from encoderkit.models.folder import ModelFolder


@pytest.mark.parametrize("task", list(TASK_CLASSES))
def test_export_matches_pytorch_on_new_shapes(task, tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    root = tiny_root(tmp_path_factory)
    out = export_task_model(root, tiny_tokenizer_dir, task)
    card = read_card(out)
    assert card["task"] == task and card["stage"] == "export"
    assert card["metrics"]["fp32_max_abs_diff"] < 1e-4
    assert (out / "model.onnx").is_file() and (out / "model.int8.onnx").is_file()
    # a batch size and sequence length the trace never saw: the axes must be dynamic
    tok = AutoTokenizer.from_pretrained(out)
    texts = ["good"] * 4 + ["the story of a man who said that he had a great time with his data and code " * 3]
    enc = tok(texts, padding=True, return_tensors="np")
    inputs = {k: v.astype(np.int64) for k, v in enc.items()}
    src = ModelFolder.open(make_task_model(root, tiny_tokenizer_dir, task))
    assert src.task == ModelFolder.open(out).task == task
    ref = torch_outputs(src.load(task=task), task, inputs)
    got = ort_session(out / "model.onnx").run(OUTPUT_NAMES[task], inputs)
    mask = inputs["attention_mask"].astype(bool)
    for r, g in zip(ref, got, strict=True):
        assert g.shape == r.shape
        if r.ndim >= 2 and r.shape[1] == mask.shape[1]:
            r, g = r[mask], g[mask]
        np.testing.assert_allclose(g, r, atol=1e-4)
    int8 = ort_session(out / "model.int8.onnx").run(OUTPUT_NAMES[task], inputs)
    assert max(float(np.abs(a - b).max()) for a, b in zip(int8, got, strict=True)) > 0  # really a different graph
    quality = card["metrics"].get("int8_mean_cosine", 1 - card["metrics"].get("int8_max_prob_diff", 1))
    assert quality > 0.9


def test_fused_graph_is_quantized_with_int8_attention(tmp_path_factory, tiny_tokenizer_dir):
    """With --optimize, INT8 quantises the fused graph: its Attention becomes QAttention (Q, K, V in int8), the
    faster route (bench/embed_peers.py); the card says which route the graph took."""
    import onnx

    out = export_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")  # exported with --optimize
    card = read_card(out)
    ops = {n.op_type for n in onnx.load(str(out / "model.int8.onnx")).graph.node}
    fp32_ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert "Attention" in fp32_ops  # the optimizer fused it
    assert card["metrics"]["int8_graph"] == "fused-then-quantized"
    assert "QAttention" in ops and "Attention" not in ops


def test_export_fails_beyond_tolerance(tmp_path_factory, tiny_tokenizer_dir, tmp_path):
    src = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    with pytest.raises(EncoderkitError, match="differs from PyTorch"):
        run(ExportConfig(model=str(src), out=str(tmp_path / "out"), tolerance=1e-12))
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_cli_refuses_wrong_task_and_mlm_folders(tmp_path_factory, tiny_tokenizer_dir, tmp_path, capsys):
    import json

    import torch
    from conftest import tiny_bert_config
    from transformers import BertForMaskedLM

    src = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    wrong = tmp_path / "wrong"
    shutil.copytree(src, wrong)
    card = json.loads((wrong / "encoderkit.json").read_text())
    card["task"] = "ner"
    (wrong / "encoderkit.json").write_text(json.dumps(card))
    assert main(["export", "--model", str(wrong), "--out", str(tmp_path / "o1")]) == 2
    assert "needs a *ForTokenClassification head" in capsys.readouterr().err

    mlm = tmp_path / "mlm"
    torch.manual_seed(0)
    BertForMaskedLM(tiny_bert_config(200)).save_pretrained(mlm)
    assert main(["export", "--model", str(mlm), "--out", str(tmp_path / "o2")]) == 2
    assert "'mlm' model" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_corrupt_onnx_is_refused(tmp_path_factory, tiny_tokenizer_dir, tmp_path, capsys):
    from encoderkit.inference.predictor import Predictor

    out = export_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    data = (broken / "model.onnx").read_bytes()
    (broken / "model.onnx").write_bytes(data[: len(data) // 3])
    with pytest.raises(EncoderkitError, match="not a valid ONNX model"):
        Predictor.load(broken, backend="onnx-fp32")
    (tmp_path / "in.txt").write_text("good movie\n")
    rc = main(["predict", "--model", str(broken), "--input", str(tmp_path / "in.txt"), "--output",
               str(tmp_path / "out.jsonl"), "--backend", "onnx-fp32"])
    assert rc == 2 and "re-create it with encoderkit export" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_an_int8_graph_beyond_its_parity_leaves_the_fp32_graph_usable(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """The engines' cached export makes both graphs at once; an INT8 graph that fails its parity check is dropped
    with its reason kept, so --backend onnx-fp32 (and auto) still run and onnx-int8 is refused naming the reason
    (before: the FP32 graph failed with it)."""
    from encoderkit.inference import export
    from encoderkit.inference.predictor import Predictor

    folder = make_task_model(tmp_path, tiny_tokenizer_dir, "classify")
    calls = iter(range(100))  # the INT8 graph's probabilities and PyTorch's made to differ by up to 1
    monkeypatch.setattr(export, "_probs", lambda logits, multi: np.full(logits.shape, float(next(calls) % 2)))
    fp32 = Predictor.load(folder, backend="onnx-fp32", threads=1)
    assert fp32.classify(["a short text"])[0]["label"]
    with pytest.raises(EncoderkitError, match=r"probabilities differ from PyTorch by up to .*--backend onnx-int8 is "
                                              r"refused for this folder; use --backend onnx-fp32"):
        Predictor.load(folder, backend="onnx-int8", threads=1)
