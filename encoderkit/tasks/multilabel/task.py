"""The multilabel task object (:mod:`encoderkit.tasks.protocol`): several labels per text, a sigmoid and a
threshold per label; served on ``/v1/classify``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.models.card import read_card
from encoderkit.tasks.classify.features import featurize
from encoderkit.tasks.multilabel.data import read_examples
from encoderkit.tasks.multilabel.features import decode, thresholds_of
from encoderkit.tasks.multilabel.options import MultilabelOptions
from encoderkit.tasks.multilabel.train import OPTIONS
from encoderkit.tasks.multilabel.train import build as build_run
from encoderkit.tasks.multilabel.train import evaluate_folder as evaluate_saved
from encoderkit.tasks.protocol import SEQUENCE_REQUEST, Runner, Task, TaskInputs, typical_and_batch


class MultilabelTask(Task):
    name = "multilabel"
    options = OPTIONS
    outputs = ("logits",)
    few_logits = True
    endpoint = "classify"
    unit = SEQUENCE_REQUEST
    primary_metrics = ("micro_f1",)
    data_help = ("a .tsv/.csv table with a 'labels' column of labels joined by '|', or a .jsonl whose 'labels' is a "
                 "list, and the text column the model was fine-tuned on")
    agreement_measure = "label set"  # INT8 agreement: the set of labels over their thresholds
    agreement_fields = ("labels",)

    # -- training and evaluation: the task's train module ------------------------------------------
    build = staticmethod(build_run)
    evaluate_folder = staticmethod(evaluate_saved)

    # -- inference ----------------------------------------------------------------------------------
    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
        """``{"labels": [the labels over their thresholds], "scores": {label: probability}}`` per record."""
        return self.serve(runner, [r["text"] for r in records])

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """Items: texts (a multilabel model takes no text pairs); one :meth:`predict` result each."""
        if any(not isinstance(x, str) for x in items):
            raise EncoderkitError("a multilabel model classifies single texts; send 'texts' without 'text_pairs'")
        if not items:
            return []
        rows = featurize(runner.tokenizer, list(items), None, runner.max_length)
        logits = np.stack([out[0] for out in runner.run_rows(rows)])  # (N, C)
        names = runner.info.labels
        return decode(logits, names, thresholds_of(runner.info.card, names))

    def agreement_records(self, path: str, cfg: Any, folder: Any, *, limit: int = 0,
                          miner: str = "") -> list[dict[str, Any]]:
        """The table's texts (the column the model was trained on) as ``predict`` records."""
        options = self.options_for_folder(cfg, folder)
        ex = read_examples(path, options, folder.card.get("text_column"), folder.card.get("label_column"), labels=False)
        texts = list(ex.texts)[:limit] if limit else list(ex.texts)
        return [{"text": t} for t in texts]

    # -- compression --------------------------------------------------------------------------------
    planned_unit = (1, "one request (one text)")

    def compress_inputs(self, spec: str, path: Path, *, card: dict[str, Any] | None, folder: str | Path | None,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> TaskInputs:
        """The texts of a table (the column the model was trained on); no class ids: a label set is not
        one class, so distillation and recovery have no hard loss here."""
        card = card or (read_card(folder) if folder else {})  # the columns the model was trained on
        options = MultilabelOptions(label_separator=card.get("label_separator", MultilabelOptions.label_separator))
        ex = read_examples(path, options, card.get("text_column"), card.get("label_column"), labels=False)
        return TaskInputs(list(ex.texts), None, str(path))

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: np.random.Generator, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        options = self.options_for_folder(cfg, start)
        ex = read_examples(dev, options, start.card.get("text_column"), start.card.get("label_column"), labels=False)
        return typical_and_batch(ex.texts, len, rng)

    def latency_rows(self, samples: dict[str, Any], tokenizer: Any, folder: Any, cfg: Any, max_length: int
                     ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
        return (featurize(tokenizer, samples["one"], None, max_length),
                featurize(tokenizer, samples["batch"], None, max_length))


TASK = MultilabelTask()
