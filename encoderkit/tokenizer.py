"""Train a tokenizer on a corpus (``encoderkit tokenizer train``) and load existing ones.

Two kinds, both trained with HF ``tokenizers`` and saved as a standard HF tokenizer folder that
``transformers.AutoTokenizer.from_pretrained(out)`` opens:

- ``wordpiece``: BERT-style. ``BertNormalizer`` (lowercase and accent stripping when
  ``lowercase``), ``BertPreTokenizer`` (split on whitespace and punctuation), ``##`` continuation
  prefix, ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` with token type ids 0/1.
- ``bpe``: RoBERTa-style byte-level BPE: every byte is in the alphabet, so no input is ever
  unknown and ``decode(encode(x)) == x``; ``<s> A </s>`` / ``<s> A </s></s> B </s>``.

The corpus is streamed: documents are read one at a time and reach the trainer in pieces of at
most ``TRAIN_PIECE_CHARS`` characters, so memory holds the word counts, never the corpus. :func:`word_start_table` says which token ids begin a word, for whole-word masking; :func:`token_surfaces`
gives each token's text without word markers, for masking only words.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.config import StageConfig, arg, check
from encoderkit.data.readers import DOC_SPLITS, ReadStats, estimate_bytes, iter_documents
from encoderkit.errors import EncoderkitError
from encoderkit.io import output_dir, write_json_atomic
from encoderkit.models.card import write_card

KINDS = ("wordpiece", "bpe")
ROLES = ("pad", "unk", "cls", "sep", "mask")
# role -> token, in vocabulary id order
DEFAULT_SPECIALS: dict[str, dict[str, str]] = {
    "wordpiece": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "bpe": {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"},
}
BYTE_ALPHABET = 256
TRAIN_PIECE_CHARS = 1 << 16  # long documents reach the trainer in pieces of at most this many characters
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")


@dataclass
class TokenizerConfig(StageConfig):
    """Settings of ``encoderkit tokenizer train``."""

    corpus: list[str] = arg(
        help="Text files, folders, globs, hf:NAME[:CONFIG][:SPLIT] or builtin:stdlib.", required=True)
    out: str = arg(help="Output folder for the tokenizer (HF layout).", required=True)
    kind: str = arg("wordpiece", help="wordpiece (BERT-style) or bpe (RoBERTa-style byte-level BPE).",
                    choices=KINDS)
    vocab_size: int = arg(30522, help="Vocabulary size, special tokens included (an upper bound: a small "
                                      "corpus may give fewer tokens).")
    lowercase: bool | None = arg(None, help="Lowercase (and strip accents for wordpiece). Default: on for "
                                            "wordpiece (uncased), off for bpe.")
    min_frequency: int = arg(2, help="A merge must occur at least this often in the corpus.")
    limit_alphabet: int = arg(1000, help="wordpiece: keep at most this many distinct characters (the rarest "
                                         "become [UNK]). bpe always uses the 256 bytes.")
    special_tokens: list[str] = arg(
        [], help="Override special tokens as ROLE=TOKEN (roles: pad unk cls sep mask); overridden roles "
                 "take the first ids, in the order given; a bare TOKEN adds an extra special token. Default: "
                 "[PAD] [UNK] [CLS] [SEP] [MASK] for wordpiece, <s> <pad> </s> <unk> <mask> for bpe.")
    model_max_length: int = arg(512, help="Longest sequence (in tokens) the tokenizer will produce for a model.")
    max_documents: int = arg(0, help="Train on at most this many documents (0: all).")
    doc_split: str = arg("file", help="Plain-text files: one document per file, per blank-line-separated "
                                      "block, or per line.", choices=DOC_SPLITS)
    text_field: str = arg("text", help="JSONL / hf: field that holds the text.")
    text_column: str = arg("text", help="CSV / TSV / Parquet column that holds the text.")
    skip_bad_encoding: bool = arg(False, help="Leave out files that are not UTF-8 (counted) instead of stopping.")
    overwrite: bool = arg(False, help="Replace an existing --out folder.")

    def validate(self) -> None:
        check(self.vocab_size > 0, f"vocab_size must be positive, got {self.vocab_size}")
        check(self.min_frequency >= 1, "min_frequency must be at least 1")
        check(self.model_max_length >= 8, "model_max_length must be at least 8")
        check(self.max_documents >= 0, "max_documents must be 0 (all) or positive")
        roles, extra = special_token_roles(self.kind, self.special_tokens)
        n_special = len(roles) + len(extra)
        need = n_special + (BYTE_ALPHABET if self.kind == "bpe" else 1)
        what = "the 256 byte symbols" if self.kind == "bpe" else "at least one character"
        check(self.vocab_size >= need,
              f"vocab_size={self.vocab_size} is too small: the {n_special} special tokens plus {what} need "
              f"{need}; raise --vocab-size (typical: 8000-50000)")

    @property
    def is_lowercase(self) -> bool:
        return self.kind == "wordpiece" if self.lowercase is None else self.lowercase


def special_token_roles(kind: str, overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """``(role -> token, extra special tokens)`` from the kind's defaults and ``ROLE=TOKEN`` overrides.
    The dict's order is the id order: overridden roles first, in the order given, then the other
    defaults; extra tokens follow them."""
    given: dict[str, str] = {}
    extra: list[str] = []
    for item in overrides:
        role, sep, token = item.partition("=")
        if sep and role in ROLES:
            check(bool(token), f"special token {item!r}: give a token after '='")
            given[role] = token
        elif sep:
            raise EncoderkitError(f"special token {item!r}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        else:
            extra.append(item)
    roles = dict(given)
    for role, token in DEFAULT_SPECIALS[kind].items():
        roles.setdefault(role, token)
    tokens = list(roles.values()) + extra
    dupes = sorted({t for t in tokens if tokens.count(t) > 1})
    check(not dupes, f"special tokens repeat: {', '.join(dupes)}; give each role its own token")
    return roles, extra


@dataclass
class Result:
    """What ``tokenizer train`` made: the folder, the vocabulary and the corpus it saw."""

    out: str
    kind: str
    vocab_size: int
    documents: int
    text_bytes: int
    skipped_files: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "notes" or v}


def build_backend(kind: str, lowercase: bool, roles: dict[str, str]) -> Any:
    """An untrained ``tokenizers.Tokenizer`` (model, normalizer, pre-tokenizer, decoder); the
    post-processor is added after training, when the special token ids are known."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=roles["unk"], continuing_subword_prefix="##"))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                    strip_accents=lowercase, lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    else:
        tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False))
        if lowercase:
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
    return tok


def _trainer(cfg: TokenizerConfig, special_tokens: list[str]) -> Any:
    from tokenizers import pre_tokenizers, trainers

    if cfg.kind == "wordpiece":
        return trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                         special_tokens=special_tokens, limit_alphabet=cfg.limit_alphabet,
                                         continuing_subword_prefix="##", show_progress=False)
    return trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                               special_tokens=special_tokens, show_progress=False,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def _post_processor(kind: str, tok: Any, roles: dict[str, str]) -> Any:
    from tokenizers import processors

    cls, sep = roles["cls"], roles["sep"]
    cls_id, sep_id = tok.token_to_id(cls), tok.token_to_id(sep)
    if kind == "wordpiece":
        return processors.TemplateProcessing(single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
                                             special_tokens=[(cls, cls_id), (sep, sep_id)])
    return processors.RobertaProcessing((sep, sep_id), (cls, cls_id), trim_offsets=True, add_prefix_space=False)


def wrap_fast(tok: Any, kind: str, roles: dict[str, str], extra: list[str], model_max_length: int) -> Any:
    """The trained backend as a ``PreTrainedTokenizerFast`` with its special tokens named."""
    from transformers import PreTrainedTokenizerFast

    kw: dict[str, Any] = {f"{role}_token": token for role, token in roles.items()}
    if kind == "bpe":
        kw.update(bos_token=roles["cls"], eos_token=roles["sep"])
        kw["model_input_names"] = ["input_ids", "attention_mask"]
    else:
        kw["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    if extra:
        kw["additional_special_tokens"] = extra
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length,
                                   padding_side="right", truncation_side="right", **kw)


def split_long_text(text: str, max_chars: int = TRAIN_PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most about ``max_chars`` characters, cut just after a newline (or,
    for a single huge line, after a space), so the words the pre-tokenizer sees do not change."""
    start = 0
    while len(text) - start > max_chars:
        cut = text.rfind("\n", start, start + max_chars)
        if cut < 0:
            cut = text.rfind(" ", start, start + max_chars)
        end = cut + 1 if cut >= start else start + max_chars
        yield text[start:end]
        start = end
    if start < len(text):
        yield text[start:]


def _training_texts(cfg: TokenizerConfig, stats: ReadStats) -> Iterator[str]:
    """The corpus as a stream of strings of at most ``TRAIN_PIECE_CHARS`` characters (the trainer
    buffers a few hundred items ahead, so bounded pieces bound memory), with a progress bar."""
    from encoderkit.progress import note, progress

    docs = iter_documents(cfg.corpus, doc_split=cfg.doc_split, text_field=cfg.text_field,
                          text_column=cfg.text_column, skip_bad_encoding=cfg.skip_bad_encoding,
                          on_skip=lambda src, why: note(f"skipped {src}: {why}"), stats=stats)
    total = estimate_bytes(cfg.corpus)
    with progress(total=total, unit="B", unit_scale=True, desc="tokenizer: reading corpus") as bar:
        for doc in docs:
            for piece in split_long_text(doc.text):
                yield piece
                bar.update(len(piece.encode("utf-8")))
            if cfg.max_documents and stats.documents >= cfg.max_documents:
                break


def run(cfg: TokenizerConfig) -> Result:
    """Train a WordPiece or byte-level BPE tokenizer on a corpus and save it as an HF tokenizer folder.

    Example: encoderkit tokenizer train --corpus data/ --kind wordpiece --vocab-size 16000 --out runs/tok
    """
    roles, extra = special_token_roles(cfg.kind, cfg.special_tokens)
    special_tokens = list(roles.values()) + extra
    started = time.perf_counter()
    stats = ReadStats()
    with output_dir(cfg.out, cfg.overwrite) as tmp:
        tok = build_backend(cfg.kind, cfg.is_lowercase, roles)
        tok.train_from_iterator(_training_texts(cfg, stats), trainer=_trainer(cfg, special_tokens))
        size = tok.get_vocab_size(with_added_tokens=True)
        if size > cfg.vocab_size:
            raise EncoderkitError(
                f"vocab_size={cfg.vocab_size} is too small for this corpus: the {len(special_tokens)} special "
                f"tokens and the corpus alphabet (characters, and their '##' forms) already take {size}; "
                f"raise --vocab-size above {size} or lower --limit-alphabet")
        check([tok.token_to_id(t) for t in special_tokens] == list(range(len(special_tokens))),
              "special tokens did not get the first ids after training (internal error)")
        if cfg.kind == "wordpiece":
            renumber_wordpiece(tok, special_tokens, roles["unk"])
        tok.post_processor = _post_processor(cfg.kind, tok, roles)
        fast = wrap_fast(tok, cfg.kind, roles, extra, cfg.model_max_length)
        fast.save_pretrained(str(tmp))
        tok.model.save(str(tmp))  # vocab.txt (wordpiece) or vocab.json + merges.txt (bpe), for other tools
        _portable_class_name(tmp)
        notes = []
        if size < cfg.vocab_size:
            notes.append(f"the corpus gave only {size} tokens (asked for {cfg.vocab_size}); "
                         "use a larger corpus or a lower --min-frequency to fill the vocabulary")
        if stats.skipped_files:
            notes.append(f"{stats.skipped_files} file(s) skipped: not UTF-8")
        metrics = {"vocab_size": size, "documents": stats.documents, "text_bytes": stats.text_bytes,
                   "skipped_files": stats.skipped_files}
        write_card(tmp, stage="tokenizer", parent=None, config=cfg.result_dict(), metrics=metrics,
                   kind=cfg.kind, lowercase=cfg.is_lowercase, special_tokens=roles)
    return Result(out=str(cfg.out), kind=cfg.kind, vocab_size=size, documents=stats.documents,
                  text_bytes=stats.text_bytes, skipped_files=stats.skipped_files,
                  seconds=round(time.perf_counter() - started, 2), notes=notes)


def renumber_wordpiece(tok: Any, special_tokens: list[str], unk_token: str) -> None:
    """Give a trained WordPiece vocabulary canonical ids: special tokens first (in their order), then
    the rest sorted by (piece length without ``##``, continuation or not, text).

    The HF WordPiece trainer numbers the ``##`` pieces in hash-map order (huggingface/tokenizers#1794),
    so two runs on the same corpus number the same vocabulary differently. WordPiece encodes by
    vocabulary membership alone, so renumbering changes the ids and nothing else; with it, equal
    vocabularies give byte-identical tokenizers. (Ties between equally frequent merges can still pick
    different pieces on a tiny corpus; byte-level BPE training is deterministic.)
    """
    from tokenizers import models

    vocab = tok.get_vocab(with_added_tokens=False)
    specials = set(special_tokens)
    rest = sorted((t for t in vocab if t not in specials),
                  key=lambda t: (len(t.removeprefix("##")), t.startswith("##"), t))
    tok.model = models.WordPiece(vocab={t: i for i, t in enumerate(special_tokens + rest)}, unk_token=unk_token,
                                 continuing_subword_prefix="##", max_input_chars_per_word=100)


def _portable_class_name(folder: Path) -> None:
    """Name the generic fast class in tokenizer_config.json: transformers 5 calls it TokenizersBackend,
    but 4.x only knows PreTrainedTokenizerFast (which 5.x still maps to the same class)."""
    cfg_path = Path(folder) / "tokenizer_config.json"
    data = json.loads(cfg_path.read_text(encoding="utf-8"))
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
        write_json_atomic(cfg_path, data)


# -- loading -----------------------------------------------------------------------------------------
def load_tokenizer(path: str | Path) -> Any:
    """Load the (fast) tokenizer of an HF folder: one made by ``tokenizer train`` or any model folder.

    Raises :class:`EncoderkitError` when the folder is missing, has no tokenizer files, or holds a
    tokenizer with no fast (Rust) version, which offsets and :func:`word_start_table` need.
    """
    from transformers import AutoTokenizer

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
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens} | set(tokenizer.added_tokens_decoder)
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
