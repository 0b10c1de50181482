"""Retrieval data: BEIR folders, the SciFact CSV export, and (query, positive, negatives) JSONL.

A BEIR source is ``PATH#SPLIT``: a BEIR folder (``corpus.jsonl``, ``queries.jsonl``, ``qrels/SPLIT.tsv``) or the
SciFact export zip, whose ``test`` is its ``validation`` split (BEIR's SciFact test set). A document is encoded as
``title + " " + text``, as BEIR's sentence-transformers wrapper does.
"""

from __future__ import annotations

import ast
import json
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from encoderkit.data.files import MEMBER_SEP
from encoderkit.errors import EncoderkitError
from encoderkit.io import csv_records, lines_of, read_jsonl, read_lines, records

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)


@dataclass
class Retrieval:
    """corpus: doc id -> (title, text); queries: query id -> text; qrels: query id -> {doc id: relevance}."""

    corpus: dict[str, tuple[str, str]]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]

    def doc_text(self, doc_id: str) -> str:
        title, text = self.corpus[doc_id]
        return f"{title} {text}".strip()


def pseudo_queries(data: Retrieval, n: int, seed: int = 0, max_words: int = 32) -> dict[str, str]:
    """``n`` corpus documents (a seeded sample) turned into queries, label-free: the title when it has
    three words or more, else the text's first sentence, at most ``max_words`` words. Keys are
    ``pseudo:<doc id>``, never a split's query id."""
    ids = sorted(data.corpus)
    rng = np.random.default_rng(seed)
    out: dict[str, str] = {}
    for i in rng.permutation(len(ids)):
        if len(out) >= n:
            break
        title, text = data.corpus[ids[i]]
        query = title if len(title.split()) >= 3 else _SENTENCE_END.split(text.strip(), maxsplit=1)[0]
        words = query.split()[:max_words]
        if len(words) >= 3:
            out[f"pseudo:{ids[i]}"] = " ".join(words)
    return out


def split_spec(spec: str) -> tuple[Path, str]:
    path, _, split = str(spec).partition("#")
    return Path(path), split or "test"


def is_beir_source(spec: str) -> bool:
    path, _ = split_spec(spec)
    return path.is_dir() or path.suffix == ".zip"


def load_retrieval(spec: str) -> Retrieval:
    """Corpus, queries and qrels of ``PATH#SPLIT`` (see the module docstring)."""
    path, split = split_spec(spec)
    if not path.exists():
        raise EncoderkitError(f"retrieval data {path} does not exist")
    data = _scifact_zip(path, split) if path.suffix == ".zip" else _beir_folder(path, split)
    missing = {d for rels in data.qrels.values() for d in rels if d not in data.corpus}
    if missing:
        raise EncoderkitError(f"{spec}: {len(missing)} judged document id(s) are not in the corpus "
                              f"(e.g. {sorted(missing)[:3]})")
    data.qrels = {q: r for q, r in data.qrels.items() if q in data.queries}
    if not data.qrels:
        raise EncoderkitError(f"{spec}: no query has a relevance judgment")
    return data


def parse_scifact_abstract(raw: str, where: str) -> str:
    """``"['sent 1'\\n 'sent 2']"`` -> ``"sent 1 sent 2"``."""
    sentences = [ast.literal_eval(m) for m in _LITERAL.findall(raw)]
    if raw.strip() not in ("", "[]") and not sentences:
        raise EncoderkitError(f"{where}: abstract is not a list of quoted sentences: {raw[:80]!r}")
    return " ".join(sentences)


def _scifact_zip(path: Path, split: str) -> Retrieval:
    split = {"test": "validation", "dev": "validation"}.get(split, split)
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise EncoderkitError(f"{path}: not a zip file ({e})") from e
    with zf:
        names = {Path(n).name: n for n in zf.namelist()}
        need = ["corpus_train.csv", f"claims_{split}.csv"]
        for n in need:
            if n not in names:
                raise EncoderkitError(f"{path}: no {n} inside (has {', '.join(sorted(names))}); is this the SciFact "
                                      "export?")

        def rows(name: str, columns: tuple[str, ...]) -> list[tuple[str, dict[str, str]]]:
            """(where, row) of a member CSV through the one line reader; its ``columns`` must be there."""
            where = f"{path}{MEMBER_SEP}{name}"
            with zf.open(names[name]) as f:
                out = [(f"{where}:{n}", r) for n, r in csv_records(lines_of(f, where, keep_ends=True), where)]
            missing = [c for c in columns if out and c not in out[0][1]]
            if missing:
                raise EncoderkitError(f"{where}: no column {', '.join(missing)} (columns: {', '.join(out[0][1])}); "
                                      "is this the SciFact export?")
            return out

        corpus = {}
        for where, r in rows("corpus_train.csv", ("doc_id", "title", "abstract")):
            corpus[r["doc_id"]] = (r["title"], parse_scifact_abstract(r["abstract"], where))
        queries: dict[str, str] = {}
        qrels: dict[str, dict[str, int]] = {}
        for _, r in rows(f"claims_{split}.csv", ("id", "claim")):
            qid = r["id"]
            queries[qid] = r["claim"]
            for d in re.findall(r"\d+", r.get("cited_doc_ids", "")):
                qrels.setdefault(qid, {})[d] = 1
    return Retrieval(corpus, queries, qrels)


def _beir_folder(path: Path, split: str) -> Retrieval:
    for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv"):
        if not (path / name).is_file():
            raise EncoderkitError(f"{path}: no {name}; a BEIR folder holds corpus.jsonl, queries.jsonl and "
                                  "qrels/<split>.tsv")
    corpus = {}
    for where, rec in _jsonl(path / "corpus.jsonl"):
        corpus[_field(rec, "_id", where)] = (_text(rec, "title", where), _text(rec, "text", where))
    queries = {_field(rec, "_id", where): _text(rec, "text", where) for where, rec in _jsonl(path / "queries.jsonl")}
    qrels: dict[str, dict[str, int]] = {}
    name = path / f"qrels/{split}.tsv"
    for n, line in records(read_lines(name, "qrels file"), str(name)):
        cells = line.split("\t")
        if n == 1 and not cells[-1].strip().lstrip("-").isdigit():
            continue  # header
        if len(cells) != 3 or not cells[2].strip().lstrip("-").isdigit():
            raise EncoderkitError(f"{name}:{n}: expected 'query-id<TAB>corpus-id<TAB>score'")
        qrels.setdefault(cells[0], {})[cells[1]] = int(cells[2])
    return Retrieval(corpus, queries, qrels)


def _jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """(``file:line``, object) of each record of a JSONL file (:func:`encoderkit.io.read_jsonl`)."""
    for n, rec in read_jsonl(path, "data file"):
        yield f"{path}:{n}", rec


def _field(rec: dict, key: str, where: str) -> str:
    """``rec[key]`` as an id string; a missing or empty one names ``where``."""
    value = rec.get(key)
    if value is None or isinstance(value, (dict, list)) or str(value).strip() == "":
        raise EncoderkitError(f"{where}: no {key!r} field (an id); a BEIR record needs one")
    return str(value)


def _text(rec: dict, key: str, where: str) -> str:
    """``rec[key]`` as a text ("" when missing or null); another type names ``where``."""
    value = rec.get(key) or ""
    if not isinstance(value, str):
        raise EncoderkitError(f"{where}: field {key!r} holds {json.dumps(value)[:40]}, expected a text")
    return value


@dataclass
class Triple:
    query: str
    positive: str
    negatives: list[str]
    where: str


def read_triples(path: str | Path) -> list[Triple]:
    """JSONL lines ``{"query": ..., "positive": ..., "negatives": [...]}`` (negatives optional)."""
    path = Path(path)
    if not path.is_file():
        raise EncoderkitError(f"data file {path} does not exist")
    out = []
    for where, rec in _jsonl(path):
        q, p = rec.get("query"), rec.get("positive")
        negs = rec.get("negatives", [])
        if not isinstance(q, str) or not q.strip() or not isinstance(p, str) or not p.strip():
            raise EncoderkitError(f"{where}: needs non-empty 'query' and 'positive' strings")
        if not isinstance(negs, list) or not all(isinstance(x, str) and x.strip() for x in negs):
            raise EncoderkitError(f"{where}: 'negatives' must be a list of non-empty strings")
        out.append(Triple(q, p, negs, where))
    if not out:
        raise EncoderkitError(f"{path} holds no rows")
    return out
