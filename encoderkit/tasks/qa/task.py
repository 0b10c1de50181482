"""The qa task object (:mod:`encoderkit.tasks.protocol`): Extractive question answering: the best answer span of a context, in overlapping windows."""

from __future__ import annotations

from typing import Any

from encoderkit.tasks.protocol import ServingUnit, Task
from encoderkit.tasks.qa.train import OPTIONS, build, evaluate_folder


class QaTask(Task):
    name = "qa"
    options = OPTIONS
    outputs = ("start_logits", "end_logits")
    per_token = True
    pair_inputs = True
    record_fields = ("question", "context")
    endpoint = "answer"
    unit = ServingUnit("one request (one typical dev question and its context, all its windows)", "request",
                       "32 dev questions", "32 requests")
    primary_metrics = ("f1",)
    data_help = "a SQuAD JSON file"

    # -- training and evaluation --------------------------------------------------------------------
    def build(self, data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        return build(data, options, tokenizer, folder)

    def evaluate_folder(self, folder: Any, tokenizer: Any, data: Any, options: Any, engine: Any = None) -> dict[str, Any]:
        return evaluate_folder(folder, tokenizer, data, options, engine=engine)

    # -- inference ----------------------------------------------------------------------------------

    # -- compression --------------------------------------------------------------------------------


TASK = QaTask()
