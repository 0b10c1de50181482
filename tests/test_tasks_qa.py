"""QA data and features: SQuAD reading and article split, offsets on real items, n-best decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from encoderkit.errors import EncoderkitError
from encoderkit.tasks.qa.data import read_squad
from encoderkit.tasks.qa.features import decode_answers, featurize_qa


@pytest.fixture(scope="module")
def squad_zip(shared_data):
    return shared_data / "squad_v1.1" / "dev-v1.1.json.zip"


def test_article_split_is_disjoint_and_complete(squad_zip):
    train, _ = read_squad(squad_zip, "train")
    held, _ = read_squad(squad_zip, "heldout")
    assert len(train) + len(held) == 10570
    assert not {e.title for e in train} & {e.title for e in held}
    assert len({e.title for e in held}) == 10  # 48 articles: 38 / 10


def test_offsets_map_back_to_answers_on_real_items(squad_zip, minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    examples, _ = read_squad(squad_zip, "heldout")
    examples = examples[::50][:40]
    f = featurize_qa(tok, [e.question for e in examples], [e.context for e in examples], max_length=128, doc_stride=32,
                     answer_starts=[e.answers[0][1] for e in examples],
                     answer_texts=[e.answers[0][0] for e in examples])
    assert f.input_ids.shape[0] > len(examples)  # long contexts give several windows
    found = set()
    for w in np.nonzero(f.start_positions)[0]:
        e = examples[f.example_index[w]]
        a, b = f.offsets[w, f.start_positions[w], 0], f.offsets[w, f.end_positions[w], 1]
        assert e.context[a:b] == e.answers[0][0]
        found.add(int(f.example_index[w]))
    assert found == set(range(len(examples)))  # every answer lies fully inside some window
    # decoding one-hot logits at the gold positions gives the gold text and char offsets
    start = np.where(np.arange(128)[None] == f.start_positions[:, None], 5.0, 0.0)
    end = np.where(np.arange(128)[None] == f.end_positions[:, None], 5.0, 0.0)
    start[f.start_positions == 0] = 0.0
    end[f.start_positions == 0] = 0.0
    answers = decode_answers(f, start, end, max_answer_length=30)
    for e, best in zip(examples, answers, strict=True):
        assert best[0].text == e.answers[0][0] and best[0].start == e.answers[0][1]


def test_span_search_respects_max_length_and_order(minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    ctx = "Ada Lovelace wrote the first program in 1843 for the engine."
    f = featurize_qa(tok, ["Who?"], [ctx], max_length=48, doc_stride=8)
    toks = f.offsets[0, :, 0] >= 0
    idx = np.nonzero(toks)[0]
    start = np.full(48, -5.0)
    end = np.full(48, -5.0)
    start[idx[0]] = 3.0   # "ada"
    end[idx[-1]] = 4.0    # "." far away: longer than max_answer_length
    end[idx[2]] = 2.0     # "##lace" (ada love ##lace)
    start[idx[3]] = 9.0   # "wrote": a start AFTER the good end, and too far from "."
    best = decode_answers(f, start[None], end[None], max_answer_length=3, top_k=3)[0]
    assert best[0].text == "Ada Lovelace" and best[0].score == pytest.approx(5.0)
    assert all(len(tok.tokenize(a.text)) <= 3 for a in best)


def test_bad_answer_offsets_are_skipped_with_a_count(tmp_path, capsys):
    data = {"version": "1.1", "data": [{"title": "T", "paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "1", "question": "Where?", "answers": [{"text": "France", "answer_start": 12}]},
        {"id": "2", "question": "What?", "answers": [{"text": "Paris", "answer_start": 3}]},
    ]}]}]}
    p = tmp_path / "s.json"
    p.write_text(json.dumps(data))
    examples, skipped = read_squad(p)
    assert skipped == 1 and [e.id for e in examples] == ["1"]
    assert "skipped 1 answer" in capsys.readouterr().err
    p.write_text('{"data": 3}')
    with pytest.raises(EncoderkitError, match="SQuAD format"):
        read_squad(p)


def _one_article(path):
    ctx = "ada wrote the first program"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": "1", "question": "who ?", "answers": [{"text": "ada", "answer_start": 0}]}]}]}]}))
    return path


def test_a_new_span_head_learns_faster_than_the_encoder(tmp_path, tiny_tokenizer_dir, tiny_bert_dir):
    """A randomly initialised span head learns at HEAD_LR_SCALE x --lr (a few hundred steps of a small SQuAD set
    barely move a head at the encoder's rate); a trained QA folder's head keeps --lr."""
    from conftest import _tiny_folder

    from encoderkit.tasks.common import TrainData, open_model
    from encoderkit.tasks.qa import train as qa_train
    from encoderkit.train.engine import param_groups

    assert qa_train.HEAD_LR_SCALE >= 10
    data = TrainData(train=str(_one_article(tmp_path / "s.json")))
    options = qa_train.QaOptions(max_length=32, doc_stride=8, max_question_length=8)
    folder = open_model(tiny_bert_dir)
    run = qa_train.build(data, options, folder.tokenizer(), folder)
    assert run.lr_scale == {"qa_outputs": qa_train.HEAD_LR_SCALE}
    assert run.card["head"] == {"lr_scale": qa_train.HEAD_LR_SCALE}
    groups = param_groups(run.module, 0.01, run.lr_scale)
    head = {id(p) for p in run.module.qa_outputs.parameters()}
    for g in groups:
        assert g["lr_scale"] == (qa_train.HEAD_LR_SCALE if {id(p) for p in g["params"]} <= head else 1.0)
    trained = open_model(_tiny_folder(tmp_path / "qa", tiny_tokenizer_dir, "BertForQuestionAnswering"))
    assert trained.task == "qa"
    assert qa_train.build(data, options, trained.tokenizer(), trained).lr_scale == {}
