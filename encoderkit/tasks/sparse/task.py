"""The sparse task object (:mod:`encoderkit.tasks.protocol`): learned sparse retrieval (SPLADE), one weight per
vocabulary entry per text; served on ``/v1/embed_sparse`` as ``{token: weight}``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.protocol import Runner, ServingUnit, Task
from encoderkit.tasks.sparse.features import OUTPUT, Splade, top_terms
from encoderkit.tasks.sparse.train import OPTIONS, SPARSE_DATA, encode
from encoderkit.tasks.sparse.train import build as build_run
from encoderkit.tasks.sparse.train import evaluate_folder as evaluate_saved


class SparseTask(Task):
    name = "sparse"
    options = OPTIONS
    outputs = (OUTPUT,)  # the pooled vector (B, V): the graph pools, so a batch's output is not (B, T, V)
    endpoint = "embed_sparse"
    unit = ServingUnit("one query (batch 1)", "query", "a batch of 32 corpus documents", "32 documents")
    primary_metrics = ("ndcg@10",)
    data_help = SPARSE_DATA

    # -- training and evaluation: the task's train module ------------------------------------------
    build = staticmethod(build_run)
    evaluate_folder = staticmethod(evaluate_saved)

    def graph_module(self, model: Any) -> Any:
        """The masked-LM model with SPLADE pooling on top: the graph's output is the pooled vector."""
        return Splade(model)

    # -- inference ----------------------------------------------------------------------------------
    def vectors(self, runner: Runner, texts: Sequence[str], max_length: int | None = None) -> Any:
        """SPLADE vectors of ``texts`` as a CSR matrix (N, V) float32 (cut to ``max_length``, default the
        runner's)."""
        vocab = int(runner.info.config.get("vocab_size") or len(runner.tokenizer))
        return encode(runner.engine, runner.tokenizer, list(texts), max_length or runner.max_length, runner.max_batch,
                      vocab)

    def tokens(self, runner: Runner) -> list[str]:
        """The token of each vector entry (the tokenizer's; ids past it, a vocabulary the tokenizer does not use, as
        ``[unused<id>]``)."""
        vocab = int(runner.info.config.get("vocab_size") or len(runner.tokenizer))
        names = runner.tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(runner.tokenizer)))))
        return list(names) + [f"[unused{i}]" for i in range(len(names), vocab)]

    def terms(self, runner: Runner, rows: Sequence[tuple[np.ndarray, np.ndarray]], top_k: int = 0,
              threshold: float = 0.0) -> list[dict[str, float]]:
        """``{token: weight}`` per (indices, values) row, heaviest first (``top_k`` 0: every non-zero one)."""
        tokens = self.tokens(runner)
        return [top_terms(i, v, tokens, top_k, threshold) for i, v in rows]

    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], *, top_k: int = 0, threshold: float = 0.0,
                **kw: Any) -> list[dict[str, Any]]:
        """``{"terms": {token: weight}}`` per record (``text``): its non-zero weights, heaviest first."""
        rows = self.serve(runner, [r["text"] for r in records])
        return [{"terms": t} for t in self.terms(runner, rows, top_k, threshold)]

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """Items: texts; each one's non-zero entries as (token ids int32, weights float32) (the route picks the
        terms)."""
        if any(not isinstance(x, str) for x in items):
            raise EncoderkitError("a sparse model encodes single texts; send 'texts'")
        if not items:
            return []
        m = self.vectors(runner, items)
        return [(m.indices[m.indptr[i]:m.indptr[i + 1]].astype(np.int32), m.data[m.indptr[i]:m.indptr[i + 1]])
                for i in range(m.shape[0])]

    # -- compression: not offered for sparse models ----------------------------------------------------
    planned_unit = (32, "a batch of 32 documents, and a single query")
    distill_kind = "sparse"

    def compress_inputs(self, spec: str, path: Any, *, card: dict[str, Any] | None, folder: Any,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> Any:
        raise EncoderkitError("compression of a sparse (SPLADE) model is not supported; export it (encoderkit export "
                              "--quantize int8-dynamic) for a smaller graph")

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: Any, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        return self.compress_inputs(dev, dev, card=None, folder=None, label2id=None, limit=0, seed=0, miner=None)


TASK = SparseTask()
