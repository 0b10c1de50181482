"""The embed task object (:mod:`encoderkit.tasks.protocol`): Bi-encoder embeddings: pooled, optionally normalised token states (sentence-transformers layout)."""

from __future__ import annotations

from typing import Any

from encoderkit.tasks.embed.train import OPTIONS, build, evaluate_folder
from encoderkit.tasks.protocol import ServingUnit, Task


class EmbedTask(Task):
    name = "embed"
    options = OPTIONS
    outputs = ("last_hidden_state",)
    per_token = True
    int8_by_default = True  # mean cosine 0.992 to FP32 on MiniLM, SciFact nDCG@10 within 0.4% (bench/encode_speed.py)
    record_fields = ("text",)
    endpoint = "embed"
    unit = ServingUnit("one query (batch 1)", "query", "a batch of 32 corpus documents", "32 documents")
    primary_metrics = ("ndcg@10",)
    data_help = "a corpus (text, JSONL, CSV/TSV, folder) or a BEIR source"

    # -- training and evaluation --------------------------------------------------------------------
    def build(self, data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        return build(data, options, tokenizer, folder)

    def evaluate_folder(self, folder: Any, tokenizer: Any, data: Any, options: Any, engine: Any = None) -> dict[str, Any]:
        return evaluate_folder(folder, tokenizer, data, options, engine=engine)

    # -- inference ----------------------------------------------------------------------------------

    # -- compression --------------------------------------------------------------------------------


TASK = EmbedTask()
