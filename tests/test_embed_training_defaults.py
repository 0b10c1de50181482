"""Embed/rerank training defaults found against sentence-transformers' trainers (bench/quality_embed.py): the
contrastive loss leaves a row's false negatives out of its softmax (another copy of its positive in the batch, a
document cited by two training queries, or another positive of its own query), and hard negatives are mined at the
length the model trains at."""

from __future__ import annotations

import numpy as np
import torch

from encoderkit.data.beir import Retrieval, Triple
from encoderkit.tasks.batching import BucketedBatches
from encoderkit.tasks.embed import mining
from encoderkit.tasks.embed.features import false_negative_mask, mnrl_loss
from encoderkit.tasks.embed.train import with_false_negative_mask

GROUPS = [Triple("q1", "X", ["N1"], "a"), Triple("q2", "X", ["N2"], "b"), Triple("q1", "Y", ["X"], "c"),
          Triple("q3", "Z", ["Y"], "d")]


def test_mask_marks_copies_of_the_positive_and_the_querys_other_positives():
    relevant = {"q1": {"X", "Y"}, "q2": {"X"}, "q3": {"Z"}}
    columns = ["X", "X", "Y", "Z", "X"]  # four positives, then one negative that is q1's and q2's positive
    mask = false_negative_mask(["q1", "q2", "q1", "q3"], columns, relevant)
    assert mask.tolist() == [
        [False, True, True, False, True],   # q1: the other X, its other positive Y, the negative X
        [True, False, False, False, True],  # q2: the other X and the negative X; Y is not q2's
        [True, True, False, False, True],   # q1 (positive Y): every X is relevant to q1 too
        [False, False, False, False, False],
    ]


def test_masked_loss_equals_the_loss_without_the_duplicate_column():
    torch.manual_seed(0)
    q = torch.randn(3, 8)
    p = torch.randn(3, 8)
    p[1] = p[0]  # rows 0 and 1 share their positive
    mask = torch.tensor([[False, True, False], [True, False, False], [False, False, False]])
    masked = mnrl_loss(q, p, 20.0, [], mask)
    by_hand = torch.stack([
        torch.nn.functional.cross_entropy(20.0 * torch.nn.functional.normalize(q[i:i + 1], dim=-1)
                                          @ torch.nn.functional.normalize(p[cols], dim=-1).T,
                                          torch.tensor([0]))
        for i, cols in ((0, [0, 2]), (1, [1, 2]), (2, [2, 0, 1]))]).mean()
    assert torch.allclose(masked, by_hand, atol=1e-5)
    assert mnrl_loss(q, p, 20.0, []) > masked + 0.1  # unmasked, the shared positive counts against both rows


def test_training_batches_carry_the_mask():
    source = BucketedBatches(np.asarray([1, 1, 1, 1]), 4, lambda idx, epoch: {"q_input_ids": torch.zeros(1)},
                             seed=0, bucket=False)
    batch = next(with_false_negative_mask(source, GROUPS, 1)(0, 0, 1))
    idx = source.batches(0)[0]
    assert "q_input_ids" in batch and batch["fn_mask"].shape == (4, 8)
    where = {int(i): n for n, i in enumerate(idx)}  # group -> its row in the batch
    assert bool(batch["fn_mask"][where[0], where[1]])  # group 0's positive X is group 1's positive too
    assert bool(batch["fn_mask"][where[0], where[2]])  # group 2 is q1's other positive Y
    assert not batch["fn_mask"][where[3]].any()  # q3's only relevant text is its own positive


def test_mining_reads_documents_at_the_training_length(monkeypatch):
    seen = []
    monkeypatch.setattr(mining, "resolve_model", lambda m: m)
    monkeypatch.setattr(mining, "load_bi_encoder", lambda folder: None)
    monkeypatch.setattr(mining, "load_tokenizer", lambda folder: None)
    monkeypatch.setattr(mining, "folder_max_length", lambda folder: 256)  # the miner's own length

    def retrieve(model, tok, data, max_length, max_query_length, batch_size, **kw):
        seen.append(max_length)
        return {q: list(data.corpus) for q in data.qrels}

    monkeypatch.setattr(mining, "retrieve", retrieve)
    data = Retrieval({f"d{i}": ("", f"doc {i}") for i in range(40)}, {"q": "query"}, {"q": {"d0": 1}})
    for asked in (128, 512, 0):
        groups = mining.groups_from_beir(data, negatives="mined", num_negatives=2, seed=0, miner="m",
                                         max_length=asked)
        assert len(groups) == 1 and len(groups[0].negatives) == 2 and "doc 0" not in groups[0].negatives
    assert seen == [128, 256, 256]  # the training length where shorter, else the miner's own
