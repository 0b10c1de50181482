"""NER features and decoding: words -> sub-token windows, and logits -> entities with character spans (numpy on a
fast tokenizer, no torch: shared by fine-tuning, evaluation and the deploy runtime).

One label per word, at its first sub-token (``-100`` on the others in training). Long texts are cut into windows
overlapping by ``stride`` sub-tokens, nothing truncated; decoding takes each word from the window where its first
sub-token has the most context. Raw text is split by :func:`split_words` (CoNLL style), so spans end on word edges.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.tags import iob2_to_spans

IGNORE = -100
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


@dataclass
class NerFeatures:
    """Sub-token windows of one text (W windows, padded to the longest, L).

    input_ids, attention_mask, token_type_ids: int64 (W, L), ready for the model.
    word_index: int64 (W, L), the index of the word whose FIRST sub-token sits at this position,
        -1 elsewhere (special tokens, padding, later sub-tokens).
    labels: int64 (W, L) label id at first sub-tokens, -100 elsewhere; None without tags.
    words: the words; word_spans: int64 (N, 2) character [start, end) of each word in ``text``.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    word_index: np.ndarray
    words: list[str]
    word_spans: np.ndarray
    text: str
    labels: np.ndarray | None = None

    def model_inputs(self) -> dict[str, np.ndarray]:
        """The arrays a BERT-style model takes, each (W, L)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "token_type_ids": self.token_type_ids}


@dataclass
class Entity:
    """One predicted entity: type, character span [start, end) in the text, its text and mean word probability."""

    label: str
    start: int
    end: int
    text: str
    score: float

    def to_dict(self) -> dict:
        return {"label": self.label, "start": self.start, "end": self.end, "text": self.text,
                "score": round(self.score, 6)}


def split_words(text: str) -> tuple[list[str], np.ndarray]:
    """Split raw text into words and their character spans (N, 2)."""
    matches = list(_WORD.finditer(text))
    spans = np.array([[m.start(), m.end()] for m in matches], dtype=np.int64).reshape(-1, 2)
    return [m.group() for m in matches], spans


def featurize_words(
    tokenizer,
    words: Sequence[str],
    *,
    max_length: int = 256,
    stride: int = 32,
    label_ids: Sequence[int] | None = None,
    text: str | None = None,
    word_spans: np.ndarray | None = None,
) -> NerFeatures:
    """Windows of sub-tokens for pre-split ``words`` (and their label ids, for training).

    ``stride`` is the number of sub-tokens shared by consecutive windows; it must be below
    ``max_length - 2``. Without ``text``/``word_spans`` the words are taken as joined by spaces.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise EncoderkitError("NER features need a fast (Rust) tokenizer with offsets; the model folder needs "
                              "tokenizer.json")
    if stride >= max_length - 3:
        raise EncoderkitError(f"stride {stride} must be smaller than max_length {max_length} minus 3")
    words = list(words)
    if text is None or word_spans is None:
        text, word_spans = _join(words)
    if not words:  # an empty text still gets one window ([CLS] [SEP]) so batch shapes stay simple
        words_in = [""]
    else:
        words_in = words
    enc = tokenizer(
        words_in, is_split_into_words=True, truncation=True, max_length=max_length, stride=stride,
        return_overflowing_tokens=True, return_offsets_mapping=True,
    )
    n_windows = len(enc["input_ids"])
    width = max(len(ids) for ids in enc["input_ids"])
    input_ids = np.full((n_windows, width), tokenizer.pad_token_id or 0, dtype=np.int64)
    attention = np.zeros((n_windows, width), dtype=np.int64)
    types = np.zeros((n_windows, width), dtype=np.int64)
    word_index = np.full((n_windows, width), -1, dtype=np.int64)
    for w in range(n_windows):
        ids = enc["input_ids"][w]
        input_ids[w, : len(ids)] = ids
        attention[w, : len(ids)] = 1
        if "token_type_ids" in enc:
            types[w, : len(ids)] = enc["token_type_ids"][w]
        offsets = enc["offset_mapping"][w]
        prev = None
        for t, k in enumerate(enc.word_ids(w)):
            # first sub-token of a word: a new word id whose offset starts at the word's start
            # (a window can begin in the middle of a word; those pieces are not first sub-tokens)
            if k is not None and k != prev and offsets[t][0] == 0 and words:
                word_index[w, t] = k
            prev = k
    labels = None
    if label_ids is not None:
        if len(label_ids) != len(words):
            raise EncoderkitError(f"{len(label_ids)} labels for {len(words)} words")
        lab = np.asarray(list(label_ids) + [IGNORE], dtype=np.int64)
        labels = np.where(word_index >= 0, lab[word_index], IGNORE)
    spans = np.asarray(word_spans, dtype=np.int64).reshape(-1, 2)
    return NerFeatures(input_ids, attention, types, word_index, words, spans, text, labels)


def featurize_text(tokenizer, text: str, *, max_length: int = 256, stride: int = 32) -> NerFeatures:
    """Windows of sub-tokens for raw ``text`` (split by :func:`split_words`); see the module docstring."""
    words, spans = split_words(text)
    return featurize_words(tokenizer, words, max_length=max_length, stride=stride, text=text, word_spans=spans)


def window_rows(feats: Sequence[NerFeatures], with_labels: bool = False
                ) -> tuple[list[dict[str, np.ndarray]], list[tuple[int, int]]]:
    """One feature row per window of every text (padding cut off; ``labels`` too with ``with_labels``)
    and its (text, window) position."""
    rows, where = [], []
    for i, f in enumerate(feats):
        for w in range(len(f.input_ids)):
            n = int(f.attention_mask[w].sum())
            row = {"input_ids": f.input_ids[w, :n], "token_type_ids": f.token_type_ids[w, :n]}
            if with_labels:
                row["labels"] = f.labels[w, :n]
            rows.append(row)
            where.append((i, w))
    return rows, where


def window_logits(feats: Sequence[NerFeatures], where: Sequence[tuple[int, int]], outs: Sequence[np.ndarray],
                  n_labels: int) -> list[np.ndarray]:
    """Per text, its windows' logits (W, L, C) from each window row's (n, C) output (padding zero)."""
    logits = [np.zeros(f.input_ids.shape + (n_labels,), dtype=np.float32) for f in feats]
    for (i, w), out in zip(where, outs, strict=True):
        logits[i][w, : len(out)] = out
    return logits


def word_logits(features: NerFeatures, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-word logits (N, C) from window logits (W, L, C): for each word, the window where its first
    sub-token is furthest from a window edge. Also a bool mask (N,): False for a word the tokenizer
    turned into no sub-token at all (e.g. a lone control character), which decodes as ``O``."""
    logits = np.asarray(logits, dtype=np.float32)
    n_words = len(features.words)
    out = np.zeros((n_words, logits.shape[-1]), dtype=np.float32)
    best = np.full(n_words, -1, dtype=np.int64)
    lengths = features.attention_mask.sum(axis=1)
    for w, t in zip(*np.nonzero(features.word_index >= 0), strict=True):
        k = features.word_index[w, t]
        context = min(t, lengths[w] - 1 - t)
        if context > best[k]:
            best[k] = context
            out[k] = logits[w, t]
    return out, best >= 0


def decode_word_tags(features: NerFeatures, logits: np.ndarray,
                     id2label: Mapping[int, str]) -> tuple[list[str], np.ndarray]:
    """IOB2 tag per word and its softmax probability (N,), from window logits (W, L, C)."""
    per_word, seen = word_logits(features, logits)
    if not len(per_word):
        return [], np.zeros(0, dtype=np.float32)
    z = per_word - per_word.max(axis=-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    ids = probs.argmax(axis=-1)
    tags = [id2label[int(i)] if ok else "O" for i, ok in zip(ids, seen, strict=True)]
    return tags, np.where(seen, probs[np.arange(len(ids)), ids], 1.0)


def decode_entities(features: NerFeatures, logits: np.ndarray, id2label: Mapping[int, str]) -> list[Entity]:
    """Entities with character spans in ``features.text`` from window logits (W, L, C)."""
    tags, probs = decode_word_tags(features, logits, id2label)
    entities = []
    for kind, first, last in iob2_to_spans(tags):
        start, end = int(features.word_spans[first, 0]), int(features.word_spans[last - 1, 1])
        entities.append(Entity(kind, start, end, features.text[start:end], float(probs[first:last].mean())))
    return entities


def _join(words: Sequence[str]) -> tuple[str, np.ndarray]:
    spans, pos = [], 0
    for w in words:
        spans.append((pos, pos + len(w)))
        pos += len(w) + 1
    return " ".join(words), np.asarray(spans, dtype=np.int64).reshape(-1, 2)
