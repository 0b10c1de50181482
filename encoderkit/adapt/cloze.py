"""Cloze queries from a masked-LM (``--offline-kinds cloze --cloze-model FOLDER``).

A passage sentence with a seeded :data:`CLOZE_RATE` of its content words (one-sub-token, alphabetic, not
stopwords) masked at once, each replaced by the masked-LM's top other whole-word prediction: a paraphrase that no
longer matches the passage word for word. Deterministic given the sentence's seed; a sentence with nothing to
replace gives no query (counted).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder, task_from_config
from encoderkit.models.tokenizer import token_surfaces, word_start_table
from encoderkit.tasks.common import resolve_model

CLOZE_RATE = 0.3  # share of a sentence's content words the masked-LM replaces
BATCH = 32  # sentences per masked-LM forward pass
MAX_TOKENS = 128  # sub-tokens of a sentence the masked-LM reads
_STOPWORDS = """
a about above after again against all am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just me more most my myself no nor not now of off on
once only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which
while who whom why will with would you your yours yourself yourselves also may might must shall upon via within
without whether however thus therefore although though yet either neither one two three many much another
"""
STOPWORDS = frozenset(_STOPWORDS.split())  # function words: never masked, never put in
MLM_FOLDER = ("a folder with a masked-LM head (the output of `encoderkit pretrain`, or a *ForMaskedLM folder such "
              "as bert-base-uncased; all-MiniLM-L6-v2 as shipped has no MLM head)")
NEEDS_MODEL = f"--offline-kinds cloze needs --cloze-model FOLDER: {MLM_FOLDER}"


class ClozeWriter:
    """The masked-LM of ``--cloze-model`` and the vocabulary it may put in a query; counts what it made."""

    def __init__(self, name: str | Path, batch_size: int = BATCH) -> None:
        folder = ModelFolder.open(resolve_model(name))
        if task_from_config(folder.config) != "mlm":
            arch = ", ".join(folder.config.get("architectures") or []) or "no architectures in config.json"
            raise EncoderkitError(f"--cloze-model {name} has no masked-LM head ({arch}); give {MLM_FOLDER}")
        self.tok = folder.tokenizer()
        if self.tok.mask_token_id is None:
            raise EncoderkitError(f"--cloze-model {name}: its tokenizer has no mask token; give {MLM_FOLDER}")
        self.model = folder.load(task="mlm")
        self.batch_size = batch_size
        vocab = int(self.model.config.vocab_size)  # the logits' width
        starts = word_start_table(self.tok)[:vocab]  # (the tokenizer's own word marks: ##, Ġ, ▁)
        self.lower = [w.lower() for w in token_surfaces(self.tok)]  # "" for special and added tokens
        allowed = np.zeros(vocab, dtype=bool)  # whole words a query may hold
        allowed[: len(starts)] = [bool(st) and len(w) >= 2 and w.isalpha() and w not in STOPWORDS
                                  for st, w in zip(starts, self.lower, strict=False)]
        self.allowed = torch.from_numpy(allowed)  # (V,)
        self.spellings: dict[str, list[int]] = {}  # a word's ids in every case and spelling of its piece
        for i, w in enumerate(self.lower):
            self.spellings.setdefault(w, []).append(i)
        self.special = set(self.tok.all_special_ids)
        self.made = self.skipped = 0

    def counts(self) -> dict[str, int]:
        return {"cloze_queries": self.made, "cloze_skipped": self.skipped}

    def _masked(self, sentence: str, seed: int) -> tuple[list[int], list[int]]:
        """The sentence's ids (with special tokens) and the positions to mask (sorted; none: nothing to replace)."""
        enc = self.tok(sentence, truncation=True, max_length=MAX_TOKENS)
        ids, words = list(enc["input_ids"]), enc.word_ids()
        per_word: dict[int, int] = {}
        for w in words:
            if w is not None:
                per_word[w] = per_word.get(w, 0) + 1
        content = [i for i, (t, w) in enumerate(zip(ids, words, strict=True))
                   if w is not None and per_word[w] == 1 and t not in self.special
                   and self.lower[t].isalpha() and self.lower[t] not in STOPWORDS]
        if not content:
            return ids, []
        n = max(1, round(CLOZE_RATE * len(content)))
        picked = np.random.default_rng(seed).choice(len(content), size=n, replace=False)
        return ids, sorted(content[int(i)] for i in picked)

    def rewrite(self, sentences: list[str], seeds: list[int]) -> list[str | None]:
        """Each sentence with its masked words replaced (see the module docstring); None where nothing could be."""
        plans = [self._masked(s, seed) for s, seed in zip(sentences, seeds, strict=True)]
        out: list[str | None] = [None] * len(sentences)
        todo = [i for i, (_, at) in enumerate(plans) if at]
        pad = self.tok.pad_token_id or 0
        for a in range(0, len(todo), self.batch_size):
            part = todo[a : a + self.batch_size]
            width = max(len(plans[i][0]) for i in part)
            ids = torch.full((len(part), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(part):
                row, at = plans[i]
                ids[r, : len(row)] = torch.tensor(row)
                ids[r, at] = self.tok.mask_token_id
                mask[r, : len(row)] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()  # (B, T, V)
            for r, i in enumerate(part):
                row, at = plans[i]
                scores = logits[r, at].masked_fill(~self.allowed, float("-inf"))  # (M, V)
                for m, t in enumerate(at):
                    scores[m, self.spellings[self.lower[row[t]]]] = float("-inf")  # not the word itself
                new = list(row)
                for t, pred in zip(at, scores.argmax(-1).tolist(), strict=True):
                    new[t] = int(pred)
                out[i] = self._text(new, sentences[i])
        self.made += sum(q is not None for q in out)
        self.skipped += sum(q is None for q in out)
        return out

    def _text(self, ids: list[int], sentence: str) -> str | None:
        text = " ".join(self.tok.decode(ids, skip_special_tokens=True).split())
        return text if text and text.lower() != " ".join(sentence.split()).lower() else None
