"""Two gloo processes under torchrun give the same weights as one process with the same global
batch (one process accumulates the two micro-batches the two ranks read)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from encoderkit.data.masking import Masker, MaskingSpec
    from encoderkit.models.load import build_encoder
    from encoderkit.models.mlm import MaskedOnlyMLM, mlm_loss_fn
    from encoderkit.models.presets import build_config
    from encoderkit.train import distributed
    from encoderkit.train.engine import IndexedBatches, TrainSettings, fit

    out, grad_accum = sys.argv[1], int(sys.argv[2])
    blocks = np.random.default_rng(0).integers(5, 100, size=(64, 32))
    blocks[:, 0] = 2
    masker = Masker(spec=MaskingSpec(rate=0.3), seed=1, mask_id=4, pad_id=0, special_ids=[0, 1, 2, 3, 4], '''
    '''vocab_size=100)
    source = IndexedBatches(len(blocks), 4, lambda idx, epoch: masker(blocks[idx], idx, epoch), seed=3)
    config = build_config(None, 100, 64, layers=2, hidden=32, heads=4, ffn=64, dropout=0.1)
    mlm = MaskedOnlyMLM(build_encoder(config, seed=0))
    initial = {k: v.clone() for k, v in mlm.model.state_dict().items()}
    settings = TrainSettings(lr=3e-3, max_steps=6, batch_size=4, grad_accum=grad_accum, warmup=2, progress=False)
    result = fit(mlm, mlm_loss_fn, source, settings, out + "-run")
    if distributed.current().is_main:
        save_file({k: v.clone() for k, v in mlm.model.state_dict().items()}, out + ".safetensors")
        save_file(initial, out + ".init.safetensors")
        print("LOSS", result.train_logs["loss"])
''')


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_gloo_processes_match_one_process(tmp_path) -> None:
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, str(script), str(tmp_path / "one"), "2"],
                         capture_output=True, text=True, env=env, timeout=170, check=False)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(tmp_path / "two"), "1"], capture_output=True, text=True, env=env,
                         timeout=170, check=False)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    init = load_file(tmp_path / "one.init.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-5, rtol=1e-4), name
    loss_one = float(one.stdout.split("LOSS")[1])
    loss_two = float(two.stdout.split("LOSS")[1])
    assert loss_one == pytest.approx(loss_two, rel=1e-4)
    moved = max(float((a[n] - init[n]).abs().max()) for n in a)
    assert moved > 1e-3  # the weights did train, so equality is not trivial
