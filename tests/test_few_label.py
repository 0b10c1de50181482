"""finetune --task classify's few-label route (encoderkit/train/few_label.py): taken automatically at a few examples
per class and not above, forced by --few-label, written as an ordinary classifier folder (predict, export, plain
transformers with the recorded pooling), and its bad input named."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from test_finetune import FILL, NEG, POS, _cfg, one_thread  # noqa: F401  (one_thread: autouse fixture)

from encoderkit.errors import EncoderkitError
from encoderkit.models.pooling import apply_pooling
from encoderkit.train import few_label
from encoderkit.train.finetune import run


def _balanced(path: Path, per_class: int, seed: int, labels: tuple[str, ...] = ("neg", "pos")) -> Path:
    rng = random.Random(seed)
    lines = ["sentence\tlabel"]
    for _ in range(per_class):
        for y in labels:
            words = rng.sample(FILL, 3) + [rng.choice(POS if y == "pos" else NEG)]
            rng.shuffle(words)
            lines.append(" ".join(words) + f"\t{y}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _card(out: Path) -> dict:
    return json.loads((out / "encoderkit.json").read_text())


def _quick(tmp_path, model, **kw):
    """A few pair rounds (the route) or a few steps (the standard route): the choice, not the learning, is tested."""
    return _cfg(tmp_path, model, task="classify", pair_iterations=1, max_steps=2, batch_size=4, **kw)


def test_auto_takes_the_route_at_few_labels_and_not_above(tmp_path, tiny_bert_dir):
    few = _balanced(tmp_path / "few.tsv", 6, 0)
    res = run(_quick(tmp_path, tiny_bert_dir, train=str(few), out=str(tmp_path / "few")))
    card = _card(res.out)
    assert card["few_label"]["pairs"] == 2 * 12  # one round: a positive and a negative pair per example
    assert card["task"] == "classify" and card["labels"] == ["neg", "pos"] and card["pooling"] == "mean"

    many = _balanced(tmp_path / "many.tsv", few_label.MAX_PER_CLASS + 1, 1)
    res = run(_quick(tmp_path, tiny_bert_dir, train=str(many), out=str(tmp_path / "many")))
    assert "few_label" not in _card(res.out)
    assert _card(res.out)["pooling"] == "first"  # the standard route's auto pooling, untouched


def test_the_flag_forces_the_route_on_and_off(tmp_path, tiny_bert_dir):
    few = _balanced(tmp_path / "few.tsv", 6, 0)
    res = run(_quick(tmp_path, tiny_bert_dir, train=str(few), out=str(tmp_path / "off"), few_label="off"))
    assert "few_label" not in _card(res.out)
    many = _balanced(tmp_path / "many.tsv", few_label.MAX_PER_CLASS + 1, 1)
    res = run(_quick(tmp_path, tiny_bert_dir, train=str(many), out=str(tmp_path / "on"), few_label="on"))
    assert _card(res.out)["few_label"]["pairs"] == 2 * 2 * (few_label.MAX_PER_CLASS + 1)
    with pytest.raises(EncoderkitError, match="--few-label on: .*not --task rerank"):
        run(_cfg(tmp_path, tiny_bert_dir, task="rerank", train=str(few), out=str(tmp_path / "rr"), few_label="on"))


def test_the_folder_learns_predicts_exports_and_loads_in_transformers(tmp_path, tiny_bert_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from encoderkit.inference.export import ExportConfig
    from encoderkit.inference.export import run as export
    from encoderkit.inference.predictor import Predictor

    train, dev = _balanced(tmp_path / "train.tsv", 8, 0), _balanced(tmp_path / "dev.tsv", 24, 1)
    res = run(_cfg(tmp_path, tiny_bert_dir, task="classify", train=str(train), dev=str(dev), pair_iterations=4))
    card = _card(res.out)
    assert "few_label" in card and card["hf_compatible"] is False and "mean pooling" in card["warning"]
    assert res.metrics["accuracy"] >= 0.75  # one sentiment word in four (chance: 0.5); a random tiny body
    rows = [line.split("\t") for line in dev.read_text().splitlines()[1:]]
    predictor = Predictor.load(res.out, backend="torch-fp32")
    labels = [g["label"] for g in predictor.classify([t for t, _ in rows])]
    assert np.mean([p == y for p, (_, y) in zip(labels, rows, strict=True)]) == pytest.approx(res.metrics["accuracy"])
    texts = ["a great fun story", "a dull and boring plot"]
    got = predictor.classify(texts)

    tok = AutoTokenizer.from_pretrained(res.out)
    model = apply_pooling(AutoModelForSequenceClassification.from_pretrained(res.out).eval())
    with torch.no_grad():
        logits = model(**tok(texts, return_tensors="pt", padding=True)).logits.softmax(-1).numpy()
    mine = np.asarray([[g["scores"][n] for n in ("neg", "pos")] for g in got])
    np.testing.assert_allclose(mine, logits, atol=1e-5)

    exported = export(ExportConfig(model=str(res.out), out=str(tmp_path / "onnx"))).out
    onnx = Predictor.load(exported, backend="onnx-fp32").classify(texts)
    np.testing.assert_allclose([[g["scores"][n] for n in ("neg", "pos")] for g in onnx], mine, atol=1e-4)

    from encoderkit.compress.quantize import QuantizeConfig
    from encoderkit.compress.quantize import run as quantize

    quantize(QuantizeConfig(model=str(res.out), out=str(tmp_path / "int8")))  # compression: dynamic INT8 weights
    small = Predictor.load(tmp_path / "int8", backend="torch-fp32").classify([t for t, _ in rows])
    assert np.mean([a["label"] == b for a, b in zip(small, labels, strict=True)]) >= 0.9


def test_first_pooling_gives_a_folder_plain_transformers_computes_the_same(tmp_path, tiny_bert_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from encoderkit.inference.predictor import Predictor

    train = _balanced(tmp_path / "train.tsv", 6, 0)
    res = run(_quick(tmp_path, tiny_bert_dir, train=str(train), pooling="first"))
    assert _card(res.out)["hf_compatible"] is True
    texts = ["a great fun story", "a dull and boring plot here"]
    tok = AutoTokenizer.from_pretrained(res.out)
    plain = AutoModelForSequenceClassification.from_pretrained(res.out).eval()
    with torch.no_grad():
        probs = plain(**tok(texts, return_tensors="pt", padding=True)).logits.softmax(-1).numpy()
    got = Predictor.load(res.out, backend="torch-fp32").classify(texts)
    np.testing.assert_allclose([[g["scores"][n] for n in ("neg", "pos")] for g in got], probs, atol=1e-5)


def test_head_is_the_regression_fitted_on_the_pooled_features():
    """Logistic regression by L-BFGS: the gradient of its objective is ~0 at the answer (a converged fit)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5))
    y = (x[:, 0] + 0.3 * rng.normal(size=40) > 0).astype(np.int64)
    w = few_label.fit_head(x, y, 2, c=1.0)
    wt = torch.tensor(w, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(torch.as_tensor(x) @ wt.T, torch.as_tensor(y)) + (wt * wt).sum() / 80
    loss.backward()
    assert float(wt.grad.abs().max()) < 1e-5
    assert ((x @ w.T).argmax(1) == y).mean() >= 0.9


def test_pairs_pair_each_example_within_and_across_classes():
    labels = ["a", "a", "b", "b", "b", "c", "c"]
    first, second, target = few_label.make_pairs(labels, 3, seed=0)
    assert len(first) == 2 * 3 * len(labels)
    same = np.asarray([labels[i] == labels[j] for i, j in zip(first, second, strict=True)])
    assert (same == (target == 1.0)).all() and (first != second).all()
    assert np.bincount(first, minlength=len(labels)).tolist() == [6] * len(labels)


def test_a_batch_encodes_each_text_once_and_its_loss_is_the_pairs_loss():
    """Pairs over 6 texts, 8 pairs a batch: every text once in the batch's rows, the indices give back each pair,
    and the module's loss equals the loss of the pairs encoded side by side (dropout off)."""
    from transformers import BertConfig, BertModel

    rows = [{"input_ids": np.arange(1, 3 + i, dtype=np.int64)} for i in range(6)]
    pairs = few_label.make_pairs(["a", "a", "a", "b", "b", "b"], 4, seed=0)
    batches = list(few_label.PairBatches(rows, pairs, 8, 0, seed=0)(0, 0, 1))
    assert len(batches) == len(pairs[0]) // 8
    body = BertModel(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16), add_pooling_layer=False).eval()
    module = few_label.PairModule(body, "mean")
    seen = []
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        texts = [tuple(ids[k][mask[k] == 1].tolist()) for k in range(len(ids))]
        assert len(set(texts)) == len(texts) < 16  # each distinct text once: fewer rows than the 16 sides
        assert [len(t) for t in texts] == sorted(len(t) for t in texts)  # shortest first: two passes pad less
        seen += [(texts[a], texts[b]) for a, b in zip(batch["a_index"], batch["b_index"], strict=True)]
        a = [{"input_ids": np.asarray(texts[k])} for k in batch["a_index"]]
        b = [{"input_ids": np.asarray(texts[k])} for k in batch["b_index"]]
        u, v = (module.embed(**few_label.encode_batch(side, 0)) for side in (a, b))
        expected = torch.nn.functional.mse_loss(torch.nn.functional.cosine_similarity(u, v), batch["target"])
        torch.testing.assert_close(module(**batch), expected)
    want = [(tuple(rows[i]["input_ids"].tolist()), tuple(rows[j]["input_ids"].tolist()))
            for i, j in zip(*pairs[:2], strict=True)]
    assert sorted(seen) == sorted(want)


def test_a_class_of_one_example_is_named_with_the_file(tmp_path, tiny_bert_dir):
    train = _balanced(tmp_path / "train.tsv", 4, 0)
    with train.open("a") as f:
        f.write("a lonely sentence\tneutral\n")
    with pytest.raises(EncoderkitError, match=r"train\.tsv: class 'neutral' has 1 example"):
        run(_quick(tmp_path, tiny_bert_dir, train=str(train)))
    assert not (tmp_path / "out").exists()


def test_a_dev_label_not_in_train_is_named_with_the_file(tmp_path, tiny_bert_dir):
    train = _balanced(tmp_path / "train.tsv", 4, 0)
    dev = _balanced(tmp_path / "dev.tsv", 2, 1, labels=("neg", "pos", "mixed"))
    with pytest.raises(EncoderkitError, match=r"dev\.tsv:\d+: label 'mixed' does not occur in the training data"):
        run(_quick(tmp_path, tiny_bert_dir, train=str(train), dev=str(dev)))
    assert not (tmp_path / "out").exists()
