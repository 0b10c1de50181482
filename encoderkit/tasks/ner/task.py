"""The ner task object (:mod:`encoderkit.tasks.protocol`): named entities: token classification over words, long
sentences in overlapping windows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from encoderkit.tasks.ner.data import read_ner
from encoderkit.tasks.ner.features import decode_entities, decode_word_tags, featurize_text, window_logits, window_rows
from encoderkit.tasks.ner.options import folder_stride
from encoderkit.tasks.ner.train import OPTIONS, featurize
from encoderkit.tasks.ner.train import build as build_run
from encoderkit.tasks.ner.train import evaluate_folder as evaluate_saved
from encoderkit.tasks.protocol import Runner, ServingUnit, Task, TaskInputs, typical_and_batch


class NerTask(Task):
    name = "ner"
    options = OPTIONS
    outputs = ("logits",)
    per_token = True
    endpoint = "extract"
    unit = ServingUnit("one request (one typical dev sentence, all its windows)", "request", "32 dev sentences",
                       "32 requests")
    primary_metrics = ("f1",)
    data_help = "a CoNLL or JSONL NER file"
    agreement_measure = "token label"  # INT8 agreement: each word's predicted tag
    # a token head from random weights needs more steps at 3e-5 than a small set gives (docs/finetune.md, "Against
    # the HF Trainer"): run_ner's 5e-5, and a narrow model (MiniLM) higher still
    finetune_lr = 5e-5
    small_model_lr = 1e-4

    # -- training and evaluation: the task's train module ------------------------------------------
    build = staticmethod(build_run)
    evaluate_folder = staticmethod(evaluate_saved)

    # -- inference ----------------------------------------------------------------------------------
    def extract(self, runner: Runner, texts: Sequence[str], stride: int | None = None) -> list[list[dict[str, Any]]]:
        """Entities per text: [{"entity", "label", "start", "end", "score"}], character offsets [start, end);
        long texts in overlapping windows (``stride``: the folder's card, else a quarter of the length cut)."""
        id2label = dict(enumerate(runner.info.labels))
        return [[{"entity": e.text, "label": e.label, "start": e.start, "end": e.end, "score": float(e.score)}
                 for e in decode_entities(f, logits, id2label)] for f, logits in self._windows(runner, texts, stride)]

    @staticmethod
    def _windows(runner: Runner, texts: Sequence[str], stride: int | None = None) -> list[tuple[Any, Any]]:
        """Per text, its features and its windows' logits (W, L, C), the windows run in one ``run_rows``."""
        stride = stride if stride is not None else folder_stride(runner.info.card, runner.max_length)
        feats = [featurize_text(runner.tokenizer, t, max_length=runner.max_length, stride=stride) for t in texts]
        rows, where = window_rows(feats)
        outs = [o[0] for o in runner.run_rows(rows)] if rows else []
        return list(zip(feats, window_logits(feats, where, outs, len(runner.info.labels)), strict=True))

    def predict(self, runner: Runner, records: Sequence[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
        """``{"entities": [...]}`` per record (``text``), as :meth:`extract` finds them."""
        return [{"entities": e} for e in self.extract(runner, [r["text"] for r in records])]

    def serve(self, runner: Runner, items: list[Any]) -> list[Any]:
        """Items: texts; the entities of each (:meth:`extract`)."""
        return self.extract(runner, items)

    def agreement_records(self, path: str, cfg: Any, folder: Any, *, limit: int = 0,
                          miner: str = "") -> list[dict[str, Any]]:
        """The sentences of a CoNLL or JSONL file, their words joined by spaces, as ``predict`` records."""
        sents = read_ner(path, cfg.tag_scheme)
        return [{"text": " ".join(s.words)} for s in (sents[:limit] if limit else sents)]

    def agreement_units(self, runner: Runner, records: Sequence[dict[str, Any]]) -> list[list[Any]]:
        """Per record, the tag of each of its words (what :meth:`extract` decodes its entities from)."""
        id2label = dict(enumerate(runner.info.labels))
        windows = self._windows(runner, [r["text"] for r in records])
        return [decode_word_tags(f, logits, id2label)[0] for f, logits in windows]

    # -- compression --------------------------------------------------------------------------------
    planned_unit = (1, "one request (one text)")
    distill_kind = "tokens"

    def distill_rows(self, cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
        """The sentences of a CoNLL or JSONL file (its words; tags are not used), cut at ``cfg.seq_len``."""
        sents = read_ner(cfg.train)
        enc = tokenizer([s.words for s in sents], is_split_into_words=True, truncation=True, max_length=cfg.seq_len)
        keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
        return [{k: np.asarray(enc[k][i], dtype=np.int64) for k in keys} for i in range(len(enc["input_ids"]))]

    def compress_inputs(self, spec: str, path: Any, *, card: dict[str, Any] | None, folder: Any,
                        label2id: dict[str, int] | None, limit: int, seed: int, miner: str | None) -> Any:
        """The words of each sentence joined by spaces."""
        return TaskInputs([" ".join(s.words) for s in read_ner(path)], None, str(path))

    def latency_samples(self, dev: str, cfg: Any, start: Any, rng: Any, *, miner: str,
                        candidates: int) -> dict[str, Any]:
        return typical_and_batch(read_ner(dev, cfg.tag_scheme), lambda s: len(" ".join(s.words)), rng)

    def latency_rows(self, samples: dict[str, Any], tokenizer: Any, folder: Any, cfg: Any,
                     max_length: int) -> tuple[list, list]:
        opts = dataclasses.replace(self.options_for_folder(cfg, folder), max_length=max_length)
        return (window_rows(featurize(tokenizer, samples["one"], opts))[0],
                window_rows(featurize(tokenizer, samples["batch"], opts))[0])


TASK = NerTask()
