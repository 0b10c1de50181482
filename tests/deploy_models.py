"""Tiny task model folders for the deploy tests (export, runtime, serve): 2 layers, hidden 32."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_bert_config

TASK_CLASSES = {
    "classify": "BertForSequenceClassification",
    "rerank": "BertForSequenceClassification",
    "ner": "BertForTokenClassification",
    "qa": "BertForQuestionAnswering",
    "embed": "BertModel",
}
LABELS = {"classify": ["negative", "positive"], "ner": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]}


def make_task_model(root: Path, tokenizer_dir: Path, task: str, seed: int = 0) -> Path:
    """A randomly initialised tiny BERT with ``task``'s head, its tokenizer and encoderkit.json."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from encoderkit.models.card import write_card

    out = root / f"tiny_{task}"
    if (out / "encoderkit.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    labels = LABELS.get(task, [])
    kw = {}
    if task == "rerank":
        kw = {"num_labels": 1}
    elif labels:
        kw = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
              "label2id": {v: i for i, v in enumerate(labels)}}
    torch.manual_seed(seed)
    model = getattr(transformers, TASK_CLASSES[task])(tiny_bert_config(len(tok), **kw))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    extra = {"pooling": "mean", "normalize": True} if task == "embed" else {}
    write_card(out, "finetune", None, {}, task=task, labels=labels, **extra)
    return out


def export_task_model(root: Path, tokenizer_dir: Path, task: str) -> Path:
    """``make_task_model`` exported to ONNX FP32 and INT8 (``model.onnx`` + ``model.int8.onnx``); reused per session."""
    from encoderkit.inference.export import ExportConfig, run

    out = root / f"tiny_{task}_onnx"
    if not (out / "encoderkit.json").is_file():
        src = make_task_model(root, tokenizer_dir, task)
        # the fusion pass is slow; it is exercised on two tasks only
        run(ExportConfig(model=str(src), out=str(out), optimize=task in ("classify", "qa"), quantize="int8-dynamic"))
    return out


def tiny_root(tmp_path_factory) -> Path:
    """One folder per test session for the tiny task models, so each is built and exported once."""
    root = tmp_path_factory.getbasetemp() / "deploy_models"
    root.mkdir(exist_ok=True)
    return root


def served_predictors(tmp_path_factory, tokenizer_dir: Path, max_batch: int) -> dict:
    """One ONNX fp32 Predictor per task (named after the task), over the session's exported tiny models."""
    from encoderkit.inference.predictor import Predictor

    root = tiny_root(tmp_path_factory)
    return {t: Predictor.load(export_task_model(root, tokenizer_dir, t), backend="onnx-fp32", max_batch=max_batch)
            for t in TASK_CLASSES}
