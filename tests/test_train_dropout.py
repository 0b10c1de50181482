"""Pretraining's own dropout: off for a run of at most one pass over the corpus, the model's own for
more, and the written model keeps the dropout fine-tuning uses."""

from __future__ import annotations

import json

import pytest
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.train import pretrain
from encoderkit.train.dropout import auto_train_dropout, dropout_set
from tests.test_pretrain import SENTENCE, make_store, tiny_cfg


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer_dir):
    return make_store(tmp_path_factory.mktemp("drop"), tiny_tokenizer_dir, (SENTENCE + "\n") * 120, seq_len=33)


class Attention(nn.Module):  # reads a float rate, as ModernBERT's attention does
    def __init__(self) -> None:
        super().__init__()
        self.attention_dropout = 0.1
        self.drop = nn.Dropout(0.2)


def test_dropout_set_changes_every_rate_and_restores_them_also_on_error() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1), Attention())
    with dropout_set(net, 0.0):
        assert (net[1].p, net[2].attention_dropout, net[2].drop.p) == (0.0, 0.0, 0.0)
    assert (net[1].p, net[2].attention_dropout, net[2].drop.p) == (0.1, 0.1, 0.2)
    with pytest.raises(RuntimeError), dropout_set(net, 0.05):
        raise RuntimeError("boom")
    assert (net[1].p, net[2].attention_dropout, net[2].drop.p) == (0.1, 0.1, 0.2)
    with dropout_set(net, None):
        assert net[1].p == 0.1


def test_auto_rate_is_zero_for_one_pass_and_the_models_own_for_more() -> None:
    assert auto_train_dropout(0.4) == 0.0 and auto_train_dropout(1.0) == 0.0
    assert auto_train_dropout(1.5) is None


def _spy_fit(monkeypatch) -> list[set[float]]:
    seen: list[set[float]] = []
    real = pretrain.fit

    def fit(module, *args, **kwargs):
        seen.append({m.p for m in module.modules() if isinstance(m, nn.Dropout)})
        return real(module, *args, **kwargs)

    monkeypatch.setattr(pretrain, "fit", fit)
    return seen


def test_a_short_run_trains_without_dropout_and_writes_the_models_own(store, tmp_path, monkeypatch) -> None:
    seen = _spy_fit(monkeypatch)
    result = pretrain.run(tiny_cfg(store, tmp_path / "m", dropout=0.1, max_steps=3))
    assert seen == [{0.0}]
    assert result.metrics["train_dropout"] == 0.0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["hidden_dropout_prob"] == 0.1 and config["attention_probs_dropout_prob"] == 0.1


def test_many_passes_keep_the_models_dropout_and_an_explicit_rate_wins(store, tmp_path, monkeypatch) -> None:
    seen = _spy_fit(monkeypatch)
    result = pretrain.run(tiny_cfg(store, tmp_path / "m", dropout=0.1, max_steps=0, epochs=2))
    assert "train_dropout" not in result.metrics
    pretrain.run(tiny_cfg(store, tmp_path / "m2", dropout=0.1, max_steps=3, train_dropout=0.05))
    assert seen == [{0.1}, {0.05}]


def test_a_rate_out_of_range_is_refused() -> None:
    with pytest.raises(EncoderkitError, match="train-dropout must be -1"):
        pretrain.PretrainConfig(data="x", out="y", preset="tiny", train_dropout=1.5)
