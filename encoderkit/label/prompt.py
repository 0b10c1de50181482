"""The labelling prompt and the parsing of an answer back into one of the labels.

A template is plain text with placeholders in braces: ``{text}`` (required), ``{labels}``,
``{descriptions}`` and ``{examples}``. Substitution is literal (``str.replace``), so braces inside
texts or examples need no escaping.
"""

from __future__ import annotations

import re
from pathlib import Path

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_text_file

DEFAULT_TEMPLATE = """Classify the text into exactly one of these labels: {labels}.
{descriptions}{examples}
Answer with the label only, nothing else.

Text: {text}
Label:"""

PLACEHOLDERS = ("{text}", "{labels}", "{descriptions}", "{examples}")


def load_template(value: str) -> str:
    """``value`` is a file holding the template, the template itself, or empty (the default)."""
    if not value:
        return DEFAULT_TEMPLATE
    path = Path(value)
    template = read_text_file(path, "--template") if "{" not in value and path.is_file() else value
    if "{text}" not in template:
        where = f"template file {path}" if template is not value else "--template"
        found = [p for p in PLACEHOLDERS if p in template]
        raise EncoderkitError(f"{where} has no {{text}} placeholder (found: {', '.join(found) or 'none'}); put "
                              "{text} where the text to label goes")
    return template


def render(template: str, text: str, labels: list[str], descriptions: dict[str, str],
           examples: list[tuple[str, str]]) -> str:
    """The prompt for one text (the examples and descriptions are the same for every text)."""
    return template.replace("{text}", text).replace("{labels}", ", ".join(labels)).replace(
        "{descriptions}", describe(labels, descriptions)).replace("{examples}", shots(examples))


def describe(labels: list[str], descriptions: dict[str, str]) -> str:
    if not descriptions:
        return ""
    return "".join(f"- {name}: {descriptions[name]}\n" for name in labels if name in descriptions)


def shots(examples: list[tuple[str, str]]) -> str:
    if not examples:
        return ""
    return "\nExamples:\n" + "".join(f"Text: {t}\nLabel: {lab}\n\n" for t, lab in examples)


_STRIP = re.compile(r"^[\s\"'`*.:>\-]+|[\s\"'`*.!:<]+$")


def parse_answer(answer: str | None, labels: list[str]) -> str | None:
    """The label an answer names, or None: the whole answer (case, quotes, punctuation and a
    ``Label:`` prefix ignored), else its first line, else the only label named as a whole word."""
    if not answer:
        return None
    lower = {name.lower(): name for name in labels}
    for candidate in (answer, answer.strip().splitlines()[0] if answer.strip() else ""):
        c = _STRIP.sub("", candidate.strip())
        c = re.sub(r"^(label|answer)\s*[:=]\s*", "", c, flags=re.IGNORECASE)
        c = _STRIP.sub("", c).lower()
        if c in lower:
            return lower[c]
    named = [name for name in labels if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", answer, flags=re.IGNORECASE)]
    return named[0] if len(named) == 1 else None
