"""The data a compression lever reads, through the task readers and the columns in the model's card.

Every lever declares the data fields it needs (:data:`FIELDS`: ``train``, ``calib``, ``miner``); the recipe runner
(or a lever's CLI stage) builds one :class:`LeverData` for the model's task and hands it over, so no lever reads
files itself. Each task reads its own inputs (its object's ``compress_inputs``); a ``.txt`` file (one input per
line, no labels) works for every task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoderkit.data.beir import is_beir_source
from encoderkit.errors import EncoderkitError
from encoderkit.io import read_lines, records
from encoderkit.models.folder import ModelFolder
from encoderkit.models.heads import PRETRAINED
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.embed.texts import beir_texts
from encoderkit.tasks.protocol import Task, TaskInputs

FIELDS = {
    "train": "the task's training data (--train)",
    "calib": "in-domain inputs for calibration (--calib, else --train)",
    "miner": ("rerank: the first-stage bi-encoder whose top candidates of a BEIR source's queries are the pairs "
              "(--miner)"),
}
OTHER_DATA = {PRETRAINED: "a text file"}  # what an MLM model's data is (the pretrained head has no task object)


def _task(name: str | None) -> Task | None:
    """The task object of a fine-tuned task's name; None for a pretrained (MLM) model or an unknown task."""
    return get_task(name) if name in TASKS else None


def data_help(task: str | None) -> str:
    """What ``task``'s data file is, for error messages."""
    spec = _task(task)
    return spec.data_help if spec is not None else OTHER_DATA.get(task or "", "task data")


def read_task_inputs(spec: str, task: str, *, card: dict[str, Any] | None = None, folder: str | Path | None = None,
                     label2id: dict[str, int] | None = None, limit: int = 0, seed: int = 0,
                     miner: str | None = None) -> TaskInputs:
    """Inputs (and classify labels) of ``spec`` read as ``task``'s data, or the lines of a ``.txt`` file.

    ``folder``: the model whose card names the classify columns; ``label2id``: its classes (classify
    labels are read only when it is given); ``miner``: rerank's first stage on a BEIR source."""
    path = Path(str(spec).partition("#")[0])
    if path.suffix == ".txt":
        # the one line reader: only \n ends a text (a U+2028 or form feed inside one is text), a BOM dropped
        lines = [ln.strip() for _, ln in records(read_lines(path, "text file"), str(path))]
        if not lines:
            raise EncoderkitError(f"{path} holds no texts")
        return TaskInputs(list(lines), None, str(path)).head(limit)
    task_object = _task(task)
    if task_object is None:
        raise EncoderkitError(f"{spec}: compression reads {', '.join(TASKS[:-1])} or {TASKS[-1]} data, not {task!r} "
                              "(a .txt file of texts works for any model)")
    out = task_object.compress_inputs(spec, path, card=card, folder=folder, label2id=label2id, limit=limit, seed=seed,
                                      miner=miner)
    if not out.texts:
        raise EncoderkitError(f"{spec} holds no {task} inputs; expected {data_help(task)}")
    return out.head(limit)


def vocabulary_texts(spec: str, task: str, **kwargs: Any) -> list[Any]:
    """The texts whose tokens the vocabulary lever keeps: :func:`read_task_inputs`' inputs, or for a rerank
    model's BEIR source, every document of the corpus and every query of the split (as embed reads it): the
    documents a reranker serves are the corpus, not only the judged or mined ones."""
    task_object = _task(task)
    if task_object is not None and task_object.uses_miner and is_beir_source(spec):
        return beir_texts(spec)
    return read_task_inputs(spec, task, **kwargs).texts


@dataclass
class LeverData:
    """The data sources a lever may ask for, and the model they belong to (its task and card).

    ``sources`` maps a field of :data:`FIELDS` to a file or source spec; ``calib`` falls back to
    ``train``. :meth:`require` checks a step's declared fields before anything runs."""

    task: str
    sources: dict[str, str | None] = field(default_factory=dict)
    folder: str | None = None
    _cache: dict[tuple[Any, ...], TaskInputs] = field(default_factory=dict, repr=False)

    @classmethod
    def for_model(cls, model: str | Path, **sources: str | None) -> LeverData:
        mf = ModelFolder.open(model, weights=False, tokenizer=False)
        if mf.task is None:
            raise EncoderkitError(f"{model}: cannot tell the model's task; set 'task' in its encoderkit.json")
        return cls(mf.task, {k: v for k, v in sources.items() if v}, str(model))

    @property
    def uses_miner(self) -> bool:
        """Whether the model's task reads a BEIR source's pairs through a first-stage bi-encoder (``miner``)."""
        task_object = _task(self.task)
        return task_object is not None and task_object.uses_miner

    def with_sources(self, **sources: str | None) -> LeverData:
        """A copy where the given non-empty sources (a step's or a stage's own files) replace these."""
        return LeverData(self.task, {**self.sources, **{k: v for k, v in sources.items() if v}}, self.folder)

    def source(self, name: str) -> str | None:
        if name not in FIELDS:
            raise EncoderkitError(f"unknown lever data field {name!r}; known: {', '.join(FIELDS)}")
        got = self.sources.get(name)
        return got or (self.sources.get("train") if name == "calib" else None)

    def require(self, fields: tuple[str, ...], where: str) -> None:
        """Raise, naming the task, the field and ``where`` (the step), when a declared field has no source."""
        for name in fields:
            if not self.source(name):
                raise EncoderkitError(f"{where}: the {self.task} model's step needs '{name}' ({FIELDS[name]}: "
                                      f"{data_help(self.task)}), and none was given; pass it or "
                                      "set the step's own data field")

    def inputs(self, name: str, model: str | Path, limit: int = 0, seed: int = 0) -> TaskInputs:
        """The inputs of field ``name`` read as the task's data, with classify labels as ``model``'s class ids."""
        spec = self.source(name)
        if not spec:
            self.require((name,), f"{self.task} data")
        miner = self.sources.get("miner") if self.uses_miner else None
        key = (spec, str(model), limit, seed, miner)
        if key not in self._cache:
            mf = ModelFolder.open(model, weights=False, tokenizer=False)
            label2id = {str(v): int(k) for k, v in (mf.config.get("id2label") or {}).items()}
            label2id.update({str(lab): i for i, lab in enumerate(mf.labels)})
            self._cache[key] = read_task_inputs(str(spec), self.task, card=mf.card, folder=self.folder or model,
                                                label2id=label2id, limit=limit, seed=seed, miner=miner)
        return self._cache[key]
