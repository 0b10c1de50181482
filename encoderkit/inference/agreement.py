"""INT8 agreement: how often a folder's INT8 graph gives what its FP32 graph gives on dev rows, in the task's own
terms (the task object's ``agreement``: classify the predicted label, multilabel the label set, ner each word's
tag, qa the answer span, rerank each query's top-1 passage). ``encoderkit export --dev`` and ``encoderkit compress
--dev`` record it in the card (``int8_agreement``), and ``--backend auto`` reads it there
(:func:`encoderkit.inference.policy.serve_choice`): INT8 from :data:`INT8_MIN_AGREEMENT` on a VNNI/AMX CPU.

    {"int8_agreement": {"value": 0.997, "rows": 872, "units": 872, "measure": "label", "file": "dev.tsv",
                        "threshold": 0.995}}

Both graphs run as the Predictor runs them: length-sorted batches of ``max_batch`` rows (a dynamic-INT8 graph's
activation scale is one per call, so the batches matter), the folder's max length, its card's decoding settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks import get_task
from encoderkit.tasks.inference import run_rows
from encoderkit.tasks.options import TaskDataOptions
from encoderkit.tasks.protocol import INT8_MIN_AGREEMENT

__all__ = ["CARD_KEY", "INT8_MIN_AGREEMENT", "AgreementRunner", "int8_agreement", "not_measured", "verdict"]

CARD_KEY = "int8_agreement"


@dataclass
class AgreementRunner:
    """What a task's inference methods use of the Predictor (:class:`~encoderkit.tasks.protocol.Runner`)."""

    info: ModelFolder
    tokenizer: Any
    engine: Any  # run(inputs) -> outputs
    max_batch: int

    @property
    def max_length(self) -> int:
        return self.info.max_length

    def run_rows(self, rows: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        return run_rows(self.engine, rows, self.tokenizer.pad_token_id or 0, self.max_batch,
                        per_token=get_task(self.info.task).per_token)


def not_measured(why: str) -> dict[str, Any]:
    """The card's record of an agreement that was not measured, and why."""
    return {"value": None, "why": why, "threshold": INT8_MIN_AGREEMENT}


def agreement_rows(info: ModelFolder, dev: str, *, limit: int = 0, miner: str = "", qa_split: str = "all",
                   candidates: int = 100) -> Any:
    """The first ``limit`` (0: all) rows of ``dev`` read by the task's reader, what :func:`int8_agreement` compares on
    (``miner``/``candidates``: a reranker's BEIR source; ``qa_split``: a SQuAD file's articles); read before any
    graph is made, so a bad file fails at once."""
    task = get_task(info.task)
    cfg = TaskDataOptions(task=info.task, qa_split=qa_split, candidates=candidates, **task.eval_columns(info.path))
    try:
        records = task.agreement_records(dev, cfg, info, limit=limit, miner=miner)
    except EncoderkitError as e:
        raise EncoderkitError(f"--dev {dev}: {e}") from e
    if not records:
        raise EncoderkitError(f"--dev {dev} holds no {info.task} rows to measure INT8 agreement on; give the task's "
                              "dev data")
    return records


def int8_agreement(info: ModelFolder, fp32: Any, int8: Any, dev: str, *, limit: int = 0, miner: str = "",
                   qa_split: str = "all", candidates: int = 100, max_batch: int = 32,
                   records: Any = None) -> dict[str, Any]:
    """The card's ``int8_agreement`` of the engine ``int8`` (the INT8 graph) against ``fp32`` (the FP32 graph) of
    the model ``info`` (its task, labels, card settings and tokenizer), on :func:`agreement_rows` of ``dev`` (or the
    ``records`` it returned)."""
    task = get_task(info.task)
    if records is None:
        records = agreement_rows(info, dev, limit=limit, miner=miner, qa_split=qa_split, candidates=candidates)
    tokenizer = info.tokenizer()
    ref, got = (AgreementRunner(info, tokenizer, engine, max_batch) for engine in (fp32, int8))
    a = task.agreement(ref, got, records)
    where = str(Path(dev).resolve()) if Path(dev).exists() else str(dev)  # a BEIR source may be PATH#split
    return {"value": round(a.value, 6), "rows": a.rows, "units": a.units, "measure": a.measure, "file": where,
            "threshold": INT8_MIN_AGREEMENT}


def verdict(record: dict[str, Any] | None) -> tuple[bool | None, str]:
    """Whether a card's ``int8_agreement`` lets ``auto`` run INT8 (None: nothing was measured), and why, e.g.
    ``INT8 agrees on 98.7% of 872 dev rows < 99.5%`` or ``no INT8 agreement measured (export --dev FILE)``."""
    if not record or record.get("value") is None:
        return None, "no INT8 agreement measured (export --quantize int8-dynamic --dev FILE)"
    value, least = float(record["value"]), INT8_MIN_AGREEMENT  # today's threshold, whatever the card recorded
    ok = value >= least
    # enough digits that a value just under the threshold does not print as the threshold
    digits = 1 if ok else next((d for d in (1, 2, 3) if f"{100 * value:.{d}f}" != f"{100 * least:.{d}f}"), 4)
    return ok, (f"INT8 agrees on {100 * value:.{digits}f}% of {record.get('rows', '?')} dev rows "
                f"{'>=' if ok else '<'} {100 * least:.1f}%")
