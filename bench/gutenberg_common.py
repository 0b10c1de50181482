"""What the benches that pretrain on the Gutenberg novels share (bench/axes.py, bench/mlm_claims.py): the data
paths, the corpus, the WordPiece tokenizer and token store trained on it, and the held-out MLM metrics."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from types import SimpleNamespace

# the real data sets, as in tests/conftest.py (ENCODERKIT_SHARED_DATA overrides, e.g. from a git worktree)
SHARED = Path(os.environ.get("ENCODERKIT_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))
BOOKS = SHARED / "mlm_corpus_gutenberg" / "gitenberg"
SST2 = SHARED / "glue_sst2"


def corpus(work: Path, books: int, chars_per_book: int, skip_header: bool = False) -> Path:
    """The first ``books`` novels (0: every one) as plain text files under ``work/corpus``, each cut to
    ``chars_per_book`` characters (0: whole books); ``skip_header``: after the Gutenberg header (the
    ``*** START OF`` line), where a book has one."""
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    paths = sorted(BOOKS.glob("*.txt.gz"))
    if not paths:
        raise SystemExit(f"no Gutenberg novels under {BOOKS}")
    for path in paths[:books or None]:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            text = f.read()
        if skip_header:
            start = text.find("*** START OF")
            text = text[text.find("\n", start) + 1:] if start >= 0 else text
        (out / path.name.replace(".gz", "")).write_text(text[:chars_per_book] if chars_per_book else text,
                                                        encoding="utf-8")
    return out


def tokenizer_and_store(text: Path, work: Path, vocab: int, seq_len: int, heldout: float,
                        reuse: bool = False) -> tuple[Path, Path]:
    """(tokenizer, token store) under ``work``: a WordPiece of ``vocab`` trained on ``text`` (paragraphs split at
    blank lines) and its store of ``seq_len`` blocks, ``heldout`` of the documents held out. ``reuse``: a tokenizer
    already in ``work`` is kept, and so is its store when that has the same ``seq_len``; otherwise both are made
    afresh."""
    from encoderkit.data.prepare import PrepareConfig
    from encoderkit.data.prepare import run as prepare
    from encoderkit.train.tokenizer import TokenizerConfig
    from encoderkit.train.tokenizer import run as train_tokenizer

    tok = work / "tokenizer"
    trained = not (reuse and (tok / "tokenizer.json").is_file())
    if trained:
        train_tokenizer(TokenizerConfig(corpus=[str(text)], out=str(tok), kind="wordpiece", vocab_size=vocab,
                                        doc_split="blank_line", overwrite=not reuse))
    store = work / "store"
    meta = store / "meta.json"
    if not trained and meta.is_file() and json.loads(meta.read_text()).get("seq_len") == seq_len:
        print(f"reusing the tokenizer and token store of {work} (same seq_len)", flush=True)
        return tok, store
    prepare(PrepareConfig(corpus=[str(text)], tokenizer=str(tok), out=str(store), seq_len=seq_len,
                          heldout=heldout, doc_split="blank_line", overwrite=True))
    return tok, store


def heldout_mlm(model_dir: Path, store: Path, eval_blocks: int, batch_size: int) -> dict[str, float]:
    """Held-out masked-token loss and accuracy (``evaluate_folder``'s dict) over ``eval_blocks`` blocks of
    ``store``, under the standard 15% token masks of seed 0: the same masks for every model."""
    from encoderkit.models.folder import ModelFolder
    from encoderkit.models.tokenizer import load_tokenizer
    from encoderkit.train.pretrain import evaluate_folder

    cfg = SimpleNamespace(mask_rate=0.15, seed=0, max_examples=eval_blocks, batch_size=batch_size)
    return evaluate_folder(ModelFolder.open(model_dir, tokenizer=False), load_tokenizer(store), store, cfg)
