"""Documents to index, with stable ids, and their split into token-window passages.

Sources (``encoderkit index --corpus ...``):

* a JSONL file (``.jsonl``): one object per line with an id (``--id-field``, default ``id``, else
  ``_id``), the text (``--text-field``) and an optional title (``--title-field``), encoded as
  ``title + " " + text`` as BEIR does;
* a CSV file (``.csv``): the same fields as columns;
* a BEIR folder (``corpus.jsonl`` inside) or the SciFact export zip: its corpus;
* any other file, or every non-hidden file below a folder: one document per file, whose id is its
  path relative to the folder (or the file's own path).

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

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from encoderkit.errors import EncoderkitError


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


def read_corpus(sources: list[str], id_field: str = "id", text_field: str = "text", title_field: str = "title") -> CorpusRead:
    """Every document of ``sources`` (see the module docstring) in a deterministic order."""
    docs: list[SourceDoc] = []
    skipped: list[str] = []
    for spec in sources:
        path = Path(spec.partition("#")[0])
        if not path.exists():
            raise EncoderkitError(f"corpus {spec} does not exist")
        if path.suffix == ".zip" or (path.is_dir() and (path / "corpus.jsonl").is_file()):
            from encoderkit.data.beir import load_retrieval

            data = load_retrieval(spec)
            docs += [SourceDoc(d, data.doc_text(d), f"{spec}: doc {d}") for d in data.corpus]
        elif path.is_dir():
            for f in sorted(p for p in path.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(path).parts)):
                _read_file(f, str(f.relative_to(path)), docs, skipped, id_field, text_field, title_field)
        else:
            _read_file(path, str(path), docs, skipped, id_field, text_field, title_field)
    seen: dict[str, str] = {}
    for d in docs:
        if d.id in seen:
            raise EncoderkitError(f"document id {d.id!r} appears twice ({seen[d.id]} and {d.where}); ids must be "
                                  "unique: fix the source or give --id-field a unique field")
        seen[d.id] = d.where
    if not docs:
        why = f" ({len(skipped)} skipped: {'; '.join(skipped[:3])})" if skipped else ""
        raise EncoderkitError(f"corpus {', '.join(sources)} holds no document with text{why}; nothing to index")
    return CorpusRead(docs, skipped)


def _read_file(path: Path, doc_id: str, docs: list[SourceDoc], skipped: list[str], id_field: str, text_field: str,
               title_field: str) -> None:
    raw = path.read_bytes()
    if path.suffix in (".jsonl", ".csv"):
        records = _jsonl(path, raw, skipped) if path.suffix == ".jsonl" else _csv(path, raw, skipped)
        for where, rec in records:
            rid = rec.get(id_field, rec.get("_id")) if id_field == "id" else rec.get(id_field)
            if rid is None or str(rid).strip() == "":
                raise EncoderkitError(f"{where}: no {id_field!r} field; every record needs an id (--id-field)")
            text = rec.get(text_field)
            if not isinstance(text, str):
                raise EncoderkitError(f"{where}: field {text_field!r} is missing or not a string (--text-field)")
            title = rec.get(title_field) or ""
            full = f"{title} {text}".strip() if isinstance(title, str) else text.strip()
            if full:
                docs.append(SourceDoc(str(rid), full, where))
            else:
                skipped.append(f"{where}: empty text")
        return
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        skipped.append(f"{path}: not UTF-8 (first bad byte at offset {e.start})")
        return
    if text:
        docs.append(SourceDoc(doc_id, text, str(path)))
    else:
        skipped.append(f"{path}: empty")


def _jsonl(path: Path, raw: bytes, skipped: list[str]):
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            skipped.append(f"{path}:{n}: not UTF-8 (byte {e.start} of the line)")
            continue
        except json.JSONDecodeError as e:
            raise EncoderkitError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise EncoderkitError(f"{path}:{n}: expected a JSON object")
        yield f"{path}:{n}", rec


def _csv(path: Path, raw: bytes, skipped: list[str]):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        skipped.append(f"{path}: not UTF-8 (first bad byte at offset {e.start})")
        return
    for n, rec in enumerate(csv.DictReader(io.StringIO(text, newline="")), 2):
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
