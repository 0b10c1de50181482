"""The masked-only MLM head against the full head, and loading encoders with/without a head."""

from __future__ import annotations

import pytest
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.models.load import build_encoder, load_encoder
from encoderkit.models.mlm import MaskedOnlyMLM, evaluate_mlm, full_head_loss
from encoderkit.models.presets import build_config
from tests.conftest import tiny_bert_config


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 24), generator=g)
    attention = torch.ones_like(ids)
    attention[2, 18:] = 0  # one padded row: the mask must reach the encoder
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[2, 18:] = -100
    return ids, attention, labels


@pytest.mark.parametrize("arch", ["bert", "modernbert", "deberta"])
def test_masked_only_loss_and_grads_equal_full_head(arch: str) -> None:
    config = build_config(None, 120, 64, layers=2, hidden=32, heads=4, ffn=64, arch=arch, dropout=0.0,
                          special_ids={"pad": 0, "cls": 2, "sep": 3})
    model = build_encoder(config, seed=0)
    if arch == "modernbert":
        model.sparse_prediction = False  # the reference is the full (B, L, V) head
    ids, attention, labels = _batch(120)
    full = full_head_loss(model, ids, labels, attention)
    full.backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    loss, _correct, count = MaskedOnlyMLM(model)(ids, labels, attention)
    loss.backward()
    assert count.item() == int((labels != -100).sum())
    assert torch.allclose(loss, full, atol=1e-5), (loss.item(), full.item())
    for name, grad in full_grads.items():
        assert torch.allclose(model.get_parameter(name).grad, grad, atol=1e-5), name


def test_wrapper_keeps_standard_state_dict_and_loads_in_transformers(tmp_path) -> None:
    from transformers import AutoModelForMaskedLM, BertForMaskedLM

    model = BertForMaskedLM(tiny_bert_config(100)).eval()
    mlm = MaskedOnlyMLM(model)
    assert set(mlm.state_dict()) == {f"model.{k}" for k in model.state_dict()}  # parts are not registered twice
    model.save_pretrained(tmp_path)
    again = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ids, attention, labels = _batch(100, seed=1)
    batch = [{"input_ids": ids, "attention_mask": attention, "labels": labels}]
    assert (evaluate_mlm(MaskedOnlyMLM(again), batch)["loss"]
            == pytest.approx(evaluate_mlm(mlm, batch)["loss"], abs=1e-6))


def test_evaluate_mlm_weights_by_tokens_and_counts_accuracy() -> None:
    model = tiny_masked_lm()
    ids, attention, labels = _batch(100, seed=2)
    metrics = evaluate_mlm(MaskedOnlyMLM(model), [{"input_ids": ids, "attention_mask": attention, "labels": labels}])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    picked = labels != -100
    expected_acc = (logits.argmax(-1)[picked] == labels[picked]).float().mean().item()
    assert metrics["accuracy"] == pytest.approx(expected_acc)
    assert metrics["perplexity"] == pytest.approx(torch.tensor(metrics["loss"]).exp().item(), rel=1e-5)


def tiny_masked_lm():
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(tiny_bert_config(100)).eval()


def test_load_encoder_adds_a_tied_fresh_head(tiny_bert_dir) -> None:
    model = load_encoder(tiny_bert_dir)
    assert type(model).__name__ == "BertForMaskedLM"
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    assert torch.count_nonzero(model.cls.predictions.bias) == 0
    transform = model.cls.predictions.transform
    assert 0.01 < transform.dense.weight.std().item() < 0.03  # BERT init, not left uninitialised
    assert torch.all(transform.LayerNorm.weight == 1)
    # the encoder weights are the saved ones
    from transformers import BertModel

    plain = BertModel.from_pretrained(tiny_bert_dir)
    assert torch.equal(plain.encoder.layer[0].attention.self.query.weight,
                       model.bert.encoder.layer[0].attention.self.query.weight)


def test_load_encoder_errors(tiny_bert_dir, tmp_path) -> None:
    with pytest.raises(EncoderkitError, match="tokenizer has 100000 tokens"):
        load_encoder(tiny_bert_dir, vocab_size=100000)
    with pytest.raises(EncoderkitError, match="beyond the model's 128 positions"):
        load_encoder(tiny_bert_dir, seq_len=256)
    with pytest.raises(EncoderkitError, match="no config.json"):
        load_encoder(tmp_path)


def test_build_encoder_is_seeded_and_leaves_global_rng_alone() -> None:
    config = build_config("tiny", 100, 64)
    state = torch.get_rng_state()
    a, b = build_encoder(config, seed=3), build_encoder(config, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(EncoderkitError, match="not divisible"):
        build_config(None, 100, 64, layers=2, hidden=30, heads=4, ffn=64)
