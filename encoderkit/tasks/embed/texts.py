"""Texts of a corpus for embedding work: the sentence pieces embedding distillation trains on (and compression
calibrates an embedder with), and a BEIR source's texts and samples. Documents are cut into pieces of 1, 2 and 4
sentences in turn, so a student sees query-length and passage-length inputs.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from encoderkit.config import check
from encoderkit.data.beir import load_retrieval, split_spec
from encoderkit.data.readers import ReadStats, iter_documents
from encoderkit.errors import EncoderkitError
from encoderkit.progress import note

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
PIECE_SENTENCES = (1, 2, 4)


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (split after . ! ? before a capital or digit), whitespace collapsed."""
    return [s for s in (" ".join(p.split()) for p in _SENTENCE_END.split(text)) if s]


def source_documents(spec: str, follow_links: bool = False, stats: ReadStats | None = None) -> Iterator[str]:
    """Document texts of one source: a BEIR source's corpus (title + text), and with an explicit
    ``#split`` that split's queries too (each its own text; no labels are read), or any corpus file or folder (links
    that leave a folder left out unless ``follow_links``, counted in ``stats.skipped_links``)."""
    path, split = split_spec(spec)
    if (path.is_dir() and (path / "corpus.jsonl").is_file()) or (path.suffix == ".zip" and _is_scifact_zip(path)):
        data = load_retrieval(f"{path}#{split}")
        for doc_id in data.corpus:
            yield data.doc_text(doc_id)
        if "#" in str(spec):  # the split's queries: those its qrels name (a BEIR queries.jsonl holds every split's)
            yield from (data.queries[q] for q in data.qrels if q in data.queries)
        return

    def skipped(source: str, why: str) -> None:
        note(f"distill: left out {source} ({why})")

    for doc in iter_documents(spec, doc_split="blank_line", skip_bad_encoding=True, on_skip=skipped,
                              follow_links=follow_links, stats=stats):
        yield doc.text


def _documents(spec: str, follow_links: bool, stats: ReadStats | None) -> Iterator[str]:
    """:func:`source_documents` of ``spec``, its skipped links added to ``stats`` (each source counts its own)."""
    own = ReadStats()
    yield from source_documents(spec, follow_links, own)
    if stats is not None:
        stats.skipped_links += own.skipped_links


def _is_scifact_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return any(Path(n).name == "corpus_train.csv" for n in zf.namelist())
    except (zipfile.BadZipFile, FileNotFoundError):
        return False


def training_texts(sources: str, limit: int = 0, min_chars: int = 20, seed: int = 0, follow_links: bool = False,
                   stats: ReadStats | None = None) -> list[str]:
    """Pieces of 1, 2 or 4 consecutive sentences from the documents of ``sources`` (comma-separated; folders read
    as :func:`source_documents` reads them, ``stats.skipped_links`` summed over the sources).

    With ``limit`` the pieces are a seeded sample of that many, taken evenly from each source
    (what one source lacks goes to the others). Pieces shorter than ``min_chars`` are dropped.
    """
    per_source: list[list[str]] = []
    for spec in [s.strip() for s in sources.split(",") if s.strip()]:
        pieces: list[str] = []
        turn = 0
        for text in _documents(spec, follow_links, stats):
            sentences = split_sentences(text)
            i = 0
            while i < len(sentences):
                n = PIECE_SENTENCES[turn % len(PIECE_SENTENCES)]
                turn += 1
                piece = " ".join(sentences[i : i + n])
                i += n
                if len(piece) >= min_chars:
                    pieces.append(piece)
        if not pieces:
            raise EncoderkitError(f"--train {spec}: no text of at least {min_chars} characters; check the source")
        per_source.append(list(dict.fromkeys(pieces)))
    check(bool(per_source), "--train: no source given")
    if not limit:
        return [p for pieces in per_source for p in pieces]
    rng = np.random.default_rng(seed)
    out: list[str] = []
    left, pending = limit, sorted(range(len(per_source)), key=lambda i: len(per_source[i]))
    while pending:  # smallest sources first, so what they lack is shared by the larger ones
        i = pending.pop(0)
        take = min(len(per_source[i]), left // (len(pending) + 1))
        picked = rng.choice(len(per_source[i]), size=take, replace=False)
        out.extend(per_source[i][j] for j in sorted(picked))
        left -= take
    return out


def beir_texts(spec: str) -> list[str]:
    """Every document of a BEIR source's corpus, then every query of its split."""
    data = load_retrieval(spec)
    return [data.doc_text(d) for d in data.corpus] + list(data.queries.values())


def beir_sample(dev: str, n: int, rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """A BEIR source's judged queries and the texts of ``n`` documents drawn from its corpus by ``rng``."""
    data = load_retrieval(dev)
    doc_ids = list(data.corpus)
    picked = rng.choice(len(doc_ids), size=min(n, len(doc_ids)), replace=False)
    return [data.queries[q] for q in sorted(data.qrels)], [data.doc_text(doc_ids[int(i)]) for i in picked]
