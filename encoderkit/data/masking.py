"""MLM masking: pure, seeded, vectorised.

:func:`mask_tokens` draws from a ``torch.Generator``; :class:`Masker` from a counter-based hash of ``(seed, epoch,
block, position)``, so a block's mask depends on nothing else: a resumed run reproduces it without saving RNG state,
and neither the batch size nor the sharding across processes changes it. Per sequence ``rate * n_eligible`` tokens
are picked, rounded stochastically so the expected fraction is the rate even for short sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from encoderkit.config import check
from encoderkit.data.prepare import splitmix64  # kept there so tokenising worker processes never import torch
from encoderkit.models.tokenizer import token_surfaces, word_start_table

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MaskingSpec:
    """What to mask. ``rate`` is the fraction of eligible tokens picked (BERT 0.15; 0.3-0.4 works
    well for short runs); of those, ``mask_frac`` become [MASK], ``random_frac`` a random token and
    the rest are kept (but still predicted)."""

    rate: float = 0.15
    mask_frac: float = 0.8
    random_frac: float = 0.1
    whole_word: bool = False
    words_only: bool = False
    skip_words: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        check(0.0 < self.rate < 1.0, f"masking rate must be between 0 and 1 (exclusive), got {self.rate}")
        check(0.0 <= self.mask_frac <= 1.0, f"mask_frac must be in [0, 1], got {self.mask_frac}")
        check(0.0 <= self.random_frac <= 1.0, f"random_frac must be in [0, 1], got {self.random_frac}")
        check(
            self.mask_frac + self.random_frac <= 1.0 + 1e-9,
            f"mask_frac + random_frac must be at most 1 (the rest is kept), got {self.mask_frac} + {self.random_frac}",
        )


# -- core: from uniform draws to a mask --------------------------------------------------------
def _pick_tokens(eligible: torch.Tensor, score: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Pick the ``budget[b]`` eligible positions of lowest ``score`` in each row.

    eligible, score: (B, L); budget: (B,) long. Returns picked (B, L) bool.
    """
    score = score.masked_fill(~eligible, float("inf"))
    sorted_score = score.sort(dim=1).values  # (B, L)
    # the budget-th smallest score is the row's threshold (draws are 53-bit floats: no ties)
    threshold = sorted_score.gather(1, (budget - 1).clamp(min=0)[:, None])  # (B, 1)
    return (score <= threshold) & (budget[:, None] > 0) & eligible


def _pick_whole_words(
    eligible: torch.Tensor, word_start: torch.Tensor, score: torch.Tensor, budget: torch.Tensor
) -> torch.Tensor:
    """Pick whole words in order of their start token's ``score`` until ``budget[b]`` tokens.

    A word is taken while the running token count's midpoint stays within the budget (so the
    count lands as close to the budget as word lengths allow, without bias up or down).
    eligible, word_start, score: (B, L); budget: (B,). Returns picked (B, L) bool.
    """
    B, L = eligible.shape
    prev_eligible = torch.cat([torch.zeros(B, 1, dtype=torch.bool), eligible[:, :-1]], dim=1)
    starts = eligible & (word_start | ~prev_eligible)  # (B, L)
    word_id = starts.long().cumsum(dim=1) - 1  # (B, L): index of the word a token belongs to
    word_id = word_id.clamp(min=0)
    # per word slot: length and score of its start token (slots without a word: inf score, 0 length)
    word_len = torch.zeros(B, L, dtype=torch.long).scatter_add_(1, word_id, eligible.long())
    word_score = torch.full((B, L), float("inf"), dtype=score.dtype).scatter_reduce(
        1, word_id, score.masked_fill(~starts, float("inf")), reduce="amin")
    order = word_score.argsort(dim=1)  # (B, L) word slots, best first
    sorted_len = word_len.gather(1, order)
    before = sorted_len.cumsum(dim=1) - sorted_len
    take_sorted = (before.double() + sorted_len.double() / 2 <= budget[:, None].double()) & (sorted_len > 0)
    take_word = torch.zeros(B, L, dtype=torch.bool).scatter(1, order, take_sorted)
    return take_word.gather(1, word_id) & eligible


def apply_masking(
    input_ids: torch.Tensor,
    *,
    spec: MaskingSpec,
    eligible: torch.Tensor,
    mask_id: int,
    random_ids: torch.Tensor,
    word_start: torch.Tensor | None,
    draws: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask ``input_ids`` (B, L) given uniform ``draws`` (4, B, L) in [0, 1).

    draws[0] orders positions (or words), draws[1][:, 0] rounds the budget, draws[2] chooses
    mask / random / keep, draws[3] chooses the random replacement. Returns (masked_ids, labels),
    both (B, L) long, labels ``-100`` where not picked.
    """
    n_eligible = eligible.sum(dim=1).double()  # (B,)
    exact = spec.rate * n_eligible
    budget = (exact.floor() + (draws[1][:, 0].double() < exact - exact.floor()).double()).long()  # (B,)
    check(not spec.whole_word or word_start is not None,
          "whole-word masking needs word_start (B, L): which tokens begin a word "
          "(encoderkit.models.tokenizer.word_start_table)")
    if spec.whole_word:
        picked = _pick_whole_words(eligible, word_start.bool(), draws[0], budget)
    else:
        picked = _pick_tokens(eligible, draws[0], budget)
    labels = torch.where(picked, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    to_mask = picked & (draws[2] < spec.mask_frac)
    to_random = picked & ~to_mask & (draws[2] < spec.mask_frac + spec.random_frac)
    idx = (draws[3] * len(random_ids)).long().clamp_(max=len(random_ids) - 1)
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(to_random, random_ids.to(input_ids.dtype)[idx], masked)
    return masked, labels


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    spec: MaskingSpec,
    special_mask: torch.Tensor,
    mask_id: int,
    random_ids: torch.Tensor,
    word_start: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask a batch with randomness from ``generator``.

    input_ids (B, L) long; special_mask (B, L) bool, True for special tokens and padding (never
    picked); random_ids (V',) long, the ids a random replacement may take; word_start (B, L)
    bool or None (needed for ``spec.whole_word``). Returns (masked_ids, labels), both (B, L).
    """
    B, L = input_ids.shape
    draws = torch.rand((4, B, L), generator=generator, dtype=torch.float64)
    return apply_masking(input_ids.long(), spec=spec, eligible=~special_mask.bool(), mask_id=mask_id,
                         random_ids=random_ids, word_start=word_start, draws=draws)


def never_pick_table(tokenizer: Any, spec: MaskingSpec, word_start: np.ndarray | None) -> np.ndarray:
    """(V,) bool: the ids ``spec`` never picks besides the special ones: with ``words_only`` every token
    whose text is not all letters (a byte-level piece of a multi-byte character counts as letters);
    with ``skip_words`` every word-start token (``word_start``, the tokenizer's table) spelling one of
    them (any case)."""
    surfaces = token_surfaces(tokenizer)
    never = np.zeros(len(surfaces), dtype=bool)
    if spec.words_only:
        never |= np.array([not s or not all(ch.isalpha() or ch == "\ufffd" for ch in s) for s in surfaces])
    if spec.skip_words:
        skip = {w.lower() for w in spec.skip_words}
        never |= np.array([bool(s) and s.lower() in skip for s in surfaces]) & word_start[:len(surfaces)]
    return never


# -- counter-based draws: a pure function of (seed, epoch, block, stream, position) ------------
def block_draws(seed: int, epoch: int, block_index: np.ndarray, length: int, streams: int = 4) -> torch.Tensor:
    """Uniform draws in [0, 1) of shape (streams, B, L) that depend only on (seed, epoch, block, position).

    block_index: (B,) ints (global index of each block in the data set).
    """
    blocks = np.asarray(block_index, dtype=np.int64).astype(np.uint64)  # (B,)
    key = splitmix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))
    key = splitmix64(key ^ np.array([epoch & (2**64 - 1)], dtype=np.uint64))
    row = splitmix64(key ^ splitmix64(blocks))  # (B,)
    counter = (np.arange(streams, dtype=np.uint64)[:, None, None] << np.uint64(32)) | np.arange(length, dtype=np.uint64)
    bits = splitmix64(row[None, :, None] ^ splitmix64(counter))  # (S, B, L)
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53))


class Masker:
    """Turns blocks of token ids into an MLM batch, deterministically per (seed, epoch, block).

    Build it with :meth:`from_tokenizer` (or the explicit ids). ``masker(blocks, block_index, epoch)``
    returns ``input_ids``, ``attention_mask`` and ``labels``, each (B, L) long tensors.
    """

    def __init__(
        self,
        *,
        spec: MaskingSpec,
        seed: int,
        mask_id: int,
        pad_id: int | None,
        special_ids: Sequence[int],
        vocab_size: int,
        word_start_table: np.ndarray | None = None,
        never_table: np.ndarray | None = None,
    ) -> None:
        self.spec = spec
        self.seed = int(seed)
        self.mask_id = int(mask_id)
        self.pad_id = None if pad_id is None else int(pad_id)
        specials = sorted({int(i) for i in special_ids} | ({self.pad_id} if self.pad_id is not None else set()))
        is_special = np.zeros(vocab_size, dtype=bool)
        is_special[[i for i in specials if 0 <= i < vocab_size]] = True
        self.random_ids = torch.from_numpy(np.flatnonzero(~is_special)).long()  # (V',)
        check(len(self.random_ids) > 0, "the vocabulary has no non-special token to use as a random replacement")
        check(
            not spec.whole_word or word_start_table is not None,
            "whole-word masking needs the tokenizer's word-start table",
        )
        self.word_start_table = (None if word_start_table is None
                                 else torch.from_numpy(np.asarray(word_start_table, dtype=bool)))
        # (V,) bool: ids never picked: the special ones and padding, and never_table's (words_only / skip_words)
        never = is_special.copy()
        if never_table is not None:
            extra = np.asarray(never_table, dtype=bool)[:vocab_size]
            never[:len(extra)] |= extra
            check(not never.all(), "masking: --mask-words-only / --mask-skip-words leave no token of this "
                  "vocabulary to pick")
        self.never = torch.from_numpy(never)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, spec: MaskingSpec, seed: int) -> Masker:
        """Take the [MASK], pad and special ids (and, for whole-word masking, the word-start table;
        for ``words_only`` / ``skip_words``, the ids never picked) from a transformers tokenizer."""
        check(tokenizer.mask_token_id is not None,
              f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no mask token; MLM needs one "
              "(train a tokenizer with `encoderkit tokenizer train`, which adds [MASK])")

        starts = word_start_table(tokenizer) if spec.whole_word or spec.skip_words else None
        never = never_pick_table(tokenizer, spec, starts) if spec.words_only or spec.skip_words else None
        return cls(spec=spec, seed=seed, mask_id=tokenizer.mask_token_id, pad_id=tokenizer.pad_token_id,
                   special_ids=tokenizer.all_special_ids, vocab_size=len(tokenizer),
                   word_start_table=starts if spec.whole_word else None, never_table=never)

    def eligible(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, L) bool: the tokens that may be picked (not special, not padding, not never-picked; an id
        past the vocabulary is not special)."""
        size = len(self.never)
        return ~self.never[ids.clamp(0, size - 1)] | (ids >= size)

    def __call__(self, blocks: np.ndarray | torch.Tensor, block_index: np.ndarray | Sequence[int] | torch.Tensor,
                 epoch: int) -> dict[str, torch.Tensor]:
        """blocks (B, L) ints; block_index (B,) global block numbers; returns input_ids,
        attention_mask (0 on padding) and labels (-100 where not picked), each (B, L) long."""
        ids = torch.as_tensor(np.asarray(blocks, dtype=np.int64)) if not torch.is_tensor(blocks) else blocks.long()
        if torch.is_tensor(block_index):
            block_index = block_index.cpu().numpy()
        B, L = ids.shape
        check(len(block_index) == B, f"got {B} blocks but {len(block_index)} block indices")
        draws = block_draws(self.seed, epoch, np.asarray(block_index), L)
        word_start = None
        if self.spec.whole_word:
            word_start = self.word_start_table[ids.clamp(0, len(self.word_start_table) - 1)]
        masked, labels = apply_masking(ids, spec=self.spec, eligible=self.eligible(ids), mask_id=self.mask_id,
                                       random_ids=self.random_ids, word_start=word_start, draws=draws)
        if self.pad_id is None:
            attention = torch.ones_like(ids)
        else:
            attention = (ids != self.pad_id).long()
        return {"input_ids": masked, "attention_mask": attention, "labels": labels}
