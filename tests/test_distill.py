"""Distillation: student built from the right teacher layers, loss components, training lowers the loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from encoderkit.compress.distill import DistillConfig, DistillLoss, LossWeights, hidden_cosine_loss
from encoderkit.compress.distill import run as distill
from encoderkit.compress.students import (
    build_student_from_teacher,
    check_same_tokenizer,
    parse_layer_map,
    soft_target_kl,
)
from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import load_model as load_task_model
from tests.conftest import WORDS, tiny_bert_config


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny 4-layer classifier whose logits are far from uniform (scaled head)."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    out = tmp_path_factory.mktemp("teacher")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(1)
    cfg = tiny_bert_config(len(tok), num_hidden_layers=4, num_labels=2, id2label={0: "0", 1: "1"},
                           label2id={"0": 0, "1": 1})
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight.mul_(40.0)
        model.classifier.bias.copy_(torch.tensor([1.5, -1.5]))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def train_tsv(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    lines = ["sentence\tlabel"]
    for i in range(64):
        n = int(torch.randint(3, 9, (1,), generator=g))
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=g)]
        lines.append(" ".join(words) + " \t" + str(i % 2))
    p = tmp_path_factory.mktemp("data") / "train.tsv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_layer_map_parsing():
    assert parse_layer_map("every-other", 6) == [0, 2, 4]
    assert parse_layer_map("every-other", 5) == [0, 2, 4]
    assert parse_layer_map("1,3", 4) == [1, 3]
    assert parse_layer_map([0, 5], 6) == [0, 5]
    with pytest.raises(EncoderkitError, match="do not exist"):
        parse_layer_map("0,6", 6)
    with pytest.raises(EncoderkitError, match="once"):
        parse_layer_map("1,1", 6)
    with pytest.raises(EncoderkitError, match="every-other"):
        parse_layer_map("first-half", 6)


def test_student_layers_are_exactly_the_chosen_teacher_layers(teacher_dir):
    teacher = load_task_model(teacher_dir)
    student = build_student_from_teacher(teacher, [1, 3])
    assert student.config.num_hidden_layers == 2
    t_state, s_state = teacher.state_dict(), student.state_dict()
    for s_idx, t_idx in enumerate([1, 3]):
        s_keys = [k for k in s_state if f"encoder.layer.{s_idx}." in k]
        assert s_keys
        for k in s_keys:
            assert torch.equal(s_state[k], t_state[k.replace(f"layer.{s_idx}.", f"layer.{t_idx}.")]), k
    # a student layer is not accidentally the teacher's same-index layer
    assert not torch.equal(s_state["bert.encoder.layer.0.attention.self.query.weight"],
                           t_state["bert.encoder.layer.0.attention.self.query.weight"])
    for k in ("bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight", "classifier.weight"):
        assert torch.equal(s_state[k], t_state[k])
    # the teacher is left untouched and the student owns its tensors
    student.bert.embeddings.word_embeddings.weight.data.add_(1.0)
    assert not torch.equal(student.bert.embeddings.word_embeddings.weight,
                           teacher.bert.embeddings.word_embeddings.weight)


def test_kl_is_zero_for_equal_logits_and_scaled_by_t_squared():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(8, 5, generator=g)
    s = torch.randn(8, 5, generator=g)
    assert soft_target_kl(t.clone(), t, 2.0).abs() < 1e-6
    assert soft_target_kl(s, t, 2.0) > 0
    # against the textbook formula: T^2 * mean_rows sum_c p_t (log p_t - log p_s)
    T = 3.0
    p_t = torch.softmax(t / T, -1)
    manual = (p_t * (torch.log_softmax(t / T, -1) - torch.log_softmax(s / T, -1))).sum(-1).mean() * T * T
    assert torch.allclose(soft_target_kl(s, t, T), manual, atol=1e-5)
    # shift invariance of softmax: adding a constant per row changes nothing
    assert soft_target_kl(t + 7.0, t, 2.0).abs() < 1e-5


def test_hidden_cosine_ignores_padding_and_scale():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 4, 8, generator=g)
    assert hidden_cosine_loss(3.0 * h, h).abs() < 1e-6
    other = h.clone()
    other[:, -1] = -h[:, -1]  # opposite direction, but only on padded positions
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    assert hidden_cosine_loss(other, h, mask).abs() < 1e-6
    assert hidden_cosine_loss(other, h) > 0.4  # 2 of 8 tokens at cos -1 -> mean 0.5


def test_distill_loss_parts_and_projection():
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, generator=g)
    h_t = torch.randn(4, 5, 16, generator=g)
    batch = {"attention_mask": torch.ones(4, 5, dtype=torch.long), "labels": torch.tensor([0, 1, 2, 0])}
    loss = DistillLoss(LossWeights(kl=1.0, hard=0.0, cos=1.0), student_width=8, teacher_width=16, mlm=False)
    assert loss.proj is not None and loss.proj.in_features == 8 and loss.proj.out_features == 16
    out_s = SimpleNamespace(logits=logits.clone(), hidden_states=(torch.randn(4, 5, 8, generator=g),))
    out_t = SimpleNamespace(logits=logits, hidden_states=(h_t,))
    total, parts = loss(out_s, out_t, batch)
    assert parts["kl"] == pytest.approx(0.0, abs=1e-6)
    assert "hard" not in parts and parts["cos"] > 0
    assert total.item() == pytest.approx(parts["cos"], rel=1e-5)
    total.backward()
    assert loss.proj.weight.grad is not None and loss.proj.weight.grad.abs().sum() > 0


def test_mlm_kl_counts_only_masked_positions():
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 6, 11, generator=g)
    s = t.clone()
    s[:, 0] += torch.randn(2, 11, generator=g)  # differs only where nothing is masked
    labels = torch.full((2, 6), -100)
    labels[:, 3] = 4
    loss = DistillLoss(LossWeights(kl=1.0, hard=0.0, cos=0.0), 8, 8, mlm=True)
    _, parts = loss(SimpleNamespace(logits=s), SimpleNamespace(logits=t), {"labels": labels})
    assert parts["kl"] == pytest.approx(0.0, abs=1e-6)


def _kl_on_data(student_dir: Path, teacher_dir: Path, tsv: Path) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    texts = [line.split("\t")[0] for line in tsv.read_text().splitlines()[1:]]
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        s = load_task_model(student_dir).eval()(**enc).logits
        t = load_task_model(teacher_dir).eval()(**enc).logits
    return float(soft_target_kl(s, t, 1.0))


def _initial_student(teacher_dir: Path, tmp_path: Path) -> Path:
    """A random 2-layer student with the teacher's tokenizer whose logits disagree with the teacher's."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    init = tmp_path / "init"
    teacher = load_task_model(teacher_dir)
    cfg = teacher.config.__class__.from_dict({**teacher.config.to_dict(), "num_hidden_layers": 2})
    torch.manual_seed(5)
    student = BertForSequenceClassification(cfg)
    with torch.no_grad():
        student.classifier.weight.copy_(-teacher.classifier.weight)
        student.classifier.bias.copy_(-teacher.classifier.bias)
    student.save_pretrained(init)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(init)
    return init


def test_task_distillation_lowers_the_kl_and_writes_a_card(teacher_dir, train_tsv, tmp_path):
    import json

    init = _initial_student(teacher_dir, tmp_path)
    out = tmp_path / "student"
    cfg = DistillConfig(teacher=str(teacher_dir), out=str(out), train=str(train_tsv), student=str(init), max_steps=40,
                        lr=3e-3, batch_size=16, hard_weight=0.0, cos_weight=0.1, warmup=0.0, bf16=False)
    res = distill(cfg)
    assert res.student_params < res.teacher_params
    before, after = _kl_on_data(init, teacher_dir, train_tsv), _kl_on_data(out, teacher_dir, train_tsv)
    assert after < 0.5 * before, (before, after)
    card = json.loads((out / "encoderkit.json").read_text())
    assert card["stage"] == "distill" and (out / card["parent"]).resolve() == teacher_dir.resolve()
    assert (out / card["config"]["student"]).resolve() == init.resolve()  # paths recorded relative to the folder
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary run folder left


def test_a_classifier_student_keeps_the_default_rate_when_none_is_given(teacher_dir, train_tsv, tmp_path):
    import json

    out = tmp_path / "student"
    distill(DistillConfig(teacher=str(teacher_dir), out=str(out), train=str(train_tsv), max_steps=1, batch_size=16,
                          bf16=False))
    # rerank: 3e-4 (test_distill_tasks)
    assert json.loads((out / "encoderkit.json").read_text())["config"]["lr"] == 1e-4
    with pytest.raises(EncoderkitError, match="lr must be >= 0"):
        DistillConfig(teacher=str(teacher_dir), out=str(out), train=str(train_tsv), lr=-1.0)


def test_tokenizer_mismatch_is_a_clear_error(teacher_dir, train_tsv, tmp_path):
    from transformers import BertTokenizerFast

    other = tmp_path / "other_student"
    other.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS))[::-1]]
    (other / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(other / "vocab.txt")).save_pretrained(other)
    with pytest.raises(EncoderkitError, match="different tokenizers"):
        check_same_tokenizer(teacher_dir, other)
    cfg = DistillConfig(teacher=str(teacher_dir), out=str(tmp_path / "s"), train=str(train_tsv), student=str(other),
                        max_steps=1)
    with pytest.raises(EncoderkitError, match="different tokenizers"):
        distill(cfg)
    assert not (tmp_path / "s").exists()


def test_agnostic_distillation_on_mlm_blocks(tiny_tokenizer_dir, tmp_path, monkeypatch):
    """DistilBERT mode: KL on masked positions + MLM + cosine; the loss falls on fixed blocks."""
    import numpy as np
    from transformers import AutoTokenizer, BertForMaskedLM

    from encoderkit.compress import distill as distill_mod

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    teacher = tmp_path / "mlm_teacher"
    torch.manual_seed(2)
    model = BertForMaskedLM(tiny_bert_config(len(tok), num_hidden_layers=4))
    with torch.no_grad():  # a teacher with a clear preference per token, so there is something to learn
        model.cls.predictions.bias.copy_(3.0 * torch.randn(len(tok), generator=torch.Generator().manual_seed(0)))
    model.save_pretrained(teacher)
    tok.save_pretrained(teacher)
    rng = np.random.default_rng(0)
    blocks = rng.integers(5, len(tok), size=(64, 16))
    blocks[:, 0], blocks[:, -1] = tok.cls_token_id, tok.sep_token_id
    monkeypatch.setattr(distill_mod, "load_blocks", lambda data: blocks)
    init = tmp_path / "init"
    torch.manual_seed(7)
    BertForMaskedLM(tiny_bert_config(len(tok), num_hidden_layers=2)).save_pretrained(init)
    tok.save_pretrained(init)
    cfg = DistillConfig(teacher=str(teacher), out=str(tmp_path / "s"), mode="agnostic", data="unused",
                        student=str(init),
                        max_steps=30, lr=3e-3, batch_size=16, warmup=0.0, bf16=False)
    res = distill(cfg)
    assert set(res.train_logs) >= {"kl", "hard", "cos"}
    assert res.steps == 30
    assert load_task_model(tmp_path / "s").config.num_hidden_layers == 2

    def kl(student_dir: Path) -> float:
        ids = torch.as_tensor(blocks[:32])
        with torch.no_grad():
            s = load_task_model(student_dir).eval()(input_ids=ids).logits
            t = load_task_model(teacher).eval()(input_ids=ids).logits
        return float(soft_target_kl(s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1]), 1.0))

    assert kl(tmp_path / "s") < 0.5 * kl(init)


def test_narrow_student_matches_hidden_states_through_a_projection(teacher_dir):
    from encoderkit.compress.distill import DistillModule, make_loss_fn
    from encoderkit.compress.students import build_narrow_student

    teacher = load_task_model(teacher_dir).eval()
    student = build_narrow_student(teacher, hidden_size=16, num_layers=2, generator_seed=0)
    assert student.config.hidden_size == 16 and student.config.num_hidden_layers == 2
    assert student.config.hidden_size % student.config.num_attention_heads == 0
    state = torch.random.get_rng_state()
    build_narrow_student(teacher, 16, 2, generator_seed=1)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is left as it was
    module = DistillModule(student,
                           DistillLoss(LossWeights(kl=1.0, hard=0.5, cos=1.0), 16, teacher.config.hidden_size,
                                       mlm=False))
    batch = {"input_ids": torch.tensor([[2, 10, 11, 3], [2, 12, 3, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
             "labels": torch.tensor([0, 1])}
    loss, parts = make_loss_fn(teacher, want_hidden=True)(module, batch)
    assert set(parts) == {"kl", "hard", "cos"} and torch.isfinite(loss)
    loss.backward()
    assert module.loss.proj.weight.grad is not None
    assert all(p.grad is None for p in teacher.parameters())


def test_task_batches_group_similar_lengths(teacher_dir, tmp_path):
    """Batches are length-bucketed: each holds rows of similar length, so little is padding."""
    import random

    from transformers import AutoConfig, AutoTokenizer

    from encoderkit.compress.distill import task_batches

    rng = random.Random(0)
    lines = (["sentence\tlabel"]
             + [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) + f"\t{i % 2}" for i in range(400)])
    tsv = tmp_path / "mixed.tsv"
    tsv.write_text("\n".join(lines) + "\n")
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    source, n, has_labels = task_batches(str(tsv), tok, AutoConfig.from_pretrained(teacher_dir), 8, 64, seed=0)
    assert n == 400 and has_labels
    batches = list(source(0, 0, 1))
    seen = sorted(int(b["labels"].shape[0]) for b in batches)
    assert sum(seen) == 400 and set(seen) == {8}
    padding = sum(float((b["attention_mask"] == 0).float().mean()) for b in batches) / len(batches)
    assert padding < 0.1  # random batches of lengths 1..40 words are ~40% padding
