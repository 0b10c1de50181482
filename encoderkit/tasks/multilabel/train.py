"""Multi-label classification: fine-tuning wiring and evaluation on HF's own ``AutoModelForSequenceClassification``
(a sigmoid per label, first-token pooling, so plain ``transformers`` computes the same probabilities).

With many labels each one is rare (2 of 56 per text is a prior of 0.04), and a new head's sigmoids start at 0.5:
at a fine-tuning rate the bias barely moves, so the whole budget goes into pushing every logit down through the
encoder, and training ends at the prior's loss with nothing over 0.5. So a new head starts at the prior (each
output bias is the log-odds of its label's frequency in the training rows), is then fitted on the frozen model's
features (:func:`fit_head`: a linear probe, then everything fine-tunes from it: LP-FT, so the first epoch refines a
head that already separates the labels instead of spending itself finding one) and learns :data:`HEAD_LR_SCALE`
times faster than the pretrained encoder; checkpoints are compared at the threshold tuned on dev (what the saved folder
applies, recorded in its card), not at 0.5, which rare labels seldom reach early on. The threshold is one for
every label (best dev micro-F1) unless ``--metric macro_f1`` asks for each label's own
(:func:`~encoderkit.tasks.multilabel.features.choose_thresholds`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import CLASSIFIER, default_pooling
from encoderkit.progress import note
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.classify.data import label_names
from encoderkit.tasks.classify.features import engine_logits, featurize
from encoderkit.tasks.classify.train import label_targets, predict_logits
from encoderkit.tasks.common import (
    EvalData,
    TaskRun,
    TrainData,
    check_labels,
    output_layer,
    run_batches,
    seeded_subset,
)
from encoderkit.tasks.inference import ModuleEngine
from encoderkit.tasks.multilabel.data import Examples, read_examples
from encoderkit.tasks.multilabel.features import (
    DEFAULT_THRESHOLD,
    choose_thresholds,
    prior_log_odds,
    scores,
    sigmoid,
    thresholds_of,
)
from encoderkit.tasks.multilabel.options import MultilabelOptions

OPTIONS = MultilabelOptions
HEAD_LR_SCALE = 300.0  # a new head learns at this times --lr (near 1e-2 at the default): it starts from random weights
HEAD_FIT = True  # a new head is first fitted on the frozen features (:func:`fit_head`), then everything fine-tunes
HEAD_FIT_ITERATIONS = 200  # L-BFGS iterations of that fit (full batch over the training rows' features)
HEAD_FIT_L2 = 1e-5  # its L2 weight on the mean loss: sklearn's C=10 on 5,000 rows (1 / (2 C N))


def start_at_prior(model: torch.nn.Module, y: np.ndarray) -> str:
    """Set the new head's output bias to each label's training log-odds (targets ``y``, (N, C)), so its
    sigmoids start at the labels' frequencies; the head's top-level name (what learns at :data:`HEAD_LR_SCALE`)."""
    name, layer = output_layer(model, y.shape[1], bias=True)
    with torch.no_grad():
        layer.bias.copy_(torch.from_numpy(prior_log_odds(y)).to(layer.bias.dtype))
    return name.split(".")[0]


def fit_head(model: torch.nn.Module, rows: list[dict[str, np.ndarray]], y: np.ndarray, pad_id: int,
             batch_size: int) -> str:
    """Fit the new head's output layer on the frozen model's features (a linear probe: the input of that layer,
    the pooler's output in BERT, for every training row, then a logistic regression per label on them, from the
    prior), so that fine-tuning starts from a head that already separates the labels; the head's top-level name."""
    name, layer = output_layer(model, y.shape[1], bias=True)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, torch.nn.Identity())  # the model's "logits" are then the layer's input features
    try:
        x = torch.from_numpy(np.stack(run_batches(model, rows, pad_id, batch_size, lambda out: out.logits)))
    finally:
        setattr(parent, attr, layer)
    x, target = x.double(), torch.from_numpy(y).double()
    weight = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64, requires_grad=True)
    bias = torch.from_numpy(prior_log_odds(y)).requires_grad_(True)
    opt = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=HEAD_FIT_ITERATIONS, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ weight.T + bias, target)
        loss = loss + HEAD_FIT_L2 * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        at_prior = float(closure().detach())
        opt.step(closure)
        fitted = float(closure().detach())
    note(f"new head fitted on the frozen features of {len(rows)} training rows (a linear probe): loss {at_prior:.4f} "
         f"at the labels' prior -> {fitted:.4f}; now fine-tuning everything from it")
    with torch.no_grad():
        layer.weight.copy_(weight.to(layer.weight.dtype))
        layer.bias.copy_(bias.to(layer.bias.dtype))
    return name.split(".")[0]


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
    per_label = data.metric == "macro_f1"  # macro-F1 rewards each label's own best threshold; micro-F1 one for all
    if data.dev:
        dev = _subset(read_examples(data.dev, options, ex.text_column, ex.label_column), data.max_dev_examples,
                      data.seed)
        _check_known(names, dev)
        assert dev.labels is not None
        drows = featurize(tokenizer, dev.texts, None, options.max_length)
        dy = label_targets(dev.labels, names, multi_label=True)

        def dev_probs(module) -> np.ndarray:
            return sigmoid(predict_logits(module, drows, pad_id, data.eval_batch_size))

        def evaluate(module) -> dict[str, float]:
            """Scores at the thresholds tuned on these rows (what saving this checkpoint would record), and
            micro-F1 at 0.5."""
            probs = dev_probs(module)
            at_half = scores(dy, probs >= DEFAULT_THRESHOLD)["micro_f1"]
            return {**scores(dy, probs >= choose_thresholds(probs, dy, per_label=per_label)),
                    "micro_f1_at_0.5": at_half}

    model = folder.load(AutoModelForSequenceClassification, num_labels=len(names), id2label=dict(enumerate(names)),
                        label2id={n: i for i, n in enumerate(names)}, problem_type="multi_label_classification")
    lr_scale: dict[str, float] = {}
    if not (folder.task == "multilabel" and folder.labels == names):  # a new head (a trained one keeps its own)
        head = start_at_prior(model, y)
        if HEAD_FIT:
            fit_head(model, rows, y, pad_id, data.eval_batch_size)
        lr_scale[head] = HEAD_LR_SCALE
    card: dict[str, Any] = {
        "task": "multilabel", "labels": names, "pooling": default_pooling(CLASSIFIER), "max_length": options.max_length,
        "multi_label": True,
        "text_column": ex.text_column, "label_column": ex.label_column, "label_separator": options.label_separator,
        "thresholds": dict.fromkeys(names, DEFAULT_THRESHOLD), "hf_compatible": True,
        "head": {"bias": "label log-odds", "lr_scale": HEAD_LR_SCALE,
                 **({"fit": "logistic regression on the frozen features"} if HEAD_FIT else {})}
        if lr_scale else {"bias": "trained"}}

    def loss_fn(module, batch):
        return module(**batch).loss, {}

    def save(module, out: Path) -> None:
        """Save the model, and tune the thresholds on dev into ``card`` (finetune writes it after this)."""
        module.save_pretrained(out)
        if dev_probs is None:
            return
        probs = dev_probs(module)
        chosen = choose_thresholds(probs, dy, per_label=per_label)
        card["threshold_rule"] = "per label: its best dev F1" if per_label else "one for all: the best dev micro-F1"
        card["thresholds"] = {n: float(t) for n, t in zip(names, chosen, strict=True)}
        card["dev_at_thresholds"] = scores(dy, probs >= chosen)  # optimistic: tuned on the same rows
        chosen_text = ", ".join(f"{n} {t:.2f}" for n, t in card["thresholds"].items()) if per_label else \
            f"{chosen[0]:.2f} for every label"
        note(f"thresholds chosen on dev ({data.dev}): {chosen_text}")

    return TaskRun(model, loss_fn, source, evaluate, (data.metric or "micro_f1", "max"), save, card,
                   num_train=len(rows), lr_scale=lr_scale)


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: MultilabelOptions,
                    engine: Any = None) -> dict[str, float]:
    """Metrics of a saved multi-label model on a labelled file at the thresholds its card records;
    ``engine`` (default: the folder's torch model) computes the logits (e.g. ONNX Runtime on its export)."""
    if engine is None:
        engine = ModuleEngine(folder.load(AutoModelForSequenceClassification), ["logits"])
    names = folder.labels
    ex = _subset(read_examples(data.data, options, folder.card.get("text_column"), folder.card.get("label_column")),
                 data.max_examples, data.seed)
    _check_known(names, ex)
    assert ex.labels is not None
    rows = featurize(tokenizer, ex.texts, None, options.max_length)
    probs = sigmoid(engine_logits(engine, rows, tokenizer.pad_token_id, data.batch_size))
    gold = label_targets(ex.labels, names, multi_label=True)
    return {**scores(gold, probs >= thresholds_of(folder.card, names)), "examples": len(rows)}
