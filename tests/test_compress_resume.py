"""Long compression work survives an interruption: a distillation continues from its latest checkpoint
(same weights as a run never stopped), and a recipe keeps the steps it finished and measured."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from deploy_models import make_task_model, tiny_root

from encoderkit.compress.distill import DistillConfig
from encoderkit.compress.distill import run as distill
from encoderkit.compress.stack import CompressConfig
from encoderkit.compress.stack import run as compress
from encoderkit.errors import EncoderkitError
from encoderkit.models.card import read_card
from encoderkit.train import engine
from tests.conftest import WORDS

REAL_FIT = engine.fit


class Stop(Exception):
    pass


def go_on(monkeypatch) -> None:
    """Training runs as it does (undoes :func:`stop_training_at`; ``monkeypatch.undo`` would also undo
    the test's own cache)."""
    monkeypatch.setattr(engine, "fit", REAL_FIT)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "rerank")


@pytest.fixture(scope="module")
def lists(tmp_path_factory) -> Path:
    g = np.random.default_rng(0)

    def sentence(lo: int = 3, hi: int = 9) -> str:
        return " ".join(WORDS[j] for j in g.integers(0, len(WORDS), g.integers(lo, hi)))

    p = tmp_path_factory.mktemp("resume_data") / "triples.jsonl"
    p.write_text("".join(json.dumps({"query": sentence(2, 4), "positive": sentence(),
                                     "negatives": [sentence() for _ in range(3)]}) + "\n" for _ in range(32)))
    return p


def stop_training_at(monkeypatch, step: int, starts: list[int] | None = None) -> None:
    """The next distillation raises in its ``step``-th loss call (1-based) of this call; ``starts``
    collects the step every later fit starts from."""
    real = REAL_FIT
    calls = {"n": 0}

    def fit(module, loss_fn, *args, **kw):
        def loss(m, batch):
            calls["n"] += 1
            if calls["n"] == step:
                raise Stop(f"stopped in step {step}")
            return loss_fn(m, batch)

        res = real(module, loss if calls["n"] < step else loss_fn, *args, **kw)
        if starts is not None:
            starts.append(res.start_step)
        return res

    monkeypatch.setattr(engine, "fit", fit)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_an_interrupted_distillation_resumes_to_the_weights_of_an_uninterrupted_one(reranker, lists, tmp_path,
                                                                                    monkeypatch):
    settings = {"teacher": str(reranker), "train": str(lists), "layers": "0", "candidates": 4, "max_steps": 6,
                "batch_size": 8, "seq_len": 32, "bf16": False, "save_every": 2, "lr": 1e-3}
    stop_training_at(monkeypatch, 5)
    with pytest.raises(Stop):
        distill(DistillConfig(**settings, out=str(tmp_path / "student")))
    assert not (tmp_path / "student").exists()  # nothing half-written under the output name
    assert (tmp_path / ".student.run" / "checkpoints" / "step-0000004").is_dir()
    go_on(monkeypatch)
    resumed = distill(DistillConfig(**settings, out=str(tmp_path / "student"), resume=True))
    reference = distill(DistillConfig(**settings, out=str(tmp_path / "reference")))
    assert resumed.steps == reference.steps == 6
    a, b = weights(tmp_path / "student"), weights(tmp_path / "reference")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    assert not (tmp_path / ".student.run").exists()  # the checkpoints go once the student is written


def test_a_fresh_distillation_replaces_stale_checkpoints_and_a_changed_one_cannot_resume_them(
        reranker, lists, tmp_path, monkeypatch):
    settings = {"teacher": str(reranker), "train": str(lists), "layers": "0", "candidates": 4, "max_steps": 4,
                "batch_size": 8, "seq_len": 32, "bf16": False, "save_every": 2}
    stop_training_at(monkeypatch, 3)
    with pytest.raises(Stop):
        distill(DistillConfig(**settings, out=str(tmp_path / "s")))
    go_on(monkeypatch)
    with pytest.raises(EncoderkitError, match="cannot resume"):
        distill(DistillConfig(**{**settings, "lr": 5e-4}, out=str(tmp_path / "s"), resume=True))
    res = distill(DistillConfig(**settings, out=str(tmp_path / "s")))  # no --resume: starts again
    assert res.steps == 4 and not (tmp_path / ".s.run").exists()


class Measured:
    """A measure stand-in that counts which folders it measured."""

    def __init__(self) -> None:
        self.folders: list[str] = []

    def __call__(self, folder: Path) -> dict:
        from encoderkit.compress.measure import bytes_on_disk

        self.folders.append(Path(folder).name)
        return {"quality": 1.0, "params": 1, "bytes": bytes_on_disk(folder), "latency_b1_ms": 1.0,
                "latency_b32_ms": 1.0}


RECIPE = ("task: rerank\nsteps:\n"
          "  - {lever: distill, layers: '0', max_steps: 6, batch_size: 8, seq_len: 32, candidates: 4, bf16: false}\n"
          "  - {lever: prune, method: ffn, amount: 0.5, importance: magnitude}\n"
          "  - {lever: quantize, method: dynamic-int8}\n")


def test_a_recipe_interrupted_twice_resumes_without_redoing_a_finished_step(reranker, lists, tmp_path, monkeypatch):
    import encoderkit.compress.prune as prune_mod

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "out"
    cfg = {"recipe": str(recipe), "model": str(reranker), "dev": str(lists), "out": str(out), "train": str(lists),
           "save_every": 2}
    first = Measured()
    stop_training_at(monkeypatch, 5)  # killed in the distillation's 5th step: its step-4 checkpoint is kept
    with pytest.raises(Stop):
        compress(CompressConfig(**cfg), measure=first)
    partial = tmp_path / ".out.partial"
    assert first.folders == [reranker.name] and not out.exists()
    assert (partial / ".01-distill.run" / "checkpoints" / "step-0000004").is_dir()
    go_on(monkeypatch)

    second, starts = Measured(), []
    stop_training_at(monkeypatch, 10**9, starts)  # records where the distillation starts
    real_prune = prune_mod.prune
    monkeypatch.setattr(prune_mod, "prune", lambda *a, **kw: (_ for _ in ()).throw(Stop("stopped in the prune step")))
    with pytest.raises(Stop):
        compress(CompressConfig(**cfg, resume=True), measure=second)
    assert starts == [4]  # continued from its checkpoint, not from step 0
    assert second.folders == ["01-distill"]  # the start is not measured again
    assert json.loads((partial / "progress.json").read_text())["rows"][1]["lever"] == "distill"

    third = Measured()
    monkeypatch.setattr(prune_mod, "prune", real_prune)
    monkeypatch.setattr("encoderkit.compress.distill.run", lambda *a, **kw: pytest.fail("a finished step ran again"))
    res = compress(CompressConfig(**cfg, resume=True), measure=third)
    assert third.folders == ["02-prune", "03-quantize"]
    assert [r["lever"] for r in res.rows] == ["start", "distill", "prune", "quantize"]
    assert (out / "03-quantize" / "model.int8.onnx").is_file() and (out / "report.md").is_file()
    assert not partial.exists() and (out / "progress.json").is_file()  # kept: a finished recipe can be continued
    assert str(partial) not in (out / "report.json").read_text()  # the report names the final folders


def test_a_recipe_resumes_only_the_same_settings_and_reruns_only_its_edited_steps(reranker, lists, tmp_path,
                                                                                  monkeypatch):
    import encoderkit.compress.prune as prune_mod

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "out"
    cfg = {"recipe": str(recipe), "model": str(reranker), "dev": str(lists), "out": str(out), "train": str(lists)}
    real_prune = prune_mod.prune
    monkeypatch.setattr(prune_mod, "prune", lambda *a, **kw: (_ for _ in ()).throw(Stop("stopped in the prune step")))
    with pytest.raises(Stop):
        compress(CompressConfig(**cfg), measure=Measured())
    with pytest.raises(EncoderkitError, match=r"cannot resume .*other settings \(calib\)"):
        compress(CompressConfig(**cfg, calib=str(lists), resume=True), measure=Measured())
    assert (tmp_path / ".out.partial" / "01-distill").is_dir()  # a refused resume touches nothing
    monkeypatch.setattr(prune_mod, "prune", real_prune)
    monkeypatch.setattr("encoderkit.compress.distill.run", lambda *a, **kw: pytest.fail("a kept step ran again"))
    distilled = weights(tmp_path / ".out.partial" / "01-distill")

    recipe.write_text(RECIPE.replace("amount: 0.5", "amount: 0.25"))  # edited from step 2 on, while interrupted
    edited = Measured()
    res = compress(CompressConfig(**cfg, resume=True), measure=edited)
    assert edited.folders == ["02-prune", "03-quantize"]
    assert res.rows[2]["bytes"] > 0 and (out / "progress.json").is_file()
    ffn = {k: v.shape for k, v in weights(out / "02-prune").items() if "intermediate.dense.weight" in k}
    assert ffn and all(shape[0] == round(distilled[k].shape[0] * 0.75) for k, shape in ffn.items())  # the new amount

    before = (out / "02-prune" / "model.safetensors").stat().st_mtime_ns
    recipe.write_text(RECIPE.replace("amount: 0.5", "amount: 0.25").replace("dynamic-int8}",
                                                                            "dynamic-int8, per_channel: false}"))
    finished = Measured()  # a finished run continued: only its edited last step runs
    res = compress(CompressConfig(**cfg, resume=True), measure=finished)
    assert finished.folders == ["03-quantize"]
    assert [r["lever"] for r in res.rows] == ["start", "distill", "prune", "quantize"]
    assert (out / "02-prune" / "model.safetensors").stat().st_mtime_ns == before
    assert read_card(out / "03-quantize")["config"]["per_channel"] is False
    assert "per_channel" in (out / "report.json").read_text() and not (tmp_path / ".out.partial").exists()
    again = Measured()
    compress(CompressConfig(**cfg, resume=True), measure=again)  # the same recipe: nothing runs or is measured
    assert again.folders == [] and (out / "report.md").is_file()
    with pytest.raises(EncoderkitError, match=r"cannot resume .*other settings \(calib\)"):
        compress(CompressConfig(**cfg, calib=str(lists), resume=True), measure=Measured())
    assert (out / "report.md").is_file() and not (tmp_path / ".out.partial").exists()  # refused: the output stays put

    import encoderkit.compress.quantize as quantize_mod

    monkeypatch.setattr(prune_mod, "prune", lambda *a, **kw: pytest.fail("a kept step ran again"))
    monkeypatch.setattr(quantize_mod, "quantize", lambda *a, **kw: pytest.fail("a kept step ran again"))
    remeasured = Measured()  # another measurement setting: every step is measured again, none is run again
    res = compress(CompressConfig(**cfg, dev_limit=5, resume=True), measure=remeasured)
    assert remeasured.folders == [reranker.name, "01-distill", "02-prune", "03-quantize"]
    assert json.loads((out / "progress.json").read_text())["identity"]["settings"]["dev_limit"] == 5
    (out / "progress.json").unlink()  # e.g. a folder written before finished runs kept it
    with pytest.raises(EncoderkitError, match=r"cannot resume .*no progress.json.*--overwrite"):
        compress(CompressConfig(**cfg, resume=True), measure=Measured())
    assert (out / "report.md").is_file()


def test_one_writer_at_a_time_and_a_dead_writers_lock_is_taken_over(tmp_path):
    import os
    import subprocess
    import sys

    from encoderkit.io import resumable_dir

    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    with resumable_dir(out, False, False) as work:
        assert lock.read_text() == str(os.getpid())
        (work / "a").write_text("1")
    assert (out / "a").is_file() and not lock.exists()
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".out2.lock").write_text(str(writer.pid))
        with pytest.raises(EncoderkitError, match=rf"another process \(pid {writer.pid}\) is writing .*out2"), \
                resumable_dir(tmp_path / "out2", False, False):
            pass
        assert not (tmp_path / ".out2.partial").exists()
        with resumable_dir(tmp_path / "out3", False, False):  # another folder's writer does not block this one
            pass
    finally:
        writer.kill()
        writer.wait()
    with resumable_dir(tmp_path / "out2", False, False) as work:  # its writer is gone: taken over
        (work / "b").write_text("2")
    assert (tmp_path / "out2" / "b").is_file() and not (tmp_path / ".out2.lock").exists()


def test_a_step_finished_but_not_measured_is_measured_on_resume_not_run_again(reranker, lists, tmp_path, monkeypatch):
    import encoderkit.compress.prune as prune_mod

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    cfg = {"recipe": str(recipe), "model": str(reranker), "dev": str(lists), "out": str(tmp_path / "out"),
           "train": str(lists)}

    class StopAtPrune(Measured):
        def __call__(self, folder: Path) -> dict:
            if Path(folder).name == "02-prune":
                raise Stop("stopped while measuring the pruned model")
            return super().__call__(folder)

    with pytest.raises(Stop):
        compress(CompressConfig(**cfg), measure=StopAtPrune())
    assert (tmp_path / ".out.partial" / "02-prune" / "model.safetensors").is_file()
    monkeypatch.setattr(prune_mod, "prune", lambda *a, **kw: pytest.fail("a finished step ran again"))
    again = Measured()
    res = compress(CompressConfig(**cfg, resume=True), measure=again)
    assert again.folders == ["02-prune", "03-quantize"]
    assert [r["lever"] for r in res.rows] == ["start", "distill", "prune", "quantize"]
