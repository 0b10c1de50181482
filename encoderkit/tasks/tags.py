"""Tag schemes for token classification: IOB1 / BIOES to IOB2, and IOB2 to entity spans. Readers convert on the way
in, so a model's ``id2label`` is always IOB2 and decoding has one scheme; the rules are seqeval's default,
non-strict mode (an ``I-X`` that does not continue an ``X`` opens an entity, so a stray one is never lost).
"""

from __future__ import annotations

from collections.abc import Sequence

from encoderkit.errors import EncoderkitError

SCHEMES = ("iob1", "iob2", "bioes", "auto")


def split_tag(tag: str) -> tuple[str, str]:
    """``"B-PER"`` -> ``("B", "PER")``; ``"O"`` -> ``("O", "")``. Raises on an unknown prefix."""
    if tag == "O":
        return "O", ""
    prefix, sep, kind = tag.partition("-")
    if not sep or prefix not in ("B", "I", "E", "S") or not kind:
        raise EncoderkitError(f"tag {tag!r} is not O or <B|I|E|S>-<TYPE>; fix the tag column of the data")
    return prefix, kind


def guess_scheme(sequences: Sequence[Sequence[str]]) -> str:
    """``bioes`` if any ``E-``/``S-`` tag occurs; ``iob1`` if some entity starts with ``I-``; else ``iob2``."""
    prefixes: set[str] = set()
    iob1 = False
    for tags in sequences:
        prev = "O"
        for tag in tags:
            p, kind = split_tag(tag)
            prefixes.add(p)
            if p == "I":
                pp, pk = split_tag(prev)
                if pp == "O" or pk != kind:
                    iob1 = True
            prev = tag
    if prefixes & {"E", "S"}:
        return "bioes"
    return "iob1" if iob1 else "iob2"


def to_iob2(tags: Sequence[str], scheme: str = "auto") -> list[str]:
    """Convert one sentence's tags to IOB2 (rules in the module docstring)."""
    if scheme == "auto":
        scheme = guess_scheme([tags])
    if scheme not in ("iob1", "iob2", "bioes"):
        raise EncoderkitError(f"unknown tag scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    out: list[str] = []
    prev_kind = ""  # type of the entity open before this token ("" when none)
    for tag in tags:
        p, kind = split_tag(tag)
        if p == "O":
            out.append("O")
            prev_kind = ""
            continue
        if p in ("B", "S"):
            out.append(f"B-{kind}")
        elif p == "I":
            out.append(f"I-{kind}" if prev_kind == kind else f"B-{kind}")
        else:  # E
            out.append(f"I-{kind}" if prev_kind == kind else f"B-{kind}")
        # S and E close the entity in BIOES; the next I- would open a new one.
        prev_kind = "" if p in ("S", "E") and scheme == "bioes" else kind
    return out


def iob2_to_spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Entity spans ``(type, first, last+1)`` over token positions from IOB2 tags (tolerant)."""
    spans: list[tuple[str, int, int]] = []
    start, kind = -1, ""
    for i, tag in enumerate(list(tags) + ["O"]):
        p, k = split_tag(tag)
        continues = p in ("I", "E") and k == kind and start >= 0
        if not continues and start >= 0:
            spans.append((kind, start, i))
            start, kind = -1, ""
        if p in ("B", "S") or (p in ("I", "E") and not continues):
            start, kind = i, k
    return spans


def to_bioes(iob2: Sequence[str]) -> list[str]:
    """IOB2 -> BIOES (used to test that conversions round-trip)."""
    tags = ["O"] * len(iob2)
    for kind, start, end in iob2_to_spans(iob2):
        if end - start == 1:
            tags[start] = f"S-{kind}"
        else:
            tags[start] = f"B-{kind}"
            for i in range(start + 1, end - 1):
                tags[i] = f"I-{kind}"
            tags[end - 1] = f"E-{kind}"
    return tags


def to_iob1(iob2: Sequence[str]) -> list[str]:
    """IOB2 -> IOB1 (``B-`` only where an entity touches one of the same type)."""
    tags = ["O"] * len(iob2)
    prev_end, prev_kind = -1, ""
    for kind, start, end in iob2_to_spans(iob2):
        touching = prev_end == start and prev_kind == kind
        tags[start] = f"B-{kind}" if touching else f"I-{kind}"
        for i in range(start + 1, end):
            tags[i] = f"I-{kind}"
        prev_end, prev_kind = end, kind
    return tags
