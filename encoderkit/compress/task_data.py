"""The data a compression lever reads, through the TASK readers and the columns in the model's card.

Every lever declares the data fields it needs (:data:`FIELDS`); the recipe runner (or a lever's
CLI stage) builds one :class:`LeverData` for the model's task and hands it over, so that no lever
reads files itself:

- ``train``: the task's training data as the task reads it (distillation, recovery, QAT);
- ``calib``: in-domain inputs for calibration, importance scores and vocabulary (default: ``train``).

Inputs of each task, read by the task's own reader:

- classify: :func:`encoderkit.tasks.tabular.read_rows`; the text column the model was fine-tuned on
  (its card's ``text_column``), the pair and label columns of the fine-tuning config in its lineage
  (else found as ``finetune`` finds them); labels become the model's class ids;
- ner: :func:`encoderkit.tasks.ner.data.read_ner` (the words of a sentence joined by spaces);
- qa: :func:`encoderkit.tasks.qa.data.read_squad`, the training articles, (question, context) pairs;
- rerank: a BEIR source (:func:`encoderkit.retrieval.beir.load_retrieval`: each judged
  (query, document) pair; with a ``miner``, each judged query with its top :data:`MINED_PAIRS`
  documents from that bi-encoder, the pairs a reranker serves on, as distillation reads them) or
  JSONL triples (:func:`~encoderkit.retrieval.beir.read_triples`: the query with its positive and
  each negative);
- embed: a BEIR source's documents and queries; a table's text column (found as classify finds it);
  any other corpus cut into sentence pieces as embedding distillation reads it.

A ``.txt`` file (one input per line, no labels) is read the same way for every task.

Vocabulary (:func:`vocabulary_texts`) reads the same inputs, except that a rerank model's BEIR
source gives every document of its corpus and every query of its split: the documents a reranker
serves are the corpus, not only the ones a training query judged or mined.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.protocol import TaskInputs

FIELDS = {
    "train": "the task's training data (--train)",
    "calib": "in-domain inputs for calibration (--calib, else --train)",
    "miner": "rerank: the first-stage bi-encoder whose top candidates of a BEIR source's queries are the pairs (--miner)",
}
MINED_PAIRS = 16  # rerank on a BEIR source with a miner: each judged query's top 16 documents, as distillation scores them
# what each task's data file is, for error messages
TASK_DATA = {
    "classify": "a .tsv/.csv/.jsonl table with the text column the model was fine-tuned on",
    "ner": "a CoNLL or JSONL NER file",
    "qa": "a SQuAD JSON file",
    "rerank": "a BEIR source (folder or zip, PATH#split) or JSONL {query, positive, negatives}",
    "embed": "a corpus (text, JSONL, CSV/TSV, folder) or a BEIR source",
    "mlm": "a text file",
}


COLUMNS = ("text_column", "label_column", "text_pair_column")


def card_columns(folder: str | Path) -> dict[str, str]:
    """The data columns a classify model was fine-tuned with: what its card (or the nearest card of its
    lineage) records, else, for folders written before cards recorded all three, the fine-tuning
    config found in its lineage. The one rule for compression's readers and its measurer; a pair
    classifier whose pair column no longer shows in its lineage is refused."""
    from encoderkit.io import lineage

    cards = lineage(folder)
    cols: dict[str, str] = {}
    for card in cards:
        for key in COLUMNS:
            if card.get(key) and key not in cols:
                cols[key] = str(card[key])
        conf = card.get("config") or {}
        if card.get("stage") == "finetune" or "label_column" in conf:
            for key in ("text_pair_column", "label_column"):
                if key in conf and key not in cols:
                    cols[key] = str(conf[key])
            if conf.get("text_column") not in (None, "auto") and "text_column" not in cols:
                cols["text_column"] = str(conf["text_column"])
            break
    if cards and cards[0].get("text_pair") and "text_pair_column" not in cols:
        raise EncoderkitError(f"{folder}: the model classifies text pairs, but its lineage no longer names the pair "
                              "column (the fine-tuned parent folder is gone); keep the parent folder, add "
                              "'text_pair_column' to its encoderkit.json, or pass single texts in a .txt file")
    return cols


def _label_ids(values: list[Any], label2id: dict[str, int], wheres: list[str]) -> list[int]:
    out = []
    for v, where in zip(values, wheres, strict=True):
        key = str(v).strip()
        if key in label2id:
            out.append(int(label2id[key]))
        elif key.lstrip("-").isdigit():
            out.append(int(key))
        else:
            raise EncoderkitError(f"{where}: label {key!r}, which the model does not know (its labels: "
                                  f"{sorted(label2id)}); fix the file or pass unlabelled data")
    return out


def _classify_inputs(path: Path, columns: dict[str, str], label2id: dict[str, int] | None) -> TaskInputs:
    from types import SimpleNamespace

    from encoderkit.tasks.classify.data import resolve_text_column
    from encoderkit.tasks.tabular import column, read_rows, text_column

    rows = read_rows(path)
    label_col = columns.get("label_column", "label")
    pair_col = columns.get("text_pair_column", "")
    opts = SimpleNamespace(text_column="auto", label_column=label_col, text_pair_column=pair_col)
    name = resolve_text_column(rows, path, opts, columns.get("text_column"))
    texts: list[Any] = text_column(rows, name, path, "--text-column")
    if pair_col:
        texts = list(zip(texts, text_column(rows, pair_col, path, "--text-pair-column"), strict=True))
    labels = None
    if label2id is not None and label_col in rows[0].fields:
        labels = _label_ids(column(rows, label_col, path, "--label-column"), label2id, [r.where for r in rows])
    return TaskInputs(texts, labels, str(path))


def _rerank_inputs(spec: str, miner: str | None = None) -> TaskInputs:
    from encoderkit.retrieval.beir import is_beir_source, load_retrieval, read_triples

    if is_beir_source(spec) and miner:
        from encoderkit.compress.distill_tasks import candidate_lists

        lists = candidate_lists(spec, miner, MINED_PAIRS)
        # rank-major (every query's first candidate, then every query's second, ...), so that the first N
        # pairs a calibration sample takes span N queries
        return TaskInputs([(q, c[r]) for r in range(len(lists[0][1])) for q, c in lists], None, spec)
    if is_beir_source(spec):
        data = load_retrieval(spec)
        pairs = [(data.queries[q], data.doc_text(d)) for q, rels in data.qrels.items() for d, r in rels.items() if r > 0]
    else:
        pairs = [(t.query, p) for t in read_triples(spec) for p in (t.positive, *t.negatives)]
    return TaskInputs(pairs, None, spec)


def _embed_inputs(spec: str, path: Path, limit: int, seed: int) -> TaskInputs:
    from encoderkit.retrieval.beir import is_beir_source, load_retrieval
    from encoderkit.tasks.tabular import find_text_column, read_rows, table_format, text_column

    if is_beir_source(spec):
        data = load_retrieval(spec)
        return TaskInputs([data.doc_text(d) for d in data.corpus] + list(data.queries.values()), None, spec)
    try:
        table_format(path)
    except EncoderkitError:  # not a table: any corpus, cut into sentence pieces as embedding distillation reads it
        from encoderkit.compress.distill_embed import training_texts

        return TaskInputs(list(training_texts(spec, limit, seed=seed)), None, spec)
    rows = read_rows(path)
    name, _ = find_text_column(rows, path)
    return TaskInputs(list(text_column(rows, name, path, "--text-column")), None, spec)


def read_task_inputs(spec: str, task: str, *, card: dict[str, Any] | None = None, folder: str | Path | None = None,
                     label2id: dict[str, int] | None = None, limit: int = 0, seed: int = 0,
                     miner: str | None = None) -> TaskInputs:
    """Inputs (and classify labels) of ``spec`` read as ``task``'s data (see the module docstring).

    ``folder``: the model whose card names the classify columns; ``label2id``: its classes (classify
    labels are read only when it is given); ``miner``: rerank's first stage on a BEIR source."""
    path = Path(str(spec).partition("#")[0])
    if path.suffix == ".txt":
        if not path.is_file():
            raise EncoderkitError(f"text file {path} does not exist")
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            raise EncoderkitError(f"{path} holds no texts")
        return TaskInputs(list(lines), None, str(path)).head(limit)
    if task == "classify":
        columns = card_columns(folder) if folder is not None else {}
        if card and card.get("text_column"):
            columns.setdefault("text_column", str(card["text_column"]))
        out = _classify_inputs(path, columns, label2id)
    elif task == "ner":
        from encoderkit.tasks.ner.data import read_ner

        out = TaskInputs([" ".join(s.words) for s in read_ner(path)], None, str(path))
    elif task == "qa":
        from encoderkit.tasks.qa.data import read_squad

        examples, _ = read_squad(path, "train")  # the training articles; the held-out ones stay unseen
        out = TaskInputs([(e.question, e.context) for e in examples], None, str(path))
    elif task == "rerank":
        out = _rerank_inputs(spec, miner)
    elif task == "embed":
        out = _embed_inputs(spec, path, limit, seed)
    else:
        raise EncoderkitError(f"{spec}: compression reads classify, ner, qa, rerank or embed data, not {task!r} "
                              "(a .txt file of texts works for any model)")
    if not out.texts:
        raise EncoderkitError(f"{spec} holds no {task} inputs; expected {TASK_DATA.get(task, 'task data')}")
    return out.head(limit)


def vocabulary_texts(spec: str, task: str, **kwargs: Any) -> list[Any]:
    """The texts whose tokens the vocabulary lever keeps: :func:`read_task_inputs`' inputs, or for a rerank
    model's BEIR source, every document of the corpus and every query of the split (as embed reads it)."""
    from encoderkit.retrieval.beir import is_beir_source

    if task == "rerank" and is_beir_source(spec):
        return _embed_inputs(spec, Path(spec.partition("#")[0]), 0, 0).texts
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
        from encoderkit.models.folder import ModelFolder

        mf = ModelFolder.open(model, weights=False, tokenizer=False)
        if mf.task is None:
            raise EncoderkitError(f"{model}: cannot tell the model's task; set 'task' in its encoderkit.json")
        return cls(mf.task, {k: v for k, v in sources.items() if v}, str(model))

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
                                      f"{TASK_DATA.get(self.task, 'task data')}), and none was given; pass it or "
                                      "set the step's own data field")

    def inputs(self, name: str, model: str | Path, limit: int = 0, seed: int = 0) -> TaskInputs:
        """The inputs of field ``name`` read as the task's data, with classify labels as ``model``'s class ids."""
        from encoderkit.models.folder import ModelFolder

        spec = self.source(name)
        if not spec:
            self.require((name,), f"{self.task} data")
        miner = self.sources.get("miner") if self.task == "rerank" else None
        key = (spec, str(model), limit, seed, miner)
        if key not in self._cache:
            mf = ModelFolder.open(model, weights=False, tokenizer=False)
            label2id = {str(v): int(k) for k, v in (mf.config.get("id2label") or {}).items()}
            label2id.update({str(lab): i for i, lab in enumerate(mf.labels)})
            self._cache[key] = read_task_inputs(str(spec), self.task, card=mf.card, folder=self.folder or model,
                                                label2id=label2id, limit=limit, seed=seed, miner=miner)
        return self._cache[key]
