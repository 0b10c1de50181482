"""The unit every corpus reader yields (:mod:`encoderkit.data.readers`, :mod:`encoderkit.data.builtin_corpus`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    """One document: its ``text`` (stripped, never empty), the ``source`` it came from and the
    1-based ``line`` (or record number for HF datasets) where it starts."""

    text: str
    source: str
    line: int
