"""Classify data: labelled rows of a TSV / CSV / JSONL table read into texts, optional text pairs and labels
(multi-label: joined by ``label_separator``, or a JSON list). The label set is sorted, numerically when all are
integers.
"""

from __future__ import annotations

from pathlib import Path

from encoderkit.errors import EncoderkitError
from encoderkit.progress import note
from encoderkit.tasks.classify.options import ClassifyOptions
from encoderkit.tasks.labeled import labelled_rows
from encoderkit.tasks.tabular import column, find_text_column, read_rows, text_column


def resolve_text_column(rows: list, path: str | Path, options: ClassifyOptions, saved: str | None = None) -> str:
    """``--text-column``, or for ``auto`` the column the model was trained on (``saved``, when the file
    has it), else one found by :func:`~encoderkit.tasks.tabular.find_text_column`, stated in the log."""
    if options.text_column != "auto":
        return options.text_column
    if saved and saved in rows[0].fields:
        return saved
    name, how = find_text_column(rows, path, exclude=(options.label_column, options.text_pair_column))
    note(f"{path}: text column {name!r} ({how}); --text-column picks another")
    return name


def read_examples(path: str | Path, options: ClassifyOptions, saved_column: str | None = None, train: bool = False
                  ) -> tuple[list[str], list[str] | None, list[list[str]], list[str], str]:
    """texts, pairs (or None), labels (a list per row; one element unless multi-label), row locations,
    and the text column read. Output of ``encoderkit label`` loses its unlabeled lines; for training, its
    audit corrections are applied and suspected errors dropped when asked (:mod:`encoderkit.tasks.labeled`)."""
    rows = read_rows(path)
    rows = labelled_rows(rows, path, options.audit_sheet if train else "", options.drop_suspected and train)
    name = resolve_text_column(rows, path, options, saved_column)
    texts = text_column(rows, name, path, "--text-column")
    pair_col = options.text_pair_column
    pairs = text_column(rows, pair_col, path, "--text-pair-column") if pair_col else None
    raw = column(rows, options.label_column, path, "--label-column")
    labels = []
    for r, v in zip(rows, raw, strict=True):
        if isinstance(v, list):
            items = [str(x) for x in v]
        elif options.multi_label:
            items = [x.strip() for x in str(v).split(options.label_separator) if x.strip()]
        else:
            items = [str(v).strip()]
        if not items or (not options.multi_label and (len(items) != 1 or not items[0])):
            raise EncoderkitError(f"{r.where}: label {v!r} in column {options.label_column!r} is empty; fill or drop "
                                  "the row")
        labels.append(items)
    return texts, pairs, labels, [r.where for r in rows], name


def label_names(labels: list[list[str]]) -> list[str]:
    names = sorted({x for items in labels for x in items})
    if all(n.lstrip("-").isdigit() for n in names):
        names.sort(key=int)
    return names
