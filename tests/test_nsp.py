"""BERT's next-sentence objective: the pair builder's statistics and layout, static against
dynamic masking, and a tiny mlm+nsp pretraining run whose folder loads in transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from encoderkit.data.nsp import PairBuilder, cut_windows
from encoderkit.errors import EncoderkitError
from tests.test_pretrain import make_store, tiny_cfg

IDS = {"cls": 2, "sep": 3, "pad": 0}


def synthetic_docs(n_docs: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Documents of 2..120 tokens whose ids encode (document, position): doc d's token j is
    1000 * (d + 1) + j, so a pair's tokens tell where they came from."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 121, n_docs)
    tokens = np.concatenate([1000 * (d + 1) + np.arange(n) for d, n in enumerate(lengths)]).astype(np.int64)
    return tokens, np.concatenate([[0], np.cumsum(lengths)])


def test_windows_cover_each_document_once() -> None:
    _tokens, offsets = synthetic_docs()
    doc, start, length = cut_windows(offsets, np.arange(40), 29)
    assert (length >= 2).all() and (length <= 29).all()
    for d in range(40):
        mine = doc == d
        n = offsets[d + 1] - offsets[d]
        covered = length[mine].sum()
        assert n - 1 <= covered <= n  # only a trailing 1-token window is left out
        assert (start[mine] >= offsets[d]).all() and (start[mine] + length[mine] <= offsets[d + 1]).all()


def test_half_true_next_half_random_and_never_the_same_document() -> None:
    tokens, offsets = synthetic_docs()
    pairs = PairBuilder(tokens, offsets, np.arange(40), seq_len=32, ids=IDS, seed=7)
    labels, same_doc = [], 0
    for epoch in range(20):
        d = pairs.draw(np.arange(len(pairs)), epoch)
        labels.append(d.label)
        rnd = d.label == 1
        assert (d.b_doc[rnd] != d.a_doc[rnd]).all()  # never the same document
        same_doc += int((d.b_doc[~rnd] == d.a_doc[~rnd]).sum())
        # the true next segment starts where A ends, inside the same document
        assert (d.b_start[~rnd] == d.a_start[~rnd] + d.a_len[~rnd]).all()
        assert (d.a_len >= 1).all() and (d.b_len >= 1).all()
        assert (d.b_start + d.b_len <= offsets[d.b_doc + 1]).all() and (d.b_start >= offsets[d.b_doc]).all()
    labels = np.concatenate(labels)
    n = len(labels)
    assert abs(labels.mean() - 0.5) < 4 * 0.5 / np.sqrt(n), (labels.mean(), n)  # 4 sigma of a fair coin
    assert same_doc == int((labels == 0).sum())
    # seeded: the same seed and epoch give the same pairs; another epoch or seed others
    again = PairBuilder(tokens, offsets, np.arange(40), seq_len=32, ids=IDS, seed=7).draw(np.arange(len(pairs)), 3)
    first = pairs.draw(np.arange(len(pairs)), 3)
    assert np.array_equal(again.label, first.label) and np.array_equal(again.b_start, first.b_start)
    assert not np.array_equal(pairs.draw(np.arange(len(pairs)), 4).label, first.label)
    other_seed = PairBuilder(tokens, offsets, np.arange(40), seq_len=32, ids=IDS, seed=8)
    assert not np.array_equal(other_seed.draw(np.arange(len(pairs)), 3).label, first.label)


def test_random_segment_comes_from_every_other_document_uniformly() -> None:
    tokens, offsets = synthetic_docs(n_docs=5)
    pairs = PairBuilder(tokens, offsets, np.arange(5), seq_len=16, ids=IDS, seed=1)
    idx = np.flatnonzero(pairs.doc == 0)[:1].repeat(1)
    counts = np.zeros(5)
    for epoch in range(4000):
        d = pairs.draw(idx, epoch)
        if d.label[0] == 1:
            counts[d.b_doc[0]] += 1
    assert counts[0] == 0
    share = counts[1:] / counts[1:].sum()
    assert np.all(np.abs(share - 0.25) < 0.04), share  # ~2000 draws: sd of a share is about 0.01


def test_layout_and_token_types() -> None:
    tokens, offsets = synthetic_docs()
    pairs = PairBuilder(tokens, offsets, np.arange(40), seq_len=32, ids=IDS, seed=0)
    idx = np.arange(min(64, len(pairs)))
    batch, d = pairs(idx, 0), pairs.draw(idx, 0)
    ids, types = batch["input_ids"].numpy(), batch["token_type_ids"].numpy()
    assert ids.shape == types.shape == (len(idx), 32)
    assert torch.equal(batch["next_sentence_label"], torch.from_numpy(d.label))
    for r in range(len(idx)):
        a, b = d.a_len[r], d.b_len[r]
        assert ids[r, 0] == IDS["cls"] and ids[r, a + 1] == IDS["sep"] and ids[r, a + b + 2] == IDS["sep"]
        assert (ids[r, a + b + 3:] == IDS["pad"]).all()
        assert list(ids[r, 1:a + 1] // 1000 - 1) == [d.a_doc[r]] * a  # A: tokens of its document
        assert list(ids[r, a + 2:a + b + 2] // 1000 - 1) == [d.b_doc[r]] * b
        assert (types[r, :a + 2] == 0).all() and (types[r, a + 2:a + b + 3] == 1).all()
        assert (types[r, a + b + 3:] == 0).all()
    # a true pair continues A token by token
    true = np.flatnonzero(d.label == 0)[0]
    a = d.a_len[true]
    assert ids[true, a + 2] == ids[true, a] + 1


def test_pair_builder_refuses_a_single_document() -> None:
    tokens, offsets = synthetic_docs(n_docs=3)
    with pytest.raises(EncoderkitError, match="at least two documents"):
        PairBuilder(tokens, offsets, np.array([1]), seq_len=32, ids=IDS, seed=0)


# -- pretraining with the NSP objective --------------------------------------------------------------
@pytest.fixture(scope="module")
def topic_store(tmp_path_factory, tiny_tokenizer_dir):
    """480 line documents, each one word of 40 repeated 24 times: a true next segment repeats A's
    word and a random one (from another document) almost always does not, so next-sentence
    prediction is learnable by a tiny model in a couple of hundred steps, on held-out documents too."""
    from tests.conftest import WORDS

    lines = [" ".join([WORDS[i % 40]] * 24) for i in range(480)]
    return make_store(tmp_path_factory.mktemp("topics"), tiny_tokenizer_dir, "\n".join(lines) + "\n", seq_len=32)


@pytest.mark.parametrize("objective", ["mlm", "mlm+nsp"])
def test_static_masks_repeat_across_epochs_and_dynamic_ones_differ(topic_store, tmp_path, objective) -> None:
    from encoderkit.data.masking import Masker
    from encoderkit.data.prepare import read_meta
    from encoderkit.models.tokenizer import load_tokenizer
    from encoderkit.train.pretrain import training_batches

    meta = read_meta(topic_store)
    idx = np.arange(8)
    for masking, same in (("static", True), ("dynamic", False)):
        cfg = tiny_cfg(topic_store, tmp_path / "o", objective=objective, masking=masking)
        masker = Masker.from_tokenizer(load_tokenizer(topic_store), cfg.masking_spec(), seed=cfg.seed)
        _, make_batch = training_batches(cfg, topic_store, meta, masker)
        e0, e1, e0_again = make_batch(idx, 0), make_batch(idx, 1), make_batch(idx, 0)
        assert torch.equal(e0["labels"], e0_again["labels"])
        assert torch.equal(e0["labels"], e1["labels"]) is same, masking
        assert torch.equal(e0["input_ids"], e1["input_ids"]) is same, masking
        if objective == "mlm+nsp":
            assert set(e0) >= {"token_type_ids", "next_sentence_label"}


def test_mlm_nsp_run_learns_and_loads_in_transformers(topic_store, tmp_path) -> None:
    from transformers import AutoModelForMaskedLM, AutoModelForPreTraining

    from encoderkit.train.pretrain import run

    # dynamic: pairs are re-drawn every epoch, so NSP cannot be learnt by memorising fixed examples
    result = run(tiny_cfg(topic_store, tmp_path / "m", objective="mlm+nsp", max_steps=200, lr=5e-3, warmup=5,
                          schedule="constant", batch_size=16, mask_rate=0.15, eval_blocks=256))
    card = json.loads((tmp_path / "m" / "encoderkit.json").read_text())["metrics"]
    assert card["heldout_loss"] < card["initial_heldout_loss"] - 1.0, card
    # measured: held-out NSP loss 0.69 -> 0.42, accuracy 0.58 -> 0.83 (96 pairs of held-out documents)
    assert card["heldout_nsp_loss"] < card["initial_heldout_nsp_loss"] - 0.15, card
    assert result.metrics["heldout_nsp_accuracy"] > 0.7, card
    # an MLM folder by name (what distillation and the folder readers pick the class by), with BERT's
    # pretraining heads in its weights: AutoModelForPreTraining gets the trained NSP head back
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    full = AutoModelForPreTraining.from_pretrained(tmp_path / "m")
    assert type(full).__name__ == "BertForPreTraining"
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "m" / "model.safetensors")
    assert torch.equal(full.cls.seq_relationship.weight, saved["cls.seq_relationship.weight"])
    assert torch.equal(full.bert.pooler.dense.weight, saved["bert.pooler.dense.weight"])
    mlm = AutoModelForMaskedLM.from_pretrained(tmp_path / "m")
    assert type(mlm).__name__ == "BertForMaskedLM"
    assert torch.equal(mlm.cls.predictions.transform.dense.weight, full.cls.predictions.transform.dense.weight)


def test_nsp_is_refused_for_other_families(topic_store, tmp_path) -> None:
    from transformers import RobertaConfig, RobertaForMaskedLM

    from encoderkit.train.pretrain import run

    with pytest.raises(EncoderkitError, match="mlm\\+nsp needs --arch bert.*deberta"):
        tiny_cfg(topic_store, tmp_path / "o", objective="mlm+nsp", arch="deberta")
    folder = tmp_path / "roberta"
    RobertaForMaskedLM(RobertaConfig(vocab_size=150, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=66, pad_token_id=0)
                       ).save_pretrained(folder)
    with pytest.raises(EncoderkitError, match="roberta model"):
        run(tiny_cfg(topic_store, tmp_path / "o", objective="mlm+nsp", model=str(folder), layers=0, hidden=0,
                     heads=0, ffn=0))
