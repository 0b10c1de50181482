"""``encoderkit evaluate``: the task metrics of a model folder on labelled data, printed as JSON.

The task comes from ``--task``, else the folder's ``encoderkit.json``, else its architecture
(``*ForSequenceClassification`` with one label: rerank; with more: classify;
``*ForTokenClassification``: ner; ``*ForQuestionAnswering``: qa; a sentence-transformers folder:
embed). Feature settings saved with the model (max length, strides) are reused; an explicit
``--max-length`` overrides the saved one (e.g. to score a reranker on longer passages than it saw).
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.config import arg
from encoderkit.errors import EncoderkitError
from encoderkit.io import read_card
from encoderkit.tasks import TASK_MODULES, TASKS
from encoderkit.tasks.common import load_tokenizer, resolve_model
from encoderkit.tasks.options import TaskDataOptions


@dataclass
class EvaluateConfig(TaskDataOptions):
    """Evaluate a model folder on a task's labelled data."""

    task: str = arg("", help="Task (default: from the folder's encoderkit.json or its architecture). 'mlm': held-out "
                    "masked-LM loss/accuracy/perplexity on a token store from `encoderkit data prepare` (--data STORE; "
                    "--max-examples caps the blocks).", choices=("",) + TASKS + ("mlm",))
    model: str = arg(help="Model folder to evaluate ('minilm' = all-MiniLM-L6-v2).", required=True)
    data: str = arg(help="Labelled data in the task's format (see `encoderkit finetune --help`); mlm: a token store folder.",
                    required=True)
    tokenizer: str = arg("", help="Tokenizer folder (default: the model folder's own).")
    max_examples: int = arg(0, help="Evaluate a seeded random subset of this many examples (0: all); rerank/embed: of the judged "
                                "queries, searching the whole corpus.")
    mask_rate: float = arg(0.15, help="mlm: fraction of tokens picked for prediction (80/10/10 as in pretraining).")
    miner: str = arg("minilm", help="rerank: bi-encoder that proposes the top-100 candidates on a BEIR source.")
    batch_size: int = arg(64, help="Inference batch size.", speed=True)
    eval_batch_size: int = arg(64, help="(same as --batch-size; kept for shared task code)", speed=True)


@dataclass
class EvaluateResult:
    model: str
    task: str
    data: str
    metrics: dict[str, Any]
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "data": self.data, "seconds": round(self.seconds, 1), **self.metrics}


MODULES = {**TASK_MODULES, "mlm": "encoderkit.train.pretrain"}


def infer_task(folder: Path, card: dict) -> str:
    if card.get("task") in MODULES:
        return card["task"]
    if (folder / "modules.json").is_file():
        return "embed"
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch = " ".join(config.get("architectures") or [])
    if "ForSequenceClassification" in arch:
        return "rerank" if len(config.get("id2label") or {}) == 1 else "classify"
    if "ForTokenClassification" in arch:
        return "ner"
    if "ForQuestionAnswering" in arch:
        return "qa"
    if "ForMaskedLM" in arch:
        return "mlm"
    raise EncoderkitError(f"{folder}: cannot tell the task from config.json (architectures {arch or 'missing'}); pass --task")


def run(cfg: EvaluateConfig) -> EvaluateResult:
    """Print the task metrics (JSON) of a model folder on labelled data."""
    folder = resolve_model(cfg.model)
    card = read_card(folder)
    if cfg.max_length:
        if card.get("max_length") and card["max_length"] != cfg.max_length:
            from encoderkit.progress import note

            note(f"{folder}: scoring at --max-length {cfg.max_length}, but the model was fine-tuned at {card['max_length']}; "
                 "quality can drop at a length the model has not seen")
        card = {**card, "max_length": cfg.max_length}
    task = cfg.task or infer_task(folder, card)
    cfg.task = task
    cfg.eval_batch_size = cfg.batch_size
    tokenizer = load_tokenizer(folder, cfg.tokenizer or None)
    t0 = time.perf_counter()
    metrics = importlib.import_module(MODULES[task]).evaluate_folder(folder, tokenizer, cfg.data, cfg, card)
    return EvaluateResult(str(folder), task, cfg.data, metrics, time.perf_counter() - t0)
