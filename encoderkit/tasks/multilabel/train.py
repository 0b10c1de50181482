"""Multi-label classification: fine-tuning wiring and evaluation.

Head: Hugging Face's own ``AutoModelForSequenceClassification`` with ``problem_type
"multi_label_classification"`` (a sigmoid per label, BCE loss) pooling the first token, so plain
``transformers`` loads the folder and computes the same probabilities. Training's dev evaluation
(which picks the checkpoint) predicts a label at probability 0.5; when the best checkpoint is saved,
each label's threshold is chosen on the dev set (the one of 0.05, 0.10, ..., 0.95 that maximises that
label's F1; 0.5 without dev data or for a label dev never has) and recorded in ``encoderkit.json``
(``thresholds``), which evaluate, predict and serve apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.progress import note
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.classify.data import label_names
from encoderkit.tasks.classify.features import engine_logits, featurize
from encoderkit.tasks.classify.train import label_targets, predict_logits
from encoderkit.tasks.common import EvalData, TaskRun, TrainData, check_labels, seeded_subset
from encoderkit.tasks.inference import ModuleEngine
from encoderkit.tasks.multilabel.data import Examples, read_examples
from encoderkit.tasks.multilabel.features import (
    DEFAULT_THRESHOLD,
    choose_thresholds,
    scores,
    sigmoid,
    thresholds_of,
)
from encoderkit.tasks.multilabel.options import MultilabelOptions

OPTIONS = MultilabelOptions


def _subset(ex: Examples, limit: int, seed: int) -> Examples:
    keep = seeded_subset(list(range(len(ex.texts))), limit, seed)
    if len(keep) == len(ex.texts):
        return ex
    return Examples([ex.texts[i] for i in keep], None if ex.labels is None else [ex.labels[i] for i in keep],
                    [ex.where[i] for i in keep], ex.text_column, ex.label_column)


def _check_known(names: list[str], ex: Examples) -> None:
    """A label the head has no output for (never seen in training) is an error naming its row."""
    assert ex.labels is not None
    check_labels(set(names), [x for items in ex.labels for x in items],
                 [w for w, items in zip(ex.where, ex.labels, strict=True) for _ in items])


def model_class():
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification


def build(data: TrainData, options: MultilabelOptions, tokenizer, folder: ModelFolder) -> TaskRun:
    """Read train/dev, featurise, and make the HF multi-label model and its engine pieces."""
    ex = _subset(read_examples(data.train, options), data.max_train_examples, data.seed)
    assert ex.labels is not None
    names = label_names(ex.labels)
    if not names:
        raise EncoderkitError(f"{data.train}: every row is labelled none in column {ex.label_column!r}; "
                              "a classifier needs rows with labels")
    rows = featurize(tokenizer, ex.texts, None, options.max_length)
    y = label_targets(ex.labels, names, multi_label=True)
    pad_id = tokenizer.pad_token_id

    def make_batch(idx: np.ndarray, epoch: int):
        # targets (B, C) added after padding: encode_batch would take a C-long row for per-token labels
        batch = encode_batch([rows[i] for i in idx], pad_id)
        batch["labels"] = torch.from_numpy(y[idx])
        return batch

    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), data.batch_size, make_batch,
                             seed=data.seed, bucket=data.bucket)
    evaluate, dev_probs = None, None
    if data.dev:
        dev = _subset(read_examples(data.dev, options, ex.text_column, ex.label_column), data.max_dev_examples, data.seed)
        _check_known(names, dev)
        assert dev.labels is not None
        drows = featurize(tokenizer, dev.texts, None, options.max_length)
        dy = label_targets(dev.labels, names, multi_label=True)

        def dev_probs(module) -> np.ndarray:
            return sigmoid(predict_logits(module, drows, pad_id, data.eval_batch_size))

        def evaluate(module) -> dict[str, float]:
            return scores(dy, dev_probs(module) >= DEFAULT_THRESHOLD)

    model = folder.load(model_class(), num_labels=len(names), id2label=dict(enumerate(names)),
                        label2id={n: i for i, n in enumerate(names)}, problem_type="multi_label_classification")
    card: dict[str, Any] = {
        "task": "multilabel", "labels": names, "pooling": "first", "max_length": options.max_length, "multi_label": True,
        "text_column": ex.text_column, "label_column": ex.label_column, "label_separator": options.label_separator,
        "thresholds": dict.fromkeys(names, DEFAULT_THRESHOLD), "hf_compatible": True}

    def loss_fn(module, batch):
        return module(**batch).loss, {}

    def save(module, out: Path) -> None:
        """Save the model, and tune the thresholds on dev into ``card`` (finetune writes it after this)."""
        module.save_pretrained(out)
        if dev_probs is None:
            return
        probs = dev_probs(module)
        chosen = choose_thresholds(probs, dy)
        card["thresholds"] = {n: float(t) for n, t in zip(names, chosen, strict=True)}
        card["dev_at_thresholds"] = scores(dy, probs >= chosen)  # optimistic: tuned on the same rows
        note(f"thresholds chosen on dev ({data.dev}): " + ", ".join(f"{n} {t:.2f}" for n, t in card["thresholds"].items()))

    return TaskRun(model, loss_fn, source, evaluate, (data.metric or "micro_f1", "max"), save, card, num_train=len(rows))


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: MultilabelOptions,
                    engine: Any = None) -> dict[str, float]:
    """Metrics of a saved multi-label model on a labelled file at the thresholds its card records;
    ``engine`` (default: the folder's torch model) computes the logits (e.g. ONNX Runtime on its export)."""
    if engine is None:
        engine = ModuleEngine(folder.load(model_class()), ["logits"])
    names = folder.labels
    ex = _subset(read_examples(data.data, options, folder.card.get("text_column"), folder.card.get("label_column")),
                 data.max_examples, data.seed)
    _check_known(names, ex)
    assert ex.labels is not None
    rows = featurize(tokenizer, ex.texts, None, options.max_length)
    probs = sigmoid(engine_logits(engine, rows, tokenizer.pad_token_id, data.batch_size))
    return {**scores(label_targets(ex.labels, names, multi_label=True), probs >= thresholds_of(folder.card, names)), "examples": len(rows)}
