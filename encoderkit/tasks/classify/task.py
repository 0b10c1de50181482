"""The classify task object (:mod:`encoderkit.tasks.protocol`): Sequence classification (single texts or pairs; one label, or several with --multi-label)."""

from __future__ import annotations

from typing import Any

from encoderkit.tasks.classify.train import OPTIONS, build, evaluate_folder
from encoderkit.tasks.protocol import ServingUnit, Task


class ClassifyTask(Task):
    name = "classify"
    options = OPTIONS
    outputs = ("logits",)
    pair_inputs = False
    few_logits = True
    record_fields = ("text",)
    endpoint = "classify"
    unit = ServingUnit("one request (batch 1, a typical dev example)", "request", "32 dev examples in one batch", "32 requests")
    primary_metrics = ("accuracy", "micro_f1")
    data_help = "a .tsv/.csv/.jsonl table with the text column the model was fine-tuned on"

    # -- training and evaluation --------------------------------------------------------------------
    def build(self, data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        return build(data, options, tokenizer, folder)

    def evaluate_folder(self, folder: Any, tokenizer: Any, data: Any, options: Any, engine: Any = None) -> dict[str, Any]:
        return evaluate_folder(folder, tokenizer, data, options, engine=engine)

    # -- inference ----------------------------------------------------------------------------------

    # -- compression --------------------------------------------------------------------------------


TASK = ClassifyTask()
