"""The few-label route of ``finetune --task classify`` (SetFit's idea, our own code).

With at most :data:`MAX_PER_CLASS` labelled examples in every class (``--few-label auto``; ``on`` / ``off`` force
it), a classification head trained from scratch on the few rows learns little. Instead:

1. sentence pairs from the labels: ``--pair-iterations`` rounds, each pairing every training text with one other
   text of its class (target cosine 1) and one of another class (target 0);
2. the encoder body is tuned on the pairs with a cosine-similarity loss (the mean squared error between the cosine
   of the two pooled embeddings and the target), one pass, at :data:`BODY_LR`, batch :data:`BODY_BATCH`;
3. the head is fitted on the tuned embeddings of the training texts, normalised to unit length (what the pairs'
   cosine tuned; a sentence-transformers checkpoint normalises them too): multinomial logistic regression with an
   L2 penalty (:data:`HEAD_C`, as scikit-learn's default), to convergence (L-BFGS), without an intercept.

The result is an ordinary ``AutoModelForSequenceClassification`` folder, which predicts, exports, serves and
compresses like any classifier. Its classifier reads BERT's pooler (dense + tanh) over the pooled embedding ``e``;
the route sets that dense layer to a scaled identity ``alpha * I`` with ``alpha`` small enough that the tanh is
linear to a fraction of a percent, and the classifier to ``W / (alpha * s)`` (``s``: the training embeddings' median
length), so the logits are ``W e / s`` = ``(|e| / s) W u`` with ``u = e / |e|``. A BERT classifier cannot divide by
``|e|``, which is why the regression has no intercept: without one, scaling the logits by ``|e| / s`` keeps their
order, so the folder predicts the class the regression on unit vectors predicts (its probabilities are sharper for
longer embeddings). An intercept fitted on unit vectors but applied beside unnormalised ones would outweigh the
evidence of every text whose embedding is short, e.g. full sentences after training on short phrases.

The pooling follows classify's one rule
(:mod:`encoderkit.models.pooling`): asked ``--pooling`` wins; ``auto`` on a model that is not yet a classifier
is mean here (the sentence embedding the pairs tune; a sentence-transformers checkpoint was trained for it), which
plain transformers ignores for a BERT, so the card says ``hf_compatible: false`` with its warning, as for any
mean-pooled classifier; ``--pooling first`` gives a folder plain transformers computes the same.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.io import output_dir
from encoderkit.models.card import write_card
from encoderkit.models.pooling import AUTO, MEAN, pool
from encoderkit.progress import note
from encoderkit.tasks.batching import encode_batch
from encoderkit.tasks.classify.data import label_names, read_examples
from encoderkit.tasks.classify.features import featurize
from encoderkit.tasks.common import seeded_subset
from encoderkit.train import checkpoint
from encoderkit.train.engine import TrainSettings, fit

MAX_PER_CLASS = 64  # --few-label auto takes the route when no class has more training examples than this
MODES = ("auto", "on", "off")
BODY_LR = 2e-5  # SetFit's body learning rate
BODY_BATCH = 16  # pairs per step (SetFit's)
BODY_WARMUP = 0.1
HEAD_C = 1.0  # inverse L2 strength of the logistic regression (scikit-learn's default, SetFit's head)
HEAD_ITERATIONS = 500  # L-BFGS iterations at most; the regression is convex and small
TANH_RANGE = 0.05  # alpha puts the largest training feature at tanh(0.05): the pooler's tanh stays linear


@dataclasses.dataclass(frozen=True)
class Examples:
    """The training texts and their label per row, as the classify task reads them."""

    texts: list[str]
    labels: list[str]
    where: str  # the training file, for messages


ROUTE_FAMILIES = ("bert",)  # config model_types whose classifier holds the route's head (a pooler + a linear
# classifier: :func:`check_model`); ``auto`` takes the standard route on any other


def route(cfg: Any, task: Any, data: Any, options: Any, model_type: str | None = None) -> Examples | None:
    """The examples to train the few-label route on, or None for the standard route: ``--few-label on``, or ``auto``
    with at most :data:`MAX_PER_CLASS` examples in every class, on a task that offers it (single texts, one label
    each). ``on`` where it cannot run, and a class of one example, are errors naming the class and the file."""
    mode = cfg.few_label
    if mode == "off":
        return None
    offered = getattr(task, "few_label", False) and not getattr(options, "multi_label", False)
    pairs = bool(getattr(options, "text_pair_column", ""))
    if not offered or pairs:
        if mode == "on":
            why = "text pairs (--text-pair-column)" if offered else f"--task {cfg.task}"
            raise EncoderkitError(f"--few-label on: the few-label route trains single-text classifiers with one "
                                  f"label per text, not {why}; use --few-label off")
        return None
    texts, _, labels, _, _ = read_examples(data.train, options, train=True)
    keep = seeded_subset(list(range(len(texts))), data.max_train_examples, data.seed)
    texts, labels = [texts[i] for i in keep], [labels[i][0] for i in keep]
    counts = Counter(labels)
    if mode == "auto" and max(counts.values()) > MAX_PER_CLASS:
        return None
    if mode == "auto" and model_type not in ROUTE_FAMILIES:
        note(f"few-label: {len(texts)} examples, but a {model_type} classifier has no BERT pooler to hold the "
             "route's head: the standard route")
        return None
    if len(counts) < 2:
        return None  # the classify task's own message (one label) follows
    for name in label_names([[x] for x in counts]):
        if counts[name] < 2:
            raise EncoderkitError(
                f"{data.train}: class {name!r} has 1 example; the few-label route pairs each example with another of "
                "its class, so every class needs 2 or more: add examples of it, drop it, or use --few-label off")
    note(f"few-label route: {len(texts)} examples in {len(counts)} classes ({min(counts.values())}-"
         f"{max(counts.values())} per class; --few-label {mode}, auto below {MAX_PER_CLASS + 1} per class): "
         f"contrastive pairs, then a logistic-regression head (--few-label off: the standard route)")
    return Examples(texts, labels, str(data.train))


def make_pairs(labels: list[str], iterations: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``iterations`` rounds over the rows: each row with a random other row of its class (target 1.0) and a random
    row of another class (target 0.0). Returns first rows, second rows and targets, shuffled by ``seed``."""
    rng = np.random.default_rng(seed)
    y = np.asarray(labels)
    same = {c: np.flatnonzero(y == c) for c in set(labels)}
    other = {c: np.flatnonzero(y != c) for c in set(labels)}
    first, second, target = [], [], []
    for _ in range(iterations):
        for i, c in enumerate(labels):
            mates = same[c][same[c] != i]
            first += [i, i]
            second += [int(rng.choice(mates)), int(rng.choice(other[c]))]
            target += [1.0, 0.0]
    order = rng.permutation(len(first))
    return (np.asarray(first)[order], np.asarray(second)[order], np.asarray(target, dtype=np.float32)[order])


class PairBatches:
    """A :class:`~encoderkit.train.engine.BatchSource` over sentence pairs: the same pairs each epoch, reshuffled.
    Each batch holds every distinct text of its pairs once (padded token rows, shortest first) with the two sides as
    indices into them (``a_index``, ``b_index``) and the targets: with a few dozen texts, a batch of pairs names many
    texts twice or more, and each is encoded once (the loss and its gradient are the same sum over the pairs; a text
    named twice shares one dropout mask). :class:`PairModule` encodes the shorter half and the longer half of the
    rows in two passes, each padded only to its own longest."""

    def __init__(self, rows: list[dict[str, np.ndarray]], pairs: tuple[np.ndarray, np.ndarray, np.ndarray],
                 batch_size: int, pad_id: int, seed: int) -> None:
        self.rows, self.pairs, self.batch_size, self.pad_id, self.seed = rows, pairs, batch_size, pad_id, seed

    def __len__(self) -> int:
        return max(1, len(self.pairs[0]) // self.batch_size)

    def __call__(self, epoch: int, start: int, stride: int) -> Iterator[dict[str, torch.Tensor]]:
        first, second, target = self.pairs
        order = np.random.default_rng([self.seed, epoch]).permutation(len(first))
        for b in range(start, len(self), stride):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            texts, where = np.unique(np.concatenate([first[idx], second[idx]]), return_inverse=True)
            by_length = np.argsort([len(self.rows[i]["input_ids"]) for i in texts], kind="stable")
            place = np.empty_like(by_length)
            place[by_length] = np.arange(len(by_length))  # a text's row in the length order
            rows = encode_batch([{k: v for k, v in self.rows[i].items() if k != "labels"} for i in texts[by_length]],
                                self.pad_id)
            where = place[where]
            yield {**rows, "a_index": torch.as_tensor(where[:len(idx)]), "b_index": torch.as_tensor(where[len(idx):]),
                   "target": torch.as_tensor(target[idx])}


class PairModule(nn.Module):
    """The classifier's encoder body seen as a sentence encoder; forward returns the cosine-similarity loss."""

    def __init__(self, body: nn.Module, pooling: str) -> None:
        super().__init__()
        self.body, self.pooling = body, pooling

    def embed(self, **inputs: torch.Tensor) -> torch.Tensor:
        return pool(self.body(**inputs).last_hidden_state, inputs["attention_mask"], self.pooling)

    def embed_sorted(self, **inputs: torch.Tensor) -> torch.Tensor:
        """:meth:`embed` of rows sorted shortest first, in two passes: the shorter half cut to its own longest (the
        padding it drops is masked out anyway), then the longer half."""
        half = len(inputs["input_ids"]) // 2
        if half == 0:
            return self.embed(**inputs)
        width = int(inputs["attention_mask"][:half].sum(1).max())
        short = self.embed(**{k: v[:half, :width] for k, v in inputs.items()})
        return torch.cat([short, self.embed(**{k: v[half:] for k, v in inputs.items()})])

    def forward(self, target: torch.Tensor, a_index: torch.Tensor, b_index: torch.Tensor,
                **batch: torch.Tensor) -> torch.Tensor:
        e = self.embed_sorted(**batch).float()
        return F.mse_loss(F.cosine_similarity(e[a_index], e[b_index]), target.float())


def _pair_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    return module(**batch), {}


@torch.no_grad()
def embeddings(encoder: PairModule, rows: list[dict[str, np.ndarray]], pad_id: int, batch_size: int) -> np.ndarray:
    """The pooled embeddings (N, H) float64 of token rows, in their order."""
    encoder.eval()
    out = []
    for s in range(0, len(rows), batch_size):
        batch = encode_batch([{k: r[k] for k in r if k != "labels"} for r in rows[s:s + batch_size]], pad_id)
        out.append(encoder.embed(**batch).double().numpy())
    return np.concatenate(out)


def fit_head(features: np.ndarray, y: np.ndarray, num_classes: int, c: float = HEAD_C) -> np.ndarray:
    """Multinomial logistic regression without intercept on ``features`` (N, H): the mean cross-entropy plus
    ``|W|^2 / (2 c N)`` (scikit-learn's objective with ``C=c``, divided by ``c N``), minimised by L-BFGS.
    Returns W (C, H)."""
    x = torch.as_tensor(features, dtype=torch.float64)
    t = torch.as_tensor(y, dtype=torch.int64)
    w = torch.zeros(num_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=HEAD_ITERATIONS, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")
    penalty = 1.0 / (2.0 * c * len(x))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(x @ w.T, t) + penalty * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy()


def install_head(model: nn.Module, w: np.ndarray, alpha: float, scale: float) -> None:
    """The pooler's dense layer as ``alpha * I`` and the classifier as ``W / (alpha * scale)`` with no bias: logits
    are ``W tanh(alpha e) / (alpha * scale)``, i.e. ``W e / scale`` (see the module docstring)."""
    dense, classifier = model.base_model.pooler.dense, model.classifier
    with torch.no_grad():
        dense.weight.copy_(torch.eye(dense.weight.shape[0], dtype=dense.weight.dtype) * alpha)
        dense.bias.zero_()
        classifier.weight.copy_(torch.as_tensor(w / (alpha * scale), dtype=classifier.weight.dtype))
        classifier.bias.zero_()


def check_model(model: nn.Module, where: str) -> None:
    """The route fits the head through BERT's pooler (dense + tanh) and a linear classifier."""
    pooler = getattr(model.base_model, "pooler", None)
    dense = getattr(pooler, "dense", None)
    square = isinstance(dense, nn.Linear) and dense.in_features == dense.out_features
    if not (square and isinstance(getattr(model, "classifier", None), nn.Linear)):
        raise EncoderkitError(f"--few-label: {where} ({type(model).__name__}) has no BERT-style pooler and linear "
                              "classifier, which the few-label route fits its head through; use --few-label off")


def run(cfg: Any, examples: Examples, task: Any, data: Any, options: Any, tokenizer: Any, folder: Any,
        out: Path, settings: dict[str, Any]) -> tuple[int, float, dict[str, float]]:
    """Train the route and write the classifier folder ``out``; returns (body steps, seconds, dev metrics)."""
    pooling = options.pooling
    if cfg.pooling in ("", AUTO) and folder.task != task.name:
        pooling = MEAN  # the sentence embedding the pairs tune (see the module docstring)
    options = dataclasses.replace(options, pooling=pooling)
    with torch.random.fork_rng(devices=[]):  # the head's initialisation follows --seed (then replaced)
        torch.manual_seed(cfg.seed)
        tr = task.build(data, options, tokenizer, folder)
    model = tr.module
    check_model(model, str(folder.path))
    names = tr.card["labels"]
    index = {n: i for i, n in enumerate(names)}
    rows = featurize(tokenizer, examples.texts, None, options.max_length)
    pad_id = tokenizer.pad_token_id
    pairs = make_pairs(examples.labels, cfg.pair_iterations, cfg.seed)
    source = PairBatches(rows, pairs, BODY_BATCH, pad_id, cfg.seed)
    encoder = PairModule(model.base_model, pooling)
    body = TrainSettings(lr=BODY_LR, weight_decay=cfg.weight_decay, warmup=BODY_WARMUP, schedule="linear",
                         epochs=1.0, batch_size=BODY_BATCH, clip_norm=cfg.clip_norm, betas=(0.9, 0.999), eps=1e-8,
                         seed=cfg.seed, bf16=cfg.bf16, log_every=max(1, min(50, len(source) // 10)),
                         save_every=cfg.save_every)
    t0 = time.perf_counter()
    with checkpoint.run_dir_beside(out, cfg.resume) as run_dir:
        result = fit(encoder, _pair_loss, source, body, run_dir, fingerprint={"config": settings, "few_label": True},
                     resume=cfg.resume)
        encoder.to("cpu")
        features = embeddings(encoder, rows, pad_id, cfg.eval_batch_size)
        lengths = np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
        w = fit_head(features / lengths, np.asarray([index[x] for x in examples.labels]), len(names))
        alpha = TANH_RANGE / max(float(np.abs(features).max()), 1e-12)
        install_head(model, w, alpha, float(np.median(lengths)))
        model.eval()
        seconds = time.perf_counter() - t0
        metrics = tr.evaluate(model) if tr.evaluate else {}
        retry = f"rerun with --resume (the trained checkpoints are kept in {run_dir})"
        with output_dir(out, cfg.overwrite, retry=retry) as tmp, torch.no_grad():
            tr.save(model, tmp)
            tokenizer.save_pretrained(tmp)
            route_card = {"pairs": len(pairs[0]), "pair_iterations": cfg.pair_iterations, "body_lr": BODY_LR,
                          "body_batch": BODY_BATCH, "body_steps": result.steps, "head": "logistic regression",
                          "head_c": HEAD_C, "alpha": alpha}
            write_card(tmp, "finetune", folder.path, settings, {"dev": metrics}, steps=result.steps,
                       train_examples=tr.num_train, train_seconds=round(seconds, 1), **tr.card, few_label=route_card)
    shutil.rmtree(run_dir, ignore_errors=True)
    return result.steps, seconds, metrics
