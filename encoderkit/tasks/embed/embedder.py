"""The one text-to-vector path: tokenise, run an engine, pool, cut (Matryoshka), normalise.

    Embedder.of_runner(predictor).embed(texts, dim=256)        # serving, index, search, label (ONNX or torch)
    Embedder.of_module(bi_encoder, tokenizer, 256).embed(texts)  # training-time evaluation, mining, exact search

The engine gives token states (B, T, H), or pools itself (``pools``: a training-time BiEncoder on its device), or
reads whole texts (``pool_texts``: a static model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.models.pooling import POOLINGS, pool_array
from encoderkit.tasks.inference import run_rows


def tokenize(tokenizer: Any, texts: list[str], max_length: int) -> list[dict[str, np.ndarray]]:
    """1-D int64 token rows (``input_ids``, ``token_type_ids`` when the tokenizer gives them), cut to ``max_length``."""
    enc = tokenizer(texts, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    return [{k: np.asarray(enc[k][i], dtype=np.int64) for k in keys} for i in range(len(texts))]


class PooledEngine:
    """An engine that gives token states (``last_hidden_state``: ONNX Runtime on an export, or a torch
    encoder) as one that gives sentence embeddings (B, H): pooled by :func:`encoderkit.models.pooling.pool_array`
    as :class:`~encoderkit.tasks.embed.features.BiEncoder` pools, then L2-normalised when ``normalize``."""

    pools = True

    def __init__(self, engine: Any, pooling: str, normalize: bool = True) -> None:
        self.engine, self.pooling, self.normalize = engine, pooling, normalize
        self.in_flight = getattr(engine, "in_flight", 1)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self._pooled(self.engine.run(inputs), inputs)

    def run_many(self, batches: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        return [self._pooled(outs, b) for outs, b in zip(self.engine.run_many(batches), batches, strict=True)]

    def _pooled(self, outs: list[np.ndarray], inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        pooled = pool_array(np.asarray(outs[0], dtype=np.float32), inputs["attention_mask"], self.pooling)
        if self.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return [pooled]



class BiEncoderEngine:
    """A :class:`~encoderkit.tasks.embed.features.BiEncoder` as an engine that pools (``pools``): the encoder and
    its pooling run on the module's device, un-normalised (the :class:`Embedder` cuts and normalises), and
    ``[(B, H) float32]`` comes back. The caller puts the module in eval mode."""

    pools = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            pooled = self.model(**{k: torch.from_numpy(v).to(device) for k, v in inputs.items()}, normalize=False)
        return [pooled.float().cpu().numpy()]


class Embedder:
    """Texts -> embeddings over one engine; see the module docstring. ``normalize`` is the default of
    :meth:`embed` (a folder's sentence-transformers ``Normalize`` module); ``max_batch`` rows per engine call."""

    def __init__(self, engine: Any, tokenizer: Any, pooling: str, *, normalize: bool = True, max_length: int = 256,
                 max_batch: int = 64) -> None:
        if pooling not in POOLINGS:
            raise EncoderkitError(f"embedding pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.engine, self.tokenizer, self.pooling, self.normalize = engine, tokenizer, pooling, normalize
        self.max_length, self.max_batch = max_length, max_batch

    @classmethod
    def of_runner(cls, runner: Any) -> Embedder:
        """The Predictor's (a :class:`~encoderkit.tasks.protocol.Runner`): its engine, tokenizer, length and batch
        limits, and the folder's pooling and normalisation (:class:`~encoderkit.models.folder.ModelFolder`)."""
        return cls(runner.engine, runner.tokenizer, runner.info.pooling, normalize=bool(runner.info.normalize),
                   max_length=runner.max_length, max_batch=runner.max_batch)

    @classmethod
    def of_module(cls, model: Any, tokenizer: Any, max_length: int, max_batch: int = 64) -> Embedder:
        """A :class:`~encoderkit.tasks.embed.features.BiEncoder` (its encoder, pooling and normalisation), as it
        is now: training evaluates the weights being trained. It pools on its device (:class:`BiEncoderEngine`);
        the embedder cuts and normalises. The caller puts the module in eval mode."""
        return cls(BiEncoderEngine(model), tokenizer, model.pooling, normalize=model.normalize, max_length=max_length,
                   max_batch=max_batch)

    def pooled(self, texts: Sequence[str], max_length: int | None = None, progress: bool = False,
               max_batch: int | None = None) -> np.ndarray:
        """Pooled, un-normalised embeddings (N, H) float32 of ``texts`` cut to ``max_length`` (default: the
        embedder's) sub-tokens, ``max_batch`` (default: the embedder's) rows per engine call; (0, 0) for no
        texts. ``progress``: a progress bar (a corpus)."""
        if len(texts) == 0:
            return np.zeros((0, 0), dtype=np.float32)
        if getattr(self.engine, "pool_texts", None) is not None:  # reads whole texts itself (a static model)
            return self.engine.pool_texts(list(texts))
        rows = tokenize(self.tokenizer, list(texts), max_length or self.max_length)
        return self.pooled_rows(rows, progress, max_batch)

    def pooled_rows(self, rows: list[dict[str, np.ndarray]], progress: bool = False,
                    max_batch: int | None = None) -> np.ndarray:
        """Pooled, un-normalised embeddings (N, H) float32 of token rows already made (``input_ids`` and
        ``token_type_ids`` 1-D int64, as :func:`tokenize` gives): e.g. one token between [CLS] and [SEP]."""
        engine = self.engine if getattr(self.engine, "pools", False) else PooledEngine(self.engine, self.pooling, False)
        out = run_rows(engine, rows, self.tokenizer.pad_token_id or 0, max_batch or self.max_batch,
                       desc="encode" if progress else "")
        return np.stack([o[0] for o in out]).astype(np.float32)

    def embed(self, texts: Sequence[str], dim: int | None = None, normalize: bool | None = None,
              max_length: int | None = None, progress: bool = False, max_batch: int | None = None) -> np.ndarray:
        """Embeddings (N, dim or H) float32: :meth:`pooled`, then :meth:`finish` (``normalize`` defaults to the
        embedder's)."""
        return self.finish(self.pooled(texts, max_length, progress, max_batch), dim,
                           self.normalize if normalize is None else normalize)

    @staticmethod
    def finish(vectors: np.ndarray, dim: int | None, normalize: bool) -> np.ndarray:
        """Keep the first ``dim`` dimensions (Matryoshka truncation) of (N, H) vectors, then L2-normalise."""
        if dim is not None:
            if not 1 <= dim <= vectors.shape[1]:
                raise EncoderkitError(f"dim={dim} must be between 1 and the model's {vectors.shape[1]} dimensions")
            vectors = vectors[:, :dim]
        if normalize:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(vectors, dtype=np.float32)
