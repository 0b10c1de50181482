"""The token store: ``encoderkit data prepare`` and ``encoderkit data inspect``.

A split's documents are one stream, each followed by [SEP], packed into ``[CLS]`` + ``seq_len - 1`` token blocks;
the last partial block is kept, padded with [PAD], so no text is lost. Nothing holds the corpus in RAM. The store:
``meta.json``, ``tokens.bin`` (every document's ids), ``doc_offsets.npy``, ``doc_split.npy`` (1: held out),
``train.npy`` / ``heldout.npy`` (blocks) and the tokenizer. A rerun with the same fingerprint (inputs, tokenizer,
settings) does nothing ("cache hit").
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import sys
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from encoderkit.config import StageConfig, arg, check
from encoderkit.data.readers import (
    BUILTIN_PREFIX,
    DOC_SPLITS,
    HF_PREFIX,
    ReadStats,
    estimate_bytes,
    iter_documents,
    resolve_sources,
)
from encoderkit.errors import EncoderkitError
from encoderkit.io import output_dir, portable, portable_path, read_json, write_json_atomic
from encoderkit.models.card import write_card
from encoderkit.models.tokenizer import TOKENIZER_FILES, load_tokenizer
from encoderkit.progress import note, progress

FORMAT_VERSION = 1
SPLITS = ("train", "heldout")
# the files whose contents define a tokenizer (model weights and configs of a model folder are not hashed)
HASHED_TOKENIZER_FILES = TOKENIZER_FILES + ("merges.txt", "added_tokens.json", "tokenizer_config.json",
                                            "special_tokens_map.json")


@dataclass
class PrepareConfig(StageConfig):
    corpus: list[str] = arg(help="Text files, folders, globs, hf:NAME[:CONFIG][:SPLIT] or builtin:stdlib.",
                            required=True)
    tokenizer: str = arg(help="Tokenizer folder (`encoderkit tokenizer train` or any HF model).", required=True)
    out: str = arg("", help="Output folder for the token store (required for `data prepare`).")
    seq_len: int = arg(128, help="Tokens per packed block, [CLS] and [SEP]s included.")
    heldout: float = arg(0.01, help="Fraction of documents held out (at least one when > 0); 0 for none.")
    seed: int = arg(0, help="Seed of the document hash that picks the held-out documents.")
    doc_split: str = arg("file", help="How plain-text files become documents.", choices=DOC_SPLITS)
    text_field: str = arg("text", help="JSON field holding the text (JSONL / hf: sources).")
    text_column: str = arg("text", help="Column holding the text (CSV / TSV / Parquet sources).")
    skip_bad_encoding: bool = arg(False, help="Leave out files that are not UTF-8 instead of stopping.")
    follow_links: bool = arg(False, help="Also read files that symbolic links inside a corpus folder point to "
                                         "outside it (by default such links are skipped and counted).")
    batch_size: int = arg(1000, help="Documents per tokenisation batch.", speed=True)
    num_workers: int = arg(0, help="Tokenising processes; 0 = the tokenizer's own threads in this process.", speed=True)
    overwrite: bool = arg(False, help="Replace an existing --out prepared from other inputs or settings.")

    def validate(self) -> None:
        check(self.seq_len >= 8, f"seq_len must be at least 8, got {self.seq_len}")
        check(0.0 <= self.heldout < 0.5, f"heldout must be in [0, 0.5), got {self.heldout}")
        check(self.batch_size >= 1, f"batch_size must be at least 1, got {self.batch_size}")
        check(self.num_workers >= 0, f"num_workers must be >= 0, got {self.num_workers}")


@dataclass
class PrepareResult:
    out: Path
    meta: dict[str, Any]
    cache_hit: bool

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "cache_hit": self.cache_hit, "fingerprint": self.meta["fingerprint"],
                "seq_len": self.meta["seq_len"], "counts": self.meta["counts"],
                "skipped_links": self.meta.get("skipped_links", 0)}


# -- hashing (counter-based randomness for the held-out split and for masking.Masker) -------------
_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 arrays (wrapping arithmetic): a cheap, well-mixed
    hash that turns counters (document index, block index, position) into independent random bits."""
    with np.errstate(over="ignore"):
        z = x + _GOLD
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


# -- fingerprint -----------------------------------------------------------------------------------
def tokenizer_hash(folder: str | Path) -> str:
    """sha256 over the contents of the tokenizer files in ``folder`` (model weights are ignored)."""
    folder = Path(folder)
    check(folder.is_dir(), f"tokenizer folder {folder} does not exist; train one with `encoderkit tokenizer train` "
                           "or pass a model folder")
    h = hashlib.sha256()
    found = [n for n in HASHED_TOKENIZER_FILES if (folder / n).is_file()]
    check(any(n in TOKENIZER_FILES for n in found),
          f"tokenizer folder {folder} holds none of {', '.join(TOKENIZER_FILES)}; "
          "pass a folder made by `encoderkit tokenizer train` or a Hugging Face model folder")
    for name in found:
        h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return h.hexdigest()


def input_signature(sources: list[str], follow_links: bool = False) -> list[dict[str, Any]]:
    """One entry per resolved source: absolute path, size and mtime_ns (``hf:``/``builtin:`` by name)."""
    sig = []
    for src in resolve_sources(sources, follow_links, quiet=True):
        if src.startswith(BUILTIN_PREFIX):
            sig.append({"source": src, "python": sys.version})  # the stdlib's docstrings follow the interpreter
        elif src.startswith(HF_PREFIX):
            sig.append({"source": src})
        else:
            st = Path(src).stat()
            sig.append({"source": str(Path(src).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return sig


def fingerprint(cfg: PrepareConfig) -> tuple[str, list[dict[str, Any]], str]:
    """(fingerprint, input signature, tokenizer hash). Missing inputs raise before anything is written."""
    inputs = input_signature(cfg.corpus, cfg.follow_links)
    tok_hash = tokenizer_hash(cfg.tokenizer)
    # follow_links changes which files are read, which the input signature already lists
    settings = {k: v for k, v in cfg.result_dict().items()
                if k not in ("corpus", "tokenizer", "out", "overwrite", "follow_links")}
    key = json.dumps({"format": FORMAT_VERSION, "inputs": inputs, "tokenizer": tok_hash, "settings": settings},
                     sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest(), inputs, tok_hash


# -- tokenising ------------------------------------------------------------------------------------
_worker_tokenizer: Any = None


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, built once
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(backend: Any, texts: list[str]) -> list[list[int]]:
    return [enc.ids for enc in backend.encode_batch_fast(texts, add_special_tokens=False)]


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    return _encode(_worker_tokenizer, texts)


def encode_batches(backend: Any, batches: Iterable[list[str]], num_workers: int) -> Iterator[list[list[int]]]:
    """Token ids of each batch of texts, in order. With ``num_workers`` > 0 the batches go to worker
    processes, at most ``2 * num_workers`` in flight so that the corpus is never read ahead."""
    if num_workers == 0:
        for texts in batches:
            yield _encode(backend, texts)
        return

    with ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(backend.to_str(),)) as pool:
        pending: deque[Future] = deque()
        for texts in batches:
            pending.append(pool.submit(_encode_in_worker, texts))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def text_batches(docs: Iterable[Any], max_docs: int, max_chars: int = 1 << 24) -> Iterator[list[str]]:
    """Texts of ``docs`` in batches of at most ``max_docs`` documents and (unless one document is
    longer) ``max_chars`` characters, so that whole-file documents never pile up in RAM."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        if batch and (len(batch) >= max_docs or chars + len(doc.text) > max_chars):
            yield batch
            batch, chars = [], 0
        batch.append(doc.text)
        chars += len(doc.text)
    if batch:
        yield batch


def tokenize_corpus(cfg: PrepareConfig, backend: Any, tokens_path: Path, dtype: np.dtype,
                    stats: ReadStats | None = None) -> np.ndarray:
    """Append every document's ids to ``tokens_path``; returns the (n_docs + 1,) int64 offsets.
    Documents that tokenise to nothing are left out; ``stats`` counts what the read skipped."""
    docs = iter_documents(cfg.corpus, doc_split=cfg.doc_split, text_field=cfg.text_field,
                          text_column=cfg.text_column, skip_bad_encoding=cfg.skip_bad_encoding,
                          on_skip=lambda src, why: note(f"skipped {src}: {why}"), stats=stats,
                          follow_links=cfg.follow_links)
    bar = progress(total=estimate_bytes(cfg.corpus, cfg.follow_links), unit="B", unit_scale=True, desc="tokenising")
    lengths = array("q")  # tokens per document: 8 bytes each, the only per-document state kept in RAM
    n_tokens = 0

    def texts_with_progress() -> Iterator[list[str]]:
        for texts in text_batches(docs, cfg.batch_size):
            bar.update(sum(map(len, texts)))
            yield texts

    with open(tokens_path, "wb", buffering=1 << 22) as f, bar:
        for ids in encode_batches(backend, texts_with_progress(), cfg.num_workers):
            batch_lengths = [len(seq) for seq in ids]
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=sum(batch_lengths))
            f.write(flat.astype(dtype).tobytes())
            lengths.extend(n for n in batch_lengths if n)
            n_tokens += len(flat)
            bar.set_postfix(docs=len(lengths), tokens=n_tokens, refresh=False)
    check(n_tokens > 0, f"the corpus {', '.join(cfg.corpus)} yields no tokens with tokenizer {cfg.tokenizer}")
    return np.concatenate([[0], np.cumsum(np.frombuffer(lengths, dtype=np.int64))])


# -- splitting and packing -------------------------------------------------------------------------
def heldout_flags(n_docs: int, fraction: float, seed: int) -> np.ndarray:
    """(n_docs,) bool: True for held-out documents. A document is held out when a seeded hash of its
    index falls below ``fraction``; when that picks none (small corpora) the lowest hash is taken.
    Every document stays in train when there is only one."""
    if fraction <= 0 or n_docs < 2:
        return np.zeros(n_docs, dtype=bool)
    with np.errstate(over="ignore"):
        bits = splitmix64(splitmix64(np.arange(n_docs, dtype=np.uint64)) ^ np.uint64(seed & (2**64 - 1)))
    u = (bits >> np.uint64(11)).astype(np.float64) / 2**53
    flags = u < fraction
    if not flags.any():
        flags[int(np.argmin(u))] = True
    if flags.all():
        flags[int(np.argmax(u))] = False
    return flags


def split_stream(tokens: np.ndarray, offsets: np.ndarray, doc_ids: np.ndarray, sep: int,
                 chunk: int = 1 << 20) -> Iterator[np.ndarray]:
    """A split's token stream in pieces: each document (in slices of at most ``chunk`` ids, so a
    huge document is never read whole) followed by [SEP]."""
    sep_piece = np.array([sep], dtype=tokens.dtype)
    for d in doc_ids:
        for start in range(int(offsets[d]), int(offsets[d + 1]), chunk):
            yield tokens[start:min(start + chunk, int(offsets[d + 1]))]
        yield sep_piece


def pack_split(tokens: np.ndarray, offsets: np.ndarray, doc_ids: np.ndarray, out_path: Path, seq_len: int,
               ids: dict[str, int], desc: str) -> int:
    """Write the blocks of the documents ``doc_ids`` (in order) to ``out_path`` as an (N, seq_len) .npy.

    tokens: (T,) memmap; offsets: (n_docs + 1,) int64. Returns N.
    """
    body = seq_len - 1
    n_stream = int((offsets[doc_ids + 1] - offsets[doc_ids]).sum()) + len(doc_ids)
    n_blocks = -(-n_stream // body)
    blocks = np.lib.format.open_memmap(out_path, mode="w+", dtype=tokens.dtype, shape=(n_blocks, seq_len))
    rows_per_write = max(1, (1 << 20) // body)
    row = 0

    def write_rows(stream: np.ndarray, n_rows: int) -> None:
        nonlocal row
        rows = np.empty((n_rows, seq_len), dtype=tokens.dtype)
        rows[:, 0] = ids["cls"]
        rows[:, 1:] = stream[:n_rows * body].reshape(n_rows, body)
        blocks[row:row + n_rows] = rows
        row += n_rows
        bar.update(n_rows)

    with progress(total=n_blocks, unit="block", desc=desc) as bar:
        pieces: list[np.ndarray] = []
        have = 0
        for piece in split_stream(tokens, offsets, doc_ids, ids["sep"]):
            pieces.append(piece)
            have += len(piece)
            if have >= rows_per_write * body:
                stream = np.concatenate(pieces)
                full = len(stream) // body
                write_rows(stream, full)
                pieces, have = [stream[full * body:]], len(stream) - full * body
        if have:
            stream = np.concatenate(pieces)
            full = len(stream) // body
            write_rows(stream, full)
            if len(stream) > full * body:  # the last partial block, padded at its end
                write_rows(np.concatenate([stream[full * body:], np.full(body, ids["pad"], tokens.dtype)]), 1)
    assert row == n_blocks, (row, n_blocks)
    blocks.flush()
    return n_blocks


# -- the stage -------------------------------------------------------------------------------------
def special_ids(tokenizer: Any, folder: str | Path) -> dict[str, int]:
    """The [CLS], [SEP], [PAD], [MASK] ids (BPE tokenizers: <s>, </s>, <pad>, <mask>); all are needed."""
    ids = {"cls": tokenizer.cls_token_id, "sep": tokenizer.sep_token_id, "pad": tokenizer.pad_token_id,
           "mask": tokenizer.mask_token_id}
    missing = [k for k, v in ids.items() if v is None]
    check(not missing, f"tokenizer {folder} has no {', '.join(missing)} token; packing needs [CLS], [SEP], [PAD] "
                       "and MLM needs [MASK] (train one with `encoderkit tokenizer train`)")
    return {k: int(v) for k, v in ids.items()}


def is_prepared(folder: str | Path, fp: str) -> bool:
    """Whether ``folder`` holds a complete store with fingerprint ``fp``."""
    folder = Path(folder)
    try:
        meta = read_meta(folder)
    except EncoderkitError:
        return False
    return meta.get("fingerprint") == fp and all((folder / f"{s}.npy").is_file() for s in SPLITS)


def run(cfg: PrepareConfig) -> PrepareResult:
    """Tokenise a corpus into a packed, memory-mapped token store (cached by fingerprint).

    Re-running with the same inputs and settings prints "cache hit" and does nothing."""
    check(bool(cfg.out), "data prepare: '--out' is required (the folder to write the token store to)")
    out = Path(cfg.out)
    fp, inputs, tok_hash = fingerprint(cfg)
    if is_prepared(out, fp):
        print(f"cache hit: {out} already holds this corpus prepared with these settings (fingerprint {fp[:16]})")
        return PrepareResult(out, read_meta(out), cache_hit=True)
    if (out / "meta.json").is_file() and not cfg.overwrite:
        raise EncoderkitError(f"{out} holds a token store prepared from other inputs or settings; pass --overwrite "
                              "to rebuild it, or choose another --out")
    tokenizer = load_tokenizer(cfg.tokenizer)
    ids = special_ids(tokenizer, cfg.tokenizer)
    vocab_size = len(tokenizer)
    dtype = np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)
    backend = _fresh_backend(tokenizer)
    with output_dir(out, cfg.overwrite) as tmp:
        stats = ReadStats()
        offsets = tokenize_corpus(cfg, backend, tmp / "tokens.bin", dtype, stats)
        n_docs = len(offsets) - 1
        flags = heldout_flags(n_docs, cfg.heldout, cfg.seed)
        np.save(tmp / "doc_offsets.npy", offsets)
        np.save(tmp / "doc_split.npy", flags.astype(np.uint8))
        tokens = np.memmap(tmp / "tokens.bin", dtype=dtype, mode="r", shape=(int(offsets[-1]),))
        counts = {}
        for split, members in (("train", ~flags), ("heldout", flags)):
            doc_ids = np.flatnonzero(members)
            n_blocks = pack_split(tokens, offsets, doc_ids, tmp / f"{split}.npy", cfg.seq_len, ids, f"packing {split}")
            counts[split] = {"docs": len(doc_ids), "tokens": int((offsets[doc_ids + 1] - offsets[doc_ids]).sum()),
                             "blocks": n_blocks}
        del tokens
        tokenizer.save_pretrained(str(tmp))
        meta = {"format": FORMAT_VERSION, "fingerprint": fp, "seq_len": cfg.seq_len, "dtype": dtype.name,
                "vocab_size": vocab_size, "special_ids": ids,
                "all_special_ids": [int(i) for i in tokenizer.all_special_ids],
                "last_block": "padded", "tokenizer": {"source": portable_path(cfg.tokenizer, tmp), "sha256": tok_hash},
                "counts": counts, "skipped_links": stats.skipped_links, "inputs": portable(inputs, tmp),
                "config": portable(cfg.result_dict(), tmp)}
        write_json_atomic(tmp / "meta.json", meta)
        write_card(tmp, stage="prepare", parent=None, config=cfg.to_dict(), metrics={"counts": counts})
    return PrepareResult(out, meta, cache_hit=False)


def _fresh_backend(tokenizer: Any) -> Any:
    """A private copy of the fast tokenizer's backend with truncation and padding off."""
    check(getattr(tokenizer, "is_fast", False), "data prepare needs a fast (Rust) tokenizer; "
                                                "save the tokenizer with tokenizer.json")
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def ensure_prepared(cfg: PrepareConfig, cache_root: str | Path) -> Path:
    """The store for ``cfg`` under ``cache_root/<fingerprint>``, built first if missing or stale
    (``cfg.out`` and ``cfg.overwrite`` are ignored)."""
    fp, _, _ = fingerprint(cfg)
    folder = Path(cache_root) / fp[:24]
    if not is_prepared(folder, fp):
        run(dataclasses.replace(cfg, out=str(folder), overwrite=True))
    return folder


# -- reading a store -------------------------------------------------------------------------------
def read_meta(folder: str | Path) -> dict[str, Any]:
    """The store's ``meta.json``."""
    return read_json(Path(folder) / "meta.json",
                     f"{folder} is not a token store (no meta.json); make one with `encoderkit data prepare`",
                     fix="re-run `encoderkit data prepare --overwrite`")


def open_blocks(folder: str | Path, split: str = "train") -> np.ndarray:
    """(N, seq_len) read-only memmap of a split's blocks."""
    check(split in SPLITS, f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    read_meta(folder)
    return np.load(Path(folder) / f"{split}.npy", mmap_mode="r")


def open_documents(folder: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens (T,) memmap, offsets (n_docs + 1,) int64, heldout flags (n_docs,) bool) of a store."""
    meta = read_meta(folder)
    folder = Path(folder)
    offsets = np.load(folder / "doc_offsets.npy")
    tokens = np.memmap(folder / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(int(offsets[-1]),))
    return tokens, offsets, np.load(folder / "doc_split.npy").astype(bool)


def decode_blocks(folder: str | Path, blocks: np.ndarray, *, skip_special_tokens: bool = False,
                  tokenizer: Any = None) -> list[str]:
    """Decode (B, L) blocks with the store's own tokenizer; padding is always dropped."""
    tokenizer = tokenizer or load_tokenizer(folder)
    pad = read_meta(folder)["special_ids"]["pad"]
    return [tokenizer.decode([int(t) for t in row if t != pad], skip_special_tokens=skip_special_tokens)
            for row in np.asarray(blocks)]


# -- data inspect ----------------------------------------------------------------------------------
@dataclass
class InspectConfig(StageConfig):
    data: str = arg(help="Token store folder made by `encoderkit data prepare`.", required=True)
    samples: int = arg(1, help="Decoded blocks to print per split.")
    split: str = arg("train", help="Split to sample blocks from.", choices=SPLITS)


def inspect(cfg: InspectConfig) -> None:
    """Print a token store's counts per split, tokens-per-document statistics and decoded sample blocks."""
    meta = read_meta(cfg.data)
    _, offsets, flags = open_documents(cfg.data)
    lengths = np.diff(offsets)
    print(f"token store {cfg.data}: seq_len {meta['seq_len']}, vocab {meta['vocab_size']}, dtype {meta['dtype']}, "
          f"tokenizer {meta['tokenizer']['source']} (sha256 {meta['tokenizer']['sha256'][:12]})")
    for split in SPLITS:
        c = meta["counts"][split]
        print(f"{split:8s} docs {c['docs']:>10,d}  tokens {c['tokens']:>14,d}  blocks {c['blocks']:>10,d}")
    for split, member in (("train", ~flags), ("heldout", flags)):
        ln = lengths[member]
        if len(ln):
            print(f"{split:8s} tokens/doc: mean {ln.mean():.1f}  median {np.median(ln):.0f}  min {ln.min()}  "
                  f"p90 {np.percentile(ln, 90):.0f}  max {ln.max()}")
    blocks = open_blocks(cfg.data, cfg.split)
    tokenizer = load_tokenizer(cfg.data)
    for i, text in enumerate(decode_blocks(cfg.data, blocks[:cfg.samples], tokenizer=tokenizer)):
        print(f"--- {cfg.split} block {i} ---\n{text}")
