"""``encoderkit.json``, the card beside a model folder's HF files: the stage, parent folder, config and
metrics that made the folder, and for task models what serving needs (task, labels, pooling, max length...).
Following the parents gives a model's history (:func:`lineage`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from encoderkit.io import portable, portable_path, read_json, recorded_path, write_json_atomic

CARD = "encoderkit.json"
CARD_FIELDS = ("stage", "parent", "config", "metrics", "created")  # what write_card itself writes
# facts of the run that made a folder, true of that folder only (its lineage keeps them for the children)
RUN_FACTS = ("steps", "train_examples", "train_seconds", "stopped_early", "loss", "layers_from_teacher",
             "recipe_step", "recipe_params",
             "dev_at_thresholds",  # a multilabel run's dev figure at its thresholds (the thresholds are inherited)
             "int8_agreement",  # of the folder's own INT8 graph (export/compress --dev): a child's graph is another
             "loads_with")  # how a pruned folder loads (plain transformers, or encoderkit only): a child is saved anew


def write_card(folder: Path, stage: str, parent: str | Path | None, config: dict[str, Any],
               metrics: dict[str, Any] | None = None, **extra: Any) -> None:
    """Write ``encoderkit.json``: the stage that made ``folder``, its parent folder, config and metrics. Paths are
    recorded relative to ``folder`` (the parent as ``../teacher``; an absolute path in the config likewise), so a
    copied or moved folder names no path of the machine that wrote it; :func:`lineage` resolves them."""
    card = {
        "stage": stage,
        "parent": portable_path(parent, folder) if parent else None,
        "config": portable(config, folder),
        "metrics": metrics or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **portable(extra, folder),
    }
    write_json_atomic(Path(folder) / CARD, card)


def read_card(folder: str | Path) -> dict[str, Any]:
    """The folder's ``encoderkit.json``, or an empty dict for a plain HF folder."""
    p = Path(folder) / CARD
    return read_json(p, "") if p.is_file() else {}


def card_facts(card: dict[str, Any]) -> dict[str, Any]:
    """A card's facts beyond :data:`CARD_FIELDS`: what a folder's own card keeps when it is rewritten."""
    return {k: v for k, v in card.items() if k not in CARD_FIELDS}


def inherited_card(folder_or_card: str | Path | dict[str, Any]) -> dict[str, Any]:
    """What a derived folder's card carries over from its parent's: the task facts (task, labels,
    pooling, max_length...), not the parent's own stage, lineage, config, metrics or date, nor the facts
    of the run that made the parent (:data:`RUN_FACTS`: a student distilled from a fine-tuned teacher did
    not train for the teacher's steps, nor with its loss)."""
    card = folder_or_card if isinstance(folder_or_card, dict) else read_card(folder_or_card)
    return {k: v for k, v in card_facts(card).items() if k not in RUN_FACTS}


def lineage(folder: str | Path) -> list[dict[str, Any]]:
    """The cards of ``folder`` and its parents, newest first (stops where a parent has no card); each card's
    ``parent`` is read relative to its own folder."""
    out, seen = [], set()
    cur: Path | None = Path(folder)
    while cur is not None and str(cur) not in seen:
        seen.add(str(cur))
        card = read_card(cur)
        if not card:
            break
        out.append({"folder": str(cur), **card})
        cur = Path(os.path.normpath(recorded_path(card["parent"], cur))) if card.get("parent") else None
    return out
