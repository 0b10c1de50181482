"""Load a model folder's (fast) tokenizer, and read its vocabulary for masking: :func:`word_start_table`
says which token ids begin a word (whole-word masking), :func:`token_surfaces` gives each token's text
without word markers (masking only words)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")


def load_tokenizer(path: str | Path) -> Any:
    """Load the (fast) tokenizer of an HF folder: one made by ``tokenizer train`` or any model folder.

    Raises :class:`EncoderkitError` when the folder is missing, has no tokenizer files, or holds a
    tokenizer with no fast (Rust) version, which offsets and :func:`word_start_table` need.
    """
    from transformers import AutoTokenizer  # noqa: PLC0415 - light path: data prepare imports this; transformers imports torch

    p = Path(path)
    if not p.exists():
        raise EncoderkitError(f"tokenizer folder {p} does not exist; train one with `encoderkit tokenizer train` "
                              "or pass a model folder")
    if not p.is_dir():
        raise EncoderkitError(f"{p} is a file; pass the folder that holds tokenizer.json (or vocab.txt)")
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise EncoderkitError(f"folder {p} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); train one "
                              "with `encoderkit tokenizer train --out DIR` or point to a model folder that has one")
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # transformers raises OSError/ValueError/... for broken folders
        raise EncoderkitError(f"could not load the tokenizer in {p} ({type(e).__name__}: {str(e)[:300]}); "
                              "check tokenizer.json / tokenizer_config.json there") from e
    if not getattr(tok, "is_fast", False):
        raise EncoderkitError(f"the tokenizer in {p} has no fast (tokenizers) version; save it with a "
                              "tokenizer.json (e.g. AutoTokenizer.from_pretrained(..).save_pretrained(dir))")
    return tok


def word_start_table(tokenizer: Any) -> np.ndarray:
    """``(len(tokenizer),) bool``: True where a token id begins a word (whole-word masking groups a
    word-start token with the non-start tokens that follow it).

    - WordPiece: every token not starting with the continuation prefix (``##``).
    - Byte-level BPE: tokens starting with the space marker ``Ġ`` or another whitespace byte, or
      with an ASCII byte that is not a letter or digit (punctuation is its own word, as in BERT).
      Tokens starting with a letter, a digit or a non-ASCII byte continue the previous word; the
      first word of a text has no ``Ġ``, so callers treat the token after a special token as a start.
    - SentencePiece (Metaspace ``▁``): tokens starting with ``▁``.
    Special and added tokens are always starts.
    """
    kind, prefix, vocab, size = _vocab_kind(tokenizer, "word_start_table")
    table = np.zeros(size, dtype=bool)
    if kind == "wordpiece":
        for token, i in vocab.items():
            table[i] = not token.startswith(prefix)
    elif kind == "bytelevel":
        byte_of = _byte_level_decoder()
        for token, i in vocab.items():
            first = byte_of.get(token[:1]) if token else None
            if first is None:  # not a byte symbol: a special / added token
                table[i] = True
            else:
                ch = chr(first)
                table[i] = first < 128 and (ch.isspace() or not ch.isalnum())
    else:
        for token, i in vocab.items():
            table[i] = token.startswith("\u2581")
    table[_special_and_added_ids(tokenizer, size)] = True
    return table


def token_surfaces(tokenizer: Any) -> list[str]:
    """Each token id's text without the tokenizer's word markers (WordPiece ``##``, byte-level BPE's
    ``Ġ`` and byte symbols, SentencePiece ``▁``), stripped of spaces; ``""`` for special and added
    tokens. A byte-level piece holding part of a multi-byte character reads as U+FFFD there."""
    kind, prefix, vocab, size = _vocab_kind(tokenizer, "token_surfaces")
    out = [""] * size
    if kind == "wordpiece":
        for token, i in vocab.items():
            out[i] = token.removeprefix(prefix)
    elif kind == "bytelevel":
        byte_of = _byte_level_decoder()
        for token, i in vocab.items():
            raw = [byte_of.get(ch) for ch in token]
            if None not in raw:
                out[i] = bytes(raw).decode("utf-8", errors="replace").strip()
    else:
        for token, i in vocab.items():
            out[i] = token.replace("\u2581", " ").strip()
    for i in _special_and_added_ids(tokenizer, size):
        out[i] = ""
    return out


def _vocab_kind(tokenizer: Any, who: str) -> tuple[str, str, dict[str, int], int]:
    """(kind, continuation prefix, token -> id with added tokens, table size) of a fast tokenizer;
    kind is ``wordpiece``, ``bytelevel`` (byte-level BPE) or ``metaspace`` (SentencePiece)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model", {})
    vocab = tokenizer.get_vocab()
    size = max(len(tokenizer), max(vocab.values()) + 1)
    mtype = model.get("type")
    if mtype == "WordPiece":
        return "wordpiece", model.get("continuing_subword_prefix") or "##", vocab, size
    if mtype == "BPE" and _has_component(spec.get("pre_tokenizer"), "ByteLevel"):
        return "bytelevel", "", vocab, size
    if _has_component(spec.get("pre_tokenizer"), "Metaspace") or mtype == "Unigram":
        return "metaspace", "", vocab, size
    raise EncoderkitError(f"{who}: unsupported tokenizer model {mtype!r} "
                          "(supported: WordPiece, byte-level BPE, SentencePiece/Metaspace)")


def _special_and_added_ids(tokenizer: Any, size: int) -> list[int]:
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    ids |= set(tokenizer.added_tokens_decoder)
    return sorted(i for i in ids if i is not None and 0 <= i < size)


def _has_component(node: Any, name: str) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == name:
        return True
    return any(_has_component(n, name) for key in ("pretokenizers", "normalizers") for n in node.get(key, []) or [])


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the printable symbol of each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
