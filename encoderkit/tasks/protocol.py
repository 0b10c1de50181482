"""The task protocol: one stateless object per task (``tasks/<name>/__init__.py``'s ``TASK``, found by
:func:`encoderkit.tasks.get_task`), which every stage asks what it would otherwise decide by comparing task names.

Settings live in the task's frozen options class. Methods that run a model take an engine or a :class:`Runner`
(the Predictor seen from below), so a task never imports deploy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from encoderkit.errors import EncoderkitError


class Runner(Protocol):
    """What a task's inference methods use of the Predictor: the folder, its tokenizer, the length cut,
    and the engine run over token rows (length-sorted batches; per row, its outputs with the padding cut
    off, in input order)."""

    info: Any  # the ModelFolder
    tokenizer: Any
    max_length: int
    max_batch: int
    engine: Any

    def run_rows(self, rows: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]: ...


@dataclass(frozen=True)
class ServingUnit:
    """What one served request is, timed for latency (and the batch unit timed for throughput; empty when
    the task has none): a description and a short name for each, as the compression report prints them."""

    desc: str
    short: str
    batch_desc: str = ""
    batch_short: str = ""


# a text (or pair) in, one result out: classify, multilabel
SEQUENCE_REQUEST = ServingUnit("one request (batch 1, a typical dev example)", "request",
                               "32 dev examples in one batch", "32 requests")


INT8_MIN_AGREEMENT = 0.995  # ``auto`` runs a folder's INT8 graph from this agreement with FP32 on its dev rows


@dataclass(frozen=True)
class Agreement:
    """INT8 agreement with FP32 on dev rows: the fraction of equal ``units`` (labels, token labels, spans,
    top-1 passages) over ``rows`` records, and what was compared (``measure``)."""

    value: float
    rows: int
    units: int
    measure: str


@dataclass
class TaskInputs:
    """Model inputs of a task's data, as compression reads them: single texts or (text, text) pairs, and
    class ids when labelled (classify only: the hard loss of distillation and recovery)."""

    texts: list[Any]
    labels: list[int] | None = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.texts)

    def head(self, n: int | None) -> TaskInputs:
        if not n:
            return self
        return TaskInputs(self.texts[:n], None if self.labels is None else self.labels[:n], self.source)


class Task:
    """One task (see the module docstring). Subclasses set the class attributes and implement the methods
    that raise :class:`NotImplementedError` here."""

    name: ClassVar[str]
    options: ClassVar[type]                 # the frozen options class (``for_training`` / ``for_folder``)
    outputs: ClassVar[tuple[str, ...]]      # the graph's output names, in order (export, ONNX and torch engines)
    per_token: ClassVar[bool] = False       # outputs are (B, T, ...) per token, not (B, C) per sequence
    pair_inputs: ClassVar[bool] = False     # a request is a (text, text) pair: export traces pairs
    few_logits: ClassVar[bool] = False      # a few logits per example: INT8 parity compares probabilities
    int8_by_default: ClassVar[bool] = False  # Predictor's ``auto`` runs the INT8 graph (measured on this task)
    # what INT8 agreement with FP32 compares on a folder's dev rows (the card's ``int8_agreement.measure``), which
    # ``auto`` reads to run the INT8 graph; None: the task is not measured so (``int8_by_default`` decides)
    agreement_measure: ClassVar[str | None] = None
    agreement_fields: ClassVar[tuple[str, ...]] = ()  # the ``predict`` result fields that the default compares
    record_fields: ClassVar[tuple[str, ...]] = ("text",)  # a ``predict`` JSONL record's fields (.txt: a text a line)
    endpoint: ClassVar[str | None] = None   # the service's route that serves it (``/v1/<endpoint>``)
    single_label: ClassVar[bool] = False    # one label per text (a softmax over labels): what an audit compares
    scores_pairs: ClassVar[bool] = False    # scores a (query, passage) pair by its sequence logits: a cross-encoder
    few_label: ClassVar[bool] = False       # finetune may take the few-label contrastive route (train/few_label.py)
    unit: ClassVar[ServingUnit]             # the serving unit compression times
    primary_metrics: ClassVar[tuple[str, ...]]  # the evaluation's quality figure (the first one present)
    data_help: ClassVar[str]                # what the task's data file is, for error messages

    # -- options ------------------------------------------------------------------------------------
    def options_for_training(self, cfg: Any, folder: Any) -> Any:
        return self.options.for_training(cfg, folder)

    def options_for_folder(self, cfg: Any, folder: Any) -> Any:
        return self.options.for_folder(cfg, folder)

    # -- training and evaluation --------------------------------------------------------------------
    def build(self, data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        """The :class:`~encoderkit.tasks.common.TaskRun` fine-tuning trains (``data``: TrainData)."""
        raise NotImplementedError

    def evaluate_folder(self, folder: Any, tokenizer: Any, data: Any, options: Any,
                        engine: Any = None) -> dict[str, Any]:
        """Metrics of a saved model on labelled data (``data``: EvalData); ``engine`` runs the model
        (None: the folder's torch model)."""
        raise NotImplementedError

    # -- inference ----------------------------------------------------------------------------------
    def check_record(self, record: dict[str, Any], where: str) -> None:
        """Refuse a ``predict`` record without the task's fields, or with a field that is not text (a list of texts
        for ``passages``), naming ``where`` (file:line)."""
        if any(not record.get(k) for k in self.record_fields):
            raise EncoderkitError(f"{where}: a {self.name} record needs non-empty fields "
                                  f"{', '.join(self.record_fields)}")
        for k in (*self.record_fields, "text_pair"):
            v = record.get(k)
            texts = v if k == "passages" and isinstance(v, list) else [v]
            if k in record and (k != "text_pair" or v is not None) and not all(isinstance(t, str) for t in texts):
                want = "a list of texts" if k == "passages" else "a text (a JSON string)"
                raise EncoderkitError(f"{where}: field {k!r} holds {json.dumps(v)[:60]}, expected {want}; fix the "
                                      "record (quote a number to make it text)")

    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
        """One public result per record (a dict with :attr:`record_fields`), in order."""
        raise NotImplementedError

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """The service's batched call: items as the endpoint parses them, one result each."""
        raise NotImplementedError

    # -- INT8 agreement (export --dev, compress --dev) -------------------------------------------------
    def agreement_records(self, path: str, cfg: Any, folder: Any, *, limit: int = 0,
                          miner: str = "") -> list[dict[str, Any]]:
        """The first ``limit`` (0: all) rows of a dev file as ``predict`` records, read with the task's reader
        (``cfg``: :class:`~encoderkit.tasks.options.TaskDataOptions` with the folder's columns; ``miner``: the
        first stage of a reranker's BEIR source)."""
        raise EncoderkitError(f"a {self.name} model's INT8 agreement is not measured on dev rows")

    def agreement_units(self, runner: Runner, records: Sequence[dict[str, Any]]) -> list[list[Any]]:
        """Per record, the units INT8 agreement compares between two runners (equal or not, each): by default
        one, the record's ``predict`` result fields :attr:`agreement_fields` (a list read as a set)."""
        def unit(value: Any) -> Any:
            return tuple(sorted(map(str, value))) if isinstance(value, (list, tuple, set)) else value

        return [[tuple(unit(r[k]) for k in self.agreement_fields)] for r in self.predict(runner, records)]

    def agreement(self, reference: Runner, other: Runner, records: Sequence[dict[str, Any]]) -> Agreement:
        """How often ``other`` (the INT8 graph) gives what ``reference`` (FP32) gives on ``records``, unit by
        unit (:meth:`agreement_units`)."""
        a, b = self.agreement_units(reference, records), self.agreement_units(other, records)
        same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
        units = sum(len(r) for r in a)
        return Agreement(same / units if units else 1.0, len(records), units, str(self.agreement_measure))

    def engine_for_latency(self, engine: Any, folder: Any) -> Any:
        """The engine timed for latency (embed pools and normalises on top of the graph)."""
        return engine

    def graph_module(self, model: Any) -> Any:
        """The torch module whose outputs (a mapping holding :attr:`outputs` by name) the exported graph and the
        torch engines give, over the folder's loaded model: the model itself, or the task's computation on top
        of it (sparse pools its MLM logits, so its graph returns (B, V), not (B, T, V))."""
        return model

    # -- compression --------------------------------------------------------------------------------
    # its compression inputs of a BEIR source are (query, document) pairs, judged or mined by a first-stage
    # bi-encoder (``miner``), not the corpus it serves (the vocabulary lever reads the whole corpus)
    uses_miner: ClassVar[bool] = False
    ranks_lists: ClassVar[bool] = False     # served per query's candidate list: the planner plans per query
    # (batch, what one timed call is): the unit the planner plans latency for
    planned_unit: ClassVar[tuple[int, str]] = (1, "one request")
    # what task distillation matches: ``logits`` (sequence logits), ``embedding``, ``lists`` (scores over each
    # query's candidates), ``tokens`` (per-token logits), ``spans`` (start and end logits)
    distill_kind: ClassVar[str] = "logits"
    distill_lr: ClassVar[float | None] = None  # task distillation's default learning rate (None: distill's)
    finetune_lr: ClassVar[float | None] = None  # fine-tuning's default learning rate (None: finetune's 3e-5)
    small_model_lr: ClassVar[float | None] = None  # ... for a narrow model (train/finetune.py's SMALL_HIDDEN)

    def eval_columns(self, folder: Any) -> dict[str, str]:
        """The data columns (evaluation config fields) a saved model's lineage records, for measuring it on
        dev data as it was fine-tuned (none: the task's reader finds its fields)."""
        return {}

    def distill_rows(self, cfg: Any, tokenizer: Any) -> list[dict[str, np.ndarray]]:
        """Token rows of task distillation's training data (``cfg``: the DistillConfig), for the kinds
        ``tokens`` and ``spans``."""
        raise NotImplementedError

    def compress_inputs(self, spec: str, path: Path, *, card: dict[str, Any] | None, folder: str | Path | None,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> TaskInputs:
        """The inputs of a data file as compression reads them (calibration, distillation, vocabulary)."""
        raise NotImplementedError

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: np.random.Generator, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        """The dev examples timed for latency (``cfg``: the evaluation config), read with the task's reader."""
        raise NotImplementedError

    def latency_rows(self, samples: dict[str, Any], tokenizer: Any, folder: Any, cfg: Any, max_length: int
                     ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
        """Feature rows of the timed unit and of the timed batch (empty: no batch unit)."""
        raise NotImplementedError


def typical_and_batch(items: list, size: Any, rng: np.random.Generator, n: int = 32) -> dict[str, list]:
    """One typical item (the median by ``size``) and a seeded sample of ``n``: a task's latency samples."""
    order = sorted(range(len(items)), key=lambda i: size(items[i]))
    pick = rng.choice(len(items), size=min(n, len(items)), replace=False)
    return {"one": [items[order[len(order) // 2]]], "batch": [items[int(i)] for i in sorted(pick)]}
