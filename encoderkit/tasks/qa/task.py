"""The qa task object (:mod:`encoderkit.tasks.protocol`): extractive question answering: the best answer span of a
context, in overlapping windows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from encoderkit.config import check
from encoderkit.errors import EncoderkitError
from encoderkit.tasks.protocol import Runner, ServingUnit, Task, TaskInputs, typical_and_batch
from encoderkit.tasks.qa.data import read_squad
from encoderkit.tasks.qa.features import decode_answers, featurize_qa, window_rows, window_span_logits
from encoderkit.tasks.qa.train import OPTIONS, featurize
from encoderkit.tasks.qa.train import build as build_run
from encoderkit.tasks.qa.train import evaluate_folder as evaluate_saved


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
    agreement_measure = "answer span"  # INT8 agreement: exact match of the best span's character offsets
    agreement_fields = ("start", "end")
    small_model_lr = 2e-4  # a narrow model (MiniLM) learns little from a small SQuAD set at 1e-4 (docs/finetune.md)

    # -- training and evaluation: the task's train module ------------------------------------------
    build = staticmethod(build_run)
    evaluate_folder = staticmethod(evaluate_saved)

    # -- inference ----------------------------------------------------------------------------------
    def answer(self, runner: Runner, questions: Sequence[str], contexts: Sequence[str],
               max_answer_length: int | None = None, n_best: int | None = None) -> list[dict[str, Any]]:
        """The best answer span per (question, context): {"answer", "start", "end", "score"}; an empty answer
        with score None when no span fits. Window and span settings come from the folder's card (what the
        model was fine-tuned and evaluated with), else defaults cut to the runner's ``max_length``."""
        if len(questions) != len(contexts):
            raise EncoderkitError(f"{len(questions)} questions but {len(contexts)} contexts; give one context per "
                                  "question")
        if not questions:
            return []
        card, max_length = runner.info.card, runner.max_length
        max_answer_length = max_answer_length or card.get("max_answer_length", 30)
        n_best = n_best or card.get("n_best", 20)
        feats = featurize_qa(runner.tokenizer, questions, contexts, max_length=max_length,
                             doc_stride=card.get("doc_stride", min(128, max_length // 4)),
                             max_question_length=card.get("max_question_length", min(64, max_length // 4)))
        start, end = window_span_logits(feats, runner.run_rows(window_rows(feats)))
        best = decode_answers(feats, start, end, n_best=n_best, max_answer_length=max_answer_length)
        return [{"answer": b[0].text, "start": b[0].start, "end": b[0].end, "score": float(b[0].score)} if b
                else {"answer": "", "start": None, "end": None, "score": None} for b in best]

    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
        """The best answer span per record (``question``, ``context``), as :meth:`answer` gives it."""
        return self.answer(runner, [r["question"] for r in records], [r["context"] for r in records])

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """Items: (question, context) tuples; one :meth:`answer` result each."""
        return self.answer(runner, [q for q, _ in items], [c for _, c in items])

    def agreement_records(self, path: str, cfg: Any, folder: Any, *, limit: int = 0,
                          miner: str = "") -> list[dict[str, Any]]:
        """The questions of a SQuAD file's ``cfg.qa_split`` articles with their contexts, as ``predict`` records."""
        examples, _ = read_squad(path, cfg.qa_split)
        return [{"question": e.question, "context": e.context} for e in (examples[:limit] if limit else examples)]

    # -- compression --------------------------------------------------------------------------------
    planned_unit = (1, "one request (one question and its context)")
    distill_kind = "spans"

    def distill_rows(self, cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
        """The first window of each (question, context) of a SQuAD file's training articles (answers are not
        used; the held-out articles stay unseen), cut at ``cfg.seq_len``."""
        examples, _ = read_squad(cfg.train, "train")
        enc = tokenizer([e.question for e in examples], [e.context for e in examples], truncation="only_second",
                        max_length=cfg.seq_len)
        keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
        return [{k: np.asarray(enc[k][i], dtype=np.int64) for k in keys} for i in range(len(enc["input_ids"]))]

    def compress_inputs(self, spec: str, path: Any, *, card: dict[str, Any] | None, folder: Any,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> Any:
        """(question, context) pairs of the training articles; the held-out ones stay unseen."""
        examples, _ = read_squad(path, "train")
        return TaskInputs([(e.question, e.context) for e in examples], None, str(path))

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: Any, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        examples, _ = read_squad(dev, cfg.qa_split)
        check(bool(examples), f"{dev} holds no question with an answer")
        return typical_and_batch(examples, lambda e: len(e.question) + len(e.context), rng)

    def latency_rows(self, samples: dict[str, Any], tokenizer: Any, folder: Any, cfg: Any,
                     max_length: int) -> tuple[list, list]:
        opts = dataclasses.replace(self.options_for_folder(cfg, folder), max_length=max_length)
        return (window_rows(featurize(tokenizer, samples["one"], opts, with_answers=False)),
                window_rows(featurize(tokenizer, samples["batch"], opts, with_answers=False)))


TASK = QaTask()
