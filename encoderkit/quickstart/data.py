"""The quickstart's data, cut from the standard library's docstrings (``builtin:stdlib``): the search corpus
(:func:`docstring_records`), fill-mask prompts from held-out modules (:func:`fill_mask_prompts`) and a labelled
task, which package a docstring comes from (:func:`family_task`). A pure function of the stdlib and a seed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from encoderkit.data import function_words
from encoderkit.data.builtin_corpus import stdlib_docstrings
from encoderkit.errors import EncoderkitError

# Packages of the pure-Python stdlib of every CPython >= 3.10 with a few hundred docstrings each
# spread over several modules (tkinter and distutils are missing from some installs).
FAMILIES = ("asyncio", "email", "xml", "multiprocessing", "unittest", "http", "importlib", "logging")
MIN_FAMILIES = 4

# Natural-language questions and the top-level modules whose docs answer them.
SEARCH_QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("read a gzip file line by line", ("gzip", "io")),
    ("parse command-line options", ("argparse", "getopt", "optparse")),
    ("compute a SHA-256 digest", ("hashlib", "hmac")),
    ("send an email through an SMTP server", ("smtplib",)),
    ("run a shell command and capture its output", ("subprocess",)),
)

_WORD = re.compile(r"[a-z]+")


@dataclass
class Record:
    id: str  # dotted name: module, module.Class, module.Class.method
    module: str
    text: str

    @property
    def package(self) -> str:
        return self.module.split(".")[0]


def docstring_records() -> list[Record]:
    """Every docstring of ``builtin:stdlib``, in corpus order. A name defined twice in one module
    (e.g. in both branches of an ``if``) keeps its first docstring under its name, the next under
    ``name#2``."""
    seen: Counter[str] = Counter()
    out = []
    for module, name, doc in stdlib_docstrings():
        rid = f"{module}.{name}" if name else module
        seen[rid] += 1
        out.append(Record(rid if seen[rid] == 1 else f"{rid}#{seen[rid]}", module, doc))
    return out


def summary(text: str, max_chars: int = 400) -> str:
    """The first paragraph of a docstring on one line, cut at ``max_chars`` on a word boundary."""
    para = " ".join(text.split("\n\n")[0].split())
    if len(para) <= max_chars:
        return para
    return para[:max_chars].rsplit(" ", 1)[0]


def search_subset(records: list[Record], every: int) -> list[Record]:
    """``every``-th module (in sorted order) plus every module that answers a demo question; all
    records for ``every`` <= 1."""
    if every <= 1:
        return records
    modules = sorted({r.module for r in records})
    keep = set(modules[::every])
    wanted = {m for _, mods in SEARCH_QUESTIONS for m in mods}
    keep |= {m for m in modules if m.split(".")[0] in wanted}
    return [r for r in records if r.module in keep]


# -- fill-mask prompts --------------------------------------------------------------------------

def fill_mask_prompts(heldout_docs: Iterable[str], train_docs: Iterable[str], vocab: dict[str, int], mask: str,
                      n: int, min_words: int = 7, max_words: int = 18) -> list[tuple[str, str]]:
    """Up to ``n`` ``(prompt, answer)`` pairs: a sentence of plain words from each of the first held-out documents
    that has one (never in the training documents), its word most frequent in training masked (one whole token,
    4+ letters, not a function word, 50+ uses: a word a model could learn from the training text)."""
    train = [" ".join(d.split()) for d in train_docs]
    freq: Counter[str] = Counter()
    for doc in train:
        freq.update(_WORD.findall(doc.lower()))
    train_text = "\n".join(train)
    out: list[tuple[str, str]] = []
    for doc in heldout_docs:
        pick = _pick_sentence(doc, freq, train_text, vocab, mask, min_words, max_words)
        if pick is not None:
            out.append(pick)
            if len(out) == n:
                break
    return out


def _pick_sentence(doc: str, freq: Counter[str], train_text: str, vocab: dict[str, int], mask: str, min_words: int,
                   max_words: int) -> tuple[str, str] | None:
    for para in doc.split("\n\n"):
        flat = " ".join(para.split())
        for sent in re.split(r"(?<=[.!?])\s+", flat):
            words = sent.rstrip(".").split()
            if not (min_words <= len(words) <= max_words) or not re.fullmatch(r"[A-Za-z0-9 ,]+\.?", sent):
                continue
            cands = [(freq[w.lower()], -i, i) for i, w in enumerate(words)
                     if w.isalpha() and len(w) >= 4 and w.lower() in vocab and w.lower() not in function_words.ENGLISH
                     and freq[w.lower()] >= 50]
            if not cands or " ".join(words) in train_text:
                continue
            i = max(cands)[2]
            return " ".join(words[:i] + [mask] + words[i + 1:]) + ".", words[i]
    return None


# -- the labelled task ---------------------------------------------------------------------------

@dataclass
class FamilyTask:
    train: list[dict[str, Any]]  # {"text", "label", "module"}
    dev: list[dict[str, Any]]
    labels: list[str]
    dev_modules: dict[str, list[str]]

    def majority_accuracy(self) -> float:
        """Dev accuracy of always answering the most frequent training label."""
        top = Counter(r["label"] for r in self.train).most_common(1)[0][0]
        return sum(r["label"] == top for r in self.dev) / max(1, len(self.dev))


def family_task(records: list[Record], per_label_train: int, per_label_dev: int, seed: int,
                dev_share: float = 0.25, max_chars: int = 600) -> FamilyTask:
    """Which package (of :data:`FAMILIES`) a docstring comes from.

    Per package, modules are shuffled (seeded) and moved to dev until dev holds ``dev_share`` of
    the package's docstrings (at least one module, never all); then at most ``per_label_train`` /
    ``per_label_dev`` docstrings per label are drawn (seeded) from each side. Texts are cut at
    ``max_chars``; the docstring's own name is not in the text."""
    rng = np.random.default_rng(seed)
    by_family: dict[str, dict[str, list[str]]] = {}
    for r in records:
        if r.package in FAMILIES:
            by_family.setdefault(r.package, {}).setdefault(r.module, []).append(r.text[:max_chars])
    labels = [f for f in FAMILIES if len(by_family.get(f, {})) >= 2]
    if len(labels) < MIN_FAMILIES:
        raise EncoderkitError(f"this Python's standard library has only {len(labels)} of the packages {FAMILIES} "
                              f"with two or more modules; the quickstart's labelled task needs {MIN_FAMILIES}")
    train: list[dict[str, Any]] = []
    dev: list[dict[str, Any]] = []
    dev_modules: dict[str, list[str]] = {}
    for label in labels:
        modules = sorted(by_family[label])
        order = [modules[i] for i in rng.permutation(len(modules))]
        total = sum(len(by_family[label][m]) for m in modules)
        chosen: list[str] = []
        for m in order[:-1]:
            if chosen and sum(len(by_family[label][c]) for c in chosen) >= dev_share * total:
                break
            chosen.append(m)
        dev_modules[label] = sorted(chosen)
        rest = [m for m in modules if m not in chosen]
        for side, mods, cap in ((dev, chosen, per_label_dev), (train, rest, per_label_train)):
            rows = [{"text": t, "label": label, "module": m} for m in sorted(mods) for t in by_family[label][m]]
            idx = sorted(rng.permutation(len(rows))[:cap]) if len(rows) > cap else range(len(rows))
            side.extend(rows[i] for i in idx)
    train = [train[i] for i in rng.permutation(len(train))]
    return FamilyTask(train, dev, labels, dev_modules)
