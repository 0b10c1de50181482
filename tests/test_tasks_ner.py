"""NER data and features: tag schemes, CoNLL/JSONL readers, sub-token labels, windows, decoding."""

from __future__ import annotations

import numpy as np
import pytest

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.ner.data import read_ner
from encoderkit.tasks.ner.features import IGNORE, decode_entities, featurize_text, featurize_words
from encoderkit.tasks.tags import guess_scheme, iob2_to_spans, to_bioes, to_iob1, to_iob2

IOB2 = ["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC", "O", "B-MISC"]


def test_scheme_round_trips():
    assert to_iob2(to_bioes(IOB2), "bioes") == IOB2
    assert to_iob2(to_iob1(IOB2), "iob1") == IOB2
    assert to_bioes(IOB2) == ["B-PER", "E-PER", "O", "S-LOC", "B-LOC", "E-LOC", "O", "S-MISC"]
    assert to_iob1(IOB2) == ["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-LOC", "O", "I-MISC"]
    assert guess_scheme([to_iob1(IOB2)]) == "iob1" and guess_scheme([to_bioes(IOB2)]) == "bioes"
    assert iob2_to_spans(IOB2) == [("PER", 0, 2), ("LOC", 3, 4), ("LOC", 4, 6), ("MISC", 7, 8)]


def test_invalid_iob1_b_after_o_is_tolerated():
    # CoNLL-2003 has `B-MISC` right after `O` (invalid IOB1): it starts an entity
    assert to_iob2(["O", "B-MISC", "I-MISC", "O", "I-PER"], "iob1") == ["O", "B-MISC", "I-MISC", "O", "B-PER"]


def test_conll_reader_docstart_scheme_and_column_change(tmp_path):
    f = tmp_path / "a.conll"
    f.write_text("-DOCSTART- -X- O O\n\nEU NNP I-NP I-ORG\nrejects VBZ I-VP O\nGerman JJ I-NP I-MISC\n\n"
                 "Peter NNP I-NP I-PER\nBlackburn NNP I-NP I-PER\n")
    sents = read_ner(f)
    assert [s.words for s in sents] == [["EU", "rejects", "German"], ["Peter", "Blackburn"]]
    assert [s.tags for s in sents] == [["B-ORG", "O", "B-MISC"], ["B-PER", "I-PER"]]
    bad = tmp_path / "bad.conll"
    bad.write_text("EU NNP I-NP I-ORG\nrejects O\n")
    with pytest.raises(EncoderkitError, match=r"bad.conll:2: 2 columns where earlier lines have 4"):
        read_ner(bad)


def test_jsonl_spans_reader(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "Angela Merkel met Macron in Paris.", "entities": [{"start": 0, "end": 13, "label": "PER"},'
                 ' {"start": 28, "end": 33, "label": "LOC"}]}\n')
    (s,) = read_ner(f)
    assert s.tags == ["B-PER", "I-PER", "O", "O", "O", "B-LOC", "O"]
    f.write_text('{"text": "Angela Merkel", "entities": [{"start": 1, "end": 13, "label": "PER"}]}\n')
    with pytest.raises(EncoderkitError, match="word edges"):
        read_ner(f)


def test_labels_on_first_sub_token(minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    words = ["Schwarzenegger", "visited", "Wolfsburg"]
    f = featurize_words(tok, words, label_ids=[1, 0, 2], max_length=32, stride=4)
    toks = tok.convert_ids_to_tokens(f.input_ids[0])
    labelled = [(t, int(lab)) for t, lab in zip(toks, f.labels[0], strict=True) if lab != IGNORE]
    # one label per word, each on the word's first piece; the other pieces are ignored
    assert [lab for _, lab in labelled] == [1, 0, 2]
    assert [t for t, _ in labelled] == [tok.tokenize(w)[0] for w in words]
    assert (f.labels[0] != IGNORE).sum() == 3 < len(toks) - 2


def test_long_text_windows_and_entity_char_spans(minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    text = "Yesterday Angela Merkel flew to Paris. " * 12
    f = featurize_text(tok, text, max_length=24, stride=6)
    assert f.input_ids.shape[0] > 3  # split into overlapping windows, none truncated away
    assert set(f.word_index[f.word_index >= 0].tolist()) == set(range(len(f.words)))
    id2label = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC"}
    logits = np.zeros(f.input_ids.shape + (4,), dtype=np.float32)
    gold = {"Angela": 1, "Merkel": 2, "Paris": 3}
    for w, t in zip(*np.nonzero(f.word_index >= 0), strict=True):
        logits[w, t, gold.get(f.words[f.word_index[w, t]], 0)] = 4.0
    ents = decode_entities(f, logits, id2label)
    assert len(ents) == 24
    for e in ents:
        assert text[e.start : e.end] == e.text
        assert e.text == ("Angela Merkel" if e.label == "PER" else "Paris")


def test_evaluate_and_the_predictor_share_one_stride_rule():
    """A NER folder's windows overlap by the same stride in evaluate (NerOptions.for_folder) and in
    Predictor.extract (NerTask.extract): the card's, else 32 cut to a quarter of the window; an explicit
    --stride is taken as given when the card has none, and training's default stays 32."""
    from types import SimpleNamespace

    from encoderkit.tasks.ner.options import NerOptions, folder_stride

    def options(card: dict, max_length: int, stride: int = 0) -> NerOptions:
        cfg = SimpleNamespace(max_length=max_length, stride=stride, tag_scheme="auto")
        return NerOptions.for_folder(cfg, SimpleNamespace(card=card))

    for card, length in (({}, 64), ({}, 256), ({"stride": 7}, 64), ({"stride": 48, "max_length": 200}, 0)):
        opts = options(card, length)
        assert opts.stride == folder_stride(card, opts.max_length)
    assert folder_stride({}, 64) == 16 and folder_stride({}, 256) == 32 and folder_stride({"stride": 7}, 64) == 7
    assert options({}, 64, stride=40).stride == 40  # explicit, no card: as given
    assert options({"stride": 7}, 64, stride=40).stride == 7  # the model's own wins
    train_cfg = SimpleNamespace(max_length=64, stride=0, tag_scheme="auto")
    assert NerOptions.for_training(train_cfg, SimpleNamespace(positions=512)).stride == 32
