"""Training rows from ``encoderkit label`` output: unlabeled lines dropped, audited gold applied,
suspected errors dropped on request.

A file is such output when its lines carry a ``labeller`` field. ``sheet`` is a reviewed audit
sheet (CSV with ``row``, ``text``, ``gold``): a filled gold label replaces the line's label.
``drop_suspected`` removes lines that ``audit suspect`` marked ``suspect`` (unless audited).
"""

from __future__ import annotations

from pathlib import Path

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.tabular import Row, read_rows


def is_labelled_output(rows: list[Row]) -> bool:
    return bool(rows) and "labeller" in rows[0].fields


def labelled_rows(rows: list[Row], path: str | Path, sheet: str = "", drop_suspected: bool = False) -> list[Row]:
    """``rows`` of a labelled file made ready for training (see the module docstring); other files
    pass through unchanged, and asking for a sheet or dropping on them is an error."""
    if not is_labelled_output(rows):
        if sheet or drop_suspected:
            raise EncoderkitError(f"{path} is not the output of `encoderkit label` (no 'labeller' field); "
                                  "--audit-sheet and --drop-suspected apply only to such files")
        return rows
    labels = {str(r.fields["label"]) for r in rows if r.fields.get("label") not in (None, "")}
    gold: dict[int, str] = {}
    if sheet:
        for s in read_rows(sheet):
            g = str(s.fields.get("gold", "")).strip()
            if not g:
                continue
            i = int(s.fields.get("row", -1)) if str(s.fields.get("row", "")).isdigit() else -1
            same_text = 0 <= i < len(rows) and (str(rows[i].fields.get("text", "")).strip()
                                                == str(s.fields.get("text", "")).strip())
            if not same_text:
                raise EncoderkitError(f"{s.where}: row {s.fields.get('row')!r} does not match a line of {path} with "
                                      "the same text; use the sheet drawn from this labeled file")
            if g not in labels:
                raise EncoderkitError(f"{s.where}: gold label {g!r} is not one of the labels in {path} "
                                      f"({', '.join(sorted(labels))}); correct the cell")
            gold[i] = g
    out = []
    for i, r in enumerate(rows):
        if i in gold:
            out.append(Row({**r.fields, "label": gold[i]}, r.where))
        elif r.fields.get("label") in (None, "") or (drop_suspected and r.fields.get("suspect") is True):
            continue
        else:
            out.append(r)
    if drop_suspected and not any("suspect" in r.fields for r in rows):
        raise EncoderkitError(f"{path} has no 'suspect' field; run `encoderkit audit suspect` on it first")
    if not out:
        raise EncoderkitError(f"{path}: no labelled line left to train on")
    return out
