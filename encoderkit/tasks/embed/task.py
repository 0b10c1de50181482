"""The embed task object (:mod:`encoderkit.tasks.protocol`): bi-encoder embeddings: pooled, optionally normalised
token states (sentence-transformers layout)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from encoderkit.config import check
from encoderkit.data.beir import is_beir_source
from encoderkit.errors import EncoderkitError
from encoderkit.models.pooling import task_pooling
from encoderkit.tasks.embed.embedder import Embedder, PooledEngine, tokenize
from encoderkit.tasks.embed.texts import beir_sample, beir_texts, training_texts
from encoderkit.tasks.embed.train import OPTIONS
from encoderkit.tasks.embed.train import build as build_run
from encoderkit.tasks.embed.train import evaluate_folder as evaluate_saved
from encoderkit.tasks.protocol import Runner, ServingUnit, Task, TaskInputs
from encoderkit.tasks.tabular import find_text_column, read_rows, table_format, text_column


class EmbedTask(Task):
    name = "embed"
    options = OPTIONS
    outputs = ("last_hidden_state",)
    per_token = True
    int8_by_default = True  # INT8 keeps FP32's embeddings and nDCG@10 (bench/encode_speed.py: docs/deploy.md)
    endpoint = "embed"
    unit = ServingUnit("one query (batch 1)", "query", "a batch of 32 corpus documents", "32 documents")
    primary_metrics = ("ndcg@10",)
    data_help = "a corpus (text, JSONL, CSV/TSV, folder) or a BEIR source"

    # -- training and evaluation: the task's train module ------------------------------------------
    build = staticmethod(build_run)
    evaluate_folder = staticmethod(evaluate_saved)

    # -- inference ----------------------------------------------------------------------------------
    def embed_raw(self, runner: Runner, texts: Sequence[str]) -> Any:
        """Pooled, un-normalised embeddings (N, H) float32 (mean or first-token pooling per the folder): the
        runner's :class:`~encoderkit.tasks.embed.embedder.Embedder`."""
        return Embedder.of_runner(runner).pooled(texts)

    @staticmethod
    def finish(vectors: Any, dim: int | None, normalize: bool) -> Any:
        """Keep the first ``dim`` dimensions (Matryoshka truncation) of (N, H) vectors, then L2-normalise."""
        return Embedder.finish(vectors, dim, normalize)

    def embed(self, runner: Runner, texts: Sequence[str], dim: int | None = None, normalize: bool | None = None) -> Any:
        """Embeddings (N, dim or H) float32; ``dim`` keeps the first dims (Matryoshka) before normalising.
        ``normalize`` defaults to the folder's setting (sentence-transformers ``Normalize`` module)."""
        return Embedder.of_runner(runner).embed(texts, dim, normalize)

    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], *, dim: int | None = None,
                **kw: Any) -> list[dict[str, Any]]:
        """``{"embedding": [...]}`` per record (``text``); ``dim``: keep the first dims, then renormalise."""
        return [{"embedding": v.tolist()} for v in self.embed(runner, [r["text"] for r in records], dim=dim)]

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """Items: texts; the pooled, un-normalised vector of each (the embed routes cut and normalise)."""
        return list(self.embed_raw(runner, items))

    # -- compression --------------------------------------------------------------------------------
    planned_unit = (32, "a batch of 32 documents, and a single query")
    distill_kind = "embedding"

    def engine_for_latency(self, engine: Any, folder: Any) -> Any:
        if getattr(engine, "pools", False):  # a static table pools itself (normalising is the Embedder's, not timed)
            return engine
        return PooledEngine(engine, task_pooling(folder, "embed"), folder.normalize)

    def compress_inputs(self, spec: str, path: Any, *, card: dict[str, Any] | None, folder: Any,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> Any:
        """A BEIR source's documents and queries; a table's text column (found as classify finds it); any other
        corpus cut into sentence pieces as embedding distillation reads it."""
        if is_beir_source(spec):
            return TaskInputs(beir_texts(spec), None, spec)
        try:
            table_format(path)
        except EncoderkitError:  # not a table: any corpus, cut into sentence pieces as embedding distillation reads it
            return TaskInputs(list(training_texts(spec, limit, seed=seed)), None, spec)
        rows = read_rows(path)
        name, _ = find_text_column(rows, path)
        return TaskInputs(list(text_column(rows, name, path, "--text-column")), None, spec)

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: Any, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        """The median-length judged query, and a seeded batch of 32 corpus documents."""
        check(is_beir_source(dev), "embed quality is nDCG@10 over a corpus: --dev must be a BEIR source (a folder with "
              "corpus.jsonl, queries.jsonl, qrels/<split>.tsv, or the SciFact zip with #split), not a file of texts")
        queries, docs = beir_sample(dev, 32, rng)
        return {"query": sorted(queries, key=len)[len(queries) // 2], "docs": docs}

    def latency_rows(self, samples: dict[str, Any], tokenizer: Any, folder: Any, cfg: Any,
                     max_length: int) -> tuple[list, list]:
        query_length = min(max_length, folder.card.get("max_query_length", cfg.max_query_length))
        return tokenize(tokenizer, [samples["query"]], query_length), tokenize(tokenizer, samples["docs"], max_length)


TASK = EmbedTask()
