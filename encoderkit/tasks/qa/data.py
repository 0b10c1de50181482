"""SQuAD v1.1-style JSON (or a .zip holding one .json), read into flat QA examples. An answer whose
``answer_start`` does not point at its text is skipped, with a warning. ``split`` picks whole articles (``train``:
the first 80% in file order), so no paragraph of a held-out article is seen in training.
"""

from __future__ import annotations

import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from encoderkit.errors import EncoderkitError
from encoderkit.io import check_input, read_text_file

TRAIN_FRACTION = 0.8


@dataclass
class QaExample:
    """One question: its context, the gold answers as (text, char start), and where it came from."""

    id: str
    title: str
    question: str
    context: str
    answers: list[tuple[str, int]]


def load_squad_json(path: str | Path) -> dict:
    path = check_input(path, "SQuAD file")
    try:
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as zf:
                members = [m for m in zf.namelist() if m.endswith(".json") and not m.startswith("__MACOSX")]
                if len(members) != 1:
                    raise EncoderkitError(f"{path}: expected exactly one .json member, found {members}")
                data = json.loads(zf.read(members[0]).decode("utf-8"))
        else:
            data = json.loads(read_text_file(path, "SQuAD file"))  # a BOM dropped, a bad byte named
    except (json.JSONDecodeError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise EncoderkitError(f"{path}: not a readable SQuAD JSON file ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise EncoderkitError(f"{path}: expected a JSON object with a 'data' list of articles (SQuAD format)")
    return data


def read_squad(path: str | Path, split: str = "all") -> tuple[list[QaExample], int]:
    """Examples of the chosen article split, and the number of answers skipped for bad offsets."""
    data = load_squad_json(path)
    articles = data["data"]
    n_train = round(TRAIN_FRACTION * len(articles))
    if split == "train":
        articles = articles[:n_train]
    elif split == "heldout":
        articles = articles[n_train:]
    elif split != "all":
        raise EncoderkitError(f"unknown SQuAD split {split!r}; use all, train or heldout")
    examples, skipped, bad = [], 0, []
    for a, article in enumerate(articles):
        for p, para in enumerate(article.get("paragraphs", [])):
            context = para.get("context")
            if not isinstance(context, str):
                raise EncoderkitError(f"{path}: article {a} paragraph {p} has no 'context' string")
            for qa in para.get("qas", []):
                answers = []
                for ans in qa.get("answers", []):
                    text, start = ans.get("text", ""), ans.get("answer_start", -1)
                    if not text or not isinstance(start, int) or context[start : start + len(text)] != text:
                        skipped += 1
                        if len(bad) < 3:
                            bad.append(f"{qa.get('id')}: {text!r} at {start}")
                        continue
                    answers.append((text, start))
                if answers:
                    examples.append(QaExample(str(qa.get("id")), article.get("title", ""), qa["question"], context,
                                              answers))
    if skipped:
        print(f"warning: {path}: skipped {skipped} answer(s) whose answer_start does not match the context "
              f"(e.g. {'; '.join(bad)})", file=sys.stderr)
    if not examples:
        raise EncoderkitError(f"{path} ({split} articles) holds no question with a valid answer")
    return examples, skipped
