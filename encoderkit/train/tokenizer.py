"""Train a tokenizer on a corpus (``encoderkit tokenizer train``); :mod:`encoderkit.models.tokenizer` loads one.

``wordpiece`` (BERT-style) or ``bpe`` (RoBERTa-style byte-level: no input is ever unknown), saved as a standard HF
tokenizer folder (``AutoTokenizer.from_pretrained``). The corpus reaches the trainer in pieces of at most
``TRAIN_PIECE_CHARS`` characters, so memory holds the word counts, never the corpus.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from encoderkit.config import StageConfig, arg, check
from encoderkit.data.readers import DOC_SPLITS, ReadStats, estimate_bytes, iter_documents
from encoderkit.errors import EncoderkitError
from encoderkit.io import output_dir, write_json_atomic
from encoderkit.models.card import write_card
from encoderkit.progress import note, progress

KINDS = ("wordpiece", "bpe")
ROLES = ("pad", "unk", "cls", "sep", "mask")
# role -> token, in vocabulary id order
DEFAULT_SPECIALS: dict[str, dict[str, str]] = {
    "wordpiece": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "bpe": {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"},
}
BYTE_ALPHABET = 256
TRAIN_PIECE_CHARS = 1 << 16  # long documents reach the trainer in pieces of at most this many characters


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
    follow_links: bool = arg(False, help="Also read files that symbolic links inside a corpus folder point to "
                                         "outside it (by default such links are skipped and counted).")
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
    skipped_links: int = 0  # links that leave a corpus folder, left out (no --follow-links)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "notes" or v}


def build_backend(kind: str, lowercase: bool, roles: dict[str, str]) -> Any:
    """An untrained ``tokenizers.Tokenizer`` (model, normalizer, pre-tokenizer, decoder); the
    post-processor is added after training, when the special token ids are known."""
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
    if cfg.kind == "wordpiece":
        return trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                         special_tokens=special_tokens, limit_alphabet=cfg.limit_alphabet,
                                         continuing_subword_prefix="##", show_progress=False)
    return trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                               special_tokens=special_tokens, show_progress=False,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def _post_processor(kind: str, tok: Any, roles: dict[str, str]) -> Any:
    cls, sep = roles["cls"], roles["sep"]
    cls_id, sep_id = tok.token_to_id(cls), tok.token_to_id(sep)
    if kind == "wordpiece":
        return processors.TemplateProcessing(single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
                                             special_tokens=[(cls, cls_id), (sep, sep_id)])
    return processors.RobertaProcessing((sep, sep_id), (cls, cls_id), trim_offsets=True, add_prefix_space=False)


def wrap_fast(tok: Any, kind: str, roles: dict[str, str], extra: list[str], model_max_length: int) -> Any:
    """The trained backend as a ``PreTrainedTokenizerFast`` with its special tokens named."""
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
    docs = iter_documents(cfg.corpus, doc_split=cfg.doc_split, text_field=cfg.text_field,
                          text_column=cfg.text_column, skip_bad_encoding=cfg.skip_bad_encoding,
                          on_skip=lambda src, why: note(f"skipped {src}: {why}"), stats=stats,
                          follow_links=cfg.follow_links)
    total = estimate_bytes(cfg.corpus, cfg.follow_links)
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
                   "skipped_files": stats.skipped_files, "skipped_links": stats.skipped_links}
        write_card(tmp, stage="tokenizer", parent=None, config=cfg.result_dict(), metrics=metrics,
                   kind=cfg.kind, lowercase=cfg.is_lowercase, special_tokens=roles)
    return Result(out=str(cfg.out), kind=cfg.kind, vocab_size=size, documents=stats.documents,
                  text_bytes=stats.text_bytes, skipped_files=stats.skipped_files,
                  seconds=round(time.perf_counter() - started, 2), skipped_links=stats.skipped_links, notes=notes)


def renumber_wordpiece(tok: Any, special_tokens: list[str], unk_token: str) -> None:
    """Give a trained WordPiece vocabulary canonical ids: special tokens first, then the rest sorted by (piece length
    without ``##``, continuation or not, text), so equal vocabularies give byte-identical tokenizers (the trainer
    numbers ``##`` pieces in hash-map order, huggingface/tokenizers#1794; WordPiece encodes by membership alone)."""
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
