"""Cross-encoder features: (query, passage) pairs -> token rows, and a model's relevance score per pair.

Pairs longer than ``max_length`` sub-tokens are truncated ``longest_first``: the passage is cut
first; a query longer than the passage is cut too (``only_second`` fails outright on a query longer
than ``max_length``). The deploy runtime truncates the same way.
"""

from __future__ import annotations

import numpy as np

from encoderkit.tasks.common import run_batches


def pair_rows(tokenizer, queries: list[str], passages: list[str], max_length: int) -> list[dict[str, np.ndarray]]:
    enc = tokenizer(queries, passages, truncation="longest_first", max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    return [{k: np.asarray(enc[k][i], dtype=np.int64) for k in keys} for i in range(len(queries))]


def score_pairs(module, tokenizer, query: str | list[str], passages: list[str], max_length: int = 256,
                batch_size: int = 64, desc: str = "") -> np.ndarray:
    """Relevance scores (N,) of (query, passage) pairs; ``query`` is one string or one per passage.
    ``module``: a torch model or an engine whose output is the logits (the first one is the score); ``desc``: show
    progress under that name."""
    if not passages:
        return np.zeros(0, dtype=np.float32)
    queries = [query] * len(passages) if isinstance(query, str) else list(query)
    return score_rows(module, pair_rows(tokenizer, queries, passages, max_length), tokenizer.pad_token_id, batch_size,
                      desc=desc)


def score_rows(module, rows: list[dict[str, np.ndarray]], pad_id: int, batch_size: int = 64,
               desc: str = "") -> np.ndarray:
    """Relevance scores (N,) of already tokenised pairs (:func:`pair_rows`); ``desc``: show progress under that name."""
    out = run_batches(module, rows, pad_id, batch_size, lambda o: o.logits[:, :1], desc=desc)
    return np.asarray(out, dtype=np.float32).reshape(len(rows), -1)[:, 0]
