"""The compression levers tests/test_anatomy.py does not run, on tiny ModernBERT and DistilBERT classifiers
(issue 54, item 2: every lever on every family), each through the entry point a user calls (the CLI in-process,
or the stage's ``run(Config)``):

- static INT8 (ORT QDQ, calibrated) and ONNX dynamic INT8 after a parity-checked export;
- weight-only RTN int4 and int8, GPTQ int8;
- magnitude (unstructured) and 2:4 pruning with recovery, written as packed sparse weights;
- distillation to fewer layers (depth);
- vocabulary trimming to the task's tokens.

Each cell asserts the lever did its thing as the folder and its report record it (bits, sparsity, packed bytes,
layers, vocabulary), that the result loads and predicts, and, where the folder's config states its shape (depth
and vocabulary), that plain transformers computes encoderkit's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import families
from tests.families import predict_records
from tests.test_anatomy import _logits, _logits_plain

bpe_tokenizer_dir, family_dir, tuned = families.bpe_tokenizer_dir, families.family_dir, families.tuned  # the fixtures

FAMILIES = ("modernbert", "distilbert")
LEVERS = ("static-int8", "rtn-4", "rtn-8", "gptq-8", "magnitude", "2:4", "distill-depth", "vocab", "onnx-int8")
LAYERS_KEY = {"modernbert": "num_hidden_layers", "distilbert": "n_layers"}


def _cli(argv: list[str]) -> None:
    from encoderkit.cli import main

    assert main(argv) == 0, argv


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())["details"]


def _close_to_base(base: list[dict], got: list[dict], atol: float) -> None:
    """Each record's probability of its own label, against the parent's probability of that label."""
    assert len(got) == len(base) > 0
    np.testing.assert_allclose([r["scores"][r["label"]] for r in got],
                               [b["scores"][r["label"]] for b, r in zip(base, got)], atol=atol)


def _block_linears(model) -> dict[str, torch.nn.Linear]:
    from encoderkit.models.anatomy import anatomy_of

    an = anatomy_of(model)
    prefix = an.layer_prefix(model)
    return {n: m for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, torch.nn.Linear)}


def _weight_only(family: str, folder: Path, train: Path, out: Path, method: str, bits: int) -> None:
    from encoderkit.compress.quantize import QuantizeConfig
    from encoderkit.compress.quantize import run as quantize

    quantize(QuantizeConfig(model=str(folder), out=str(out), method=method, bits=bits, group_size=16, measure=False,
                            calib_samples=16, batch_size=8, calib_data=str(train) if method == "gptq" else ""))
    info = json.loads((out / "config.json").read_text())["encoderkit_quantization"]
    linears = 2 * (4 if family == "modernbert" else 6)  # per block: Wqkv, Wo, Wi, Wo, or q, k, v, out, lin1, lin2
    assert info["method"] == method and info["bits"] == bits
    assert len(info["layers"]) == linears and {m["bits"] for m in info["layers"].values()} == {bits}


def _sparse(family: str, folder: Path, train: Path, out: Path, method: str) -> None:
    from encoderkit.compress.prune import PruneConfig
    from encoderkit.compress.prune import run as prune
    from encoderkit.models.folder import ModelFolder
    from encoderkit.models.sparse import SPARSE_FILE

    scope = {"scope": "layer"} if method == "magnitude" else {}
    prune(PruneConfig(model=str(folder), out=str(out), method=method, amount=0.6, measure=False,
                      recovery_data=str(train), recovery_steps=2, batch_size=8, seq_len=16, **scope))
    details = _report(out)
    assert details["recovery"], details  # the recovery fine-tuning ran
    packed = details["packed"]
    assert (out / SPARSE_FILE).is_file() and not (out / "model.safetensors").exists()
    assert packed["packed_bytes"] <= 0.6 * packed["dense_bytes"] and packed["bytes_per_nonzero"] <= 4.5  # fp32 + index
    assert json.loads((out / "encoderkit.json").read_text())["loads_with"].startswith("encoderkit only")
    linears = _block_linears(ModelFolder.open(out).load())
    assert len(linears) == 2 * (4 if family == "modernbert" else 6)
    zeros = sum(int((m.weight == 0).sum()) for m in linears.values())
    total = sum(m.weight.numel() for m in linears.values())
    if method == "2:4":  # every group of 4 input columns keeps at most 2 weights, through recovery
        assert details["sparsity"] == pytest.approx(0.5, abs=0.01)
        for name, m in linears.items():
            assert int((m.weight.reshape(-1, 4) != 0).sum(-1).max()) <= 2, name
        assert zeros / total >= 0.5
    else:
        assert details["sparsity"] == pytest.approx(0.6, abs=0.02) and zeros / total >= 0.59


def _distill_depth(family: str, folder: Path, train: Path, out: Path) -> None:
    from encoderkit.compress.distill import DistillConfig
    from encoderkit.compress.distill import run as distill

    result = distill(DistillConfig(teacher=str(folder), out=str(out), mode="task", train=str(train), layers="1",
                                   max_steps=2, batch_size=4, seq_len=16))
    assert result.steps == 2 and result.layers == [1] and result.student_params < result.teacher_params
    assert json.loads((out / "config.json").read_text())[LAYERS_KEY[family]] == 1
    torch.testing.assert_close(_logits_plain(out), _logits(out), atol=1e-5, rtol=1e-4)


def _vocab(folder: Path, train: Path, out: Path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    from tests import test_anatomy

    _cli(["prune", "--model", str(folder), "--out", str(out), "--method", "vocab", "--vocab-data", str(train),
          "--no-measure"])
    old, new = _report(out)["vocab_size"]
    assert new < old and json.loads((out / "config.json").read_text())["vocab_size"] == new
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == new
    sentences = [line.split("\t")[0] for line in train.read_text().splitlines()[1:]]
    gone = sorted(set(families.TOPICS) - {w for s in sentences for w in s.split()})
    if gone:  # a word the task's data never uses now reads as [UNK]
        assert tok(gone[0], add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    # the task's sentences keep their tokens, renumbered: the parent's logits, in plain transformers too
    monkeypatch.setattr(test_anatomy, "TEXTS", sentences[:8])
    torch.testing.assert_close(_logits(out), _logits(folder), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(_logits_plain(out), _logits(out), atol=1e-5, rtol=1e-4)


def _onnx_int8(folder: Path, train: Path, out: Path, method: str, tmp: Path) -> None:
    """Export with the parity check, then ``quantize --method static`` or ``--method dynamic --format onnx``."""
    import onnx

    from encoderkit.inference.export import ExportConfig
    from encoderkit.inference.export import run as export
    from encoderkit.models.folder import ONNX_INT8

    exported = export(ExportConfig(model=str(folder), out=str(tmp / "onnx")))
    assert exported.parity["fp32_max_abs_diff"] <= 1e-3
    fmt = [] if method == "static" else ["--format", "onnx"]
    _cli(["quantize", "--model", str(folder), "--out", str(out), "--method", method, *fmt, "--calib-data", str(train),
          "--calib-samples", "16", "--batch-size", "8", "--no-measure"])
    details = _report(out)
    assert details["runtime"] == "onnxruntime" and details["output_rel_error"] < 0.2, details
    ops = {n.op_type for n in onnx.load(str(out / ONNX_INT8)).graph.node}
    assert ("QuantizeLinear" in ops) if method == "static" else ("DynamicQuantizeLinear" in ops or
                                                                  "MatMulInteger" in ops), ops


@pytest.mark.parametrize(("family", "lever"), [pytest.param(f, lv, id=f"{f}-{lv}") for f in FAMILIES for lv in LEVERS])
def test_lever_on_family(family, lever, tuned, tmp_path, monkeypatch) -> None:
    folder, inputs = tuned(family, "classify")
    train, out = folder.parent / "train.tsv", tmp_path / "out"
    base = predict_records(folder, inputs, "torch-fp32", tmp_path / "base.jsonl")
    backend, atol = "torch-fp32", 1e-4
    if lever in ("rtn-4", "rtn-8", "gptq-8"):
        method, bits = lever.split("-")
        _weight_only(family, folder, train, out, method, int(bits))
        atol = 0.25 if bits == "4" else 0.05
    elif lever in ("magnitude", "2:4"):
        _sparse(family, folder, train, out, lever)
        atol = 1.0  # pruned and retrained: well-formed predictions are what is asked
    elif lever == "distill-depth":
        _distill_depth(family, folder, train, out)
        atol = 1.0
    elif lever == "vocab":
        _vocab(folder, train, out, monkeypatch)
        atol = 0.05  # the predict inputs hold words the task's data never uses: [UNK] now
    else:
        _onnx_int8(folder, train, out, "static" if lever == "static-int8" else "dynamic", tmp_path)
        backend, atol = "onnx-int8", 0.1
    got = predict_records(out, inputs, backend, tmp_path / "got.jsonl")
    assert [sorted(r["scores"]) for r in got] == [sorted(r["scores"]) for r in base]
    for r in got:
        assert abs(sum(r["scores"].values()) - 1) < 1e-4
    _close_to_base(base, got, atol)
