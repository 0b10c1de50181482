"""``--resume`` through the CLI: a finished run resumed prints strict JSON (null, never NaN, and no made-up speed),
``--resume`` without a checkpoint says it starts over, and metrics.jsonl never gets two rows for one step."""

from __future__ import annotations

import json
from pathlib import Path

from encoderkit.cli import main
from tests.test_write_failures import _fail_on_call, _pretrain_args, one_thread, store  # noqa: F401  (fixtures)


def _strict_json(text: str) -> dict:
    def refuse(name: str):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _steps(log: Path) -> list[int]:
    return [json.loads(line)["step"] for line in log.read_text().splitlines() if "lr" in json.loads(line)]


def test_resuming_a_finished_run_prints_strict_json(store, tmp_path, capsys, one_thread):  # noqa: F811
    args = [*_pretrain_args(store, tmp_path / "model"), "--log-every", "1"]
    assert main(args) == 0
    first = _strict_json(capsys.readouterr().out)
    assert main([*args, "--resume", "--overwrite"]) == 0
    captured = capsys.readouterr()
    again = _strict_json(captured.out)
    assert "already finished (6 of 6 steps)" in captured.err
    assert again["steps"] == 6 and again["tokens_per_s"] is None  # no step ran: no speed to report
    assert again["train_loss"] == first["train_loss"] and again["heldout_loss"] == first["heldout_loss"]
    card = json.loads((tmp_path / "model" / "encoderkit.json").read_text())
    assert round(card["metrics"]["train_loss"], 4) == first["train_loss"]
    assert _steps(tmp_path / "model-run" / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]


def test_resume_without_a_checkpoint_says_so_and_logs_each_step_once(store, tmp_path, capsys, one_thread):  # noqa: F811
    run = tmp_path / "model-run"
    run.mkdir()
    # a run killed before its first checkpoint left log rows behind
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "lr": 0.1, "loss": 9.0}) + "\n" for s in (1, 2)))
    args = [*_pretrain_args(store, tmp_path / "model"), "--log-every", "1"]
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "holds no checkpoint, so training starts from step 0" in err
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]


def test_resume_from_a_checkpoint_drops_the_rows_logged_after_it(store, tmp_path, monkeypatch, capsys, one_thread):  # noqa: F811
    import encoderkit.train.checkpoint as ckpt

    args = [*_pretrain_args(store, tmp_path / "model"), "--log-every", "1"]
    monkeypatch.setattr(ckpt, "save_model", _fail_on_call(2, ckpt.save_model))  # step 2 saved, rows 3 and 4 logged
    assert main(args) == 2
    assert _steps(tmp_path / "model-run" / "metrics.jsonl") == [1, 2, 3, 4]
    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    assert _steps(tmp_path / "model-run" / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert _strict_json(capsys.readouterr().out)["tokens_per_s"] > 0
