"""The one check of request texts at the service's edge, shared by encoderkit's routes and the
OpenAI/Cohere-compatible ones: each protocol wraps the problem in its own error shape and status
(encoderkit's routes 422, OpenAI's 400), but the rules and messages are these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TextProblem:
    code: str  # empty_input, too_many_texts, empty_text, invalid_text, text_too_long
    message: str
    param: str  # the field, or field[i] for one text


def unencodable_at(text: str) -> int | None:
    """Index of the first character that cannot be UTF-8 encoded (a lone surrogate, which JSON's \\ud800 escape
    allows), or None. The tokenizer raises on such a text, failing every request batched with it, so it is
    refused at the edge."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def text_problem(field: str, texts: Sequence[str], max_texts: int, max_chars: int,
                 allow_empty_list: bool = False) -> TextProblem | None:
    """The first problem of ``texts`` (in this order: none given, too many, an empty text, a lone surrogate,
    too long), or None."""
    if not texts and not allow_empty_list:
        return TextProblem("empty_input", f"{field}: give at least one text", field)
    if len(texts) > max_texts:
        return TextProblem("too_many_texts", f"{field}: {len(texts)} texts, more than the limit of {max_texts}", field)
    for i, t in enumerate(texts):
        where = f"{field}[{i}]"
        if not t.strip():
            return TextProblem("empty_text", f"{where} is empty", where)
        bad = unencodable_at(t)
        if bad is not None:
            return TextProblem("invalid_text", f"{where} has a lone surrogate (U+{ord(t[bad]):04X}) at character {bad}; "
                                               "texts must be valid Unicode (a \\ud800-\\udfff escape only as half of a pair)",
                               where)
        if len(t) > max_chars:
            return TextProblem("text_too_long", f"{where} has {len(t)} characters, over the limit of {max_chars}", where)
    return None
