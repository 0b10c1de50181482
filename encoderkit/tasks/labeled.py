"""Training rows from ``encoderkit label`` output: unlabeled lines dropped, audited gold applied,
suspected errors dropped on request.

A file is such output when its lines carry a ``labeller`` field. ``sheet`` is a reviewed audit
sheet (CSV with ``row``, ``text``, ``gold``): a filled gold label replaces the line's label.
``drop_suspected`` removes lines that ``audit suspect`` marked ``suspect`` (unless audited).

A pairs file (``label --task embed`` / ``rerank``: ``{query, positive, negatives}`` lines) has a sheet whose ``gold``
is the reviewer's ``yes`` or ``no`` per query (``row``, ``query``, ``text``: the passage): :func:`audited_pairs` drops
the pairs marked ``no``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_jsonl
from encoderkit.tasks.tabular import Row, read_rows

P = TypeVar("P")  # a training pair (data.beir.Triple): .query, .positive


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


def audited_pairs(pairs: list[P], path: str | Path, sheet: str) -> tuple[list[P], dict[str, Any]]:
    """``pairs`` (the lines of the pairs file ``path``, in order) less those the reviewed ``sheet`` marks ``no``, and
    the counts (``audit_sheet``, ``audited``: filled gold cells, ``dropped_no``). A sheet row must name a line of
    ``path`` with the same query and passage; a gold other than yes/no (case aside) is an error; an empty one is a pair
    not audited, kept. No ``sheet``: ``pairs`` unchanged and no counts."""
    if not sheet:
        return pairs, {}
    first = next(read_jsonl(path, "--train"), None)
    if first is None or "labeller" not in first[1]:
        raise EncoderkitError(f"--audit-sheet: {path} is not the output of `encoderkit label --task embed|rerank` (no "
                              "'labeller' field); the sheet's gold applies only to such a pairs file: drop "
                              "--audit-sheet")
    audited, wrong = 0, set()
    for s in read_rows(sheet):
        missing = [c for c in ("row", "query", "text", "gold") if c not in s.fields]
        if missing:
            raise EncoderkitError(f"{s.where}: no column {', '.join(missing)}; a pairs file's sheet (from `encoderkit "
                                  "audit sample` on it) has row, query, text, label, gold")
        gold = str(s.fields["gold"]).strip().lower()
        if not gold:
            continue
        row = str(s.fields["row"]).strip()
        i = int(row) if row.isdigit() else -1
        same = 0 <= i < len(pairs) and (pairs[i].query.strip(), pairs[i].positive.strip()) == (
            str(s.fields["query"]).strip(), str(s.fields["text"]).strip())
        if not same:
            raise EncoderkitError(f"{s.where}: row {row!r} does not match a line of {path} with the same query and "
                                  "passage; use the sheet drawn from this pairs file")
        if gold not in ("yes", "no"):
            raise EncoderkitError(f"{s.where}: gold {s.fields['gold']!r} is neither yes nor no; write yes where the "
                                  "passage answers the query, no where it does not")
        audited += 1
        if gold == "no":
            wrong.add(i)
    kept = [p for i, p in enumerate(pairs) if i not in wrong]
    if not kept:
        raise EncoderkitError(f"{path}: every pair is marked no in {sheet}; no pair left to train on")
    return kept, {"audit_sheet": str(sheet), "audited": audited, "dropped_no": len(wrong)}
