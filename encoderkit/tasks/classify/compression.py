"""What compression reads of a classify model's data: the columns its lineage records, and its inputs
(texts or text pairs, labels as the model's class ids) read with those columns."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.models.card import lineage
from encoderkit.tasks.classify.data import resolve_text_column
from encoderkit.tasks.protocol import TaskInputs
from encoderkit.tasks.tabular import column, read_rows, text_column

COLUMNS = ("text_column", "label_column", "text_pair_column")


def card_columns(folder: str | Path) -> dict[str, str]:
    """The data columns a classify model was fine-tuned with: what its card (or the nearest card of its
    lineage) records, else, for folders written before cards recorded all three, the fine-tuning
    config found in its lineage. The one rule for compression's readers and its measurer; a pair
    classifier whose pair column no longer shows in its lineage is refused."""
    cards = lineage(folder)
    cols: dict[str, str] = {}
    for card in cards:
        for key in COLUMNS:
            if card.get(key) and key not in cols:
                cols[key] = str(card[key])
        conf = card.get("config") or {}
        if card.get("stage") == "finetune" or "label_column" in conf:
            for key in ("text_pair_column", "label_column"):
                if key in conf and key not in cols:
                    cols[key] = str(conf[key])
            if conf.get("text_column") not in (None, "auto") and "text_column" not in cols:
                cols["text_column"] = str(conf["text_column"])
            break
    if cards and cards[0].get("text_pair") and "text_pair_column" not in cols:
        raise EncoderkitError(f"{folder}: the model classifies text pairs, but its lineage no longer names the pair "
                              "column (the fine-tuned parent folder is gone); keep the parent folder, add "
                              "'text_pair_column' to its encoderkit.json, or pass single texts in a .txt file")
    return cols


def _label_ids(values: list[Any], label2id: dict[str, int], wheres: list[str]) -> list[int]:
    out = []
    for v, where in zip(values, wheres, strict=True):
        key = str(v).strip()
        if key in label2id:
            out.append(int(label2id[key]))
        elif key.lstrip("-").isdigit():
            out.append(int(key))
        else:
            raise EncoderkitError(f"{where}: label {key!r}, which the model does not know (its labels: "
                                  f"{sorted(label2id)}); fix the file or pass unlabelled data")
    return out


def read_inputs(path: Path, columns: dict[str, str], label2id: dict[str, int] | None) -> TaskInputs:
    """The texts (or pairs) of a table in ``columns`` (found as fine-tuning finds them where not given), and
    its labels as class ids when ``label2id`` is given and the table has the label column."""
    rows = read_rows(path)
    label_col = columns.get("label_column", "label")
    pair_col = columns.get("text_pair_column", "")
    opts = SimpleNamespace(text_column="auto", label_column=label_col, text_pair_column=pair_col)
    name = resolve_text_column(rows, path, opts, columns.get("text_column"))
    texts: list[Any] = text_column(rows, name, path, "--text-column")
    if pair_col:
        texts = list(zip(texts, text_column(rows, pair_col, path, "--text-pair-column"), strict=True))
    labels = None
    if label2id is not None and label_col in rows[0].fields:
        labels = _label_ids(column(rows, label_col, path, "--label-column"), label2id, [r.where for r in rows])
    return TaskInputs(texts, labels, str(path))
