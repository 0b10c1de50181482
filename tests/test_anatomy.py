"""One anatomy per encoder family (encoderkit/models/anatomy.py), and every torch lever through it.

Tiny ModernBERT (fused Wqkv, gated Wi, global and local attention layers) and DistilBERT classifiers, fine-tuned
2 steps on the tiny seeded data set of tests/families.py, go through head pruning, FFN pruning, then torch dynamic
INT8, GPTQ int4, QAT INT8 and QAT INT4; each result is evaluated, exported (parity-checked ONNX) and predicted
with. An FFN-pruned folder computes the same logits in plain transformers as in encoderkit; a head-pruned folder,
whose family's config cannot say fewer heads of the same size, says in its card how it loads, plain transformers
refuses it rather than computing something else, and encoderkit's loader computes what the original computes with
the removed heads' output columns zeroed. A family without an anatomy entry is refused naming the entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import families
from tests.families import cli_error, predict_records

bpe_tokenizer_dir, family_dir, tuned = families.bpe_tokenizer_dir, families.family_dir, families.tuned  # the fixtures

TEXTS = ["the python code", "a movie of love", "it was data", "the story of a film in the code"]


def _logits_plain(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(**tok(TEXTS, padding=True, return_tensors="pt")).logits


def _logits(folder: Path, model=None) -> torch.Tensor:
    from encoderkit.models.folder import ModelFolder

    f = ModelFolder.open(folder)
    tok = f.tokenizer()
    model = model if model is not None else f.load()
    with torch.no_grad():
        return model(**tok(TEXTS, padding=True, return_tensors="pt")).logits


# -- the anatomy itself ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", families.FAMILIES)
def test_every_family_has_an_anatomy_that_finds_its_parts(family) -> None:
    import transformers as tf

    from encoderkit.models.anatomy import anatomy_of

    class Tok:
        pad_token_id, cls_token_id, sep_token_id = 0, 1, 2

        def __len__(self) -> int:
            return 100

    config = families.tiny_config(family, Tok())
    model = tf.AutoModelForSequenceClassification.from_config(config)
    an = anatomy_of(model)
    blocks = an.blocks(model)
    assert len(blocks) == 2 and an.num_heads(config) == 4 and an.head_size(config) == 8 and an.ffn_size(config) == 64
    for block in blocks:
        up = block.get_submodule(an.ffn_up)
        assert up.out_features == (128 if an.gated else 64)  # a GLU holds input and gate halves
        assert block.get_submodule(an.ffn_down).in_features == 64
        assert block.get_submodule(an.attn_out).in_features == 32 and an.block_heads(block, 8) == 4
        rows = an.head_rows(block, [1], 8)
        assert sum(len(r) for r in rows.values()) == 24  # q, k and v rows of one head, fused or not
        for path in an.norms:
            assert isinstance(block.get_submodule(path), (torch.nn.LayerNorm, torch.nn.Identity))
    prefix = an.layer_prefix(model)
    assert any(n.startswith(prefix) for n, _ in model.named_parameters())
    assert (family == "modernbert") == (an.fused_qkv is not None) == an.gated


def test_a_family_without_an_anatomy_is_refused_naming_the_entry(tmp_path, tiny_tokenizer_dir, capsys) -> None:
    import transformers as tf

    from encoderkit.compress.prune import PruneConfig, prune
    from encoderkit.errors import EncoderkitError

    tok = tf.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = tf.AlbertConfig(vocab_size=len(tok), embedding_size=16, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=64, num_labels=2)
    folder = tmp_path / "albert"
    tf.AlbertForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    with pytest.raises(EncoderkitError, match=r"prune --method ffn: albert models are not supported "
                                              r"\(AlbertForSequenceClassification: .*ANATOMIES\['albert'\]"):
        prune(folder, PruneConfig(method="ffn", importance="magnitude", measure=False), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "calib.txt").write_text("\n".join(TEXTS) + "\n")
    err = cli_error(["quantize", "--model", str(folder), "--out", str(tmp_path / "q"), "--method", "gptq", "--bits",
                     "4", "--no-measure", "--calib-data", str(tmp_path / "calib.txt")], capsys)
    assert "ANATOMIES['albert']" in err and "quantize --method gptq --format torch" in err, err
    assert not (tmp_path / "q").exists()


# -- every lever on ModernBERT and DistilBERT ------------------------------------------------------
def _prune(folder: Path, out: Path, method: str) -> dict:
    from encoderkit.compress.prune import PruneConfig, prune

    rep = prune(folder, PruneConfig(method=method, amount=0.5, importance="taylor", calib_data=str(
        folder.parent / "train.tsv"), measure=False, batch_size=8), out)
    return rep.details


def _quantize(folder: Path, out: Path, method: str, bits: int) -> dict:
    from encoderkit.compress.quantize import QuantizeConfig, quantize

    train = str(folder.parent / "train.tsv")
    cfg = QuantizeConfig(method=method, bits=bits, group_size=16, measure=False, calib_samples=16, batch_size=8,
                         calib_data=train if method == "gptq" else "", train_data=train if method == "qat" else "",
                         qat_steps=2)
    return quantize(folder, cfg, out).details


def _serves(folder: Path, inputs: Path, tmp: Path, name: str) -> list[dict]:
    """Evaluate, export (parity-checked) and predict with ``folder``; returns its torch predictions."""
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate
    from encoderkit.inference.export import ExportConfig
    from encoderkit.inference.export import run as export

    metrics = evaluate(EvaluateConfig(model=str(folder), data=str(tmp / "train.tsv"))).metrics
    assert 0 <= metrics["accuracy"] <= 1
    exported = export(ExportConfig(model=str(folder), out=str(tmp / f"{name}-onnx")))
    assert exported.parity["fp32_max_abs_diff"] <= 1e-3
    onnx = predict_records(tmp / f"{name}-onnx", inputs, "onnx-fp32", tmp / f"{name}-onnx.jsonl")
    torch_ = predict_records(folder, inputs, "torch-fp32", tmp / f"{name}.jsonl")
    assert [r["label"] for r in onnx] == [r["label"] for r in torch_]
    for a, b in zip(onnx, torch_):
        np.testing.assert_allclose(families.numbers(a), families.numbers(b), atol=2e-3)
    return torch_


@pytest.mark.parametrize("family", ["modernbert", "distilbert"])
def test_every_lever_on_modernbert_and_distilbert(family, tuned, tmp_path) -> None:
    from encoderkit.models.folder import ModelFolder

    folder, inputs = tuned(family, "classify")
    (tmp_path / "train.tsv").write_text((folder.parent / "train.tsv").read_text())
    heads, ffn = tmp_path / "heads", tmp_path / "ffn"

    # heads: half of each block's heads gone, the kept ones compute what they did before
    details = _prune(folder, heads, "heads")
    assert details["heads_per_layer"] == [2, 2]
    assert "encoderkit only" in details["loads_with"]
    card = json.loads((heads / "report.json").read_text())
    assert "encoderkit only" in json.dumps(card)
    ref = ModelFolder.open(folder).load()
    from encoderkit.models.anatomy import anatomy_of

    an = anatomy_of(ref)
    with torch.no_grad():
        for block, kept in zip(an.blocks(ref), details["heads_kept"]):
            gone = [h for h in range(4) if h not in kept]
            block.get_submodule(an.attn_out).weight[:, an.head_columns(gone, 8)[an.attn_out]] = 0
    torch.testing.assert_close(_logits(heads), _logits(folder, ref), atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="mismatched_sizes"):  # plain transformers refuses, as the note says
        _logits_plain(heads)

    # FFN on top: half the neurons (both halves of ModernBERT's gated Wi) gone
    details = _prune(heads, ffn, "ffn")
    key = an.ffn_key
    assert details[key] == [64, 32]
    block = an.blocks(ModelFolder.open(ffn).load())[0]
    assert block.get_submodule(an.ffn_up).out_features == (64 if an.gated else 32)
    assert block.get_submodule(an.ffn_down).in_features == 32

    # FFN alone: plain transformers loads it and computes encoderkit's logits
    ffn_only = tmp_path / "ffn-only"
    _prune(folder, ffn_only, "ffn")
    torch.testing.assert_close(_logits_plain(ffn_only), _logits(ffn_only), atol=1e-5, rtol=1e-4)
    assert json.loads((ffn_only / "config.json").read_text())[key] == 32

    base = _serves(ffn, inputs, tmp_path, "ffn")
    for method, bits in (("dynamic", 8), ("gptq", 4), ("qat", 8), ("qat", 4)):
        out = tmp_path / f"{method}{bits}"
        details = _quantize(ffn, out, method, bits)
        config = json.loads((out / "config.json").read_text())["encoderkit_quantization"]
        assert config["bits"] == bits and config["method"] == method
        linears = 2 * (4 if an.fused_qkv else 6)  # per block: Wqkv, Wo, Wi, Wo, or q, k, v, out, lin1, lin2
        assert {m["bits"] for m in config["layers"].values()} == {bits} and len(config["layers"]) == linears
        if method == "qat":
            assert details["qat"]["steps"] == 2
        got = _serves(out, inputs, tmp_path, out.name)
        np.testing.assert_allclose([r["scores"][r["label"]] for r in got],
                                   [b["scores"][r["label"]] for b, r in zip(base, got)], atol=0.25)


def test_export_fuses_distilbert_attention_under_its_own_config_keys(family_dir, tmp_path) -> None:
    """DistilBERT's config.json names its heads ``n_heads`` and its width ``dim``. Export reads them through the
    anatomy, so onnxruntime's optimizer fuses every block's attention; with BERT's key names it got 0 for both, could
    not guess them from the graph, and fused none (the real DistilBERT of bench/family_stack.py ran unfused)."""
    import onnx
    from transformers import AutoConfig, AutoTokenizer, DistilBertForSequenceClassification

    from encoderkit.inference.export import export_onnx
    from encoderkit.models.anatomy import config_heads_hidden
    from encoderkit.models.folder import ONNX_FP32

    base, folder = family_dir("distilbert", headless=True), tmp_path / "clf"  # a plain HF classifier folder
    torch.manual_seed(0)
    DistilBertForSequenceClassification(AutoConfig.from_pretrained(base, num_labels=2)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert "num_attention_heads" not in config and config_heads_hidden(config) == (4, 32)
    (tmp_path / "onnx").mkdir()
    report = export_onnx(folder, tmp_path / "onnx", optimize=True)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "onnx" / ONNX_FP32)).graph.node]
    assert report["optimized"] and ops.count("Attention") == 2  # one per block
    assert report["fp32_max_abs_diff"] <= 1e-4


def test_a_narrow_distilbert_student_has_an_ffn_four_times_its_width() -> None:
    """``distill --hidden-size`` builds a student with an FFN 4x its width; DistilBERT names that size ``hidden_dim``,
    so setting ``intermediate_size`` (BERT's name) left the teacher's FFN in a narrower student."""
    import transformers as tf

    from encoderkit.compress.students import build_narrow_student
    from encoderkit.models.anatomy import anatomy_of

    teacher = tf.DistilBertForSequenceClassification(
        tf.DistilBertConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, hidden_dim=256, pad_token_id=0))
    student = build_narrow_student(teacher, 32, 1, 0)
    block = anatomy_of(student).blocks(student)[0]
    assert student.config.hidden_dim == 128 and block.ffn.lin1.out_features == 128 == block.ffn.lin2.in_features
    assert block.attention.q_lin.out_features == 32 and student.config.n_layers == 1
