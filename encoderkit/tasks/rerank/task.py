"""The rerank task object (:mod:`encoderkit.tasks.protocol`): cross-encoder reranking: one relevance score per
(query, passage) pair."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from encoderkit.config import check
from encoderkit.data.beir import is_beir_source, load_retrieval, read_triples
from encoderkit.tasks.embed.texts import beir_sample
from encoderkit.tasks.protocol import Runner, ServingUnit, Task, TaskInputs
from encoderkit.tasks.rerank.candidates import MINED_PAIRS, SERVED_CANDIDATES, candidate_lists
from encoderkit.tasks.rerank.features import pair_rows
from encoderkit.tasks.rerank.train import OPTIONS
from encoderkit.tasks.rerank.train import build as build_run
from encoderkit.tasks.rerank.train import evaluate_folder as evaluate_saved


class RerankTask(Task):
    name = "rerank"
    options = OPTIONS
    outputs = ("logits",)
    pair_inputs = True
    few_logits = True
    record_fields = ("query", "passages")
    endpoint = "rerank"
    scores_pairs = True
    unit = ServingUnit("one query's top 100 candidates (100 query-passage pairs, batches of 32)", "query (top 100)")
    primary_metrics = ("ndcg@10", "mrr@10")
    data_help = "a BEIR source (folder or zip, PATH#split) or JSONL {query, positive, negatives}"
    agreement_measure = "top-1"  # INT8 agreement: each query's best-ranked passage
    small_model_lr = 2e-4  # a narrow model (MiniLM) with a new head stays near chance at 3e-5 (docs/finetune.md)

    # -- training and evaluation: the task's train module ------------------------------------------
    build = staticmethod(build_run)
    evaluate_folder = staticmethod(evaluate_saved)

    # -- inference ----------------------------------------------------------------------------------
    def score(self, runner: Runner, queries: Sequence[str], passages: Sequence[str]) -> Any:
        """Relevance logits (N,) float32 of (query, passage) pairs: the first logit; for a two-label model, the
        last label's logit minus the first's. What ``Predictor.score_pairs`` returns."""
        if not passages:
            return np.zeros(0, dtype=np.float32)
        logits = np.stack([out[0] for out in runner.run_rows(pair_rows(runner.tokenizer, list(queries), list(passages),
                                                                           runner.max_length))])  # (N, C)
        return logits[:, 0] if logits.shape[1] == 1 else logits[:, -1] - logits[:, 0]

    def rank(self, runner: Runner, query: str, passages: Sequence[str]) -> list[dict[str, Any]]:
        """Passages ranked by relevance to ``query``: [{"index", "score"}], best first."""
        scores = self.score(runner, [query] * len(passages), passages)
        order = np.argsort(-scores, kind="stable")
        return [{"index": int(i), "score": float(scores[i])} for i in order]

    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
        """``{"ranking": [{"index", "score"}]}`` per record (``query``, ``passages``)."""
        return [{"ranking": self.rank(runner, r["query"], list(r["passages"]))} for r in records]

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """Items: (query, passage) tuples; the logit of each (the rerank routes rank and cut)."""
        return self.score(runner, [q for q, _ in items], [d for _, d in items]).tolist()

    def agreement_records(self, path: str, cfg: Any, folder: Any, *, limit: int = 0,
                          miner: str = "") -> list[dict[str, Any]]:
        """Each query with its candidates as a ``predict`` record: JSONL rows' positive and negatives, or a BEIR
        source's judged queries with the ``miner``'s top ``cfg.candidates`` documents."""
        check(bool(miner) or not is_beir_source(path), f"{path} is a BEIR source: its queries have no candidates to "
              "rank without a first stage; pass --miner EMBED_FOLDER (or 'minilm'), or a JSONL of queries with "
              "candidates ({query, positive, negatives})")
        lists = candidate_lists(path, miner or None, cfg.candidates, limit=limit)
        return [{"query": q, "passages": list(c)} for q, c in lists]

    def agreement_units(self, runner: Runner, records: Sequence[dict[str, Any]]) -> list[list[Any]]:
        """Per record (a query and its candidates), the index of the passage ranked first."""
        return [[r["ranking"][0]["index"] if r["ranking"] else None] for r in self.predict(runner, records)]

    # -- compression --------------------------------------------------------------------------------
    uses_miner = True
    ranks_lists = True
    planned_unit = (100, "one query's top 100 candidates (100 query-passage pairs in one batch)")
    distill_kind = "lists"
    # a cut cross-encoder starts from chance (docs/compress.md, "A cut cross-encoder starts from nothing")
    distill_lr = 3e-4

    def compress_inputs(self, spec: str, path: Any, *, card: dict[str, Any] | None, folder: Any,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> Any:
        """A BEIR source's judged (query, document) pairs, or with ``miner`` each judged query with its top
        ``MINED_PAIRS`` documents from that bi-encoder; JSONL triples: the query with its positive and each
        negative."""
        if is_beir_source(spec) and miner:
            lists = candidate_lists(spec, miner, MINED_PAIRS)
            # rank-major (every query's first candidate, then every query's second, ...), so that the first N
            # pairs a calibration sample takes span N queries
            return TaskInputs([(q, c[r]) for r in range(len(lists[0][1])) for q, c in lists], None, spec)
        if is_beir_source(spec):
            data = load_retrieval(spec)
            pairs = [(data.queries[q], data.doc_text(d)) for q, rels in data.qrels.items()
                     for d, r in rels.items() if r > 0]
        else:
            pairs = [(t.query, p) for t in read_triples(spec) for p in (t.positive, *t.negatives)]
        return TaskInputs(pairs, None, spec)

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: Any, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        """The median-length query and 100 passages (a BEIR source's corpus sample, else the rows' candidates,
        repeated to 100)."""
        if is_beir_source(dev):
            check(bool(miner), "field 'miner' missing: a BEIR source gives queries and a corpus but no first "
                  "stage to rerank; pass --miner EMBED_FOLDER (or 'minilm'), the bi-encoder whose top "
                  f"{candidates} the reranker reorders, or a JSONL of queries with candidates "
                  "({query, positive, negatives})")
            queries, passages = beir_sample(dev, SERVED_CANDIDATES, rng)
        else:
            triples = read_triples(dev)
            check(all(t.negatives for t in triples), "field 'negatives' missing: a rerank dev row needs candidates "
                  "to rank (a positive and negatives); give each row 'negatives', or pass a BEIR source with --miner")
            queries = [t.query for t in triples]
            passages = [p for t in triples for p in [t.positive, *t.negatives]]
        passages = (passages * (SERVED_CANDIDATES // max(1, len(passages)) + 1))[:SERVED_CANDIDATES]
        return {"query": sorted(queries, key=len)[len(queries) // 2], "passages": passages}

    def latency_rows(self, samples: dict[str, Any], tokenizer: Any, folder: Any, cfg: Any,
                     max_length: int) -> tuple[list, list]:
        return pair_rows(tokenizer, [samples["query"]] * len(samples["passages"]), samples["passages"], max_length), []


TASK = RerankTask()
