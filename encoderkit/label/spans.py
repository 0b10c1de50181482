"""Entity spans from an LLM's answer, checked against the text, and their agreement with audited gold.

The LLM answers a JSON list of ``{"text", "type"}``. A span is kept only when its type is one of the asked types
and its text occurs in the input on word edges (the NER reader's words, so ``finetune --task ner`` can tag it); it
is then tagged at every such occurrence, longest spans first, an overlapping one skipped. Anything else is refused:
counted and recorded beside the line, never written as an entity. In ``labeled.jsonl`` a line carries ``entities``
(``start``, ``end``, ``label``: what the NER reader trains on) and ``label``, the kept spans as a compact JSON
string (``[{"text", "type"}]``), which the audit sheet shows and its ``gold`` cell corrects in the same form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.label.stats import wilson
from encoderkit.tasks.ner.features import split_words

NER_TEMPLATE = """Find the named entities in the text. Entity types: {labels}.
{descriptions}{examples}
Answer with a JSON list only, one object per entity with the exact text as written and its type, e.g.
[{"text": "Ada Lovelace", "type": "PER"}]. Answer [] when there is none.

Text: {text}
Entities:"""


@dataclass
class Spans:
    """One answer read against its text: entities (character offsets), the kept spans, and what was refused."""

    entities: list[dict[str, Any]] = field(default_factory=list)
    kept: list[dict[str, str]] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)


_LIST = re.compile(r"\[.*\]", re.DOTALL)


def _json_list(answer: str | None, kind: type) -> list | None:
    """The first JSON list in ``answer`` whose items are all ``kind``, else None."""
    m = _LIST.search(answer or "")
    try:
        items = json.loads(m.group()) if m else None
    except json.JSONDecodeError:
        return None
    return items if isinstance(items, list) and all(isinstance(x, kind) for x in items) else None


def parse_spans(answer: str | None, text: str, types: Sequence[str]) -> Spans | None:
    """The spans an answer names, checked against ``text`` (see the module docstring); None when the answer holds
    no JSON list of objects (asked again, like a classification answer naming no label)."""
    items = _json_list(answer, dict)
    if items is None:
        return None
    by_lower = {t.lower(): t for t in types}
    _words, edges = split_words(text)
    starts, ends = {int(a) for a in edges[:, 0]}, {int(b) for b in edges[:, 1]}
    out = Spans()
    wanted: list[tuple[str, str]] = []
    for x in items:
        s, kind = str(x.get("text", "")).strip(), by_lower.get(str(x.get("type", "")).strip().lower())
        if kind is None:
            out.refused.append({"text": s, "type": x.get("type"), "why": "type not asked for"})
        elif not s or not any(a in starts and a + len(s) in ends for a in _occurrences(text, s)):
            out.refused.append({"text": s, "type": kind, "why": "not in the text"})
        elif (s, kind) not in wanted:
            wanted.append((s, kind))
    taken: list[tuple[int, int]] = []
    for s, kind in sorted(wanted, key=lambda p: -len(p[0])):
        placed = False
        for a in _occurrences(text, s):
            b = a + len(s)
            if a in starts and b in ends and not any(a < y and x < b for x, y in taken):
                taken.append((a, b))
                out.entities.append({"start": a, "end": b, "label": kind})
                placed = True
        if placed:
            out.kept.append({"text": s, "type": kind})
        else:
            out.refused.append({"text": s, "type": kind, "why": "overlaps a longer span"})
    out.entities.sort(key=lambda e: e["start"])
    out.kept.sort(key=lambda k: text.find(k["text"]))
    return out


def _occurrences(text: str, s: str) -> list[int]:
    out, i = [], text.find(s) if s else -1
    while i >= 0:
        out.append(i)
        i = text.find(s, i + 1)
    return out


def span_cell(kept: list[dict[str, str]]) -> str:
    """The ``label`` value of a line: the kept spans as compact JSON."""
    return json.dumps(kept, ensure_ascii=False, separators=(",", ":"))


def span_set(cell: str, where: str) -> frozenset:
    """A label or gold cell as a set: spans as (text, type), a multi-label set as its labels; a cell that is not
    such JSON is an error."""
    try:
        items = json.loads(cell) if cell.strip() else []
        pairs = frozenset(str(x).strip() if isinstance(x, str) else (str(x["text"]).strip(), str(x["type"]).strip())
                          for x in items)
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError):
        raise EncoderkitError(f"{where}: {cell!r} is not a JSON list of spans or labels; write the spans as "
                              '[{"text": "...", "type": "..."}], a label set as ["a", "b"] ([] for none)') from None
    return pairs


def _kind(x: Any) -> str:
    return x[1] if isinstance(x, tuple) else x


def is_span_cell(cell: Any) -> bool:
    return isinstance(cell, str) and cell.lstrip().startswith("[")


def span_agreement(gold: Sequence[frozenset], pred: Sequence[frozenset | None]) -> dict[str, Any]:
    """Exact match of the span (or label) set per text, and per type (a text agrees on a type when both hold the
    same spans of it; on a label when both have it or both lack it), each with its Wilson 95% interval; a missing
    prediction counts as wrong."""
    n = len(gold)

    def scored(k: int, m: int) -> dict[str, Any]:
        lo, hi = wilson(k, m)
        return {"n": m, "correct": k, "accuracy": round(k / m, 4) if m else None, "ci_low": round(lo, 4),
                "ci_high": round(hi, 4)}

    exact = sum(p is not None and g == p for g, p in zip(gold, pred, strict=True))
    types = sorted({_kind(x) for s in [*gold, *(p for p in pred if p is not None)] for x in s})
    per_type = {}
    for t in types:
        k = sum(p is not None and {x for x in g if _kind(x) == t} == {x for x in p if _kind(x) == t}
                for g, p in zip(gold, pred, strict=True))
        per_type[t] = scored(k, n)
    return {**scored(exact, n), "measure": "exact match of the set per text", "per_type": per_type}


MULTILABEL_TEMPLATE = """Which of these labels apply to the text? Labels: {labels}.
{descriptions}{examples}
Answer with a JSON list of the labels that apply, e.g. ["a", "b"], nothing else. Answer [] when none applies.

Text: {text}
Labels:"""


def parse_label_set(answer: str | None, labels: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """The labels a multi-label answer names (in the label set's order) and those it names outside the set
    (refused: counted, never written); None when the answer holds no JSON list of strings."""
    items = _json_list(answer, str)
    if items is None:
        return None
    by_lower = {t.lower(): t for t in labels}
    named = {by_lower[x.strip().lower()] for x in items if x.strip().lower() in by_lower}
    refused = list(dict.fromkeys(x for x in items if x.strip().lower() not in by_lower))
    return [t for t in labels if t in named], refused
