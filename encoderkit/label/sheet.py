"""The review sheet: a CSV with one audited line per row and an empty ``gold`` column to fill.

Columns: ``row`` (0-based line of labeled.jsonl), ``text``, ``label``, ``confidence``,
``suspicion``, ``suspect``, ``gold``. ``audit review`` fills ``gold``; anyone may instead fill it
in a spreadsheet. A gold label must be one of the label set.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_lines, write_text_atomic
from encoderkit.label.spans import is_span_cell, span_set

COLUMNS = ("row", "text", "label", "confidence", "suspicion", "suspect", "gold")


def write_sheet(path: str | Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r.get(k) is None else r.get(k) for k in COLUMNS})
    write_text_atomic(Path(path), buf.getvalue())


def read_sheet(path: str | Path) -> list[dict[str, str]]:
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise EncoderkitError(f"--sheet {path} does not exist; make one with `encoderkit audit sample`")
    try:  # the one line reader: a bad byte names its line, a BOM (Excel's "CSV UTF-8") is dropped
        reader = csv.DictReader(line for _, line in read_lines(path, "--sheet", keep_ends=True))
        missing = [c for c in ("row", "text", "label", "gold") if c not in (reader.fieldnames or [])]
        if missing:
            raise EncoderkitError(f"{path}: no column {', '.join(missing)}; a sheet from `audit sample` has "
                                  f"{', '.join(COLUMNS)}")
        rows = [{k: (v or "").strip() if k != "text" else (v or "") for k, v in r.items() if isinstance(k, str)}
                for r in reader]
    except csv.Error as e:
        raise EncoderkitError(f"{path}: not a CSV sheet ({e}); give the sheet `encoderkit audit sample` wrote") from e
    for n, r in enumerate(rows, 2):
        if not r["row"].isdigit():
            raise EncoderkitError(f"{path}:{n}: row {r['row']!r} is not a line number of labeled.jsonl")
    return rows


def gold_labels(path: str | Path, rows: list[dict[str, str]], labels: list[str]) -> dict[int, str]:
    """``{row of labeled.jsonl: gold}`` for the filled rows; a gold label outside ``labels`` is an error."""
    out = {}
    for n, r in enumerate(rows, 2):
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
    for n, r in enumerate(rows, 2):
        i = int(r["row"])
        if i >= len(recs) or str(recs[i]["text"]).strip() != r["text"].strip():
            raise EncoderkitError(f"{path}:{n}: row {i} does not match line {i + 1} of {source} (another text or "
                                  "missing); use the sheet made from this labeled file")


def same_answer(label: str, gold: str, where: str) -> bool:
    """Whether a sheet row's label agrees with its gold: the same label, or for spans the same span set."""
    if is_span_cell(label) or is_span_cell(gold):
        return span_set(label, where) == span_set(gold, where)
    return label == gold
