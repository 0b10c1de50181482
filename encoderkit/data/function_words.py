"""Function words: the words MLM masking can be told never to pick (``pretrain --mask-skip-words``).

A short run that masks every kind of token learns the frequent ones first ("the", "of"); skipping them trains the
model on the content words a fill-mask prompt asks for. ``english`` is built in; any other language is a text file
with one word per line.
"""

from __future__ import annotations

from pathlib import Path

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_lines

_ENGLISH = """
a about above across after again against all almost along already also although always am among an and another
any anyone anything are around as at be became because become been before behind being below beneath beside
besides between beyond both but by can cannot could did do does doing done down during each either else
enough etc even ever every few for from further had has have having he her here hers herself him himself his
how however i if in inside instead into is it its itself just least less like many may me might mine more
most much must my myself near neither never nevertheless no none nor not now of off often on once one only
onto or other others otherwise our ours ourselves out over own per perhaps quite rather same several shall she
should since so some such than that the their theirs them themselves then there therefore these they this
those though through throughout thus to together too toward towards under unless until up upon us very via
was we were what whatever when whenever where whereas wherever whether which while who whoever whom whose why
will with within without would yet you your yours yourself yourselves
"""
ENGLISH = frozenset(_ENGLISH.split())

BUILTIN = {"english": ENGLISH}


def read_skip_words(spec: str) -> frozenset[str]:
    """``""`` -> none; a built-in list's name (``english``) -> that list; else a UTF-8 text file with one
    word per line (blank lines and ``#`` comments ignored). Words are matched lower-cased."""
    if not spec:
        return frozenset()
    if spec.lower() in BUILTIN:
        return BUILTIN[spec.lower()]
    path = Path(spec)
    if not path.is_file():
        raise EncoderkitError(f"--mask-skip-words {spec!r}: no such file and not a built-in list "
                              f"({', '.join(sorted(BUILTIN))}); give a text file with one word per line")
    lines = [line for _, line in read_lines(path, "--mask-skip-words")]  # only \n ends a line; a bad byte named
    words = frozenset(w.strip().lower() for w in lines if w.strip() and not w.lstrip().startswith("#"))
    if not words:
        raise EncoderkitError(f"--mask-skip-words {path}: the file lists no word (one word per line)")
    return words
