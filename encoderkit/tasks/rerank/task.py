"""The rerank task object (:mod:`encoderkit.tasks.protocol`): Cross-encoder reranking: one relevance score per (query, passage) pair."""

from __future__ import annotations

from typing import Any

from encoderkit.tasks.protocol import ServingUnit, Task
from encoderkit.tasks.rerank.train import OPTIONS, build, evaluate_folder


class RerankTask(Task):
    name = "rerank"
    options = OPTIONS
    outputs = ("logits",)
    pair_inputs = True
    few_logits = True
    record_fields = ("query", "passages")
    endpoint = "rerank"
    unit = ServingUnit("one query's top 100 candidates (100 query-passage pairs, batches of 32)", "query (top 100)")
    primary_metrics = ("ndcg@10", "mrr@10")
    data_help = "a BEIR source (folder or zip, PATH#split) or JSONL {query, positive, negatives}"

    # -- training and evaluation --------------------------------------------------------------------
    def build(self, data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        return build(data, options, tokenizer, folder)

    def evaluate_folder(self, folder: Any, tokenizer: Any, data: Any, options: Any, engine: Any = None) -> dict[str, Any]:
        return evaluate_folder(folder, tokenizer, data, options, engine=engine)

    # -- inference ----------------------------------------------------------------------------------

    # -- compression --------------------------------------------------------------------------------


TASK = RerankTask()
