"""Classify with mean pooling: it trains, it is saved and re-applied by every loader (evaluate,
distillation, ONNX export), it honours the padding mask; ``auto`` picks the first token (what plain
transformers computes) unless the folder is already a mean-pooled classifier."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_finetune import _cfg, _evaluate, _tsv, one_thread  # noqa: F401  (one_thread: autouse fixture)

from encoderkit.errors import EncoderkitError
from encoderkit.models.pooling import MaskedMeanPooler, apply_pooling, set_pooling
from encoderkit.train.finetune import run


def _tiny_classifier(tiny_bert_dir, pooling: str):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2).eval()
    set_pooling(model, pooling)
    return model


@pytest.mark.slow
def test_mean_pooled_classifier_learns_and_every_loader_applies_it(tmp_path, tiny_bert_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    train, dev = _tsv(tmp_path / "train.tsv", 320, 0), _tsv(tmp_path / "dev.tsv", 64, 1)
    res = run(_cfg(tmp_path, tiny_bert_dir, task="classify", train=str(train), dev=str(dev), epochs=5, pooling="mean"))
    assert res.metrics["accuracy"] >= 0.95
    assert json.loads((res.out / "encoderkit.json").read_text())["pooling"] == "mean"
    assert json.loads((res.out / "config.json").read_text())["classifier_pooling"] == "mean"
    assert _evaluate(res.out, dev)["accuracy"] == pytest.approx(res.metrics["accuracy"])

    tok = AutoTokenizer.from_pretrained(res.out)
    plain = AutoModelForSequenceClassification.from_pretrained(res.out).eval()  # pools the first token
    model = apply_pooling(AutoModelForSequenceClassification.from_pretrained(res.out).eval())
    assert isinstance(model.bert.pooler, MaskedMeanPooler)
    alone = tok(["the movie was great"], return_tensors="pt")
    both = tok(["the movie was great", "it was a dull film and the story was boring " * 4], return_tensors="pt",
               padding=True)
    with torch.no_grad():
        a, b = model(**alone).logits, model(**both).logits
        hidden = model.bert(**alone).last_hidden_state
        by_hand = model.classifier(torch.tanh(model.bert.pooler.dense(hidden.mean(1))))
        first = plain(**alone).logits
    torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=0)  # padding is not averaged in
    torch.testing.assert_close(a, by_hand, atol=1e-5, rtol=0)
    assert (first - a).abs().max() > 1e-3  # the pooling really changes the output


def test_distilled_student_keeps_mean_pooling(tiny_bert_dir):
    from encoderkit.compress.students import build_student_from_teacher

    teacher = _tiny_classifier(tiny_bert_dir, "mean")
    student = build_student_from_teacher(teacher, list(range(teacher.config.num_hidden_layers))).eval()
    assert isinstance(student.bert.pooler, MaskedMeanPooler)
    ids = torch.tensor([[2, 7, 8, 9, 3, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids=ids, attention_mask=mask).logits,
                                   teacher(input_ids=ids, attention_mask=mask).logits)


def test_onnx_export_of_a_mean_pooled_classifier_matches_torch(tmp_path, tiny_bert_dir):
    from transformers import AutoTokenizer

    from encoderkit.inference.export import OUTPUT_NAMES, ExportConfig, ort_session, torch_outputs
    from encoderkit.inference.export import run as export
    from encoderkit.models.card import write_card
    from encoderkit.models.folder import ModelFolder

    src, out = tmp_path / "src", tmp_path / "onnx"
    _tiny_classifier(tiny_bert_dir, "mean").save_pretrained(src)
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(src)
    write_card(src, "finetune", None, {}, task="classify", labels=["a", "b"], pooling="mean")
    export(ExportConfig(model=str(src), out=str(out), optimize=False, quantize="none"))
    tok = AutoTokenizer.from_pretrained(out)
    enc = tok(["good", "the story of a man who said that he had a great time " * 2], padding=True, return_tensors="np")
    inputs = {k: v.astype(np.int64) for k, v in enc.items()}
    model = ModelFolder.open(src).load(task="classify")
    assert isinstance(model.bert.pooler, MaskedMeanPooler)
    ref = torch_outputs(model, "classify", inputs)
    got = ort_session(out / "model.onnx").run(OUTPUT_NAMES["classify"], inputs)
    np.testing.assert_allclose(got[0], ref[0], atol=1e-4)
    short = ort_session(out / "model.onnx").run(OUTPUT_NAMES["classify"], {k: v[:1, :3] for k, v in inputs.items()})
    np.testing.assert_allclose(short[0][0], got[0][0], atol=1e-4)  # the padded row scores as if alone


def test_auto_pooling_is_the_first_token_unless_the_folder_is_a_mean_pooled_classifier(tmp_path, tiny_bert_dir):
    import shutil

    from encoderkit.models.folder import ModelFolder
    from encoderkit.models.pooling import task_pooling

    def resolve_pooling(asked, folder):
        return task_pooling(folder, "classify", asked)

    assert resolve_pooling("auto", ModelFolder.open(tiny_bert_dir)) == "first"
    st = tmp_path / "st"
    shutil.copytree(tiny_bert_dir, st)
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (st / "modules.json").write_text("[]")
    assert ModelFolder.open(st).pooling == "mean"  # the embedding's pooling ...
    # ... is not the classifier's: HF pools the first token
    assert resolve_pooling("auto", ModelFolder.open(st)) == "first"
    assert resolve_pooling("mean", ModelFolder.open(st)) == "mean"
    clf = tmp_path / "clf"
    _tiny_classifier(tiny_bert_dir, "mean").save_pretrained(clf)
    assert resolve_pooling("auto", ModelFolder.open(clf, tokenizer=False)) == "mean"  # a classifier keeps its own


def test_mean_pooling_is_refused_for_a_head_that_reads_the_first_token():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    model = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=50, dim=32, n_layers=1, n_heads=2,
                                                                 hidden_dim=64))
    with pytest.raises(EncoderkitError, match="--pooling first"):
        set_pooling(model, "mean")
