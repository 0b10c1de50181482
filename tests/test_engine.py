"""The training engine on a toy model: schedule, exact resume, atomic checkpoints, NaN stop,
resume identity checks, and a speed setting that leaves results within tolerance."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.train import checkpoint as ckpt
from encoderkit.train.engine import IndexedBatches, TrainSettings, fit, lr_factor

X = torch.linspace(-1, 1, 96 * 6).reshape(96, 6)
Y = (X * torch.arange(-3, 3)).sum(1, keepdim=True) * 0.5


def toy_model() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"]), {}


def source() -> IndexedBatches:
    return IndexedBatches(96, 8, lambda idx, epoch: {"x": X[idx], "y": Y[idx]}, seed=5)


def settings(**kw) -> TrainSettings:
    base = {"lr": 3e-2, "epochs": 2, "batch_size": 8, "grad_accum": 2, "warmup": 2, "progress": False, "log_every": 1}
    return TrainSettings(**{**base, **kw})


@torch.no_grad()
def evaluate(model: nn.Module) -> dict[str, float]:
    return {"mse": float(nn.functional.mse_loss(model(X), Y))}


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_lr_schedule_shapes() -> None:
    assert lr_factor(0, 100, 10, "linear") == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "linear") == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(32, 100, 10, "cosine") > lr_factor(32, 100, 10, "linear")
    assert lr_factor(100, 100, 10, "linear", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(70, 100, 10, "constant") == 1.0


def test_training_reduces_loss_and_keeps_global_rng(tmp_path) -> None:
    model = toy_model()
    before = evaluate(model)["mse"]
    rng = torch.get_rng_state()
    result = fit(model, loss_fn, source(), settings(), tmp_path, evaluate=evaluate, primary=("mse", "min"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert result.steps == 2 * (12 // 2)  # 12 micro-batches per epoch, 2 per step, 2 epochs
    assert result.eval_metrics["mse"] < 0.5 * before
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 13))


def test_resume_is_exact(tmp_path) -> None:
    full = toy_model()
    fit(full, loss_fn, source(), settings(), tmp_path / "a", evaluate=evaluate, primary=("mse", "min"))
    part = toy_model()
    r1 = fit(part, loss_fn, source(), settings(), tmp_path / "b", stop_at=7)  # crosses into epoch 2
    assert r1.steps == 7 and r1.last_checkpoint.name == "step-0000007"
    resumed = toy_model()  # fresh weights: everything must come from the checkpoint
    r2 = fit(resumed, loss_fn, source(), settings(), tmp_path / "b", resume=True)
    assert r2.steps == 12
    for a, b in zip(weights(full), weights(resumed)):
        assert torch.equal(a, b)


def test_run_dir_with_checkpoints_needs_resume_and_same_identity(tmp_path) -> None:
    fit(toy_model(), loss_fn, source(), settings(), tmp_path, stop_at=3, fingerprint={"data": "abc"})
    with pytest.raises(EncoderkitError, match="--resume"):
        fit(toy_model(), loss_fn, source(), settings(), tmp_path, fingerprint={"data": "abc"})
    with pytest.raises(EncoderkitError, match=r"different run \(fingerprint.data: checkpoint has 'abc'"):
        fit(toy_model(), loss_fn, source(), settings(), tmp_path, fingerprint={"data": "xyz"}, resume=True)
    with pytest.raises(EncoderkitError, match="settings.lr"):
        fit(toy_model(), loss_fn, source(), settings(lr=1e-3), tmp_path, fingerprint={"data": "abc"}, resume=True)


def test_failed_checkpoint_write_keeps_previous(tmp_path, monkeypatch) -> None:
    model = toy_model()
    fit(model, loss_fn, source(), settings(save_every=2), tmp_path, stop_at=4)
    good = tmp_path / "checkpoints" / "step-0000004"
    saved = good.joinpath("model.safetensors").read_bytes()
    real_write = ckpt.write_weights

    def half_write(module, path):  # writes part of the file, then the disk is full
        real_write(module, path)
        with open(path, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_weights", half_write)
    with pytest.raises(EncoderkitError, match="previous checkpoint .*step-0000004 is intact"):
        fit(model, loss_fn, source(), settings(save_every=2), tmp_path, resume=True)
    assert good.joinpath("model.safetensors").read_bytes() == saved
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]  # no temp
    monkeypatch.setattr(ckpt, "write_weights", real_write)
    resumed = fit(toy_model(), loss_fn, source(), settings(save_every=2), tmp_path, resume=True)
    assert resumed.steps == 12


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path) -> None:
    calls = {"n": 0}

    def exploding(model, batch):
        calls["n"] += 1
        loss, logs = loss_fn(model, batch)
        return (loss * float("nan") if calls["n"] > 9 else loss), logs  # micro-batch 10 = step 5

    with pytest.raises(EncoderkitError, match=r"non-finite loss .* step 5; the last good checkpoint is .*step-0000004"):
        fit(toy_model(), exploding, source(), settings(save_every=2), tmp_path)
    state = ckpt.read_state(tmp_path / "checkpoints" / "step-0000004")
    assert state["step"] == 4 and all(torch.isfinite(torch.tensor(v)) for v in state["train_logs"].values())


def test_best_checkpoint_follows_primary_metric(tmp_path) -> None:
    scores = iter([3.0, 1.0, 2.0])
    result = fit(toy_model(), loss_fn, source(), settings(eval_every=4), tmp_path,
                 evaluate=lambda m: {"f1": next(scores)}, primary=("f1", "max"))
    assert result.best_metrics == {"f1": 3.0}
    assert ckpt.read_state(result.best_checkpoint)["step"] == 4


def test_bf16_autocast_is_a_speed_setting(tmp_path) -> None:
    runs = []
    for i, bf16 in enumerate((False, True)):
        model = toy_model()
        fit(model, loss_fn, source(), settings(bf16=bf16), tmp_path / str(i))
        runs.append(evaluate(model)["mse"])
    assert runs[1] == pytest.approx(runs[0], rel=0.05)


def test_line_progress_for_log_files():
    """Without a terminal (nohup, CI) progress is a plain line per interval, not a hidden bar."""
    import io

    from encoderkit.progress import LineProgress

    out = io.StringIO()
    bar = LineProgress(total=40, initial=10, desc="train", every=0.0, stream=out)
    bar.set_postfix(loss="0.5000", tok_s="1,000")
    for _ in range(30):
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 30
    assert lines[0].startswith("train 11/40 (27.5%), loss=0.5000 tok_s=1,000, 0m00s elapsed,")
    assert lines[-1].startswith("train 40/40 (100.0%)") and lines[-1].endswith("0m00s left")
    quiet = io.StringIO()
    slow = LineProgress(range(40), desc="encode", every=3600.0, stream=quiet)
    assert list(slow) == list(range(40))  # iterates like tqdm
    assert quiet.getvalue().splitlines() == [slow.line(slow.last)]  # nothing before the interval, the end always
    assert quiet.getvalue().startswith("encode 40/40 (100.0%)")


def test_throughput_counts_the_real_tokens_of_plain_and_paired_batches():
    from encoderkit.train.engine import _batch_tokens

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert _batch_tokens({"input_ids": torch.zeros(2, 4), "attention_mask": mask}) == 5
    # an embed batch (query + passage sides) counts both sides, not its batch size
    paired = {"q_input_ids": torch.zeros(2, 4), "q_attention_mask": mask,
              "p_input_ids": torch.zeros(2, 6), "p_attention_mask": torch.ones(2, 6, dtype=torch.long)}
    assert _batch_tokens(paired) == 5 + 12
    assert _batch_tokens({"input_ids": torch.zeros(3, 7)}) == 21


def test_lr_scale_gives_named_parameters_their_own_rate(tmp_path) -> None:
    """A first AdamW step moves every weight by about lr (the update is lr * sign(grad)): the head named in
    ``lr_scale`` moves 30 times as far as the rest, and without ``lr_scale`` the two groups are as before."""
    from encoderkit.train.engine import param_groups

    model = toy_model()
    plain = param_groups(model, 0.01)
    assert [(len(g["params"]), g["weight_decay"], g["lr_scale"]) for g in plain] == [(2, 0.01, 1.0), (2, 0.0, 1.0)]
    scaled = param_groups(model, 0.01, {"3": 30.0})  # "3": the last Linear of the Sequential
    assert sorted((len(g["params"]), g["lr_scale"]) for g in scaled) == [(1, 1.0), (1, 1.0), (1, 30.0), (1, 30.0)]
    start = weights(model)
    fit(model, loss_fn, source(), settings(lr=1e-4, weight_decay=0.0, warmup=0, schedule="constant", epochs=1,
                                           max_steps=1, grad_accum=1), tmp_path, lr_scale={"3": 30.0})
    moved = [float((after - before).abs().median()) for after, before in zip(weights(model), start, strict=True)]
    assert moved[0] == pytest.approx(1e-4, rel=0.05) and moved[2] == pytest.approx(3e-3, rel=0.05)
