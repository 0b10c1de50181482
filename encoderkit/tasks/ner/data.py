"""NER data readers, always returning IOB2 tags: CoNLL column files (the word first, the tag last; every token
line of a file has the same columns, so a space inside a token is caught) and JSONL (``tokens`` + ``tags``, or
``text`` + character-span ``entities`` that start and end on word edges).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.io import check_input, json_line, read_lines, records
from encoderkit.tasks.ner.features import split_words
from encoderkit.tasks.tags import guess_scheme, iob2_to_spans, split_tag, to_iob2


@dataclass
class Sentence:
    """Words, their IOB2 tags, and where the sentence starts (``file:line``)."""

    words: list[str]
    tags: list[str]
    where: str
    text: str | None = None
    word_spans: np.ndarray | None = None


def read_ner(path: str | Path, scheme: str = "auto") -> list[Sentence]:
    """Sentences of a CoNLL file or a JSONL file (by extension: .jsonl/.json; anything else is CoNLL)."""
    path = check_input(path, "NER data file")
    sents = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_conll(path)
    if not sents:
        raise EncoderkitError(f"{path} holds no sentences")
    for s in sents:  # validate tags and name the place of a bad one
        for t in s.tags:
            try:
                split_tag(t)
            except EncoderkitError as e:
                raise EncoderkitError(f"{s.where}: {e}") from None
    if scheme == "auto":
        scheme = guess_scheme([s.tags for s in sents])
    for s in sents:
        s.tags = to_iob2(s.tags, scheme)
    return sents


def _read_conll(path: Path) -> list[Sentence]:
    sents: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    start, ncols = 0, None
    # the one line reader: only \n ends a line; a blank line ends a sentence
    for n, line in read_lines(path, "NER data file"):
        cells = line.split()
        if not cells or cells[0] == "-DOCSTART-":
            if words:
                sents.append(Sentence(words, tags, f"{path}:{start}"))
            words, tags = [], []
            continue
        if ncols is None:
            ncols = len(cells)
            if ncols < 2:
                raise EncoderkitError(f"{path}:{n}: one column only; a CoNLL line needs the word first and the "
                                      "tag last")
        elif len(cells) != ncols:
            raise EncoderkitError(
                f"{path}:{n}: {len(cells)} columns where earlier lines have {ncols}; every token line needs the "
                "same columns (word first, tag last). Fix the line (a space inside a token?)"
            )
        if not words:
            start = n
        words.append(cells[0])
        tags.append(cells[-1])
    if words:
        sents.append(Sentence(words, tags, f"{path}:{start}"))
    return sents


def _read_jsonl(path: Path) -> list[Sentence]:
    sents: list[Sentence] = []
    # one record per line of the one line reader; blank lines skipped and reported
    for n, line in records(read_lines(path, "NER data file"), str(path)):
        where = f"{path}:{n}"
        rec = json_line(line, where)
        if "tokens" in rec:
            tokens, tags = rec["tokens"], rec.get("tags", rec.get("ner_tags"))
            if tags is None or len(tags) != len(tokens):
                raise EncoderkitError(f"{where}: 'tokens' needs a 'tags' list of the same length")
            sents.append(Sentence([str(t) for t in tokens], [str(t) for t in tags], where))
        elif "text" in rec:
            if "labeller" in rec and rec.get("label") is None:
                continue  # `encoderkit label` found no span list in any answer: not a sentence without entities
            sents.append(_from_spans(rec["text"], rec.get("entities", []), where))
        else:
            raise EncoderkitError(f"{where}: expected keys 'tokens'+'tags' or 'text'+'entities'")
    return sents


def _from_spans(text: str, entities: list[dict], where: str) -> Sentence:
    words, spans = split_words(text)
    if not words:
        raise EncoderkitError(f"{where}: the text is empty")
    starts = {int(s): i for i, s in enumerate(spans[:, 0])}
    ends = {int(e): i for i, e in enumerate(spans[:, 1])}
    tags = ["O"] * len(words)
    for ent in entities:
        try:
            a, b, label = int(ent["start"]), int(ent["end"]), str(ent["label"])
        except (KeyError, TypeError, ValueError) as e:
            raise EncoderkitError(f"{where}: an entity needs integer 'start', 'end' and a 'label' ({ent!r})") from e
        if a not in starts or b not in ends:
            raise EncoderkitError(
                f"{where}: entity {text[a:b]!r} [{a}, {b}) does not start and end on word edges; fix its offsets"
            )
        i, j = starts[a], ends[b]
        if any(t != "O" for t in tags[i : j + 1]):
            raise EncoderkitError(f"{where}: entity {text[a:b]!r} overlaps another one; nested entities are not "
                                  "supported")
        tags[i] = f"B-{label}"
        for k in range(i + 1, j + 1):
            tags[k] = f"I-{label}"
    return Sentence(words, tags, where, text=text, word_spans=spans)


def entity_types(sents: list[Sentence]) -> list[str]:
    return sorted({kind for s in sents for kind, _, _ in iob2_to_spans(s.tags)})
