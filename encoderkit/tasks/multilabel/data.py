"""Multilabel data: a TSV / CSV / JSONL table whose label column holds a row's labels joined by ``|``
(``sports|politics``), or in JSONL a list. A row with none of the labels is written :data:`NONE`: a blank cell is
refused (more often a missing value than a decision), and so are labels that look joined by another separator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.classify.data import resolve_text_column
from encoderkit.tasks.multilabel.options import MultilabelOptions
from encoderkit.tasks.tabular import Row, column, read_rows, text_column

NONE = "none"  # the label cell of a row that has none of the labels
OTHER_SEPARATORS = (",", ";")
NAMES = ("labels", "label")


@dataclass
class Examples:
    """Texts, their label sets (None when the file has no label column and none was required), the
    rows' ``file:line`` and the columns read."""

    texts: list[str]
    labels: list[list[str]] | None
    where: list[str]
    text_column: str
    label_column: str | None


def resolve_label_column(rows: list[Row], path: str | Path, options: MultilabelOptions, saved: str | None,
                         required: bool = True) -> str | None:
    """``--label-column``, else ``saved`` (the model's), ``labels`` or ``label``, the first the file has."""
    if options.label_column:
        return options.label_column
    fields = rows[0].fields
    found = next((n for n in (saved, *NAMES) if n and n in fields), None)
    if found is None and required:
        raise EncoderkitError(f"{rows[0].where}: no 'labels' column (columns: {', '.join(map(str, fields))}); name the "
                              f"column of {options.label_separator!r}-joined labels 'labels' or set --label-column")
    return found


def parse_labels(value: Any, where: str, name: str, sep: str) -> list[str]:
    """One row's label set from its cell: a ``sep``-joined string or a JSON list; :data:`NONE` is the empty set."""
    if isinstance(value, list):
        bad = [x for x in value if isinstance(x, (dict, list))]
        if bad:
            raise EncoderkitError(f"{where}: column {name!r} holds {bad[0]!r} in its list; a label is a string")
        items = [str(x).strip() for x in value]
        joined = "a JSON list holds one label per element"
    elif value is None:
        items = []
        joined = ""
    else:
        items = [x.strip() for x in str(value).split(sep)]
        joined = f"labels are separated by {sep!r}"
    items = list(dict.fromkeys(x for x in items if x))
    if not items:
        raise EncoderkitError(f"{where}: no labels in column {name!r} (an empty label set); write {NONE!r} for a row "
                              "that has none of the labels, or drop the row")
    for x in items if not isinstance(value, list) else ():  # a list element is one label, commas and all
        other = next((c for c in OTHER_SEPARATORS if c in x and c != sep), None)
        if other:
            parts = [p.strip() for p in x.split(other) if p.strip()]
            fix = sep.join(parts)
            # no flag for ',': it is --label-separator's default (classify's), which this task reads as '|'
            hint = "" if other == "," else \
                f" (or pass --label-separator '{other}' if the whole file joins them that way)"
            raise EncoderkitError(f"{where}: label {x!r} in column {name!r} looks like several labels joined by "
                                  f"{other!r}, but {joined}: write {fix}{hint}")
    if NONE in items:
        if len(items) > 1:
            raise EncoderkitError(f"{where}: {NONE!r} in column {name!r} means the row has no label; it cannot go with "
                                  f"others ({', '.join(items)}): drop {NONE!r} or the other labels")
        return []
    return items


def read_examples(path: str | Path, options: MultilabelOptions, saved_text: str | None = None,
                  saved_label: str | None = None, labels: bool = True) -> Examples:
    """The texts and label sets of a table (see the module docstring); ``labels=False``: the texts only
    (compression's calibration and timed texts; a label column, when there is one, is still not taken for
    the text)."""
    # a line `encoderkit label` could not label (no list in any answer) is not a row with no label: skipped
    rows = [r for r in read_rows(path) if not ("labeller" in r.fields and r.fields.get("label") is None)]
    if not rows:
        raise EncoderkitError(f"{path}: every line is `encoderkit label` output it could not label; nothing to read")
    name = resolve_label_column(rows, path, options, saved_label, required=labels)
    finder = SimpleNamespace(text_column=options.text_column, label_column=name or "", text_pair_column="")
    text_name = resolve_text_column(rows, path, finder, saved_text)
    texts = text_column(rows, text_name, path, "--text-column")
    sets = None
    if labels and name is not None:
        raw = column(rows, name, path, "--label-column")
        sets = [parse_labels(v, r.where, name, options.label_separator) for r, v in zip(rows, raw, strict=True)]
    return Examples(texts, sets, [r.where for r in rows], text_name, name)
