"""Reading texts to label and writing labelled lines: the label set, the text field, the output record."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_lines, records
from encoderkit.tasks.tabular import Row, find_text_column, iter_rows


def parse_labels(spec: str | list[str], least: int = 2) -> list[str]:
    """``"A,B,C"`` (or a list) -> ``["A", "B", "C"]``; duplicates, empty names and fewer than ``least`` labels
    (a class needs two; entity types may be one) are errors."""
    items = spec if isinstance(spec, list) else str(spec).split(",")
    labels = [x.strip() for x in items]
    if any(not x for x in labels):
        raise EncoderkitError(f"--labels {spec!r}: an empty label name; give names separated by commas, e.g. "
                              "negative,positive")
    lowered = [x.lower() for x in labels]
    dups = sorted({x for x, low in zip(labels, lowered, strict=True) if lowered.count(low) > 1})
    if dups:
        raise EncoderkitError(f"--labels {spec!r}: {', '.join(dups)} given twice (labels are compared without case); "
                              "give each label once")
    if len(labels) < least:
        raise EncoderkitError(f"--labels {spec!r}: one label; labelling needs two or more")
    return labels


def parse_pairs(items: list[str], labels: list[str], flag: str) -> dict[str, str]:
    """``["neg=a bad review", ...]`` -> ``{label: text}``; every key must be a label."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value.strip():
            raise EncoderkitError(f"{flag} {item!r}: expected LABEL=TEXT")
        key = key.strip()
        if key not in labels:
            raise EncoderkitError(f"{flag} {item!r}: {key!r} is not one of the labels ({', '.join(labels)})")
        out[key] = value.strip()
    return out


def find_text_field(rows: list[Row], given: str, path: str | Path) -> str:
    """The input's text field: ``given`` if set, else the column the task readers would pick
    (:func:`~encoderkit.tasks.tabular.find_text_column`: one of :data:`TEXT_NAMES` by name, else the
    only text column), so that ``label`` and ``finetune`` read one file the same way."""
    if given:
        if given not in rows[0].fields:
            fields = ", ".join(map(str, rows[0].fields))
            raise EncoderkitError(f"{rows[0].where}: no field {given!r} (fields: {fields}); set --text-field to the "
                                  "field holding the text")
        return given
    try:
        return find_text_column(rows, path, exclude=("label",))[0]
    except EncoderkitError as e:
        raise EncoderkitError(str(e).replace("--text-column", "--text-field")) from None


def read_texts(path: str | Path, text_field: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Texts to label and each row's own fields; a ``.txt`` file is one text per line."""
    pairs = list(iter_texts(path, text_field))
    return [t for t, _ in pairs], [o for _, o in pairs]


TEXT_FIELD_ROWS = 100  # rows that decide the text field (what find_text_column reads of a whole table)


def iter_texts(path: str | Path, text_field: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(text, the row's own fields) of each input row, read as they are asked for (:func:`read_texts`' rows, errors
    and order; the text field is found on the first :data:`TEXT_FIELD_ROWS` rows, as on a whole file)."""
    path = Path(path)
    if path.suffix == ".txt":  # one text per line of the one line reader (only \n ends one); blank lines reported
        found = False
        for _, ln in records(read_lines(path, "--input"), str(path)):
            found = True
            yield ln.strip(), {}
        if not found:
            raise EncoderkitError(f"--input {path} holds no text; give one text per line")
        return
    rows = iter_rows(path)
    head = list(itertools.islice(rows, TEXT_FIELD_ROWS))
    if not head:
        raise EncoderkitError(f"{path} holds no rows")
    name = find_text_field(head, text_field, path)
    for r in itertools.chain(head, rows):
        v = r.fields.get(name)
        if not isinstance(v, str) or not v.strip():
            raise EncoderkitError(f"{r.where}: field {name!r} is missing, empty or not text ({v!r}); fill or drop "
                                  "the row")
        # the text's own field is kept too (unless it is 'text'), so `finetune --text-column` names the same
        # column in labeled.jsonl and in a dev file of the input's format
        yield v, {k: x for k, x in r.fields.items() if k != "text"}


def output_record(text: str, label: str | None, confidence: float | None, labeller: str,
                  own: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One output line: the four keys, then the input's own fields (a clashing one is kept as ``input_<name>``)."""
    rec: dict[str, Any] = {"text": text, "label": label,
                           "confidence": None if confidence is None else round(float(confidence), 4),
                           "labeller": labeller}
    rec.update(extra or {})
    for k, v in own.items():
        rec[f"input_{k}" if k in rec else k] = v
    return rec


def read_labeled(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``labeled.jsonl`` written by ``encoderkit label``."""
    return list(iter_labeled(path))


def iter_labeled(path: str | Path) -> Iterator[dict[str, Any]]:
    """The lines of :func:`read_labeled`, read as they are asked for."""
    for r in iter_rows(path):
        if "label" not in r.fields or "text" not in r.fields:
            raise EncoderkitError(f"{r.where}: not a labelled line (needs 'text' and 'label'); give the output of "
                                  "`encoderkit label`")
        text, label = r.fields["text"], r.fields["label"]
        if not isinstance(text, str) or not (label is None or isinstance(label, str)):
            raise EncoderkitError(f"{r.where}: 'text' must be a string and 'label' a string or null (got "
                                  f"{json.dumps(text)[:40]}, {json.dumps(label)[:40]}); give the output of "
                                  "`encoderkit label`")
        yield r.fields


def dumps(rec: dict[str, Any]) -> str:
    return json.dumps(rec, ensure_ascii=False)
