"""Metrics against hand-computed values, seqeval, and the official SQuAD normalisation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from encoderkit.metrics.ranking import reciprocal_rank_fusion, retrieval_scores
from encoderkit.metrics.scores import (
    accuracy,
    classification_scores,
    entity_scores,
    f1_binary,
    macro_f1,
    multilabel_scores,
    normalize_answer,
    squad_scores,
)


def test_classification_by_hand():
    gold = [1, 1, 0, 0, 1, 2]
    pred = [1, 0, 0, 1, 1, 2]
    assert accuracy(gold, pred) == pytest.approx(4 / 6)
    # class 1: tp 2, fp 1, fn 1 -> f1 2/3; class 0: tp 1 fp 1 fn 1 -> 1/2; class 2: 1
    assert f1_binary(gold, pred) == pytest.approx(2 / 3)
    assert macro_f1(gold, pred) == pytest.approx((2 / 3 + 1 / 2 + 1) / 3)
    s = classification_scores([0, 1, 1, 0], [0, 1, 0, 0], num_classes=2)
    assert s["accuracy"] == 0.75 and s["f1"] == pytest.approx(2 / 3)


def test_multilabel_by_hand():
    gold = np.array([[1, 0, 1], [0, 1, 0]])
    pred = np.array([[1, 0, 0], [0, 1, 0]])
    s = multilabel_scores(gold, pred)
    assert s["subset_accuracy"] == 0.5
    assert s["micro_f1"] == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))  # p=1, r=2/3
    assert s["macro_f1"] == pytest.approx((1 + 1 + 0) / 3)


def test_entity_scores_by_hand_and_against_seqeval():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-MISC", "I-MISC"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O", "B-MISC", "O"]]
    s = entity_scores(gold, pred)
    # gold 4 entities, pred 4, correct: PER, ORG -> p = r = f = 0.5
    assert (s["precision"], s["recall"], s["f1"]) == (0.5, 0.5, 0.5)
    assert s["f1_PER"] == 1.0 and s["f1_LOC"] == 0.0
    seqeval = pytest.importorskip("seqeval.metrics")
    # a messy case: stray I- tags, type switches, entity at the end
    gold = [["O", "B-PER", "I-PER", "B-PER", "O", "I-LOC", "I-LOC"], ["B-ORG", "I-ORG", "I-ORG", "O"]]
    pred = [["I-PER", "I-PER", "I-PER", "B-PER", "O", "B-LOC", "I-ORG"], ["B-ORG", "I-ORG", "O", "I-ORG"]]
    s = entity_scores(gold, pred)
    assert s["f1"] == pytest.approx(seqeval.f1_score(gold, pred))
    assert s["precision"] == pytest.approx(seqeval.precision_score(gold, pred))
    assert s["recall"] == pytest.approx(seqeval.recall_score(gold, pred))


def test_squad_normalisation_and_scores():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an apple, a pear") == "apple pear"
    s = squad_scores(["Denver Broncos", "the cat sat", "nothing"],
                     [["denver broncos", "Broncos"], ["a cat sat down"], ["x"]])
    assert s["exact_match"] == pytest.approx(1 / 3)
    # q2: pred {cat, sat} vs gold {cat, sat, down}: p=1, r=2/3 -> f1=0.8
    assert s["f1"] == pytest.approx((1 + 0.8 + 0) / 3)


def test_retrieval_by_hand():
    ranked = {"q1": ["d3", "d1", "d2"], "q2": ["d9", "d8"]}
    qrels = {"q1": {"d1": 1, "d2": 1}, "q2": {"d7": 1}, "q3": {"d1": 0}}
    s = retrieval_scores(ranked, qrels, k_recall=(2,))
    dcg = 1 / math.log2(3) + 1 / math.log2(4)
    idcg = 1 + 1 / math.log2(3)
    assert s["ndcg@10"] == pytest.approx((dcg / idcg + 0) / 2)  # q3 has no relevant doc: skipped
    assert s["mrr@10"] == pytest.approx((1 / 2 + 0) / 2)
    assert s["recall@2"] == pytest.approx((1 / 2 + 0) / 2)


def test_reciprocal_rank_fusion_by_hand():
    # a: 1/61 + 1/63, b: 1/62 + 1/61, c: 1/63 + 1/62, d: 1/64 (only in the first list)
    assert reciprocal_rank_fusion([["a", "b", "c", "d"], ["b", "c", "a"]]) == ["b", "a", "c", "d"]
    assert reciprocal_rank_fusion([["x", "y"]]) == ["x", "y"]  # one list: its own order
    assert reciprocal_rank_fusion([["a", "b"], ["b", "a"]], k=1)[0] == "a"  # a tie keeps the first seen
