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


def test_ner_fine_tunes_at_its_own_default_rate_and_a_given_lr_wins(tmp_path, tiny_bert_dir):
    """Issue 55: a token head from random weights at the shared 3e-5 (with warmup) learned too little on a small
    set (CoNLL, 1,500 sentences, 3 epochs: test F1 0.30 against the HF Trainer's 5e-5); ner's own default rate is
    what finetune trains at when --lr is not given, the card records it, and an explicit --lr still wins."""
    import torch

    from encoderkit.models.card import read_card
    from encoderkit.tasks import get_task
    from encoderkit.tasks.ner.task import TASK
    from encoderkit.train.finetune import DEFAULT_LR, FinetuneConfig, run, task_lr

    assert task_lr("ner") == TASK.finetune_lr > task_lr("classify") == DEFAULT_LR == task_lr("qa")
    # a narrow model (MiniLM's 384) takes the task's higher small-model rate; a wide one the task's own rate
    assert task_lr("ner", 384) == task_lr("classify", 384) == TASK.small_model_lr > task_lr("ner", 768)
    assert task_lr("classify", 768) == task_lr("qa", 768) == task_lr("embed", 384) == DEFAULT_LR
    assert task_lr("qa", 384) == get_task("qa").small_model_lr == task_lr("rerank", 384) > DEFAULT_LR
    train = tmp_path / "train.conll"
    train.write_text("".join(f"{w} X I-PER\nsaw X O\nit X O\n\n" for w in ("he", "she", "man", "he")))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for given, want in ((0.0, TASK.small_model_lr), (2e-5, 2e-5)):  # the tiny model is narrow
            res = run(FinetuneConfig(task="ner", model=str(tiny_bert_dir), train=str(train), out=str(tmp_path / "o"),
                                     overwrite=True, max_steps=1, batch_size=4, max_length=16, stride=4, lr=given,
                                     bf16=False, no_guardrails=True))
            assert read_card(res.out)["config"]["lr"] == want
    finally:
        torch.set_num_threads(before)
