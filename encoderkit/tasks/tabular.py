"""Labelled tables: TSV / CSV / JSONL rows as dicts, with the line each came from.

* ``.tsv``: split on tabs with no quoting (GLUE files hold unbalanced ``"``); first line is the header.
* ``.csv``: the ``csv`` module (quoted fields allowed); first line is the header.
* ``.jsonl`` / ``.json`` (one object per line): keys are the columns.
A ``.gz`` suffix after any of these is read through gzip.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.io import check_input, csv_records, json_line, lines_of, read_lines, records


@dataclass
class Row:
    """One record: its fields and where it came from (``file:line``) for error messages."""

    fields: dict[str, Any]
    where: str


def _lines(path: Path, keep_ends: bool = False) -> Iterator[tuple[int, str]]:
    """The numbered lines of ``path`` (gunzipped for .gz) from the one line reader (:func:`encoderkit.io.lines_of`:
    only ``\\n`` ends a line, a BOM dropped, a bad byte named by line and offset)."""
    if path.suffix != ".gz":
        yield from read_lines(path, "data file", keep_ends)
        return
    check_input(path, "data file")
    try:
        with gzip.open(path, "rb") as f:
            yield from lines_of(f, str(path), keep_ends, offset_kind="uncompressed byte offset")
    except (OSError, EOFError) as e:
        raise EncoderkitError(f"cannot read {path}: {e}; a .gz file must be one complete gzip stream") from e


def table_format(path: Path) -> str:
    suffix = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix
    fmt = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}.get(suffix)
    if fmt is None:
        raise EncoderkitError(f"{path}: unknown table format {suffix!r}; use .tsv, .csv or .jsonl (optionally .gz)")
    return fmt


def read_rows(path: str | Path) -> list[Row]:
    """All rows of a TSV / CSV / JSONL file (see the module docstring)."""
    return list(iter_rows(path))


def iter_rows(path: str | Path) -> Iterator[Row]:
    """The rows of :func:`read_rows`, read as they are asked for (the same errors, each when its row is reached;
    a file with no row at the end). Blank lines are skipped, counted and reported; each row names its line."""
    path = check_input(path, "data file")  # missing, a folder, a device, a pipe or unreadable: said as such
    fmt = table_format(path)
    found = False
    if fmt == "jsonl":
        for n, line in records(_lines(path), str(path)):
            found = True
            yield Row(json_line(line, f"{path}:{n}"), f"{path}:{n}")
    else:  # TSV: tabs, no quoting (GLUE files hold unbalanced "); CSV: the csv module
        for n, fields in csv_records(_lines(path, keep_ends=True), str(path), "\t" if fmt == "tsv" else ",",
                                     quoted=fmt == "csv"):
            found = True
            yield Row(fields, f"{path}:{n}")
    if not found:
        raise EncoderkitError(f"{path} holds no rows")


def column(rows: list[Row], name: str, path: str | Path, flag: str) -> list[Any]:
    """The values of column ``name``; a missing column names the flag that chose it."""
    out = []
    for r in rows:
        if name not in r.fields:
            raise EncoderkitError(f"{r.where}: no column {name!r} (columns: {', '.join(map(str, r.fields))}); "
                                  f"set {flag} to the right column")
        out.append(r.fields[name])
    return out


TEXT_NAMES = ("text", "sentence", "content", "review", "document", "body", "comment", "sentence1", "question", "tweet",
              "utterance", "title")


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def find_text_column(rows: list[Row], path: str | Path, exclude: tuple[str, ...] = ()) -> tuple[str, str]:
    """The column holding the text and how it was found: by its name (the first of :data:`TEXT_NAMES`
    present, in any case), else the only column of non-numeric strings; ``exclude`` (the label column)
    is never picked. An error lists the columns when neither rule decides."""
    columns = [c for c in rows[0].fields if c not in exclude]
    by_lower = {str(c).lower(): c for c in columns}
    for name in TEXT_NAMES:
        if name in by_lower:
            return by_lower[name], "found by its name"
    texty = [c for c in columns
             if all(isinstance(r.fields.get(c), str) and not _is_number(r.fields[c]) for r in rows[:100])]
    if len(texty) == 1:
        return texty[0], "the only text column"
    why = f"several look like text ({', '.join(map(str, texty))})" if texty else "none looks like text"
    raise EncoderkitError(f"{path}: cannot tell which column holds the text (columns: "
                          f"{', '.join(map(str, rows[0].fields))}; {why}); set --text-column")


def text_column(rows: list[Row], name: str, path: str | Path, flag: str) -> list[str]:
    """A text column: strings, none empty (an empty text is an error naming its line)."""
    values = column(rows, name, path, flag)
    for r, v in zip(rows, values, strict=True):
        if not isinstance(v, str) or not v.strip():
            raise EncoderkitError(f"{r.where}: column {name!r} is empty or not text ({v!r}); remove or fill the row")
    return values
