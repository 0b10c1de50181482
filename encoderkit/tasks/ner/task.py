"""The ner task object (:mod:`encoderkit.tasks.protocol`): Named entities: token classification over words, long sentences in overlapping windows."""

from __future__ import annotations

from typing import Any

from encoderkit.tasks.ner.train import OPTIONS, build, evaluate_folder
from encoderkit.tasks.protocol import ServingUnit, Task


class NerTask(Task):
    name = "ner"
    options = OPTIONS
    outputs = ("logits",)
    per_token = True
    record_fields = ("text",)
    endpoint = "extract"
    unit = ServingUnit("one request (one typical dev sentence, all its windows)", "request", "32 dev sentences", "32 requests")
    primary_metrics = ("f1",)
    data_help = "a CoNLL or JSONL NER file"

    # -- training and evaluation --------------------------------------------------------------------
    def build(self, data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        return build(data, options, tokenizer, folder)

    def evaluate_folder(self, folder: Any, tokenizer: Any, data: Any, options: Any, engine: Any = None) -> dict[str, Any]:
        return evaluate_folder(folder, tokenizer, data, options, engine=engine)

    # -- inference ----------------------------------------------------------------------------------

    # -- compression --------------------------------------------------------------------------------


TASK = NerTask()
