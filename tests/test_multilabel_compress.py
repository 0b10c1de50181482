"""Compression of a multi-label classifier (a sigmoid per label, config.json ``problem_type:
multi_label_classification``): distillation, recovery, pruning's self-target loss and the INT8 export
parity use each label's sigmoid, not one softmax over the labels (blind to a shift of all logits)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_finetune import one_thread  # noqa: F401 -- the autouse fixture: tiny models run on one thread

from encoderkit.compress.distill import DistillConfig, DistillLoss, LossWeights
from encoderkit.compress.distill import run as distill
from encoderkit.compress.recovery import output_kd, recover, self_target_loss
from encoderkit.compress.students import is_multi_label, sigmoid_target_loss, soft_target_kl
from tests.conftest import WORDS, tiny_bert_config

LABELS = ["film", "love", "tech"]
SHIFT = 5.0  # added to every logit of the student: a softmax cannot see it, each label's sigmoid does


def _folder(path: Path, tokenizer_dir: Path, shift: float = 0.0) -> Path:
    """A tiny multilabel BERT (3 labels, scaled head) with its tokenizer and card; ``shift`` added to every logit."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    from encoderkit.models.card import write_card

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(3)
    cfg = tiny_bert_config(len(tok), num_labels=3, id2label=dict(enumerate(LABELS)),
                           label2id={n: i for i, n in enumerate(LABELS)}, problem_type="multi_label_classification")
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight.mul_(20.0)
        model.classifier.bias.copy_(torch.tensor([1.0, -1.0, 0.0]) + shift)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    write_card(path, "finetune", None, {}, task="multilabel", labels=LABELS, text_column="text", label_column="labels")
    return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return _folder(tmp_path_factory.mktemp("ml_teacher"), tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def shifted_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The teacher with every logit raised by SHIFT: the same softmax, other label probabilities."""
    return _folder(tmp_path_factory.mktemp("ml_shifted"), tiny_tokenizer_dir, shift=SHIFT)


@pytest.fixture(scope="module")
def train_tsv(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    lines = ["text\tlabels"]
    for i in range(32):
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (5,), generator=g)]
        lines.append(" ".join(words) + "\t" + LABELS[i % 3] + ("|" + LABELS[(i + 1) % 3] if i % 2 else ""))
    p = tmp_path_factory.mktemp("ml_data") / "train.tsv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_sigmoid_loss_is_zero_for_equal_logits_and_sees_a_shift():
    t = torch.tensor([[3.0, 3.0, -3.0]])
    s = torch.tensor([[8.0, 8.0, 2.0]])  # label 3: probability 0.05 -> 0.88, the same softmax
    assert soft_target_kl(s, t, 1.0).abs() < 1e-6
    assert sigmoid_target_loss(t.clone(), t, 2.0).abs() < 1e-6
    assert sigmoid_target_loss(s, t, 1.0) > 0.5
    # against each label's Bernoulli KL(p_t || p_s), T^2-scaled, averaged over rows and labels
    g = torch.Generator().manual_seed(0)
    t, s, T = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), 2.0
    p, q = torch.sigmoid(t / T), torch.sigmoid(s / T)
    manual = (p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()).mean() * T * T
    assert torch.allclose(sigmoid_target_loss(s, t, T), manual, atol=1e-5)
    assert sigmoid_target_loss(torch.zeros(0, 3), torch.zeros(0, 3), 2.0) == 0


def test_multi_label_is_read_from_the_config():
    from transformers import BertConfig

    assert is_multi_label(SimpleNamespace(config=BertConfig(problem_type="multi_label_classification")))
    assert is_multi_label({"problem_type": "multi_label_classification"})
    assert not is_multi_label(BertConfig(problem_type="single_label_classification"))
    assert not is_multi_label(BertConfig()) and not is_multi_label({})


def test_distill_loss_switches_on_multi_label_and_drops_the_hard_part():
    t = torch.tensor([[3.0, 3.0, -3.0], [1.0, -2.0, 0.5]])
    s = t + SHIFT
    batch = {"attention_mask": torch.ones(2, 4, dtype=torch.long), "labels": torch.tensor([0, 1])}
    w = LossWeights(kl=1.0, hard=0.5, cos=0.0, temperature=2.0)
    _, parts = DistillLoss(w, 32, 32, mlm=False)(SimpleNamespace(logits=s), SimpleNamespace(logits=t), batch)
    assert parts["kl"] < 1e-5 and "hard" in parts  # single-label: unchanged
    loss, parts = DistillLoss(w, 32, 32, mlm=False, multi_label=True)(SimpleNamespace(logits=s),
                                                                      SimpleNamespace(logits=t), batch)
    assert set(parts) == {"kl"} and torch.allclose(loss, sigmoid_target_loss(s, t, 2.0))
    assert parts["kl"] > 0.5


def test_distilling_a_multilabel_teacher_uses_the_sigmoid_loss(teacher_dir, shifted_dir, train_tsv, tmp_path):
    """The student starts as the teacher with every logit shifted: softmax KL 0 on every batch, so a
    logged loss well above 0 is the sigmoid loss."""
    from encoderkit.models.folder import ModelFolder

    teacher = ModelFolder.open(teacher_dir).load(frozen=True)
    student = ModelFolder.open(shifted_dir).load(frozen=True)
    assert is_multi_label(teacher) and is_multi_label(student)
    enc = ModelFolder.open(teacher_dir).tokenizer()(["the movie was great", "python code"], padding=True,
                                                    return_tensors="pt")
    with torch.no_grad():
        t, s = teacher(**enc).logits, student(**enc).logits
    assert soft_target_kl(s, t, 2.0) < 1e-4 and sigmoid_target_loss(s, t, 2.0) > 0.5
    res = distill(DistillConfig(teacher=str(teacher_dir), out=str(tmp_path / "student"), train=str(train_tsv),
                                student=str(shifted_dir), max_steps=1, lr=1e-9, batch_size=16, hard_weight=0.5,
                                cos_weight=0.0, warmup=0.0, bf16=False))
    assert res.train_logs["kl"] > 0.5, res.train_logs
    assert "hard" not in res.train_logs  # a label set is not one class id


def test_recovery_and_importance_losses_use_each_labels_sigmoid(teacher_dir, shifted_dir, train_tsv):
    t = torch.tensor([[3.0, 3.0, -3.0]])
    s = (t + SHIFT).requires_grad_()
    mask = torch.ones(1, 4, dtype=torch.long)
    assert output_kd(SimpleNamespace(logits=s), SimpleNamespace(logits=t), mask, 2.0) < 1e-5  # single-label: as before
    kd = output_kd(SimpleNamespace(logits=s), SimpleNamespace(logits=t), mask, 2.0, multi_label=True)
    assert torch.allclose(kd, sigmoid_target_loss(s, t, 2.0)) and kd > 0.5
    # importance: BCE to the model's own decisions (sigmoid >= 0.5), a non-zero gradient
    x = torch.tensor([[2.0, -1.0, 0.0]], requires_grad=True)
    loss = self_target_loss(SimpleNamespace(logits=x), mask, multi_label=True)
    assert torch.allclose(loss, F.binary_cross_entropy_with_logits(x, torch.tensor([[1.0, 0.0, 1.0]])))
    loss.backward()
    assert x.grad.abs().sum() > 0
    y = torch.tensor([[2.0, -1.0, 0.0]])
    assert torch.equal(self_target_loss(SimpleNamespace(logits=y), mask), F.cross_entropy(y, y.argmax(-1)))

    from encoderkit.compress.task_data import read_task_inputs
    from encoderkit.models.folder import ModelFolder

    folder = ModelFolder.open(teacher_dir)
    model, teacher = ModelFolder.open(shifted_dir).load(), folder.load(frozen=True)
    inputs = read_task_inputs(str(train_tsv), "multilabel", folder=teacher_dir)
    inputs = type(inputs)(inputs.texts, [0] * len(inputs.texts), inputs.source)  # class ids would be wrong here
    cfg = SimpleNamespace(lr=1e-9, batch_size=16, seed=0, seq_len=32, kd_alpha=0.5, temperature=2.0)
    log = recover(model, teacher, folder.tokenizer(), inputs, cfg, {}, 1, [])
    assert log["kd_alpha"] == 1.0 and log["last"]["kd"] > 0.5, log  # softmax KL would be 0


def test_export_compares_each_labels_sigmoid(teacher_dir, tmp_path):
    from encoderkit.inference.export import (
        _probs,
        _run_graph,
        _sample_inputs,
        export_onnx,
        ort_session,
        torch_outputs,
    )
    from encoderkit.models.folder import ModelFolder

    logits = np.array([[3.0, 3.0, -3.0]])
    assert np.allclose(_probs(logits, multi_label=True), 1 / (1 + np.exp(-logits)))
    assert np.allclose(_probs(logits).sum(-1), 1.0)  # single-label: a softmax, as before

    info = ModelFolder.open(teacher_dir)
    out = tmp_path / "onnx"
    out.mkdir()
    report = export_onnx(info, out, int8=True)
    inputs = _sample_inputs(info.tokenizer(), info)
    ref = torch_outputs(info.load(task=info.task, attn="eager", frozen=True), info.task, inputs)[0]
    got = _run_graph(ort_session(out / "model.int8.onnx"), ["logits"], inputs)[0]
    sigmoid_diff = float(np.abs(_probs(got, True) - _probs(ref, True)).max())
    softmax_diff = float(np.abs(_probs(got) - _probs(ref)).max())
    assert report["int8_max_prob_diff"] == pytest.approx(sigmoid_diff, rel=1e-5, abs=1e-7)
    assert sigmoid_diff != pytest.approx(softmax_diff, rel=1e-3)
