"""Classify features and decoding: texts (and pairs) -> token rows, and logits -> labels with probabilities.

Pure functions on a fast HF tokenizer and numpy arrays, with the model behind an injected engine
(:mod:`encoderkit.tasks.inference`: torch or ONNX Runtime), shared by evaluation, the Predictor and
compression. Texts longer than ``max_length`` sub-tokens are truncated (the longer of a pair first).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from encoderkit.tasks.inference import Engine, run_rows


def featurize(tokenizer, texts: list[str], pairs: list[str] | None, max_length: int) -> list[dict[str, np.ndarray]]:
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    return [{k: np.asarray(enc[k][i], dtype=np.int64) for k in keys} for i in range(len(texts))]


def engine_logits(engine: Engine, rows: list[dict[str, np.ndarray]], pad_id: int, batch_size: int) -> np.ndarray:
    """Logits (N, C) for feature rows from any engine (evaluate, the Predictor: torch or ONNX Runtime)."""
    if not rows:
        return np.zeros((0, 0), np.float32)
    return np.stack([out[0] for out in run_rows(engine, rows, pad_id, batch_size)])


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def decode(logits: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    """Per row of logits (N, C): the label, its probability and every label's probability; a one-logit
    head (a reranker) gives its sigmoid as ``score``."""
    if logits.shape[1] == 1:
        probs = 1.0 / (1.0 + np.exp(-logits[:, 0]))
        return [{"label": "score", "score": float(p), "scores": {"score": float(p)}} for p in probs]
    probs = softmax(logits)
    labels = labels or [f"LABEL_{i}" for i in range(logits.shape[1])]
    return [{"label": labels[int(p.argmax())], "score": float(p.max()),
             "scores": {labels[c]: float(p[c]) for c in range(len(p))}} for p in probs]
