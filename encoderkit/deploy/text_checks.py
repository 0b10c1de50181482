"""The one check of request texts at the service's edge, shared by encoderkit's routes and the
OpenAI/Cohere-compatible ones: each protocol wraps the problem in its own error shape and status
(encoderkit's routes 422, OpenAI's 400), but the rules and messages are these.

A request-level problem (no texts, more than ``--max-texts``) refuses the request; an item's problem (an empty
text, a lone surrogate, more than ``--max-chars``) is that item's alone: encoderkit's routes answer it in the
item's place and the other items normally (:func:`item_problem`). A text longer than the model reads is not a
problem: it is truncated, and the response says which were (``truncated``). Every message names the server flag
and, where there is one, the client setting that changes the limit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# the client settings that bound the texts per request, for the messages of routes whose peers' clients batch
EMBED_CLIENTS = ("LangChain OpenAIEmbeddings(chunk_size=...), llama-index OpenAILikeEmbedding(embed_batch_size=...), "
                 "haystack OpenAIDocumentEmbedder(batch_size=...)")
RERANK_CLIENTS = "Cohere/Jina clients: fewer documents per call"


@dataclass(frozen=True)
class TextProblem:
    code: str  # empty_input, too_many_texts, empty_text, invalid_text, text_too_long
    message: str
    param: str  # the field, or field[i] for one text


def unencodable_at(text: str) -> int | None:
    """Index of the first character that cannot be UTF-8 encoded (a lone surrogate, which JSON's \\ud800 escape
    allows), or None. The tokenizer raises on such a text, failing the whole batch, so it is refused at the edge."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def count_problem(field: str, texts: Sequence[object], max_texts: int, allow_empty_list: bool = False,
                  clients: str = "") -> TextProblem | None:
    """No text given, or more than ``max_texts`` (the server's ``--max-texts``; ``clients``: the client settings that
    send fewer per request), or None."""
    if not texts and not allow_empty_list:
        return TextProblem("empty_input", f"{field}: give at least one text", field)
    if len(texts) > max_texts:
        how = f"; or send fewer per request ({clients})" if clients else "; or send fewer per request"
        return TextProblem("too_many_texts", f"{field}: {len(texts)} texts, more than the limit of {max_texts} per "
                                             f"request (raise it with the server's --max-texts{how})", field)
    return None


def item_problem(field: str, i: int | None, text: str, max_chars: int, allow_empty: bool = False) -> TextProblem | None:
    """The problem of one text (``field[i]``; ``i`` None: the field is one text): empty (unless ``allow_empty``), a
    lone surrogate, or over ``max_chars`` characters (the server's ``--max-chars``, a guard of its memory only), or
    None."""
    where = field if i is None else f"{field}[{i}]"
    if not allow_empty and not text.strip():
        return TextProblem("empty_text", f"{where} is empty (or only whitespace)", where)
    bad = unencodable_at(text)
    if bad is not None:
        return TextProblem("invalid_text", f"{where} has a lone surrogate (U+{ord(text[bad]):04X}) at character "
                                           f"{bad}; texts must be valid Unicode (a \\ud800-\\udfff escape only "
                                           "as half of a pair)", where)
    if len(text) > max_chars:
        return TextProblem("text_too_long", f"{where} has {len(text)} characters, over the server's --max-chars "
                                            f"{max_chars} (a guard of the server's memory: a text longer than the "
                                            "model reads is truncated, not refused; raise --max-chars or split the "
                                            "text)", where)
    return None


def text_problem(field: str, texts: Sequence[str], max_texts: int, max_chars: int,
                 allow_empty_list: bool = False, clients: str = "", allow_empty: bool = False) -> TextProblem | None:
    """The first problem of ``texts`` (in this order: none given, too many, then each text's: empty, a lone
    surrogate, too long), or None: for a field whose texts succeed or fail together."""
    problem = count_problem(field, texts, max_texts, allow_empty_list, clients)
    if problem is not None:
        return problem
    for i, t in enumerate(texts):
        problem = item_problem(field, i, t, max_chars, allow_empty)
        if problem is not None:
            return problem
    return None
