"""Prune lever on a tiny classifier: exact sparsity patterns, physically removed heads / neurons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from encoderkit.compress.packing import load_model
from encoderkit.compress.prune import PruneConfig, magnitude_masks, prune, semi_structured_masks, sparsity
from encoderkit.errors import EncoderkitError
from tests.conftest import WORDS, tiny_bert_config

TEXTS = [" ".join(WORDS[(i * 5 + j * 7) % len(WORDS)] for j in range(5 + i % 7)) for i in range(40)]


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification

    out = tmp_path_factory.mktemp("tiny_cls_prune")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    BertForSequenceClassification(tiny_bert_config(len(tok), num_labels=2)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def train_tsv(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "train.tsv"
    p.write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(TEXTS)))
    return p


def _cfg(**kw) -> PruneConfig:
    return PruneConfig(measure=False, batch_size=8, **kw)


def _linear_weights(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters()
            if ".encoder.layer." in n and n.endswith("weight") and p.dim() == 2}


def _logits(folder: Path, model=None) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return (model or load_model(folder))(**tok(TEXTS[:8], padding=True, return_tensors="pt")).logits


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_magnitude_masks_hit_the_exact_amount(tiny_classifier, scope) -> None:
    model = load_model(tiny_classifier)
    masks = magnitude_masks(model, 0.3, scope)
    total = sum(m.numel() for m in masks.values())
    if scope == "layer":
        for m in masks.values():
            assert int((m == 0).sum()) == int(0.3 * m.numel())
    else:
        assert int(sum((m == 0).sum() for m in masks.values())) == int(0.3 * total)
        # global: every zeroed weight is no larger than every kept one
        w = _linear_weights(model)
        zeroed = torch.cat([w[n + ".weight"].abs()[m == 0] for n, m in masks.items()])
        kept = torch.cat([w[n + ".weight"].abs()[m == 1] for n, m in masks.items()])
        assert zeroed.max() <= kept.min()


def test_two_four_pattern_survives_recovery(tiny_classifier, train_tsv, tmp_path) -> None:
    rep = prune(tiny_classifier, _cfg(method="2:4", recovery_data=str(train_tsv), recovery_steps=3), tmp_path / "p")
    model = load_model(tmp_path / "p")  # the packed weights unpacked (tests/test_sparse_pack.py: exactly)
    for name, w in _linear_weights(model).items():
        nz = (w != 0).view(w.shape[0], -1, 4).sum(-1)
        assert (nz <= 2).all(), name
    assert rep.details["recovery"]["steps"] == 3
    assert "no speed" in rep.details["speedup"] or "none on CPU" in rep.details["speedup"]
    assert abs(rep.details["sparsity"] - 0.5) < 0.01
    assert semi_structured_masks(model)  # still a valid 2:4 model


def test_unstructured_prune_stores_fewer_bytes(tiny_classifier, tmp_path) -> None:
    rep = prune(tiny_classifier, _cfg(method="magnitude", amount=0.6, scope="layer"), tmp_path / "u")
    assert abs(sparsity(load_model(tmp_path / "u")) - 0.6) < 0.01
    assert rep.after["weight_bytes"] < rep.before["weight_bytes"]  # the pruned matrices are stored packed
    packed = rep.details["packed"]  # 40% of the values plus a 1-bit mask: under half the dense bytes
    assert packed["packed_bytes"] < 0.5 * packed["dense_bytes"] and packed["bytes_per_nonzero"] < 4.5
    assert rep.after["nonzero_params"] < rep.before["nonzero_params"]


def test_gradual_magnitude_follows_the_cubic_schedule(tiny_classifier, train_tsv, tmp_path) -> None:
    cfg = _cfg(method="magnitude", amount=0.5, scope="global", schedule="gradual", recovery_data=str(train_tsv),
               recovery_steps=4)
    rep = prune(tiny_classifier, cfg, tmp_path / "g")
    stages = [s["sparsity"] for s in rep.details["recovery"]["stages"]]
    assert stages == sorted(stages) and len(stages) == 4 and stages[-1] == 0.5
    assert abs(sparsity(load_model(tmp_path / "g")) - 0.5) < 0.005


@pytest.mark.parametrize("importance", ["magnitude", "taylor"])
def test_heads_are_physically_removed_and_reload(tiny_classifier, tmp_path, importance) -> None:
    out = tmp_path / "h"
    rep = prune(tiny_classifier, _cfg(method="heads", amount=0.5, importance=importance), out, calib=TEXTS)
    model = load_model(out)
    for layer in model.bert.encoder.layer:
        att = layer.attention
        assert att.self.query.weight.shape == (16, 32) and att.self.value.weight.shape == (16, 32)
        assert att.output.dense.weight.shape == (32, 16)
    assert rep.details["heads_per_layer"] == [2, 2]
    assert json.loads((out / "config.json").read_text())["encoderkit_heads"] == rep.details["heads_kept"]
    assert rep.after["params"] < rep.before["params"]
    # the kept heads compute what they computed before: zeroing the removed heads' value rows in
    # the original model gives the same logits
    ref = load_model(tiny_classifier)
    with torch.no_grad():
        for layer, kept in zip(ref.bert.encoder.layer, rep.details["heads_kept"]):
            for h in set(range(4)) - set(kept):
                layer.attention.self.value.weight[h * 8:(h + 1) * 8] = 0
                layer.attention.self.value.bias[h * 8:(h + 1) * 8] = 0
    torch.testing.assert_close(_logits(out), _logits(tiny_classifier, ref), atol=1e-5, rtol=1e-4)


def test_ffn_neurons_removed_and_plain_transformers_reloads(tiny_classifier, tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification

    rep = prune(tiny_classifier, _cfg(method="ffn", amount=0.25, importance="magnitude"), tmp_path / "f")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "f")
    assert model.config.intermediate_size == 48
    for layer in model.bert.encoder.layer:
        assert layer.intermediate.dense.weight.shape == (48, 32) and layer.output.dense.weight.shape == (32, 48)
    assert rep.after["weight_bytes"] < rep.before["weight_bytes"]
    assert _logits(tmp_path / "f").shape == (8, 2)


def test_bad_inputs_are_clear_errors(tiny_classifier, tmp_path) -> None:
    for amount in (1.0, -0.1):
        with pytest.raises(EncoderkitError, match=r"\[0, 1\)"):
            PruneConfig(amount=amount)
    with pytest.raises(EncoderkitError, match="not one of"):
        PruneConfig(method="random")
    with pytest.raises(EncoderkitError, match="calib-data"):
        prune(tiny_classifier, _cfg(method="heads", importance="taylor"), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.gpu
def test_two_four_runs_on_semi_structured_kernels() -> None:
    if not torch.cuda.is_available():
        pytest.skip("2:4 semi-structured kernels need a CUDA GPU")
    from transformers import BertForSequenceClassification

    from encoderkit.compress.prune import to_semi_structured_gpu

    torch.manual_seed(0)  # kernel shape limits: sizes multiple of 64
    model = BertForSequenceClassification(tiny_bert_config(256, hidden_size=128, intermediate_size=256)).eval()
    with torch.no_grad():
        for name, mask in semi_structured_masks(model).items():
            model.get_submodule(name).weight.mul_(mask)
    dense = BertForSequenceClassification(model.config).eval()
    dense.load_state_dict(model.state_dict())
    dense = dense.half().cuda()
    model = model.half().cuda()
    assert to_semi_structured_gpu(model) == 12
    x = torch.randint(5, 250, (32, 64), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, dense(input_ids=x).logits, atol=2e-2, rtol=2e-2)


def test_calibration_and_recovery_read_inputs_at_the_models_max_length_by_default(tiny_classifier, tmp_path,
                                                                                  monkeypatch) -> None:
    """seq_len 0 (the default) is the folder's max length, the length it serves at; a set seq_len is kept."""
    import shutil

    import encoderkit.compress.prune as prune_module
    import encoderkit.compress.quantize as quantize_module
    from encoderkit.compress.quantize import QuantizeConfig, quantize
    from encoderkit.models.folder import ModelFolder

    folder = tmp_path / "served-at-48"
    shutil.copytree(tiny_classifier, folder)
    tok_cfg = folder / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({**json.loads(tok_cfg.read_text()), "model_max_length": 48}))
    served = ModelFolder.open(folder, tokenizer=False).max_length
    assert served == 48  # not the old fixed 128: the test tells them apart
    seen: list[int] = []
    for module in (prune_module, quantize_module):
        real = module.text_batches
        monkeypatch.setattr(module, "text_batches", lambda tok, texts, seq_len, bs, real=real: seen.append(seq_len)
                            or real(tok, texts, seq_len, bs))
    prune(folder, _cfg(method="ffn", amount=0.25), tmp_path / "a", calib=TEXTS)
    prune(folder, _cfg(method="ffn", amount=0.25, seq_len=16), tmp_path / "b", calib=TEXTS)
    quantize(folder, QuantizeConfig(measure=False, calib_samples=8, method="gptq", bits=4, group_size=16),
             tmp_path / "c", calib=TEXTS)
    assert seen == [served, 16, served]
