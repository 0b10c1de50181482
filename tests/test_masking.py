"""MLM masking: statistics on real text, whole words, determinism per (seed, epoch, block)."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from encoderkit.data.masking import IGNORE_INDEX, Masker, MaskingSpec, mask_tokens
from encoderkit.errors import EncoderkitError
from encoderkit.models.tokenizer import load_tokenizer, word_start_table

SEQ_LEN = 128
# in the tiny tokenizer's vocabulary, plus words it splits into pieces (zebra -> z ##e ##b ##r ##a)
TINY_WORDS = [
    "the", "a", "of", "to", "and", "in", "is", "was", "it", "that",
    "movie", "film", "story", "good", "bad", "zebra", "quokka", "xylophone",
]


def gutenberg_text(shared_data, name: str = "gitenberg/1342-0.txt.gz", chars: int = 150_000) -> str:
    """A slice of a Gutenberg book's body (after the licence header)."""
    with gzip.open(shared_data / "mlm_corpus_gutenberg" / name, "rt", encoding="utf-8") as f:
        text = f.read()
    start = text.find("*** START OF")
    return text[text.find("\n", start) + 1:][:chars]


def make_blocks(tok, text: str, n_padded: int = 40) -> np.ndarray:
    """(N, SEQ_LEN) blocks [CLS] ... [SEP]; the last ``n_padded`` rows are cut short and padded."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    body = SEQ_LEN - 2
    n = len(ids) // body
    arr = np.asarray(ids[:n * body]).reshape(n, body)
    blocks = np.concatenate([np.full((n, 1), tok.cls_token_id), arr, np.full((n, 1), tok.sep_token_id)], axis=1)
    rng = np.random.default_rng(0)
    for row in range(n - n_padded, n):
        cut = int(rng.integers(5, SEQ_LEN - 1))
        blocks[row, cut] = tok.sep_token_id
        blocks[row, cut + 1:] = tok.pad_token_id
    return blocks


@pytest.fixture(scope="module")
def minilm_tok(minilm_dir):
    return load_tokenizer(minilm_dir)


@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory, shared_data):
    """A byte-level BPE tokenizer (RoBERTa-style specials) trained on the fly on a Gutenberg slice."""
    from encoderkit.train.tokenizer import TokenizerConfig, run

    folder = tmp_path_factory.mktemp("bpe")
    (folder / "corpus.txt").write_text(gutenberg_text(shared_data, "gitenberg/84-0.txt.gz", 200_000))
    run(TokenizerConfig(corpus=[str(folder / "corpus.txt")], out=str(folder / "tok"), kind="bpe", vocab_size=600))
    return load_tokenizer(folder / "tok")


def picked_stats(tok, blocks: np.ndarray, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    ids = torch.as_tensor(blocks).long()
    specials = torch.tensor(sorted(set(tok.all_special_ids)))
    eligible = ~torch.isin(ids, specials)
    picked = batch["labels"] != IGNORE_INDEX
    out = batch["input_ids"][picked]
    orig = ids[picked]
    return {
        "rate": picked.sum().item() / eligible.sum().item(),
        "mask": (out == tok.mask_token_id).float().mean().item(),
        "keep": (out == orig).float().mean().item(),
        "random": ((out != tok.mask_token_id) & (out != orig)).float().mean().item(),
        "special_picked": (picked & ~eligible).sum().item(),
        "labels_ok": bool((batch["labels"][picked] == orig).all()),
        "random_special": torch.isin(out[(out != tok.mask_token_id) & (out != orig)], specials).sum().item(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.15, 0.4])
@pytest.mark.parametrize("whole_word", [False, True])
def test_masking_statistics_on_gutenberg(shared_data, minilm_tok, rate, whole_word):
    tok = minilm_tok
    blocks = make_blocks(tok, gutenberg_text(shared_data))
    masker = Masker.from_tokenizer(tok, MaskingSpec(rate=rate, whole_word=whole_word), seed=3)
    batch = masker(blocks, np.arange(len(blocks)), epoch=0)
    s = picked_stats(tok, blocks, batch)
    assert abs(s["rate"] - rate) < 0.01, s
    assert abs(s["mask"] - 0.8) < 0.02 and abs(s["random"] - 0.1) < 0.02 and abs(s["keep"] - 0.1) < 0.02, s
    assert s["special_picked"] == 0 and s["random_special"] == 0 and s["labels_ok"], s
    pad = torch.as_tensor(blocks) == tok.pad_token_id
    assert pad.any() and (batch["attention_mask"][pad] == 0).all() and (batch["attention_mask"][~pad] == 1).all()
    assert (batch["input_ids"][pad] == tok.pad_token_id).all()


def words_of_row(ids: list[int], starts: np.ndarray, special: set[int]) -> list[list[int]]:
    """Positions grouped into words: a word-start token (or the first token after a special one)
    and the continuation tokens after it."""
    words: list[list[int]] = []
    prev_special = True
    for pos, t in enumerate(ids):
        if t in special:
            prev_special = True
            continue
        if starts[t] or prev_special:
            words.append([])
        words[-1].append(pos)
        prev_special = False
    return words


@pytest.mark.slow
@pytest.mark.parametrize("which", ["wordpiece", "bpe"])
def test_whole_word_masking_never_splits_a_word(shared_data, request, which):
    tok = request.getfixturevalue("minilm_tok" if which == "wordpiece" else "bpe_tok")
    blocks = make_blocks(tok, gutenberg_text(shared_data, "gitenberg/11-0.txt.gz", 60_000), n_padded=10)
    starts = word_start_table(tok)
    masker = Masker.from_tokenizer(tok, MaskingSpec(rate=0.3, whole_word=True), seed=0)
    picked = (masker(blocks, np.arange(len(blocks)), epoch=1)["labels"] != IGNORE_INDEX).numpy()
    special = set(tok.all_special_ids)
    multi = 0
    for row in range(len(blocks)):
        for word in words_of_row(blocks[row].tolist(), starts, special):
            flags = picked[row, word]
            assert flags.all() or not flags.any(), (row, word, tok.convert_ids_to_tokens(blocks[row, word].tolist()))
            multi += len(word) > 1 and flags.all()
    assert multi > 20  # multi-token words were actually masked as wholes
    # a plain (token-level) masker does split some of those words
    plain = (Masker.from_tokenizer(tok, MaskingSpec(rate=0.3), seed=0)(blocks, np.arange(len(blocks)), 1)["labels"]
             != IGNORE_INDEX).numpy()
    split = sum(0 < plain[r, w].sum() < len(w) for r in range(len(blocks))
                for w in words_of_row(blocks[r].tolist(), starts, special))
    assert split > 0


@pytest.fixture(scope="module")
def tiny_masker_and_blocks(tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    rng = np.random.default_rng(1)
    text = " ".join(rng.choice(TINY_WORDS, size=4000))
    return tok, make_blocks(tok, text, n_padded=5)


def test_mask_depends_only_on_seed_epoch_and_block(tiny_masker_and_blocks):
    tok, blocks = tiny_masker_and_blocks
    n = len(blocks)
    masker = Masker.from_tokenizer(tok, MaskingSpec(whole_word=True), seed=7)
    full = masker(blocks, np.arange(n), epoch=2)
    again = Masker.from_tokenizer(tok, MaskingSpec(whole_word=True), seed=7)(blocks, np.arange(n), epoch=2)
    assert all(torch.equal(full[k], again[k]) for k in full)
    # any batch composition / order / size (as when resuming mid-epoch or sharding across ranks)
    order = np.random.default_rng(0).permutation(n)
    for size in (1, 3, 8):
        for chunk in np.array_split(order, max(1, n // size))[:6]:
            part = masker(blocks[chunk], chunk, epoch=2)
            assert torch.equal(part["input_ids"], full["input_ids"][chunk])
            assert torch.equal(part["labels"], full["labels"][chunk])
    new_epoch = masker(blocks, np.arange(n), epoch=3)["labels"] != IGNORE_INDEX
    other_seed = Masker.from_tokenizer(tok, MaskingSpec(whole_word=True), seed=8)(blocks, np.arange(n), 2)
    picked = full["labels"] != IGNORE_INDEX
    assert (new_epoch != picked).float().mean() > 0.1
    assert ((other_seed["labels"] != IGNORE_INDEX) != picked).float().mean() > 0.1
    # the same block under another index is masked differently (index is part of the key)
    shifted = masker(blocks, np.arange(n) + 1, epoch=2)["labels"] != IGNORE_INDEX
    assert (shifted != picked).float().mean() > 0.1


def test_mask_tokens_with_generator(tiny_masker_and_blocks):
    tok, blocks = tiny_masker_and_blocks
    ids = torch.as_tensor(blocks).long()
    special = torch.isin(ids, torch.tensor(tok.all_special_ids))
    random_ids = torch.tensor([i for i in range(len(tok)) if i not in set(tok.all_special_ids)])
    kw = {"spec": MaskingSpec(rate=0.4), "special_mask": special, "mask_id": tok.mask_token_id,
          "random_ids": random_ids}
    a = mask_tokens(ids, generator=torch.Generator().manual_seed(5), **kw)
    b = mask_tokens(ids, generator=torch.Generator().manual_seed(5), **kw)
    c = mask_tokens(ids, generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])
    picked = a[1] != IGNORE_INDEX
    assert not (picked & special).any()
    assert abs(picked.sum().item() / (~special).sum().item() - 0.4) < 0.02
    assert torch.equal(a[1][picked], ids[picked]) and torch.equal(a[0][~picked], ids[~picked])


def test_short_padded_rows_keep_the_rate_on_average(tiny_masker_and_blocks):
    tok, _ = tiny_masker_and_blocks
    # rows of 3 eligible tokens: a rounded budget would give 0 (rate 0.15) every time; stochastic rounding gives 15%
    row = [tok.cls_token_id, 10, 11, 12, tok.sep_token_id] + [tok.pad_token_id] * 11
    blocks = np.tile(row, (4000, 1))
    batch = Masker.from_tokenizer(tok, MaskingSpec(rate=0.15), seed=1)(blocks, np.arange(4000), 0)
    picked = batch["labels"] != IGNORE_INDEX
    assert abs(picked.sum().item() / (3 * 4000) - 0.15) < 0.01
    assert not picked[:, [0, 4]].any() and not picked[:, 5:].any()
    assert batch["attention_mask"][:, :5].all() and not batch["attention_mask"][:, 5:].any()


def test_spec_validation():
    MaskingSpec(rate=0.4)
    with pytest.raises(EncoderkitError, match="word_start"):
        mask_tokens(torch.zeros(1, 4, dtype=torch.long), spec=MaskingSpec(whole_word=True),
                    special_mask=torch.zeros(1, 4, dtype=torch.bool), mask_id=1, random_ids=torch.tensor([2]))
    for bad in ({"rate": 0.0}, {"rate": 1.0}, {"mask_frac": 0.9, "random_frac": 0.2}, {"random_frac": -0.1}):
        with pytest.raises(EncoderkitError):
            MaskingSpec(**bad)


@pytest.mark.parametrize("which", ["wordpiece", "bpe"])
def test_content_word_masking_never_picks_punctuation_digits_or_function_words(shared_data, request, which):
    """``words_only`` + ``skip_words`` (pretrain --mask-words-only --mask-skip-words english): every picked
    token is a piece of a word of letters and no picked word-start token spells a function word, while
    plain masking of the same blocks picks both; the rate applies to the tokens left eligible."""
    from encoderkit.data.function_words import ENGLISH
    from encoderkit.models.tokenizer import token_surfaces

    tok = request.getfixturevalue("minilm_tok" if which == "wordpiece" else "bpe_tok")
    blocks = make_blocks(tok, gutenberg_text(shared_data, chars=60_000))
    surfaces, starts = token_surfaces(tok), word_start_table(tok)
    spec = MaskingSpec(rate=0.15, words_only=True, skip_words=ENGLISH)
    masker = Masker.from_tokenizer(tok, spec, seed=0)
    labels = masker(blocks, np.arange(len(blocks)), 0)["labels"]
    picked = labels[labels != IGNORE_INDEX].tolist()
    assert all(surfaces[i] and all(ch.isalpha() or ch == "\ufffd" for ch in surfaces[i]) for i in picked)
    assert not [surfaces[i] for i in picked if starts[i] and surfaces[i].lower() in ENGLISH]
    eligible = masker.eligible(torch.as_tensor(blocks)).sum().item()
    assert abs(len(picked) / eligible - 0.15) < 0.01
    plain = Masker.from_tokenizer(tok, MaskingSpec(rate=0.15), seed=0)(blocks, np.arange(len(blocks)), 0)["labels"]
    plain_picked = [surfaces[i] for i in plain[plain != IGNORE_INDEX].tolist()]
    assert "the" in [s.lower() for s in plain_picked] and any(s in (",", ".") for s in plain_picked)


def test_token_surfaces_strip_word_markers(minilm_tok, bpe_tok) -> None:
    from encoderkit.models.tokenizer import token_surfaces

    wp = token_surfaces(minilm_tok)
    assert [wp[minilm_tok.convert_tokens_to_ids(t)] for t in ("the", "##s", "[MASK]", ",")] == ["the", "s", "", ","]
    bpe = token_surfaces(bpe_tok)
    the = bpe_tok(" the", add_special_tokens=False)["input_ids"]
    assert len(the) == 1 and bpe[the[0]] == "the" and bpe[bpe_tok.mask_token_id] == ""


def test_skip_words_file_is_read_and_a_missing_one_is_named(tmp_path) -> None:
    from encoderkit.data.function_words import ENGLISH, read_skip_words

    assert read_skip_words("english") == ENGLISH and read_skip_words("") == frozenset()
    (tmp_path / "de.txt").write_text("# German\nDer\ndie\n\ndas\n", encoding="utf-8")
    assert read_skip_words(str(tmp_path / "de.txt")) == {"der", "die", "das"}
    with pytest.raises(EncoderkitError, match="nope.txt': no such file"):
        read_skip_words(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(EncoderkitError, match="lists no word"):
        read_skip_words(str(tmp_path / "empty.txt"))
