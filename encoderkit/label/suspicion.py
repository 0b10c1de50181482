"""``encoderkit audit suspect``: which labels are likely wrong.

Out-of-fold probabilities of a logistic regression (on TF-IDF n-grams, frozen embeddings, or both) go to
cleanlab's ``find_label_issues``; each line gains ``suspicion`` (1 - the probability of its label) and ``suspect``.
TF-IDF is the default: errors of the ``embed`` labeller are reproduced, not flagged, by a model on its embeddings.
"""

from __future__ import annotations

import array
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import Predictor, as_one_call, chunks, engine_batches, text_lengths
from encoderkit.io import check_output_file, open_text_atomic
from encoderkit.label.records import dumps, iter_labeled
from encoderkit.progress import progress
from encoderkit.ray_jobs import RayJob, check_ray_args, pack, ray_actors_arg, ray_address_arg, ray_batch_arg
from encoderkit.tasks.common import resolve_model
from encoderkit.tasks.embed.embedder import Embedder, tokenize


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


SUSPECT_BLOCK = 4096  # rows per block of model calls the driver ships (one --ray chunk) or runs


class SpilledTexts:
    """Texts written to a temporary file as they are read (gone when closed, or when the process ends) and read
    back by row: what ``audit suspect`` holds instead of every text of its input. A list of texts works
    wherever this does (``len``, iteration in order, ``texts[i]``)."""

    def __init__(self, folder: Path | None) -> None:
        try:
            self._f = tempfile.TemporaryFile(dir=folder, prefix=".suspect-texts-")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise EncoderkitError(f"could not write a temporary file of the texts in {folder} ({e}); the output's "
                                  "folder must be writable") from e
        self._ends = array.array("q", [0])

    def append(self, text: str) -> None:
        data = text.encode("utf-8")
        self._f.seek(self._ends[-1])
        self._f.write(data)
        self._ends.append(self._ends[-1] + len(data))

    def __len__(self) -> int:
        return len(self._ends) - 1

    def _read(self, i: int) -> str:
        self._f.seek(self._ends[i])
        return self._f.read(self._ends[i + 1] - self._ends[i]).decode("utf-8")

    def __getitem__(self, i: int) -> str:
        return self._read(i)

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self._read(i)

    def close(self) -> None:
        self._f.close()


def features(texts: Sequence[str], kind: str, model: str, ray: RayJob | None = None):
    """(N, F) feature matrix (sparse for TF-IDF) of ``texts`` (a list or :class:`SpilledTexts`, read in order and
    by row; embeddings on ``ray``'s actors when given)."""
    from scipy import sparse
    from sklearn.feature_extraction.text import TfidfVectorizer

    parts = []
    if kind in ("tfidf", "both"):  # one pass over the texts; what it holds is the count matrix and its vocabulary
        parts.append(TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True).fit_transform(iter(texts)))
    if kind in ("embed", "both"):
        p = Predictor.load(resolve_model(model))  # with --ray too: it checks the model before any actor starts
        parts.append(sparse.csr_matrix(_embeddings(p, texts, ray)))
    return parts[0] if len(parts) == 1 else sparse.hstack(parts).tocsr()


def _embeddings(p: Any, texts: Sequence[str], ray: RayJob | None) -> np.ndarray:
    """Unit embeddings (N, H) of ``texts`` from the engine calls of ``p.embed(texts)`` on all of them (its
    length-sorted batches over the whole input: the token lengths are counted a block at a time first), each run
    as one call, a block of calls at a time; on ``ray``'s actors when given. Held: the (N, H) result, the lengths,
    and the texts of the blocks in flight."""
    lengths = [n for block in chunks(iter(texts), SUSPECT_BLOCK) for n in text_lengths(p, block)]
    call = partial(as_one_call, partial(Predictor.embed, normalize=True))
    out: np.ndarray | None = None
    blocks = pack(engine_batches(p, lengths), SUSPECT_BLOCK)

    def shipped() -> Iterator[tuple[list[str], list[list[int]]]]:
        for block in blocks:
            rows = [i for g in block for i in g]
            local, at = [], 0
            for g in block:
                local.append(list(range(at, at + len(g))))
                at += len(g)
            yield [texts[i] for i in rows], local

    if ray is None:
        results: Iterator[Any] = (_local_calls(p, call, rows, groups) for rows, groups in shipped())
    else:
        load = partial(Predictor.load, p.folder, backend=p.choice, threads=ray.threads, max_batch=p.max_batch)
        results = ray.map_chunks(shipped(), load, call)
    with progress(total=len(lengths), desc="embed", unit="text") as bar:
        for block, vecs in zip(blocks, results, strict=True):
            rows = [i for g in block for i in g]
            if out is None:
                out = np.zeros((len(lengths), len(vecs[0])), np.float32)
            out[rows] = np.stack(vecs)
            bar.update(len(rows))
    return out if out is not None else np.zeros((0, 0), np.float32)


def _local_calls(p: Any, call: Any, texts: list[str], groups: list[list[int]]) -> list[np.ndarray]:
    """``call(p, [texts[i] for i in g])`` for each group, in order, with the block's texts tokenised in one call
    (a token row does not depend on the rows tokenised with it, and one call costs less than many small ones)."""
    emb = Embedder.of_runner(p)
    if getattr(emb.engine, "pool_texts", None) is not None:  # a static model reads whole texts
        return [y for g in groups for y in call(p, [texts[i] for i in g])]
    rows = tokenize(p.tokenizer, texts, p.max_length)
    return [y for g in groups for y in emb.finish(emb.pooled_rows([rows[i] for i in g], max_batch=len(g)), None, True)]


def out_of_fold(x, y: np.ndarray, n_classes: int, folds: int, seed: int, c: float = 1.0) -> np.ndarray:
    """(N, C) probabilities, each row from a logistic regression trained on the other folds."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    smallest = np.bincount(y, minlength=n_classes).min()
    if smallest < folds:
        raise EncoderkitError(f"a label has only {smallest} lines, fewer than --folds {folds}; lower --folds or "
                              "label more")
    probs = np.zeros((len(y), n_classes))
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(np.zeros(len(y)), y):
        clf = LogisticRegression(C=c, max_iter=2000).fit(x[train], y[train])
        probs[np.ix_(test, clf.classes_)] = clf.predict_proba(x[test])
    return probs


def run(cfg: SuspectConfig) -> SuspectResult:
    """Add ``suspicion`` and ``suspect`` to every labelled line (unlabelled lines get null and false). The input is
    read twice, line by line: first for the labels (held: one label number per labelled line) and the texts, which
    go to a temporary file beside the output (:class:`SpilledTexts`); then to write each line with its scores. The
    driver holds the features of the out-of-fold model (TF-IDF counts, (N, H) embeddings) and its probabilities."""
    from cleanlab.filter import find_label_issues

    out = check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.input])
    ray = RayJob.of(cfg)  # Ray missing or an address that does not answer fails now, before the model is loaded
    texts = SpilledTexts(out.parent if out.parent.is_dir() else None)  # else the system's temporary folder
    try:
        seen: dict[str, int] = {}  # label -> its number in the order met
        met = array.array("q")  # per labelled line: its label's number
        labelled = array.array("b")  # per line: 1 when it has a label
        for r in iter_labeled(cfg.input):
            has = r["label"] not in (None, "")
            labelled.append(has)
            if has:
                met.append(seen.setdefault(str(r["label"]), len(seen)))
                texts.append(str(r["text"]))
        names = sorted(seen)
        if len(names) < 2:
            raise EncoderkitError(f"{cfg.input}: only {len(names)} distinct label(s) among labelled lines; "
                                  "suspicion needs two or more")
        y = np.asarray([names.index(x) for x in seen], dtype=np.int64)[np.asarray(met, dtype=np.int64)]
        x = features(texts, cfg.features, cfg.model, ray)
    finally:
        texts.close()
    probs = out_of_fold(x, y, len(names), cfg.folds, cfg.seed, cfg.c)
    issues = find_label_issues(labels=y, pred_probs=probs, n_jobs=1)
    j = 0
    with open_text_atomic(out) as f:
        for r, has in zip(iter_labeled(cfg.input), labelled, strict=True):
            r["suspicion"], r["suspect"] = None, False
            if has:
                r["suspicion"], r["suspect"] = round(float(1 - probs[j, y[j]]), 4), bool(issues[j])
                j += 1
            f.write(dumps(r) + "\n")
    return SuspectResult(out, len(y), int(issues.sum()))
