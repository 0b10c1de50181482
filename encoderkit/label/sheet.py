"""The review sheet: a CSV with one audited line per row and an empty ``gold`` column to fill.

Columns: ``row`` (0-based line of labeled.jsonl), ``text``, ``label``, ``confidence``,
``suspicion``, ``suspect``, ``gold``. ``audit review`` fills ``gold``; anyone may instead fill it
in a spreadsheet. A gold label must be one of the label set. A pairs file's sheet (``label --task embed``) has
``row``, ``query``, ``text`` (its passage), ``label`` (``yes``) and ``gold`` (``yes`` or ``no``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.io import csv_rows, read_lines, write_text_atomic
from encoderkit.label.spans import is_span_cell, span_set

COLUMNS = ("row", "text", "label", "confidence", "suspicion", "suspect", "gold")
PAIR_COLUMNS = ("row", "query", "text", "label", "gold")
VERDICTS = ("yes", "no")  # a pairs sheet's gold: does the passage answer the query?


def write_sheet(path: str | Path, rows: list[dict[str, Any]]) -> None:
    columns = PAIR_COLUMNS if rows and "query" in rows[0] else COLUMNS
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r.get(k) is None else r.get(k) for k in columns})
    write_text_atomic(Path(path), buf.getvalue())


class SheetRow(dict):
    """A sheet row's cells by column, and ``line``: the line of the file the row starts on (a quoted cell may hold
    line breaks, so the row's index is not its line)."""

    line: int = 0


def numbered(rows: Iterable[dict[str, str]]) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line, row)`` of each sheet row: the line :func:`read_sheet` found it on (else its place after the header
    line, for rows made in memory)."""
    for n, r in enumerate(rows, 2):
        yield getattr(r, "line", 0) or n, r


def read_sheet(path: str | Path) -> list[dict[str, str]]:
    """The rows of a sheet (:class:`SheetRow`, each knowing its line), read through the one line reader (a bad byte
    names its line, a BOM, as Excel's "CSV UTF-8" writes, is dropped) and the one CSV reader (a row's line is the line
    it starts on, a quoted cell holding line breaks included); blank rows are skipped."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise EncoderkitError(f"--sheet {path} does not exist; make one with `encoderkit audit sample`")
    cells = csv_rows(read_lines(path, "--sheet", keep_ends=True), str(path))
    first = next(cells, None)
    header = [h.strip() for h in first[1]] if first is not None else []
    missing = [c for c in ("row", "text", "label", "gold") if c not in header]
    if missing:
        raise EncoderkitError(f"{path}: no column {', '.join(missing)}; a sheet from `audit sample` has "
                              f"{', '.join(COLUMNS)}")
    rows = []
    for line, row in cells:
        if not row:
            continue
        r = SheetRow((k, v if k == "text" else v.strip()) for k, v in zip(header, row + [""] * len(header)) if k)
        r.line = line
        if not r["row"].isdigit():
            raise EncoderkitError(f"{path}:{line}: row {r['row']!r} is not a line number of labeled.jsonl")
        rows.append(r)
    return rows


def gold_labels(path: str | Path, rows: list[dict[str, str]], labels: list[str]) -> dict[int, str]:
    """``{row of labeled.jsonl: gold}`` for the filled rows; a gold label outside ``labels`` is an error."""
    out = {}
    for n, r in numbered(rows):
        g = r["gold"]
        if not g:
            continue
        if g not in labels:
            raise EncoderkitError(f"{path}:{n}: gold label {g!r} is not one of the labels ({', '.join(labels)}); "
                                  "correct the cell (labels are case-sensitive)")
        out[int(r["row"])] = g
    return out


def check_rows(path: str | Path, rows: list[dict[str, str]], recs: list[dict[str, Any]], source: str | Path) -> None:
    """Each sheet row must name a line of ``source`` holding the same text (the sheet belongs to that file)."""
    for n, r in numbered(rows):
        i = int(r["row"])
        if i >= len(recs) or str(recs[i]["text"]).strip() != r["text"].strip():
            raise EncoderkitError(f"{path}:{n}: row {i} does not match line {i + 1} of {source} (another text or "
                                  "missing); use the sheet made from this labeled file")


def same_answer(label: str, gold: str, where: str) -> bool:
    """Whether a sheet row's label agrees with its gold: the same label, or for spans the same span set."""
    if is_span_cell(label) or is_span_cell(gold):
        return span_set(label, where) == span_set(gold, where)
    return label == gold
