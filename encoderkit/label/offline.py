"""Offline labellers that need only an encoder, no server.

:class:`EmbedLabeller`: nearest label prototype (description and seed texts) in embedding space.
:class:`ClozeLabeller`: PET (Schick & Schütze 2021), the masked-LM logit of each label's verbalizer word in a
pattern. The confidence is the softmax over the labels' scores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.inference.policy import EngineChoice
from encoderkit.inference.predictor import Predictor
from encoderkit.label.endpoint import Labelled
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks import get_task


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _decide(scores: np.ndarray, labels: list[str]) -> list[Labelled]:
    probs = _softmax(scores)
    return [Labelled(labels[int(p.argmax())], float(p.max()), []) for p in probs]


class EmbedLabeller:
    """Nearest label prototype by cosine similarity."""

    def __init__(self, model: str | Path, labels: list[str], descriptions: dict[str, str],
                 seeds: list[tuple[str, str]] | None = None, temperature: float = 0.05,
                 backend: str | EngineChoice = "auto",
                 batch_size: int = 32, threads: int | None = None) -> None:
        self.predictor = Predictor.load(model, backend=backend, threads=threads, max_batch=batch_size)
        if get_task(self.predictor.task).endpoint != "embed":  # prototypes are sentence vectors: /v1/embed's call
            raise EncoderkitError(f"--model {model} is a {self.predictor.task!r} model; the embed labeller needs an "
                                  "embedding model (a sentence-transformers folder, e.g. minilm)")
        self.labels, self.temperature = labels, temperature
        anchors = [descriptions.get(name, name) for name in labels]
        protos = self.predictor.embed(anchors, normalize=True)  # (C, H)
        if seeds:
            by_label: dict[str, list[str]] = {name: [] for name in labels}
            for text, lab in seeds:
                by_label[lab].append(text)
            for c, name in enumerate(labels):
                if by_label[name]:
                    vecs = self.predictor.embed(by_label[name], normalize=True)
                    protos[c] = np.vstack([protos[c:c + 1], vecs]).mean(axis=0)
        self.prototypes = protos / np.linalg.norm(protos, axis=1, keepdims=True)

    def label(self, texts: list[str]) -> list[Labelled]:
        vecs = self.predictor.embed(texts, normalize=True)  # (N, H)
        return _decide(vecs @ self.prototypes.T / self.temperature, self.labels)


DEFAULT_PATTERN = "{text} It was {mask}."


class ClozeLabeller:
    """Verbalizer logits at the mask of ``pattern`` (which holds ``{text}`` and ``{mask}`` once each)."""

    def __init__(self, model: str | Path, labels: list[str], verbalizer: dict[str, str], pattern: str = DEFAULT_PATTERN,
                 max_length: int = 128, batch_size: int = 32) -> None:
        for ph in ("{text}", "{mask}"):
            if pattern.count(ph) != 1:
                raise EncoderkitError(f"--pattern {pattern!r} must hold {ph} exactly once")
        missing = [name for name in labels if name not in verbalizer]
        if missing:
            raise EncoderkitError(f"--verbalizer has no word for {', '.join(missing)}; give LABEL=WORD for every label")
        folder = ModelFolder.open(model)
        self.tok = folder.tokenizer()
        try:  # a quantized or head-pruned MLM folder is rebuilt
            self.model = folder.load(task="mlm")
        except EncoderkitError as e:
            raise EncoderkitError(f"--model {model}: no masked-LM head could be loaded ({e.__cause__ or e}); the cloze "
                                  "labeller needs an MLM folder (e.g. the output of `encoderkit pretrain`)") from e
        if self.tok.mask_token is None:
            raise EncoderkitError(f"--model {model}: the tokenizer has no mask token")
        self.word_ids = []
        for name in labels:
            ids = self.tok(verbalizer[name], add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise EncoderkitError(f"--verbalizer {name}={verbalizer[name]}: {len(ids)} tokens for this tokenizer "
                                      f"({self.tok.convert_ids_to_tokens(ids)}); pick a word that is one token")
            self.word_ids.append(ids[0])
        before, after = pattern.split("{text}")
        enc = lambda s: self.tok(s.replace("{mask}", self.tok.mask_token), add_special_tokens=False)["input_ids"]
        self.before, self.after = enc(before), enc(after)
        self.labels, self.max_length, self.batch_size = labels, max_length, batch_size

    def _row(self, text: str) -> list[int]:
        budget = self.max_length - len(self.before) - len(self.after) - 2
        ids = self.tok(text, add_special_tokens=False)["input_ids"][:max(budget, 0)]
        return [self.tok.cls_token_id, *self.before, *ids, *self.after, self.tok.sep_token_id]

    def label(self, texts: list[str]) -> list[Labelled]:
        out: list[np.ndarray] = []
        for start in range(0, len(texts), self.batch_size):
            rows = [self._row(t) for t in texts[start:start + self.batch_size]]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.tok.pad_token_id or 0, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r)
                mask[i, :len(r)] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
            at = (ids == self.tok.mask_token_id).float().argmax(dim=1)  # (B,) the mask's position
            out.append(logits[torch.arange(len(rows)), at][:, self.word_ids].float().numpy())  # (B, C)
        return _decide(np.concatenate(out), self.labels)
