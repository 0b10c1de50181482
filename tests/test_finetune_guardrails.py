"""Fine-tuning guardrails: each rule warns (with its reason and the flag that silences it) and stays quiet on the
good setting; a real run prints them, ``--allow``/``--no-guardrails`` silence them, the dev metric is said per
epoch, and a dev metric falling while the training loss falls is noted."""

from __future__ import annotations

import json
import random

import pytest
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.train import guardrails
from encoderkit.train.finetune import FinetuneConfig, run

GOOD = {"lr": 3e-5, "frozen": [], "epochs": 3.0, "early_stopping": 0, "num_train": 10_000, "tokenizer_differs": False,
        "tokenizer": "", "labelled": False, "audit_sheet": ""}


def _rules(**kw) -> list[str]:
    return [w.rule for w in guardrails.warnings_for(**{**GOOD, **kw})]


def test_the_good_settings_raise_no_warning():
    assert _rules() == []


@pytest.mark.parametrize(("change", "rule", "fine"), [
    ({"lr": 2e-4}, "high-lr", {"lr": 2e-4, "frozen": ["bert.embeddings.word_embeddings.weight"]}),
    ({"epochs": 10.0}, "many-epochs", {"epochs": 10.0, "early_stopping": 2}),
    ({"frozen": ["bert.encoder.layer.0.attention.self.query.weight"]}, "frozen-encoder",
     {"frozen": ["bert.encoder.layer.0.attention.self.query.weight"], "num_train": 800}),
    ({"tokenizer_differs": True, "tokenizer": "tok/"}, "other-tokenizer", {"tokenizer": "tok/"}),
    ({"labelled": True}, "unaudited-labels", {"labelled": True, "audit_sheet": "sheet.csv"}),
])
def test_each_rule_warns_and_its_good_setting_does_not(change, rule, fine):
    assert _rules(**change) == [rule]
    assert rule not in _rules(**fine)
    w = guardrails.warnings_for(**{**GOOD, **change})[0]
    assert f"--allow {rule}" in w.message() and "--no-guardrails" in w.message()


def test_the_tasks_own_default_rate_is_never_a_high_lr():
    """A narrow model's QA/rerank default (2e-4) is above the general 1e-4 limit: finetune with no --lr must not warn
    about its own choice, while a rate above that default still warns, naming the default."""
    from encoderkit.train.finetune import task_lr

    default = task_lr("qa", 384)
    assert default > guardrails.MAX_LR
    assert _rules(lr=default, default_lr=default) == []
    (w,) = guardrails.warnings_for(**{**GOOD, "lr": 2 * default, "default_lr": default})
    assert w.rule == "high-lr" and f"{default:g} is this task's default" in w.reason
    assert _rules(lr=2e-4, default_lr=3e-5) == ["high-lr"]  # a wide model's default keeps the 1e-4 limit


def test_frozen_embeddings_alone_are_not_a_frozen_encoder():
    assert _rules(frozen=["bert.embeddings.word_embeddings.weight"]) == []
    assert _rules(frozen=["model.layers.3.mlp.Wi.weight"]) == ["frozen-encoder"]  # ModernBERT's names


def test_labeller_output_is_recognised_by_its_ledger_or_field(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "a", "label": "x"}) + "\n")
    assert not guardrails.labelled_output(str(plain))
    marked = tmp_path / "marked.jsonl"
    marked.write_text(json.dumps({"text": "a", "label": "x", "labeller": "endpoint:m"}) + "\n")
    assert guardrails.labelled_output(str(marked))
    tsv = tmp_path / "t.tsv"
    tsv.write_text("text\tlabel\na\tx\n")
    (tmp_path / "t.tsv.ledger.json").write_text("{}")
    assert guardrails.labelled_output(str(tsv))


def test_an_unknown_rule_is_refused():
    with pytest.raises(EncoderkitError, match="not a guardrail"):
        guardrails.check_allowed(["high-lr", "fast"])


def test_dev_falling_while_train_loss_falls_is_noted(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    values = iter([0.80, 0.85, 0.82])

    def evaluate(module):
        return {"accuracy": next(values)}

    watched = guardrails.watch_dev(evaluate, ("accuracy", "max"), log, steps_per_epoch=2)
    for step, loss in ((2, 0.9), (4, 0.5), (6, 0.2)):  # the training loss keeps falling
        with open(log, "a") as f:
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        watched(None)
    err = capsys.readouterr().err
    assert "epoch 1 (step 2): dev accuracy 0.8000, train loss 0.9000" in err
    assert err.count("overfit") == 1 and "fell from 0.8500 to 0.8200" in err


def _rows(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"the movie was {w}", y) for y, w in ((y, rng.choice(["good", "great"] if y == "pos" else ["bad", "dull"]))
                                                   for y in (rng.choice(["pos", "neg"]) for _ in range(n)))]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_run_prints_the_warnings_and_the_flags_silence_them(tmp_path, tiny_bert_dir, tiny_tokenizer_dir, capsys,
                                                             one_thread):
    train = tmp_path / "labeled.jsonl"
    train.write_text("".join(json.dumps({"text": t, "label": y, "confidence": None, "labeller": "endpoint:sim"}) + "\n"
                             for t, y in _rows(48, 0)))
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in _rows(16, 1)))
    from transformers import BertTokenizerFast

    vocab = (tiny_tokenizer_dir / "vocab.txt").read_text().splitlines()
    vocab[10], vocab[11] = vocab[11], vocab[10]  # the same size, two tokens swapped: another vocabulary
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    other_tok = tmp_path / "other_tok"
    BertTokenizerFast(vocab=str(tmp_path / "vocab.txt"), do_lower_case=True).save_pretrained(other_tok)
    base = {"model": str(tiny_bert_dir), "train": str(train), "dev": str(dev), "lr": 1e-3, "batch_size": 16,
            "eval_batch_size": 64, "tokenizer": str(other_tok), "few_label": "off"}
    run(FinetuneConfig(**base, out=str(tmp_path / "a"), epochs=5))
    err = capsys.readouterr().err
    for rule in ("high-lr", "many-epochs", "other-tokenizer", "unaudited-labels"):
        assert f"--allow {rule}" in err, rule
    assert err.count("dev accuracy") == 5  # one line per epoch (3 steps each)
    run(FinetuneConfig(**base, out=str(tmp_path / "b"), max_steps=1, allow=["high-lr", "other-tokenizer"]))
    err = capsys.readouterr().err
    assert "--allow unaudited-labels" in err and "--allow high-lr" not in err and "--allow other-tokenizer" not in err
    run(FinetuneConfig(**base, out=str(tmp_path / "c"), max_steps=1, no_guardrails=True))
    assert "finetune: warning" not in capsys.readouterr().err
    # the few-label route (its own lr, one pass) judges the tokenizer and the labels' source, not --lr/--epochs
    run(FinetuneConfig(**{**base, "few_label": "on", "pair_iterations": 1}, out=str(tmp_path / "d"), epochs=5))
    err = capsys.readouterr().err
    assert "--allow other-tokenizer" in err and "--allow unaudited-labels" in err
    assert "--allow high-lr" not in err and "--allow many-epochs" not in err
