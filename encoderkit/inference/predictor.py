"""The Predictor: one task model behind one engine, with length-sorted batches.

    p = Predictor.load("runs/sst2")            # backend "auto": the engine policy's choice (p.backend_reason: why)
    p.classify(["a great movie", "dull"])      # [{"label": "positive", "score": ..., "scores": {...}}, ...]
    p.embed(["a query"], dim=256)              # (1, 256) float32, Matryoshka-truncated and renormalised

The engine is :mod:`encoderkit.inference.policy`'s choice, made once per load and kept in ``Predictor.choice``: a
copy loaded elsewhere (a Ray actor) is given it instead of choosing again. Long inputs are truncated to
``max_length`` (classify, rerank, embed) or cut into overlapping windows (extract, answer).
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.engines import calibration_batches, open_engine, run_rows
from encoderkit.inference.policy import ASKED, AUTO_HELP, EngineChoice, resolve
from encoderkit.io import BlankLines, check_input, check_output_file, json_line, open_text_atomic, read_lines, records
from encoderkit.models.folder import ModelFolder
from encoderkit.progress import progress
from encoderkit.ray_jobs import RayJob, check_ray_args, ray_actors_arg, ray_address_arg, ray_batch_arg
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.batching import length_batches
from encoderkit.tasks.embed.embedder import Embedder, tokenize

BACKENDS = ASKED  # what --backend may name: ``auto`` (encoderkit.inference.policy), a backend, ``static``
# ``predict`` reads, runs and writes its input this many records at a time, locally and with --ray alike (whose driver
# holds at most ray_jobs.IN_FLIGHT chunks): an input of up to CHUNK records is batched as one, a longer one per chunk
CHUNK = 4096


class Predictor:
    """A task model ready for inference; see the module docstring."""

    def __init__(self, folder: Path, info: ModelFolder, tokenizer, engine, choice: EngineChoice, max_batch: int,
                 max_length: int) -> None:
        self.folder, self.info, self.tokenizer, self.engine = folder, info, tokenizer, engine
        self.task, self.max_batch, self.max_length = info.task, max_batch, max_length
        self.choice = choice  # the engine policy's choice: what another copy (a Ray actor) loads with
        self.backend, self.backend_reason = choice.backend, choice.reason  # what runs the model, and why

    @classmethod
    def load(cls, folder: str | Path, backend: str | EngineChoice = "auto", threads: int | None = None,
             max_batch: int = 32, max_length: int | None = None, spin: bool = True,
             calibration: Sequence[str] | None = None) -> Predictor:
        """Load ``folder`` (a task model, or its export) on ``backend``: a name, resolved once by the engine policy
        (:func:`encoderkit.inference.policy.resolve`), or a choice it already made (``Predictor.choice`` of a copy
        loaded elsewhere, an index's recorded engine). ``spin=False`` lets onnxruntime's idle threads sleep (a server
        sharing the CPU with its HTTP loop). ``calibration``: texts like the ones to come (a sample of the corpus)
        whose activation ranges an explicit ``openvino-int8`` quantises with; without them it calibrates on
        vocabulary draws and built-in prose (:func:`~encoderkit.inference.engines.default_calibration`), as ``auto``
        does where it picks OpenVINO."""
        if max_batch < 1:
            raise EncoderkitError(f"max_batch must be at least 1, got {max_batch}")
        info = ModelFolder.open(folder, tokenizer=False)
        info.require_task(*TASKS)
        choice = resolve(info, backend, calibration=calibration)
        tokenizer = info.tokenizer()
        limit = info.max_length if max_length is None else min(max_length, info.max_length)
        texts = choice.texts if choice.backend == "openvino-int8" else None
        batches = calibration_batches(info, texts, limit) if texts else None
        engine = open_engine(info, choice, threads=threads, spin=spin, calibration=batches)
        return cls(info.path, info, tokenizer, engine, choice, max_batch, limit)

    # -- batching -------------------------------------------------------------------------
    def run_rows(self, rows: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        """Run the model on 1-D token rows in length-sorted batches; per row, each output with its
        padding cut off ((C,) for sequence outputs, (T_row, ...) for token outputs), in input order
        (the :class:`~encoderkit.tasks.protocol.Runner` a task's ``predict`` and ``serve`` use)."""
        return run_rows(self.engine, rows, self.tokenizer.pad_token_id or 0, self.max_batch,
                        per_token=get_task(self.task).per_token)

    def _need(self, *tasks: str) -> None:
        # a guard, not a branch: these public methods are named after a task's API (classify, extract, ...)
        if self.task not in tasks:
            raise EncoderkitError(f"{self.folder} is a {self.task!r} model; this call needs a "
                                  f"{' or '.join(tasks)} model")

    # -- tasks: each the task object's own method, on this predictor ----------------------
    def classify(self, inputs: Sequence[str | tuple[str, str] | list[str]]) -> list[dict[str, Any]]:
        """Label, its probability and every label's probability for each text or (text, text_pair); a
        multilabel model: ``{"labels": [over their thresholds], "scores": {...}}`` per text, as /v1/classify."""
        task = get_task(self.task)
        if task.endpoint == "classify":  # what the service's /v1/classify returns for this model
            return task.serve(self, list(inputs))
        self._need("classify", "rerank")
        return get_task("classify").classify(self, inputs)

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """Relevance logits (N,) of (query, passage) pairs for a ``rerank`` model (first logit; for a
        two-label model, the last label's logit minus the first's)."""
        self._need("rerank", "classify")
        return get_task("rerank").score(self, queries, passages)

    def rerank(self, query: str, passages: Sequence[str]) -> list[dict[str, Any]]:
        """Passages ranked by relevance to ``query``: [{"index", "score"}], best first."""
        self._need("rerank", "classify")
        return get_task("rerank").rank(self, query, passages)

    def embed_raw(self, texts: Sequence[str]) -> np.ndarray:
        """Pooled, un-normalised embeddings (N, H) float32 (mean or first-token pooling per the folder)."""
        self._need("embed")
        return Embedder.of_runner(self).pooled(texts)

    def embed(self, texts: Sequence[str], dim: int | None = None, normalize: bool | None = None) -> np.ndarray:
        """Embeddings (N, dim or H) float32; ``dim`` keeps the first dims (Matryoshka) before normalising.
        ``normalize`` defaults to the folder's setting (sentence-transformers ``Normalize`` module)."""
        self._need("embed")
        return Embedder.of_runner(self).embed(texts, dim, normalize)

    def extract(self, texts: Sequence[str], stride: int | None = None) -> list[list[dict[str, Any]]]:
        """Entities per text: [{"entity", "label", "start", "end", "score"}], character offsets [start, end)."""
        self._need("ner")
        return get_task("ner").extract(self, texts, stride)

    def answer(self, questions: Sequence[str], contexts: Sequence[str], max_answer_length: int | None = None,
               n_best: int | None = None) -> list[dict[str, Any]]:
        """The best answer span per (question, context): {"answer", "start", "end", "score"}; an empty
        answer with score None when no span fits. Window and span settings come from the folder's card
        (what the model was fine-tuned and evaluated with), else defaults cut to ``max_length``."""
        self._need("qa")
        return get_task("qa").answer(self, questions, contexts, max_answer_length, n_best)


def finish_embeddings(vectors: np.ndarray, dim: int | None, normalize: bool) -> np.ndarray:
    """Keep the first ``dim`` dimensions (Matryoshka truncation) of (N, H) vectors, then L2-normalise (the
    embed task's last step, for the routes and indexes that cut and normalise pooled vectors themselves)."""
    return Embedder.finish(vectors, dim, normalize)


def describe(p: Predictor) -> dict[str, Any]:
    """What a loaded predictor is: task, backend, labels, limits (for /health and logs)."""
    return {"folder": str(p.folder), "task": p.task, "backend": p.backend, "backend_reason": p.backend_reason,
            "labels": p.info.labels, "max_length": p.max_length, "max_batch": p.max_batch,
            "stage": p.info.card.get("stage")}


# -- --ray: the single-process run's engine calls, formed on the driver ------------------------------------

def engine_batches(p: Predictor, lengths: Sequence[int], chunk: int | None = None) -> list[list[int]]:
    """Row indices of the engine calls the single-process run makes of rows of these token ``lengths``:
    :func:`~encoderkit.tasks.batching.length_batches` with ``p.max_batch`` over all rows, or over each run of
    ``chunk`` rows where the caller hands the Predictor its rows ``chunk`` at a time. Each call's rows in the order
    the engine sees them (shortest first), so that :func:`as_one_call` on them pads and runs the same batch."""
    span, pad_step = chunk or max(len(lengths), 1), int(getattr(p.engine, "length_step", 1))
    return [[a + int(i) for i in g] for a in range(0, len(lengths), span)
            for g in length_batches(lengths[a:a + span], p.max_batch, step=pad_step)]


def as_one_call(fn: Callable[[Predictor, list[Any]], Any], p: Predictor, rows: list[Any]) -> Any:
    """``fn(p, rows)`` with ``p.max_batch`` set to ``len(rows)``: rows that one call of
    :func:`engine_batches` holds, in its order, are one engine call again (a group that length_batches chose is the
    least-cost split of itself, ties broken the same way, and its sorted order is kept), so a dynamic-INT8 graph,
    whose activation scale is one per call, gives each row the vector of the single-process run."""
    one = copy.copy(p)
    one.max_batch = max(1, len(rows))
    return fn(one, rows)


def text_lengths(p: Predictor, texts: Sequence[str]) -> list[int]:
    """Token rows' lengths of ``texts`` as the embed path cuts them
    (:func:`~encoderkit.tasks.embed.embedder.tokenize`)."""
    return [len(r["input_ids"]) for r in tokenize(p.tokenizer, list(texts), p.max_length)] if texts else []


class _Rows(Exception):
    def __init__(self, lengths: list[int] | None) -> None:
        self.lengths = lengths


class _Probe:
    """A Runner that featurises as ``p`` does and stops at the first engine call, with the rows' lengths."""

    def __init__(self, p: Predictor) -> None:
        self.info, self.tokenizer, self.task, self.folder = p.info, p.tokenizer, p.task, p.folder
        self.max_length, self.max_batch, self.engine = p.max_length, p.max_batch, self

    def run_rows(self, rows: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        raise _Rows([len(r["input_ids"]) for r in rows])

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        raise _Rows(None)


def record_lengths(p: Predictor, records: list[dict[str, Any]], dim: int | None = None) -> list[int] | None:
    """The token length of each record's one model row, where the task's ``predict`` makes one row per record
    and runs them all in one ``run_rows`` (classify, multilabel, embed; ner and qa while no text needs a second
    window); None otherwise (rerank ranks each record in calls of its own; windows of long texts)."""
    task = get_task(p.task)
    if task.endpoint == "embed":  # its Embedder runs the engine itself, on the texts tokenised thus
        return text_lengths(p, [r["text"] for r in records])
    try:
        task.predict(_Probe(p), records, dim=dim)
    except _Rows as r:
        return r.lengths if r.lengths is not None and len(r.lengths) == len(records) else None
    return None


# -- `encoderkit predict` ---------------------------------------------------------------------

@dataclass
class PredictConfig(StageConfig):
    """Settings of ``encoderkit predict``."""

    model: str = arg(help="Task model folder (or its ONNX export).", required=True)
    input: str = arg(help="Input: .txt (one text per line) or .jsonl with text / text_pair / question+context "
                          "/ query+passages fields.", required=True)
    output: str = arg(help="Output .jsonl file: one result per input record, in order.", required=True)
    backend: str = arg("auto", help="Inference backend; " + AUTO_HELP, choices=BACKENDS)
    dim: int | None = arg(None, help="embed: keep the first dim dimensions (Matryoshka), then renormalise.")
    overwrite: bool = arg(False, help="Replace an existing --output file.")
    threads: int | None = arg(None, help="onnxruntime intra-op threads.", speed=True)
    max_batch: int = arg(32, help="Texts per model call.", speed=True)
    ray: str | None = ray_address_arg()
    ray_actors: int = ray_actors_arg()
    ray_batch: int = ray_batch_arg()

    def validate(self) -> None:
        check(self.max_batch >= 1, "--max-batch must be at least 1")
        check_ray_args(self.ray_actors, self.ray_batch)


@dataclass
class PredictResult:
    output: Path
    records: int
    task: str
    engine: EngineChoice
    seconds: float
    blank_lines: int = 0

    def summary(self) -> dict[str, Any]:
        return {"output": str(self.output), "records": self.records, "blank_lines": self.blank_lines, "task": self.task,
                "engine": self.engine.to_dict(), "seconds": round(self.seconds, 3),
                "records_per_s": round(self.records / max(self.seconds, 1e-9), 1)}


def iter_records(path: Path, task: str, blank: BlankLines | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of each input record, read line by line (a corpus never sits whole in memory) by the
    one line reader (:func:`encoderkit.io.read_lines`: only ``\\n`` ends a line): a .txt file gives {"text": line}
    per non-blank line; .jsonl one object per line, each checked as it is read (errors name ``file:line``). Blank
    lines are skipped, counted in ``blank`` and reported; the output names each result's line."""
    need = get_task(task).record_fields
    found = False
    jsonl = path.suffix == ".jsonl"
    for n, line in records(read_lines(path, "--input"), str(path), blank):
        if not jsonl:
            if need != ("text",):  # a line of a .txt is one text: the input of a task whose record is one text
                raise EncoderkitError(f"{path}: a {task} model needs a .jsonl input with fields {', '.join(need)}")
            found = True
            yield n, {"text": line}
            continue
        rec = json_line(line, f"{path}:{n}")
        get_task(task).check_record(rec, f"{path}:{n}")
        found = True
        yield n, rec
    if not found:
        raise EncoderkitError(f"--input {path} holds no records; give one text per line (.txt) or one JSON object "
                              "per line (.jsonl)")


def chunks(records: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """``records`` in lists of ``size`` (the last one shorter), read as each list is asked for."""
    it = iter(records)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def predict_records(p: Predictor, records: list[dict[str, Any]], dim: int | None = None) -> list[dict[str, Any]]:
    """One result dict per input record (the record's ``id`` is copied when present): the task's ``predict``."""
    results = get_task(p.task).predict(p, records, dim=dim)
    return [({"id": r["id"]} if "id" in r else {}) | res for r, res in zip(records, results, strict=True)]


def _predict_shipped(dim: int | None, p: Predictor, rows: list[tuple[bool, dict[str, Any]]]) -> list[dict[str, Any]]:
    """A ``--ray`` actor's call on one group of a chunk: records tagged True are one engine call of the local run
    (:func:`as_one_call`), False a run of records whose rows the task batches itself (windows, rankings)."""
    records = [r for _, r in rows]
    if rows and rows[0][0]:
        return as_one_call(partial(predict_records, dim=dim), p, records)
    return predict_records(p, records, dim)


def run(cfg: PredictConfig) -> PredictResult:
    """Run a task model over a file of texts and write one JSON result per line.

    Example: encoderkit predict --model runs/sst2 --input reviews.txt --output preds.jsonl
    """
    out = check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.input, cfg.model])  # before the model runs
    check_input(cfg.input, "--input")
    ray = RayJob.of(cfg)  # Ray missing or an address that does not answer fails now, before the model is loaded
    p = Predictor.load(cfg.model, backend=cfg.backend, threads=cfg.threads, max_batch=cfg.max_batch)
    start = time.perf_counter()
    done = 0
    blank = BlankLines()
    numbered = chunks(iter_records(Path(cfg.input), p.task, blank), CHUNK)
    lines: deque[list[int]] = deque()  # the input lines of the chunks read and not yet written, oldest first

    def unnumbered() -> Iterator[list[dict[str, Any]]]:
        for part in numbered:
            lines.append([n for n, _ in part])
            yield [r for _, r in part]

    parts = unnumbered()
    if ray is not None:  # one Predictor per actor, on the engine chosen here (an actor never picks on its own CPU);
        # the one above checked the folder and exported its graph once
        load = partial(Predictor.load, cfg.model, backend=p.choice, threads=ray.threads, max_batch=cfg.max_batch)

        def planned(part: list[dict[str, Any]]) -> tuple[list[tuple[bool, dict[str, Any]]], list[list[int]] | None]:
            lengths = record_lengths(p, part, cfg.dim)  # the local run's engine calls of this chunk, each shipped whole
            if lengths is None:  # records whose rows are batched across records (windows), or ranked one by one
                return [(False, r) for r in part], None
            return [(True, r) for r in part], engine_batches(p, lengths)

        results_of = ray.map_chunks((planned(part) for part in parts), load, partial(_predict_shipped, cfg.dim))
    else:
        results_of = (predict_records(p, part, cfg.dim) for part in parts)
    bar = progress(desc="predict", unit="record")
    try:
        with open_text_atomic(out) as f:
            for results in results_of:  # each row says which input line it answers (blank lines are skipped)
                f.write("".join(json.dumps({"line": n} | r, ensure_ascii=False) + "\n"
                                for n, r in zip(lines.popleft(), results, strict=True)))
                f.flush()  # a chunk's results leave the driver as they are written
                done += len(results)
                bar.update(len(results))
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    return PredictResult(out, done, p.task, p.choice, seconds, blank.count)
