"""Tokenizer training (WordPiece, byte-level BPE) on a Gutenberg slice, loading, word starts, and the CLI."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from encoderkit.cli import main
from encoderkit.errors import EncoderkitError
from encoderkit.models.tokenizer import load_tokenizer, word_start_table
from encoderkit.train.tokenizer import TokenizerConfig, run, split_long_text

SAMPLE = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do."


@pytest.fixture(scope="module")
def alice(shared_data, tmp_path_factory) -> Path:
    """The first ~80 KB of Alice in Wonderland (Gutenberg, UTF-8 with a BOM and CRLF line ends)."""
    raw = gzip.decompress((shared_data / "mlm_corpus_gutenberg" / "gitenberg" / "11-0.txt.gz").read_bytes())
    path = tmp_path_factory.mktemp("corpus") / "alice.txt"
    path.write_bytes(raw[:80_000].rsplit(b"\n", 1)[0] + b"\n")
    return path


@pytest.fixture(scope="module")
def wordpiece_dir(alice, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wp") / "tok"
    run(TokenizerConfig(corpus=[str(alice)], out=str(out), kind="wordpiece", vocab_size=900))
    return out


@pytest.fixture(scope="module")
def bpe_dir(alice, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "tok"
    run(TokenizerConfig(corpus=[str(alice)], out=str(out), kind="bpe", vocab_size=700))
    return out


def _corpus_lines(path: Path, n: int) -> list[str]:
    text = path.read_text(encoding="utf-8-sig")
    return [line.strip() for line in text.splitlines() if len(line.split()) > 6][:n]


# -- WordPiece -------------------------------------------------------------------------------------
def test_wordpiece_loads_with_autotokenizer_and_has_bert_specials(wordpiece_dir):
    tok = AutoTokenizer.from_pretrained(wordpiece_dir)
    assert len(tok) == 900
    assert [tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token] == \
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tok.convert_tokens_to_ids(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) == [0, 1, 2, 3, 4]
    enc = tok("the queen", "said alice")
    ids = enc["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and ids.count(tok.sep_token_id) == 2
    first_sep = ids.index(tok.sep_token_id)
    assert enc["token_type_ids"] == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    assert tok.model_max_length == 512
    card = json.loads((wordpiece_dir / "encoderkit.json").read_text())
    assert card["stage"] == "tokenizer" and card["metrics"]["vocab_size"] == 900 and card["kind"] == "wordpiece"


def test_wordpiece_round_trips_normalised_text(wordpiece_dir, alice):
    tok = AutoTokenizer.from_pretrained(wordpiece_dir)
    normalizer = tok.backend_tokenizer.normalizer
    for line in _corpus_lines(alice, 20) + [SAMPLE, "Caf\u00e9 NA\u00cfVE R\u00e9sum\u00e9"]:
        ids = tok(line, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, line
        decoded = tok.decode(ids)
        expected = normalizer.normalize_str(line)  # lowercased, accents stripped
        assert re.findall(r"\w+", decoded) == re.findall(r"\w+", expected)
        assert decoded.replace(" ", "") == expected.replace(" ", "")
    assert tok("Alice")["input_ids"] == tok("alice")["input_ids"]  # uncased by default


def test_wordpiece_word_start_table_matches_continuation_prefix(wordpiece_dir):
    tok = load_tokenizer(wordpiece_dir)
    table = word_start_table(tok)
    assert table.shape == (len(tok),) and table.dtype == np.bool_
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    assert all(table[i] == (not t.startswith("##")) for i, t in enumerate(tokens))
    ids = tok("extraordinarily curiouser", add_special_tokens=False)["input_ids"]
    assert int(table[ids].sum()) == 2 and table[ids[0]]


def test_classic_vocab_files_give_the_same_ids(wordpiece_dir, bpe_dir):
    from transformers import BertTokenizer, RobertaTokenizer

    assert (wordpiece_dir / "vocab.txt").is_file() and (bpe_dir / "merges.txt").is_file()
    for folder, cls in ((wordpiece_dir, BertTokenizer), (bpe_dir, RobertaTokenizer)):
        auto, classic = AutoTokenizer.from_pretrained(folder), cls.from_pretrained(folder)
        assert auto(SAMPLE, "a second text") == classic(SAMPLE, "a second text")


# -- byte-level BPE ----------------------------------------------------------------------------------
def test_bpe_round_trips_exactly_and_has_roberta_format(bpe_dir, alice):
    tok = AutoTokenizer.from_pretrained(bpe_dir)
    assert len(tok) == 700
    assert tok.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]) == [0, 1, 2, 3, 4]
    assert (tok.cls_token, tok.bos_token, tok.sep_token, tok.eos_token) == ("<s>", "<s>", "</s>", "</s>")
    for text in _corpus_lines(alice, 20) + [SAMPLE, "Unseen: \u65e5\u672c\u8a9e \U0001f600\n\ttabs  and  spaces"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text  # byte-level: exact, cased, nothing unknown
    enc = tok("a b", "c")
    toks = tok.convert_ids_to_tokens(enc["input_ids"])
    assert toks[0] == "<s>" and toks[-1] == "</s>" and toks.count("</s>") == 3
    assert "token_type_ids" not in enc
    assert tok("Alice")["input_ids"] != tok("alice")["input_ids"]  # cased by default


def test_bpe_word_starts_follow_spaces(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    table = word_start_table(tok)
    words = ["the", "rabbit", "hurried", "down", "the", "extraordinarily", "long", "hall"]
    ids = tok(" ".join(words), add_special_tokens=False)["input_ids"]
    assert len(ids) > len(words)  # some words take several pieces
    assert not table[ids[0]]  # the first word has no leading space; callers start it after <s>
    assert int(table[ids[1:]].sum()) == len(words) - 1
    assert table[tok.mask_token_id] and table[tok.cls_token_id]
    punct = tok(",", add_special_tokens=False)["input_ids"]
    assert table[punct].all()


def test_training_is_reproducible(alice, tmp_path):
    """BPE training is deterministic; WordPiece ids are renumbered canonically (tokenizers#1794)."""
    for kind, size in (("bpe", 600), ("wordpiece", 600)):
        outs = [tmp_path / f"{kind}{i}" for i in range(2)]
        for out in outs:
            run(TokenizerConfig(corpus=[str(alice)], out=str(out), kind=kind, vocab_size=size, min_frequency=3))
        vocabs = [json.loads((o / "tokenizer.json").read_text())["model"]["vocab"] for o in outs]
        if kind == "bpe":
            assert (outs[0] / "tokenizer.json").read_bytes() == (outs[1] / "tokenizer.json").read_bytes()
        else:  # the same pieces get the same ids (a rare tie may swap a piece on a tiny corpus)
            shared = set(vocabs[0]) & set(vocabs[1])
            assert len(shared) >= size - 10
            order = [sorted(shared, key=v.__getitem__) for v in vocabs]
            assert order[0] == order[1]
            assert list(vocabs[0])[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_split_long_text_cuts_after_newlines():
    text = "".join(f"line {i} " + "word " * (i % 7) + "\n" for i in range(500))
    pieces = list(split_long_text(text, 200))
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(len(p) <= 200 and p.endswith("\n") for p in pieces)
    assert list(split_long_text("x" * 450, 200)) == ["x" * 200, "x" * 200, "x" * 50]


# -- options and errors --------------------------------------------------------------------------------
def test_custom_special_tokens_and_extra_token(alice, tmp_path):
    out = tmp_path / "tok"
    run(TokenizerConfig(corpus=[str(alice)], out=str(out), vocab_size=600, lowercase=False,
                        special_tokens=["unk=<oov>", "[DOC]"], max_documents=1))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.unk_token == "<oov>" and tok.convert_tokens_to_ids("<oov>") == 0
    assert "[DOC]" in tok.all_special_tokens
    assert tok("x [DOC] y", add_special_tokens=False)["input_ids"][1] == tok.convert_tokens_to_ids("[DOC]")
    assert tok("Alice")["input_ids"] != tok("alice")["input_ids"]
    with pytest.raises(EncoderkitError, match="unknown role 'bos'"):
        TokenizerConfig(corpus=["x"], out="y", special_tokens=["bos=<b>"])
    with pytest.raises(EncoderkitError, match="repeat"):
        TokenizerConfig(corpus=["x"], out="y", special_tokens=["pad=[X]", "unk=[X]"])


def test_vocab_too_small_fails_before_or_after_training_leaving_nothing(alice, tmp_path):
    with pytest.raises(EncoderkitError, match=r"vocab_size=100 is too small.*256 byte"):
        TokenizerConfig(corpus=[str(alice)], out=str(tmp_path / "x"), kind="bpe", vocab_size=100)
    out = tmp_path / "small"
    with pytest.raises(EncoderkitError, match=r"vocab_size=40 is too small for this corpus.*raise --vocab-size"):
        run(TokenizerConfig(corpus=[str(alice)], out=str(out), kind="wordpiece", vocab_size=40))
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no half-written or temporary folder


def test_existing_output_refused_unless_overwrite(alice, tmp_path):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    cfg = {"corpus": [str(alice)], "out": str(out), "vocab_size": 500, "max_documents": 1}
    with pytest.raises(EncoderkitError, match="already exists.*--overwrite"):
        run(TokenizerConfig(**cfg))
    assert (out / "keep.txt").read_text() == "old"
    result = run(TokenizerConfig(**cfg, overwrite=True))
    assert not (out / "keep.txt").exists() and (out / "tokenizer.json").is_file()
    assert result.documents == 1 and result.vocab_size == 500


def test_bad_encoding_is_skipped_and_counted(alice, tmp_path):
    bad = tmp_path / "latin.txt"
    bad.write_bytes("na\u00efve caf\u00e9\n".encode("latin-1"))
    with pytest.raises(EncoderkitError, match=r"latin\.txt:1: not UTF-8 \(byte offset 2\)"):
        run(TokenizerConfig(corpus=[str(bad), str(alice)], out=str(tmp_path / "a"), vocab_size=500))
    result = run(TokenizerConfig(corpus=[str(bad), str(alice)], out=str(tmp_path / "b"), vocab_size=500,
                                 skip_bad_encoding=True))
    assert result.skipped_files == 1 and result.documents == 1


def test_load_tokenizer_errors_and_minilm(tmp_path, minilm_dir):
    with pytest.raises(EncoderkitError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(EncoderkitError, match="has no tokenizer.*tokenizer train"):
        load_tokenizer(tmp_path / "empty")
    tok = load_tokenizer(minilm_dir)
    table = word_start_table(tok)
    pieces = tok.tokenize("unbelievably tokenization")
    ids = tok.convert_tokens_to_ids(pieces)
    assert [bool(table[i]) for i in ids] == [not p.startswith("##") for p in pieces]
    assert len(pieces) > 2 and int(table[ids].sum()) == 2


# -- the CLI -------------------------------------------------------------------------------------------
def test_cli_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tokenizer", "train", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for f in fields(TokenizerConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--config" in text


def test_cli_with_yaml_config_and_a_bad_one(alice, tmp_path, capsys):
    good = tmp_path / "tok.yaml"
    good.write_text(f"corpus: [{alice}]\nkind: bpe\nvocab_size: 600\nout: {tmp_path / 'out'}\n")
    assert main(["tokenizer", "train", "--config", str(good), "--vocab-size", "650"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["vocab_size"] == 650 and summary["kind"] == "bpe"  # the flag wins over the file
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) == 650
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"corpus: [{alice}]\nout: {tmp_path / 'out2'}\nvocab_sise: 600\n")
    assert main(["tokenizer", "train", "--config", str(bad)]) == 2
    assert "unknown key(s) vocab_sise" in capsys.readouterr().err
    bad.write_text(f"corpus: [{alice}]\nout: {tmp_path / 'out2'}\nkind: unigram\n")
    assert main(["tokenizer", "train", "--config", str(bad)]) == 2
    assert "kind='unigram' is not one of wordpiece, bpe" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()
