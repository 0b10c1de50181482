"""``encoderkit audit suspect``: which labels are likely wrong.

Out-of-fold probabilities of a quickly trained model (logistic regression, k folds, on TF-IDF word
n-grams, frozen embeddings, or both) go to cleanlab's confident-learning filter
(``cleanlab.filter.find_label_issues``). Each labelled line gains ``suspicion`` (1 minus the
out-of-fold probability of its label; high = likely wrong) and ``suspect`` (cleanlab's verdict).
TF-IDF features are the default: a labeller that is itself a function of the embeddings (the
``embed`` labeller) makes errors a model on those same embeddings reproduces, not flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.io import write_text_atomic
from encoderkit.label.records import dumps, read_labeled
from encoderkit.ray_jobs import RayJob, check_ray_args, ray_actors_arg, ray_address_arg, ray_batch_arg


@dataclass
class SuspectConfig(StageConfig):
    """Score every labelled line's chance of being wrong (out-of-fold probabilities + cleanlab)."""

    input: str = arg(help="labeled.jsonl from `encoderkit label`.", required=True)
    output: str = arg(help="Output JSONL: the same lines plus 'suspicion' and 'suspect'.", required=True)
    overwrite: bool = arg(False, help="Replace an existing --output file.")
    features: str = arg("tfidf", help="Features of the out-of-fold model: TF-IDF word 1-2-grams, frozen embeddings of "
                                      "--model, or both.", choices=("tfidf", "embed", "both"))
    model: str = arg("minilm", help="Embedding model folder for --features embed/both ('minilm' = all-MiniLM-L6-v2).")
    folds: int = arg(5, help="Cross-validation folds (each line's probability comes from a model that never saw it).")
    c: float = arg(1.0, help="Inverse L2 regularisation of the logistic regression.")
    seed: int = arg(0, help="Seed of the fold split.")
    ray: str | None = ray_address_arg()
    ray_actors: int = ray_actors_arg()
    ray_batch: int = ray_batch_arg()

    def validate(self) -> None:
        check_ray_args(self.ray_actors, self.ray_batch)
        check(not self.ray or self.features != "tfidf", "--ray runs the embedding model of --features embed or both; "
                                                        "--features tfidf runs no model")
        check(self.folds >= 2, "folds must be at least 2")
        check(self.c > 0, "c must be positive")


@dataclass
class SuspectResult:
    output: Path
    labelled: int
    suspects: int

    def summary(self) -> dict[str, Any]:
        return {"output": str(self.output), "labelled": self.labelled, "suspects": self.suspects}


def features(texts: list[str], kind: str, model: str, ray: RayJob | None = None):
    """(N, F) feature matrix (sparse for TF-IDF) of ``texts`` (embeddings on ``ray``'s actors when given)."""
    from scipy import sparse
    from sklearn.feature_extraction.text import TfidfVectorizer

    parts = []
    if kind in ("tfidf", "both"):
        parts.append(TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True).fit_transform(texts))
    if kind in ("embed", "both"):
        from encoderkit.inference.predictor import Predictor
        from encoderkit.tasks.common import resolve_model

        p = Predictor.load(resolve_model(model))  # with --ray too: it checks the model before any actor starts
        if ray is None:
            parts.append(sparse.csr_matrix(p.embed(texts, normalize=True)))
        else:  # the local run's engine calls, each shipped whole
            from encoderkit.inference.predictor import as_one_call, engine_batches, text_lengths

            load = partial(Predictor.load, p.folder, backend=p.backend, threads=ray.threads, max_batch=p.max_batch)
            call = partial(as_one_call, partial(Predictor.embed, normalize=True))
            parts.append(sparse.csr_matrix(np.stack(ray.map(texts, load, call, "embed",
                                                            groups=engine_batches(p, text_lengths(p, texts))))))
    return parts[0] if len(parts) == 1 else sparse.hstack(parts).tocsr()


def out_of_fold(x, y: np.ndarray, n_classes: int, folds: int, seed: int, c: float = 1.0) -> np.ndarray:
    """(N, C) probabilities, each row from a logistic regression trained on the other folds."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    smallest = np.bincount(y, minlength=n_classes).min()
    if smallest < folds:
        raise EncoderkitError(f"a label has only {smallest} lines, fewer than --folds {folds}; lower --folds or label more")
    probs = np.zeros((len(y), n_classes))
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(np.zeros(len(y)), y):
        clf = LogisticRegression(C=c, max_iter=2000).fit(x[train], y[train])
        probs[np.ix_(test, clf.classes_)] = clf.predict_proba(x[test])
    return probs


def run(cfg: SuspectConfig) -> SuspectResult:
    """Add ``suspicion`` and ``suspect`` to every labelled line (unlabelled lines get null and false)."""
    from cleanlab.filter import find_label_issues

    out = Path(cfg.output)
    if out.exists() and not cfg.overwrite:
        raise EncoderkitError(f"{out} exists; pass --overwrite to replace it")
    ray = RayJob.of(cfg)  # Ray missing or an address that does not answer fails now, before the model is loaded
    recs = read_labeled(cfg.input)
    idx = [i for i, r in enumerate(recs) if r["label"] not in (None, "")]
    names = sorted({str(recs[i]["label"]) for i in idx})
    if len(names) < 2:
        raise EncoderkitError(f"{cfg.input}: only {len(names)} distinct label(s) among labelled lines; suspicion needs two or more")
    y = np.asarray([names.index(str(recs[i]["label"])) for i in idx])
    x = features([str(recs[i]["text"]) for i in idx], cfg.features, cfg.model, ray)
    probs = out_of_fold(x, y, len(names), cfg.folds, cfg.seed, cfg.c)
    issues = find_label_issues(labels=y, pred_probs=probs, n_jobs=1)
    for r in recs:
        r["suspicion"], r["suspect"] = None, False
    for j, i in enumerate(idx):
        recs[i]["suspicion"] = round(float(1 - probs[j, y[j]]), 4)
        recs[i]["suspect"] = bool(issues[j])
    write_text_atomic(out, "".join(dumps(r) + "\n" for r in recs))
    return SuspectResult(out, len(idx), int(issues.sum()))
