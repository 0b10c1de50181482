"""The training-step levers change speed, not what a step computes (encoderkit.train.step_speed)."""

from __future__ import annotations

import pytest
import torch

from encoderkit.models.load import build_encoder
from encoderkit.models.mlm import MaskedOnlyMLM
from encoderkit.models.presets import build_config
from encoderkit.train import step_speed


def _tiny_mlm() -> torch.nn.Module:
    config = build_config(None, 120, 64, layers=2, hidden=32, heads=4, ffn=64, dropout=0.0,
                          special_ids={"pad": 0, "cls": 2, "sep": 3})
    return MaskedOnlyMLM(build_encoder(config, seed=0))


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 120, (3, 20), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 12:] = 0  # padding: the mask path of both kernels
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    return ids, attention, labels


def test_training_attention_is_eager_inside_and_restored_after() -> None:
    module = _tiny_mlm()
    inner = module.model
    assert inner.config._attn_implementation == "sdpa"
    with step_speed.training_attention(module, torch.device("cpu")):
        assert inner.config._attn_implementation == "eager"
    assert inner.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), step_speed.training_attention(module, torch.device("cpu")):
        raise RuntimeError("a failed step")
    assert inner.config._attn_implementation == "sdpa"  # restored on an error too
    with step_speed.training_attention(module, torch.device("cuda")):  # SDPA's fused kernels pay on a GPU
        assert inner.config._attn_implementation == "sdpa"


def test_eager_training_attention_computes_the_same_loss_and_gradients() -> None:
    module = _tiny_mlm()
    ids, attention, labels = _batch()
    loss_sdpa = module(ids, labels, attention)[0]
    loss_sdpa.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    with step_speed.training_attention(module, torch.device("cpu")):
        loss_eager = module(ids, labels, attention)[0]
        loss_eager.backward()
    assert torch.allclose(loss_sdpa, loss_eager, atol=1e-5)
    for n, p in module.named_parameters():
        if n in grads:
            assert torch.allclose(grads[n], p.grad, atol=1e-5), n


def test_fused_adamw_only_for_float_parameters_on_cpu_and_cuda() -> None:
    module = _tiny_mlm()
    assert step_speed.fused_adamw(module, torch.device("cpu")) is True
    assert step_speed.fused_adamw(module, torch.device("meta")) is None
    module.model.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
    assert step_speed.fused_adamw(module, torch.device("cpu")) is None
