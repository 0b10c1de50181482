"""The passages a model is adapted to (id, title, text) and the judged queries it is measured on.

Corpus: a BEIR folder or the SciFact zip (titles kept), a ``.jsonl``/``.csv`` of records, or files as ``index``
reads them. Evaluation: a BEIR ``PATH#split``, or a queries file (JSONL or TSV) with a qrels TSV over the corpus ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from encoderkit.data.beir import Retrieval, load_retrieval, split_spec
from encoderkit.errors import EncoderkitError
from encoderkit.io import read_csv, read_jsonl, read_lines, records
from encoderkit.progress import note
from encoderkit.retrieval.corpus import read_corpus, record_fields


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    @property
    def full(self) -> str:
        """What is encoded and searched: ``title + " " + text`` (as BEIR and ``index`` encode a document)."""
        return f"{self.title} {self.text}".strip()


def read_passages(spec: str, id_field: str = "id", text_field: str = "text", title_field: str = "title",
                  follow_links: bool = False, links: list[str] | None = None) -> list[Passage]:
    """The passages of ``spec`` (see the module docstring), in file order; empty ones left out; none at all
    is an error that says what was read. A folder of files means what is inside it: links that leave it are
    skipped (each added to ``links`` and said on stderr) unless ``follow_links``."""
    path = Path(str(spec).partition("#")[0])
    if not path.exists():
        raise EncoderkitError(f"--corpus {spec} does not exist")
    if path.is_dir() and (path / "corpus.jsonl").is_file():
        out = _records(path / "corpus.jsonl", "_id", "text", "title")
    elif path.suffix == ".zip":
        data = load_retrieval(f"{path}#{split_spec(spec)[1] if '#' in str(spec) else 'train'}")
        out = [Passage(d, t, x) for d, (t, x) in data.corpus.items()]
    elif path.suffix in (".jsonl", ".csv"):
        out = _records(path, id_field, text_field, title_field)
    else:
        try:
            read = read_corpus([str(spec)], follow_links=follow_links)
        except EncoderkitError as e:
            raise EncoderkitError(f"--corpus {spec}: no passage to adapt to ({e})") from e
        docs = read.docs
        left = [s for s in read.skipped if "leaves the corpus folder" in s]
        if left:
            note(f"skipped {len(left)} link(s) that leave the corpus folder {spec} (e.g. {left[0].split(': ')[0]}); "
                 "pass --follow-links to read them")
            if links is not None:
                links.extend(left)
        out = [Passage(d.id, "", d.text) for d in docs]
    out = [p for p in out if p.full]
    seen: set[str] = set()
    for p in out:
        if p.id in seen:
            raise EncoderkitError(f"--corpus {spec}: passage id {p.id!r} appears twice; ids must be unique")
        seen.add(p.id)
    if not out:
        raise EncoderkitError(f"--corpus {spec} holds zero passages with text; adapt needs the corpus to be searched "
                              "(JSONL records with a text field, a BEIR folder, or files of text)")
    return out


def _records(path: Path, id_field: str, text_field: str, title_field: str) -> list[Passage]:
    out = []
    for where, rec in _rows(path):
        rid, title, text = record_fields(rec, where, id_field, text_field, title_field)
        out.append(Passage(rid, str(title), text))  # as index and load_retrieval read them: the same texts
    return out


def _rows(path: Path, flag: str = "--corpus") -> Iterator[tuple[str, dict]]:
    """(``file:line``, record) of a JSONL or CSV file through the one line reader (only \\n ends a record, a BOM
    dropped, blank lines counted, a bad byte named by line and offset)."""
    rows = read_csv(path, flag) if path.suffix == ".csv" else read_jsonl(path, flag)
    for n, rec in rows:
        yield f"{path}:{n}", rec


def eval_data(passages: list[Passage], source: str, queries: str, qrels: str) -> Retrieval | None:
    """The judged queries to report nDCG@10 on: a BEIR ``source``, or ``queries`` + ``qrels`` files over the
    corpus passages; None when neither is given."""
    if source:
        return load_retrieval(source)
    if not (queries or qrels):
        return None
    if not (queries and qrels):
        raise EncoderkitError("--eval-queries and --eval-qrels go together (the queries and their judged passages)")
    corpus = {p.id: (p.title, p.text) for p in passages}
    qs = _eval_queries(Path(queries))
    judged: dict[str, dict[str, int]] = {}
    for n, line in records(read_lines(qrels, "--eval-qrels"), qrels):
        cells = line.split("\t") if "\t" in line else line.split()
        if n == 1 and not cells[-1].lstrip("-").isdigit():
            continue  # header
        if len(cells) == 4:  # TREC: query 0 doc score
            cells = [cells[0], cells[2], cells[3]]
        if len(cells) != 3 or not cells[2].lstrip("-").isdigit():
            raise EncoderkitError(f"{qrels}:{n}: expected 'query-id<TAB>corpus-id<TAB>score'")
        if cells[1] not in corpus:
            raise EncoderkitError(f"{qrels}:{n}: passage {cells[1]!r} is not in --corpus; the judged passages must "
                                  "be the corpus's own ids")
        judged.setdefault(cells[0], {})[cells[1]] = int(cells[2])
    judged = {q: r for q, r in judged.items() if q in qs}
    if not judged:
        raise EncoderkitError(f"--eval-qrels {qrels}: no judged query is in --eval-queries {queries}")
    return Retrieval(corpus, qs, judged)


def _eval_queries(path: Path) -> dict[str, str]:
    if path.suffix == ".jsonl":
        return {str(r.get("_id", r.get("id"))): str(r["text"]) for _, r in _rows(path, "--eval-queries")
                if "text" in r}
    out = {}
    for n, line in records(read_lines(path, "--eval-queries"), str(path)):
        qid, sep, text = line.partition("\t")
        if not sep:
            raise EncoderkitError(f"{path}:{n}: expected 'query-id<TAB>text' (or a .jsonl of {{_id, text}})")
        out[qid] = text
    return out
