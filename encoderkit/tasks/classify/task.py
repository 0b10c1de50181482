"""The classify task object (:mod:`encoderkit.tasks.protocol`): sequence classification (single texts or pairs;
one label, or several with --multi-label)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from encoderkit.tasks.classify.compression import card_columns, read_inputs
from encoderkit.tasks.classify.data import read_examples
from encoderkit.tasks.classify.features import decode, featurize
from encoderkit.tasks.classify.train import OPTIONS
from encoderkit.tasks.classify.train import build as build_run
from encoderkit.tasks.classify.train import evaluate_folder as evaluate_saved
from encoderkit.tasks.protocol import SEQUENCE_REQUEST, Runner, Task, typical_and_batch


class ClassifyTask(Task):
    name = "classify"
    options = OPTIONS
    outputs = ("logits",)
    few_logits = True
    endpoint = "classify"
    single_label = True
    scores_pairs = True  # a pair classifier reranks by its last label's logit over its first
    few_label = True  # few labels per class: finetune's contrastive route (encoderkit/train/few_label.py)
    unit = SEQUENCE_REQUEST
    primary_metrics = ("accuracy", "micro_f1")
    data_help = "a .tsv/.csv/.jsonl table with the text column the model was fine-tuned on"
    agreement_measure = "label"  # INT8 agreement: the predicted label
    small_model_lr = 1e-4  # a narrow model (MiniLM) at 3e-5 trails the HF Trainer (docs/finetune.md)
    agreement_fields = ("label",)

    # -- training and evaluation: the task's train module ------------------------------------------
    build = staticmethod(build_run)
    evaluate_folder = staticmethod(evaluate_saved)

    # -- inference ----------------------------------------------------------------------------------
    def classify(self, runner: Runner, inputs: Sequence[str | tuple[str, str] | list[str]]) -> list[dict[str, Any]]:
        """Label, its probability and every label's probability per text or (text, text_pair) (a one-logit
        rerank model: its sigmoid as ``score``); what ``Predictor.classify`` returns."""
        if not inputs:
            return []
        if all(isinstance(x, str) for x in inputs):
            rows = featurize(runner.tokenizer, list(inputs), None, runner.max_length)
        else:
            firsts = [x if isinstance(x, str) else x[0] for x in inputs]
            seconds = ["" if isinstance(x, str) else x[1] for x in inputs]
            rows = featurize(runner.tokenizer, firsts, seconds, runner.max_length)
        logits = np.stack([out[0] for out in runner.run_rows(rows)])  # (N, C)
        return decode(logits, runner.info.labels)

    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
        """``{"label", "score", "scores"}`` per record (``text``, and ``text_pair`` when given)."""
        return self.classify(runner, [(r["text"], r["text_pair"]) if r.get("text_pair") else r["text"]
                                      for r in records])

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """Items: texts or (text, text_pair) tuples; one :meth:`classify` result each."""
        return self.classify(runner, items)

    def agreement_records(self, path: str, cfg: Any, folder: Any, *, limit: int = 0,
                          miner: str = "") -> list[dict[str, Any]]:
        """The table's texts (and pairs) in the columns the model was fine-tuned on, as ``predict`` records."""
        options = self.options_for_folder(cfg, folder)
        texts, pairs, _, _, _ = read_examples(path, options, folder.card.get("text_column"))
        records = [{"text": t} | ({"text_pair": pairs[i]} if pairs else {}) for i, t in enumerate(texts)]
        return records[:limit] if limit else records

    # -- compression --------------------------------------------------------------------------------
    planned_unit = (1, "one request (one text or text pair)")

    def eval_columns(self, folder: Any) -> dict[str, str]:
        return card_columns(folder)

    def compress_inputs(self, spec: str, path: Any, *, card: dict[str, Any] | None, folder: Any,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> Any:
        """The table's texts (or pairs) in the columns of ``folder``'s lineage (its card's text column where
        the lineage names none), and labels as class ids when ``label2id`` is given."""
        columns = card_columns(folder) if folder is not None else {}
        if card and card.get("text_column"):
            columns.setdefault("text_column", str(card["text_column"]))
        if card and card.get("multi_label"):  # a row's labels are a set, not one class id: texts only
            label2id = None
        return read_inputs(path, columns, label2id)

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: Any, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        texts, pairs, _, _, _ = read_examples(dev, self.options_for_folder(cfg, start), start.card.get("text_column"))
        items = list(zip(texts, pairs or [None] * len(texts), strict=True))
        return typical_and_batch(items, lambda x: len(x[0]) + len(x[1] or ""), rng)

    def latency_rows(self, samples: dict[str, Any], tokenizer: Any, folder: Any, cfg: Any,
                     max_length: int) -> tuple[list, list]:
        def rows(items: list) -> list:
            pairs = [p for _, p in items] if items[0][1] is not None else None
            return featurize(tokenizer, [t for t, _ in items], pairs, max_length)

        return rows(samples["one"]), rows(samples["batch"])


TASK = ClassifyTask()
