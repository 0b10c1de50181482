"""Documents to index, with stable ids, and their split into token-window passages.

Sources (``encoderkit index --corpus ...``):

* a JSONL file (``.jsonl``): one object per line with an id (``--id-field``, default ``id``, else
  ``_id``), the text (``--text-field``) and an optional title (``--title-field``), encoded as
  ``title + " " + text`` as BEIR does;
* a CSV file (``.csv``): the same fields as columns;
* a BEIR folder (``corpus.jsonl`` inside) or the SciFact export zip: its corpus;
* any other file, or every non-hidden file below a folder: one document per file, whose id is its
  path relative to the folder (or the file's own path). A folder means what is inside it: a symbolic link whose
  target leaves the folder is skipped and counted (``--follow-links`` reads it).

Policies: a document id seen twice is refused (both places are named), since which text to keep
would be a guess; a file or record that is not UTF-8 is skipped, named and counted in the result;
empty texts are skipped; a corpus with no document is refused.

Passages: a document longer than ``size`` tokens is cut into windows of ``size`` tokens that
overlap by ``overlap`` tokens (each window starts ``size - overlap`` tokens after the last), cut at
token boundaries and kept as the document's own characters, so a hit shows real text. Passage
``j`` of document ``D`` has the id ``D#j``; results are mapped back to documents (a document
scores as its best passage).
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.data.beir import load_retrieval
from encoderkit.data.files import folder_files
from encoderkit.errors import EncoderkitError
from encoderkit.io import check_input, input_problem, read_csv, read_jsonl, read_lines


@dataclass(frozen=True)
class SourceDoc:
    id: str
    text: str
    where: str

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:32]


@dataclass
class CorpusRead:
    docs: list[SourceDoc]
    skipped: list[str]  # "where: why" of each document left out


class Skipped:
    """The documents a read left out: how many, the first ``keep`` "where: why" (all of them: None), each of those
    also passed to ``note`` as it happens (a stage's stderr line)."""

    def __init__(self, keep: int | None = None, note: Callable[[str], Any] | None = None) -> None:
        self.count, self.first, self.keep, self.note = 0, [], keep, note

    def append(self, why: str) -> None:
        self.count += 1
        if self.keep is None or len(self.first) < self.keep:
            self.first.append(why)
            if self.note is not None:
                self.note(f"skipped {why}")


def read_corpus(sources: list[str], id_field: str = "id", text_field: str = "text", title_field: str = "title",
                follow_links: bool = False) -> CorpusRead:
    """Every document of ``sources`` (see the module docstring) in a deterministic order."""
    skipped = Skipped()
    docs = list(iter_corpus(sources, id_field, text_field, title_field, skipped, follow_links))
    return CorpusRead(docs, skipped.first)


def iter_corpus(sources: list[str], id_field: str = "id", text_field: str = "text", title_field: str = "title",
                skipped: Skipped | None = None, follow_links: bool = False) -> Iterator[SourceDoc]:
    """The documents of :func:`read_corpus`, in its order, read as they are asked for: a JSONL file line by line, a
    CSV record by record (after a first pass that checks it is UTF-8, since a CSV that is not is skipped whole), a
    folder file by file; a BEIR folder or the SciFact zip is read whole by :mod:`encoderkit.data.beir` (an
    evaluation format, its queries and judgments checked with its corpus). What stays in memory is each id and where
    it came from (to name both places of a repeated id). The same errors, raised when reached: a repeated id at its
    second place, a corpus with no document at the end."""
    skipped = Skipped() if skipped is None else skipped
    seen: dict[str, str] = {}
    for spec in sources:
        for d in _source_docs(spec, skipped, id_field, text_field, title_field, follow_links):
            if d.id in seen:
                raise EncoderkitError(f"document id {d.id!r} appears twice ({seen[d.id]} and {d.where}); ids must be "
                                      "unique: fix the source or give --id-field a unique field")
            seen[d.id] = d.where
            yield d
    if not seen:
        why = f" ({skipped.count} skipped: {'; '.join(skipped.first[:3])})" if skipped.count else ""
        raise EncoderkitError(f"corpus {', '.join(sources)} holds no document with text{why}; nothing to index")


def _source_docs(spec: str, skipped: Skipped, id_field: str, text_field: str, title_field: str,
                 follow_links: bool = False) -> Iterator[SourceDoc]:
    path = Path(spec.partition("#")[0])
    if not path.exists():
        raise EncoderkitError(f"--corpus {spec} does not exist; check the spelling and the current folder")
    if not path.is_dir():
        check_input(path, "--corpus")  # a device, a pipe or an unreadable file says so
    if path.suffix == ".zip" or (path.is_dir() and (path / "corpus.jsonl").is_file()):
        data = load_retrieval(spec)
        for d in data.corpus:
            yield SourceDoc(d, data.doc_text(d), f"{spec}: doc {d}")
    elif path.is_dir():
        files, links = folder_files(path, follow_links)
        for link in links:
            skipped.append(f"{link}: a link that leaves the corpus folder {path} (--follow-links reads it)")
        for f in files:
            yield from _file_docs(f, str(f.relative_to(path)), skipped, id_field, text_field, title_field)
    else:
        yield from _file_docs(path, str(path), skipped, id_field, text_field, title_field)


def record_fields(rec: dict, where: str, id_field: str, text_field: str, title_field: str) -> tuple[str, object, str]:
    """(id, title, text) of one corpus record read at ``where`` (``file:line``): the id (``_id`` when ``id_field``
    is ``id`` and the record has no ``id``) and the text are required, the title may be missing (""); an error names
    the record and the flag to set."""
    rid = rec.get(id_field, rec.get("_id")) if id_field == "id" else rec.get(id_field)
    if rid is None or str(rid).strip() == "":
        raise EncoderkitError(f"{where}: no {id_field!r} field; every record needs an id (--id-field)")
    text = rec.get(text_field)
    if not isinstance(text, str):
        raise EncoderkitError(f"{where}: field {text_field!r} is missing or not a string (--text-field)")
    return str(rid), rec.get(title_field) or "", text


def _file_docs(path: Path, doc_id: str, skipped: Skipped, id_field: str, text_field: str,
               title_field: str) -> Iterator[SourceDoc]:
    if path.suffix in (".jsonl", ".csv"):
        records = _jsonl(path, skipped) if path.suffix == ".jsonl" else _csv(path, skipped)
        for where, rec in records:
            rid, title, text = record_fields(rec, where, id_field, text_field, title_field)
            full = f"{title} {text}".strip() if isinstance(title, str) else text.strip()
            if full:
                yield SourceDoc(rid, full, where)
            else:
                skipped.append(f"{where}: empty text")
        return
    try:
        text = path.read_bytes().decode("utf-8").removeprefix("\ufeff").strip()  # one file, one document
    except UnicodeDecodeError as e:
        skipped.append(f"{path}: not UTF-8 (first bad byte at offset {e.start})")
        return
    except OSError as e:
        raise EncoderkitError(f"corpus file {path} cannot be read: {input_problem(path, e)}") from e
    if text:
        yield SourceDoc(doc_id, text, str(path))
    else:
        skipped.append(f"{path}: empty")


def _jsonl(path: Path, skipped: Skipped) -> Iterator[tuple[str, dict]]:
    """The records of a JSONL corpus file through the one line reader (only \\n ends a record, so a text's own
    U+2028 does not); a line that is not UTF-8 is skipped, named and counted; blank lines are counted."""
    def bad(number: int, offset: int) -> None:
        skipped.append(f"{path}:{number}: not UTF-8 (byte offset {offset})")

    for n, rec in read_jsonl(path, "corpus file", lines=read_lines(path, "corpus file", on_bad=bad)):
        yield f"{path}:{n}", rec


READ_BYTES = 1 << 22  # bytes per read of the UTF-8 check


def first_bad_utf8(path: Path) -> int | None:
    """The offset of the first byte of ``path`` that is not UTF-8 (what ``bytes.decode`` reports), None if there is
    none; read :data:`READ_BYTES` at a time."""
    base, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(READ_BYTES)
            data = carry + chunk
            try:
                _, used = codecs.utf_8_decode(data, "strict", not chunk)
            except UnicodeDecodeError as e:
                return base + e.start
            if not chunk:
                return None
            base, carry = base + used, data[used:]


def _csv(path: Path, skipped: Skipped) -> Iterator[tuple[str, dict]]:
    bad = first_bad_utf8(path)
    if bad is not None:
        skipped.append(f"{path}: not UTF-8 (first bad byte at offset {bad})")
        return
    for n, rec in read_csv(path, "corpus file"):  # the one line reader: a BOM (Excel's "CSV UTF-8") dropped
        yield f"{path}:{n}", rec


def passage_spans(tokenizer, text: str, size: int, overlap: int) -> list[tuple[int, int]]:
    """Character spans [start, end) of the token windows of ``text`` (one span for a short text)."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    if size <= 0 or len(offsets) <= size:
        return [(0, len(text))]
    step = max(1, size - overlap)
    spans = []
    for start in range(0, len(offsets), step):
        end = min(start + size, len(offsets))
        spans.append((offsets[start][0], offsets[end - 1][1]))
        if end == len(offsets):
            break
    return spans
