"""A pretraining run killed with SIGKILL mid-run and resumed ends with the same weights as an
uninterrupted run (same thread count, so the arithmetic is the same)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from encoderkit.train.pretrain import PretrainConfig, run
from tests.kill import run_until_then_kill
from tests.test_pretrain import SENTENCE, make_store

CHILD = textwrap.dedent('''
    import json, sys, time
    import encoderkit.train.pretrain as pretrain

    real_loss = pretrain.mlm_loss_fn

    def slow_loss(module, batch):  # slow enough that the parent can kill it mid-run
        time.sleep(0.15)
        return real_loss(module, batch)

    pretrain.mlm_loss_fn = slow_loss
    pretrain.run(pretrain.PretrainConfig(**json.loads(sys.argv[1])))
''')


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, tiny_tokenizer_dir) -> None:
    store = make_store(tmp_path, tiny_tokenizer_dir, "\n".join([SENTENCE * 2, "the man said he was good"] * 40) + "\n")
    settings = {"data": str(store), "layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "dropout": 0.1, "batch_size": 4,
                "grad_accum": 2,
                    "lr": 3e-3, "max_steps": 16, "warmup": 3, "save_every": 2, "eval_blocks": 8, "bf16": "off"}
    killed = dict(settings, out=str(tmp_path / "killed"))
    checkpoints = tmp_path / "killed-run" / "checkpoints"
    run_until_then_kill(CHILD, killed, checkpoints / "step-0000006", tmp_path, torch.get_num_threads())
    assert not (tmp_path / "killed").exists()  # nothing half-written under the output name
    last = max(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*"))
    assert 6 <= last < 16

    resumed = run(PretrainConfig(**killed, resume=True))
    assert resumed.steps == 16
    reference = run(PretrainConfig(**settings, out=str(tmp_path / "reference")))
    a = load_file(Path(tmp_path / "killed" / "model.safetensors"))
    b = load_file(Path(tmp_path / "reference" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    assert resumed.metrics["heldout_loss"] == pytest.approx(reference.metrics["heldout_loss"], abs=1e-6)
