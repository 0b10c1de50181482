"""The token store: packing round trip, held-out split, cache, errors, `data inspect`."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest

from encoderkit import cli
from encoderkit.data.prepare import (
    PrepareConfig,
    decode_blocks,
    ensure_prepared,
    heldout_flags,
    open_blocks,
    open_documents,
    pack_split,
    read_meta,
    run,
    split_stream,
    text_batches,
)
from encoderkit.data.readers import Document, iter_documents
from encoderkit.errors import EncoderkitError
from encoderkit.models.tokenizer import load_tokenizer

TINY_WORDS = [
    "the", "a", "of", "to", "and", "in", "is", "was", "it", "that",
    "movie", "film", "story", "good", "bad", "zebra", "quokka", "data", "model",
]


def write_corpus(folder: Path, n_files: int = 3, docs_per_file: int = 15, seed: int = 0) -> list[Path]:
    """Plain-text files with blank-line-separated documents of 3-60 words."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(n_files):
        docs = [" ".join(rng.choice(TINY_WORDS, size=int(rng.integers(3, 60)))) for _ in range(docs_per_file)]
        p = folder / f"part{f}.txt"
        p.write_text("\n\n".join(docs) + "\n")
        paths.append(p)
    return paths


def prep_cfg(corpus, tokenizer, out, **kw) -> PrepareConfig:
    base = {"corpus": [str(c) for c in corpus], "tokenizer": str(tokenizer), "out": str(out), "seq_len": 16,
                "heldout": 0.2, "doc_split": "blank_line"}
    base.update(kw)
    return PrepareConfig(**base)


def expected_streams(cfg: PrepareConfig, tok) -> tuple[list[list[int]], list[int]]:
    """Every document's ids, computed independently of the store."""
    docs = [d.text for d in iter_documents(cfg.corpus, doc_split=cfg.doc_split)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in docs], [len(docs)]


def unpack(blocks: np.ndarray, cls: int, pad: int) -> list[int]:
    """The split's token stream: each block without its [CLS], padding dropped."""
    assert (blocks[:, 0] == cls).all()
    stream = blocks[:, 1:].reshape(-1).tolist()
    while stream and stream[-1] == pad:
        stream.pop()
    return stream


def test_packing_round_trip_and_heldout_split(tmp_path, tiny_tokenizer_dir):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = prep_cfg(corpus, tiny_tokenizer_dir, tmp_path / "store")
    result = run(cfg)
    tok = load_tokenizer(tiny_tokenizer_dir)
    meta = read_meta(cfg.out)
    ids = meta["special_ids"]
    docs, _ = expected_streams(cfg, tok)
    tokens, offsets, heldout = open_documents(cfg.out)
    assert len(offsets) == len(docs) + 1
    assert [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(docs))] == docs
    assert 0 < heldout.sum() < len(docs)
    for split, member in (("train", ~heldout), ("heldout", heldout)):
        blocks = open_blocks(cfg.out, split)
        assert blocks.shape[1] == 16 and blocks.dtype == np.uint16
        want = [t for i in np.flatnonzero(member) for t in docs[i] + [ids["sep"]]]
        assert unpack(np.asarray(blocks), ids["cls"], ids["pad"]) == want  # order kept, [SEP] at every boundary
        assert not (np.asarray(blocks[:-1]) == ids["pad"]).any()  # only the last block may be padded
        c = meta["counts"][split]
        assert c == {"docs": int(member.sum()), "tokens": sum(len(docs[i]) for i in np.flatnonzero(member)),
                     "blocks": len(blocks)}
    assert result.summary()["counts"] == meta["counts"] and not result.cache_hit
    # self-describing: the store's own tokenizer and card
    assert load_tokenizer(cfg.out).get_vocab() == tok.get_vocab()
    assert (Path(cfg.out) / "encoderkit.json").is_file()
    texts = decode_blocks(cfg.out, open_blocks(cfg.out))
    assert all(t.startswith("[CLS]") for t in texts) and "[PAD]" not in texts[-1]
    assert sum(t.count("[SEP]") for t in texts) == meta["counts"]["train"]["docs"]
    # the split is a pure function of (document index, seed): same again, different with another seed
    again = run(prep_cfg(corpus, tiny_tokenizer_dir, tmp_path / "store2"))
    assert np.array_equal(open_documents(again.out)[2], heldout)
    other = open_documents(run(prep_cfg(corpus, tiny_tokenizer_dir, tmp_path / "store3", seed=1)).out)[2]
    assert not np.array_equal(other, heldout)


def test_heldout_flags_fraction_minimum_and_determinism():
    flags = heldout_flags(20_000, 0.05, seed=3)
    assert abs(flags.mean() - 0.05) < 0.006 and np.array_equal(flags, heldout_flags(20_000, 0.05, seed=3))
    assert heldout_flags(10, 0.01, seed=0).sum() == 1  # at least one document when heldout > 0
    assert heldout_flags(10, 0.0, seed=0).sum() == 0 and heldout_flags(1, 0.3, seed=0).sum() == 0
    # adding documents never moves an earlier one between splits
    assert np.array_equal(heldout_flags(30_000, 0.05, seed=3)[:20_000], flags)


def test_pack_split_layout(tmp_path):
    """[CLS] + 3 stream tokens per block (seq_len 4); the stream is doc, [SEP], doc, [SEP]...; last block padded."""
    cls, sep, pad = 101, 102, 0
    tokens = np.arange(1, 12, dtype=np.uint16)  # docs: [1 2 3 4 5] [6 7] [8 9 10 11]
    offsets = np.array([0, 5, 7, 11])
    ids = {"cls": cls, "sep": sep, "pad": pad}
    assert pack_split(tokens, offsets, np.array([0, 2]), tmp_path / "a.npy", 4, ids, "test") == 4
    assert np.load(tmp_path / "a.npy").tolist() == [
        [cls, 1, 2, 3], [cls, 4, 5, sep], [cls, 8, 9, 10], [cls, 11, sep, pad]]
    assert pack_split(tokens, offsets, np.array([1]), tmp_path / "b.npy", 4, ids, "test") == 1
    assert np.load(tmp_path / "b.npy").tolist() == [[cls, 6, 7, sep]]
    pieces = list(split_stream(tokens, offsets, np.array([0, 1, 2]), sep, chunk=2))
    assert max(map(len, pieces)) == 2  # a long document is read in slices
    assert np.concatenate(pieces).tolist() == [1, 2, 3, 4, 5, sep, 6, 7, sep, 8, 9, 10, 11, sep]


def test_text_batches_bound_documents_and_characters():
    docs = [Document("x" * n, "f", i) for i, n in enumerate([5, 5, 5, 30, 1, 1, 1, 1])]
    batches = list(text_batches(docs, max_docs=3, max_chars=12))
    assert [len(t) for b in batches for t in b] == [5, 5, 5, 30, 1, 1, 1, 1]  # order kept, nothing lost
    assert [len(b) for b in batches] == [2, 1, 1, 3, 1]  # a longer-than-budget document goes alone


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_cache_hit_rebuild_and_refusal(tmp_path, tiny_tokenizer_dir, capsys):
    corpus = write_corpus(tmp_path / "corpus", n_files=2, docs_per_file=5)
    out = tmp_path / "store"
    run(prep_cfg(corpus, tiny_tokenizer_dir, out))
    before = mtimes(out)
    capsys.readouterr()
    hit = run(prep_cfg(corpus, tiny_tokenizer_dir, out, batch_size=2))  # a speed setting: still a hit
    assert hit.cache_hit and "cache hit" in capsys.readouterr().out and mtimes(out) == before
    # a changed setting: refused without --overwrite, rebuilt with it
    with pytest.raises(EncoderkitError, match="--overwrite"):
        run(prep_cfg(corpus, tiny_tokenizer_dir, out, seq_len=32))
    assert mtimes(out) == before
    rebuilt = run(prep_cfg(corpus, tiny_tokenizer_dir, out, seq_len=32, overwrite=True))
    assert not rebuilt.cache_hit and open_blocks(out).shape[1] == 32
    # a touched input file changes the fingerprint
    st = corpus[0].stat()
    os.utime(corpus[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fp = read_meta(out)["fingerprint"]
    assert not run(prep_cfg(corpus, tiny_tokenizer_dir, out, seq_len=32, overwrite=True)).cache_hit
    assert read_meta(out)["fingerprint"] != fp
    # a changed input file's content shows in the counts
    corpus[0].write_text("zebra zebra zebra\n")
    changed = run(prep_cfg(corpus, tiny_tokenizer_dir, out, seq_len=32, overwrite=True))
    assert changed.meta["counts"] != rebuilt.meta["counts"]


def test_existing_folder_is_refused_and_errors_leave_nothing(tmp_path, tiny_tokenizer_dir):
    corpus = write_corpus(tmp_path / "corpus", n_files=1, docs_per_file=3)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(EncoderkitError, match="--overwrite"):
        run(prep_cfg(corpus, tiny_tokenizer_dir, taken))
    assert os.listdir(taken) == ["notes.txt"]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    for bad_corpus, match in (([empty], "no non-empty document"), ([tmp_path / "missing.txt"], "does not exist")):
        with pytest.raises(EncoderkitError, match=match):
            run(prep_cfg(bad_corpus, tiny_tokenizer_dir, tmp_path / "out"))
        assert not any(p.name.startswith((".out", "out")) for p in tmp_path.iterdir())
    with pytest.raises(EncoderkitError, match="does not exist"):
        run(prep_cfg(corpus, tmp_path / "no_tokenizer", tmp_path / "out"))
    with pytest.raises(EncoderkitError, match="seq_len"):
        prep_cfg(corpus, tiny_tokenizer_dir, tmp_path / "out", seq_len=4)


def test_ensure_prepared_keys_the_cache_by_fingerprint(tmp_path, tiny_tokenizer_dir):
    corpus = write_corpus(tmp_path / "corpus", n_files=1, docs_per_file=8)
    cache = tmp_path / "cache"
    first = ensure_prepared(prep_cfg(corpus, tiny_tokenizer_dir, ""), cache)
    before = mtimes(first)
    assert ensure_prepared(prep_cfg(corpus, tiny_tokenizer_dir, "", num_workers=0), cache) == first
    assert mtimes(first) == before
    second = ensure_prepared(prep_cfg(corpus, tiny_tokenizer_dir, "", seq_len=24), cache)
    assert second != first and open_blocks(second).shape[1] == 24 and open_blocks(first).shape[1] == 16
    no_heldout = ensure_prepared(prep_cfg(corpus, tiny_tokenizer_dir, "", heldout=0.0), cache)
    assert open_blocks(no_heldout, "heldout").shape == (0, 16) and read_meta(no_heldout)["counts"]["train"]["docs"] == 8


def test_cli_prepare_and_inspect(tmp_path, tiny_tokenizer_dir, capsys):
    corpus = write_corpus(tmp_path / "corpus", n_files=2, docs_per_file=10)
    out = tmp_path / "store"
    argv = ["data", "prepare", "--corpus", *map(str, corpus), "--tokenizer", str(tiny_tokenizer_dir),
            "--out", str(out), "--seq-len", "32", "--heldout", "0.1", "--doc-split", "blank_line"]
    assert cli.main(argv) == 0
    counts = read_meta(out)["counts"]
    capsys.readouterr()
    assert cli.main(["data", "inspect", "--data", str(out), "--samples", "2"]) == 0
    shown = capsys.readouterr().out
    for split in ("train", "heldout"):
        c = counts[split]
        assert f"{split:8s} docs {c['docs']:>10,d}  tokens {c['tokens']:>14,d}  blocks {c['blocks']:>10,d}" in shown
    assert shown.count("--- train block") == 2 and "[CLS]" in shown
    assert cli.main(argv) == 0 and "cache hit" in capsys.readouterr().out
    assert cli.main(argv[:-1] + ["line"]) == 2 and "--overwrite" in capsys.readouterr().err


def test_large_vocab_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(70_000)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(tmp_path / "big_tok")
    (tmp_path / "c.txt").write_text("w1 w69999 w65600\n\nw70 w65535 w65536\n")
    result = run(prep_cfg([tmp_path / "c.txt"], tmp_path / "big_tok", tmp_path / "store", heldout=0.0))
    assert result.meta["dtype"] == "uint32"
    stream = unpack(np.asarray(open_blocks(result.out)), 2, 0)
    assert stream == [6, 70_004, 65_605, 3, 75, 65_540, 65_541, 3]


@pytest.mark.slow
def test_gutenberg_with_minilm_and_worker_processes(tmp_path, shared_data, minilm_dir):
    """Real text, the real WordPiece vocabulary; two tokenising processes give the same store."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("11-0.txt.gz", "35-0.txt.gz"):
        with gzip.open(shared_data / "mlm_corpus_gutenberg" / "gitenberg" / name, "rt", encoding="utf-8") as f:
            text = f.read()
        (corpus / name.replace(".gz", "")).write_text(text[:120_000])
    cfg = prep_cfg([corpus], minilm_dir, tmp_path / "a", seq_len=128, heldout=0.05, batch_size=64)
    a = run(cfg)
    b = run(prep_cfg([corpus], minilm_dir, tmp_path / "b", seq_len=128, heldout=0.05, batch_size=64, num_workers=2))
    assert a.meta["fingerprint"] == b.meta["fingerprint"]
    for split in ("train", "heldout"):
        assert np.array_equal(open_blocks(a.out, split), open_blocks(b.out, split))
    tok = load_tokenizer(minilm_dir)
    docs, _ = expected_streams(cfg, tok)
    heldout = open_documents(a.out)[2]
    ids = a.meta["special_ids"]
    want = [t for i in np.flatnonzero(~heldout) for t in docs[i] + [ids["sep"]]]
    assert unpack(np.asarray(open_blocks(a.out)), ids["cls"], ids["pad"]) == want
    assert a.meta["counts"]["heldout"]["blocks"] >= 1 and a.meta["dtype"] == "uint16"
