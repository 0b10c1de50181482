"""One figure whichever way a folder is run: ``evaluate`` equals the Predictor's outputs + scoring
(exactly on torch fp32, within tolerance on ONNX), and a classify folder written with the defaults
gives plain transformers' ``pipeline`` the same labels as encoderkit."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_finetune import _conll, _evaluate, _tsv, one_thread  # noqa: F401  (one_thread: autouse fixture)

from encoderkit.cli import main
from encoderkit.inference.predictor import Predictor
from encoderkit.metrics.scores import classification_scores, entity_scores
from encoderkit.tasks.ner.data import read_ner
from encoderkit.tasks.ner.features import split_words


def _rows(tsv: Path) -> tuple[list[str], list[str]]:
    rows = [line.split("\t") for line in tsv.read_text().splitlines()[1:]]
    return [r[0] for r in rows], [r[1] for r in rows]


def _finetune(*args: str) -> None:
    assert main(["finetune", *args, "--batch-size", "16", "--lr", "3e-3", "--seed", "0"]) == 0


@pytest.fixture(scope="module")
def st_like_base(tmp_path_factory, tiny_bert_dir) -> Path:
    """The tiny BERT dressed as a mean-pooled sentence-transformers folder (as MiniLM is): the case where
    classify used to pick mean pooling, which plain transformers does not reproduce."""
    base = tmp_path_factory.mktemp("st") / "base"
    shutil.copytree(tiny_bert_dir, base)
    (base / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                    "type": "sentence_transformers.models.Transformer"},
                                                   {"idx": 1, "name": "1", "path": "1_Pooling",
                                                    "type": "sentence_transformers.models.Pooling"}]))
    (base / "1_Pooling").mkdir()
    (base / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                                "pooling_mode_cls_token": False}))
    return base


@pytest.mark.slow  # fine-tunes and exports a tiny model
def test_classify_defaults_agree_with_the_transformers_pipeline_and_evaluate_equals_predict(
        tmp_path, st_like_base, capsys):
    from transformers import pipeline

    train, dev = _tsv(tmp_path / "train.tsv", 160, 0), _tsv(tmp_path / "dev.tsv", 48, 1)
    out = tmp_path / "clf"
    _finetune("--model", str(st_like_base), "--task", "classify", "--train", str(train), "--out", str(out),
              "--max-steps", "40")
    assert "new classification head: 2 weights initialised" in capsys.readouterr().err  # not transformers' LOAD REPORT
    card = json.loads((out / "encoderkit.json").read_text())
    assert card["pooling"] == "first" and card["hf_compatible"] is True
    texts, gold = _rows(dev)

    hf = pipeline("text-classification", model=str(out), device=-1)(texts, batch_size=8)
    torch_pred = Predictor.load(out, backend="torch-fp32").classify(texts)
    assert [h["label"] for h in hf] == [p["label"] for p in torch_pred]
    np.testing.assert_allclose([h["score"] for h in hf], [p["score"] for p in torch_pred], atol=1e-5)

    names = card["labels"]
    figure = _evaluate(out, dev)["accuracy"]
    scored = classification_scores([names.index(g) for g in gold], [names.index(p["label"]) for p in torch_pred], 2)
    assert 0.5 < figure < 1.0 or figure == 1.0  # a trained head, not a constant answer
    assert scored["accuracy"] == figure  # exactly: the same features, the same model, the same metric
    assert (classification_scores([names.index(g) for g in gold], [names.index(h["label"]) for h in hf], 2)["accuracy"]
            == figure)

    assert main(["export", "--model", str(out), "--out", str(tmp_path / "onnx")]) == 0
    onnx_pred = Predictor.load(tmp_path / "onnx", backend="onnx-fp32").classify(texts)
    onnx_acc = classification_scores([names.index(g) for g in gold], [names.index(p["label"]) for p in onnx_pred],
                                     2)["accuracy"]
    assert onnx_acc == pytest.approx(figure, abs=1 / len(texts))  # at most one near-tie may flip


def test_mean_pooling_on_request_is_recorded_as_not_hf_compatible(tmp_path, st_like_base, capsys):
    train = _tsv(tmp_path / "train.tsv", 32, 0)
    out = tmp_path / "mean"
    _finetune("--model", str(st_like_base), "--task", "classify", "--train", str(train), "--out", str(out),
              "--max-steps", "1", "--pooling", "mean")
    card = json.loads((out / "encoderkit.json").read_text())
    assert card["pooling"] == "mean" and card["hf_compatible"] is False and "OTHER outputs" in card["warning"]
    assert "WARNING: mean pooling: plain transformers" in capsys.readouterr().err


@pytest.mark.slow  # fine-tunes and exports a tiny model
def test_ner_evaluate_equals_predictor_entities_scored(tmp_path, tiny_bert_dir):
    train, dev = (_conll(tmp_path / "train.conll", 120, random.Random(0), "B"),
                  _conll(tmp_path / "dev.conll", 30, random.Random(1), "B"))
    out = tmp_path / "ner"
    _finetune("--model", str(tiny_bert_dir), "--task", "ner", "--train", str(train), "--out", str(out),
              "--max-steps", "30", "--max-length", "16", "--stride", "4")
    figure = _evaluate(out, dev)["f1"]
    assert figure > 0.1  # entities are found: the comparison below is not between two zeros
    sents = read_ner(dev)
    texts = [" ".join(s.words) for s in sents]

    def scored(entities: list[list[dict]]) -> float:
        pred = []
        for text, ents in zip(texts, entities, strict=True):
            _, spans = split_words(text)
            tags = ["O"] * len(spans)
            for e in ents:
                inside = [i for i, (a, b) in enumerate(spans) if a >= e["start"] and b <= e["end"]]
                for j, i in enumerate(inside):
                    tags[i] = ("B-" if j == 0 else "I-") + e["label"]
            pred.append(tags)
        return entity_scores([s.tags for s in sents], pred)["f1"]

    assert scored(Predictor.load(out, backend="torch-fp32").extract(texts)) == figure
    assert main(["export", "--model", str(out), "--out", str(tmp_path / "onnx")]) == 0
    assert (scored(Predictor.load(tmp_path / "onnx", backend="onnx-fp32").extract(texts))
            == pytest.approx(figure, abs=0.02))
