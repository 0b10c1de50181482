"""Extractive QA features and decoding: (question, context) -> windows, and logits -> answer spans (numpy on a fast
tokenizer, no torch: shared by fine-tuning, evaluation and the deploy runtime).

The question is kept whole (cut to ``max_question_length``); the context is cut into windows overlapping by
``doc_stride`` sub-tokens, so nothing is lost. Decoding scores the ``n_best`` start and end logits of every window
by ``start + end`` and returns the best spans over all windows as context text with character offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from encoderkit.errors import EncoderkitError


@dataclass
class QaFeatures:
    """Windows for a batch of (question, context) examples; W windows of L sub-tokens.

    input_ids, attention_mask, token_type_ids: int64 (W, L).
    offsets: int64 (W, L, 2) character [start, end) in the example's context, -1 outside the context.
    example_index: int64 (W,) the example each window belongs to.
    start_positions, end_positions: int64 (W,) the answer's sub-token span in the window, 0 (the
        [CLS] position) when the answer is not inside the window; None without answers.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    offsets: np.ndarray
    example_index: np.ndarray
    contexts: list[str]
    start_positions: np.ndarray | None = None
    end_positions: np.ndarray | None = None

    def model_inputs(self) -> dict[str, np.ndarray]:
        """The arrays a BERT-style model takes, each (W, L)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "token_type_ids": self.token_type_ids}


@dataclass
class Answer:
    """One answer span: its text, character [start, end) in the context, and start+end logit score."""

    text: str
    start: int
    end: int
    score: float

    def to_dict(self) -> dict:
        return {"text": self.text, "start": self.start, "end": self.end, "score": round(self.score, 6)}


def featurize_qa(
    tokenizer,
    questions: Sequence[str],
    contexts: Sequence[str],
    *,
    max_length: int = 384,
    doc_stride: int = 128,
    max_question_length: int = 64,
    answer_starts: Sequence[int] | None = None,
    answer_texts: Sequence[str] | None = None,
) -> QaFeatures:
    """Windows for each (question, context) pair; with answers, also the answer sub-token span per window.

    ``answer_starts`` are character offsets into each context (SQuAD's ``answer_start``).
    Windows are padded to ``max_length`` (fixed shapes for batching and export).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise EncoderkitError("QA features need a fast (Rust) tokenizer with offsets; the model folder needs "
                              "tokenizer.json")
    if len(questions) != len(contexts):
        raise EncoderkitError(f"{len(questions)} questions but {len(contexts)} contexts")
    qs, longest = [], 0
    for q in questions:  # cut long questions so every window keeps room for the context
        ids = tokenizer(q.strip(), add_special_tokens=False, return_offsets_mapping=True)
        if len(ids["input_ids"]) > max_question_length:
            q = q.strip()[: ids["offset_mapping"][max_question_length - 1][1]]
        longest = max(longest, min(len(ids["input_ids"]), max_question_length))
        qs.append(q.strip())
    if doc_stride >= max_length - longest - 3:
        raise EncoderkitError(
            f"doc_stride {doc_stride} leaves no room: it must be below max_length ({max_length}) minus the "
            f"longest question ({longest} sub-tokens, at most max_question_length) minus 3"
        )
    side = tokenizer.padding_side
    if side != "right":
        raise EncoderkitError("QA features expect a tokenizer that pads on the right (padding_side='right')")
    enc = tokenizer(
        qs, list(contexts), truncation="only_second", max_length=max_length, stride=doc_stride,
        return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length",
    )
    n = len(enc["input_ids"])
    input_ids = np.asarray(enc["input_ids"], dtype=np.int64)
    attention = np.asarray(enc["attention_mask"], dtype=np.int64)
    types = np.asarray(enc["token_type_ids"], dtype=np.int64) if "token_type_ids" in enc else np.zeros_like(input_ids)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64)
    example = np.asarray(enc["overflow_to_sample_mapping"], dtype=np.int64)
    for w in range(n):
        seq = np.array([s == 1 for s in enc.sequence_ids(w)])
        offsets[w][~seq] = -1
    starts = ends = None
    if answer_starts is not None:
        if answer_texts is None or len(answer_starts) != len(questions) or len(answer_texts) != len(questions):
            raise EncoderkitError("give one answer start and one answer text per question")
        starts = np.zeros(n, dtype=np.int64)
        ends = np.zeros(n, dtype=np.int64)
        for w in range(n):
            i = example[w]
            a0 = int(answer_starts[i])
            a1 = a0 + len(answer_texts[i])
            inside = np.nonzero(offsets[w, :, 0] >= 0)[0]
            if offsets[w, inside[0], 0] > a0 or offsets[w, inside[-1], 1] < a1:
                continue  # answer not fully in this window: target [CLS]
            s = inside[offsets[w, inside, 0] <= a0][-1]
            e = inside[offsets[w, inside, 1] >= a1][0]
            starts[w], ends[w] = s, e
    return QaFeatures(input_ids, attention, types, offsets, example, list(contexts), starts, ends)


def window_rows(feats: QaFeatures, with_answers: bool = False) -> list[dict[str, np.ndarray]]:
    """One feature row per window, padding cut off (``start/end_positions`` too with ``with_answers``)."""
    rows = []
    for w in range(len(feats.input_ids)):
        n = int(feats.attention_mask[w].sum())
        row = {"input_ids": feats.input_ids[w, :n], "token_type_ids": feats.token_type_ids[w, :n]}
        if with_answers:
            row["start_positions"] = feats.start_positions[w]
            row["end_positions"] = feats.end_positions[w]
        rows.append(row)
    return rows


def window_span_logits(feats: QaFeatures, outs: Sequence[Sequence[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Start and end logits (W, L) from each window row's (start (n,), end (n,)) outputs; padding -1e9."""
    width = feats.input_ids.shape[1]
    start = np.full((len(outs), width), -1e9, dtype=np.float32)
    end = np.full((len(outs), width), -1e9, dtype=np.float32)
    for w, (s, e) in enumerate(outs):
        start[w, : len(s)], end[w, : len(e)] = s, e
    return start, end


def decode_answers(
    features: QaFeatures,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    *,
    n_best: int = 20,
    max_answer_length: int = 30,
    top_k: int = 1,
) -> list[list[Answer]]:
    """The ``top_k`` best answer spans per example (best first), from logits (W, L) each.

    An example whose windows hold no valid span gets an empty list.
    """
    start_logits = np.asarray(start_logits, dtype=np.float32)
    end_logits = np.asarray(end_logits, dtype=np.float32)
    n_examples = len(features.contexts)
    candidates: list[dict[tuple[int, int], float]] = [{} for _ in range(n_examples)]
    for w in range(len(features.example_index)):
        i = int(features.example_index[w])
        off = features.offsets[w]
        valid = off[:, 0] >= 0
        s_log = np.where(valid, start_logits[w], -np.inf)
        e_log = np.where(valid, end_logits[w], -np.inf)
        s_idx = np.argsort(-s_log)[:n_best]
        e_idx = np.argsort(-e_log)[:n_best]
        for s in s_idx:
            if not valid[s]:
                continue
            for e in e_idx:
                if not valid[e] or e < s or e - s + 1 > max_answer_length:
                    continue
                span = (int(off[s, 0]), int(off[e, 1]))
                score = float(s_log[s] + e_log[e])
                if score > candidates[i].get(span, -np.inf):
                    candidates[i][span] = score
    out = []
    for i, cands in enumerate(candidates):
        best = sorted(cands.items(), key=lambda kv: -kv[1])[:top_k]
        out.append([Answer(features.contexts[i][a:b], a, b, sc) for (a, b), sc in best])
    return out
