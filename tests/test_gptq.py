"""GPTQ: Hessian accumulation, error feedback beats round-to-nearest, storage round trips."""

from __future__ import annotations

import pytest
import torch

from encoderkit.compress.gptq import HessianAccumulator, gptq_quantize, layer_output_error
from encoderkit.compress.packing import QuantSpec, from_storage, pack_int4, rtn_quantize, to_storage, unpack_int4


def _correlated(n: int = 1024, d: int = 64, rank: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, rank, generator=g) @ torch.randn(rank, d, generator=g) + 0.05 * torch.randn(n, d, generator=g)


def test_hessian_accumulates_in_chunks_like_one_pass() -> None:
    x = _correlated()
    acc = HessianAccumulator(64)
    for chunk in x.split(100):
        acc.add(chunk)
    torch.testing.assert_close(acc.H, 2 * x.double().T @ x.double() / len(x))


@pytest.mark.parametrize(("bits", "group", "act_order", "sym"),
                         [(4, 16, True, True), (4, -1, False, False), (8, 32, True, True)])
def test_gptq_beats_rtn_on_correlated_inputs(bits: int, group: int, act_order: bool, sym: bool) -> None:
    x = _correlated()
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    acc = HessianAccumulator(64)
    acc.add(x)
    spec = QuantSpec(bits, group, sym)
    rtn = layer_output_error(w, rtn_quantize(w, spec), x)
    gq = gptq_quantize(w, acc.H, spec, act_order=act_order, block_size=16)
    err = layer_output_error(w, gq, x)
    assert err < 0.6 * rtn, (err, rtn)
    lo, hi = spec.qrange()
    assert gq.q.min() >= lo and gq.q.max() <= hi
    if act_order and group > 0:  # groups follow the permuted order: every group holds `group` columns
        assert torch.bincount(gq.g_idx).tolist() == [group] * (64 // group)


def test_int4_packing_is_two_codes_per_byte_and_round_trips() -> None:
    codes = torch.randint(0, 16, (5, 7))
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 4)
    assert torch.equal(unpack_int4(packed, 7), codes)


@pytest.mark.parametrize(("bits", "sym", "dtype", "cols"),
                         [(8, True, torch.int8, 64), (8, False, torch.uint8, 64), (4, True, torch.uint8, 32)])
def test_storage_dtypes_and_round_trip(bits: int, sym: bool, dtype: torch.dtype, cols: int) -> None:
    w = torch.randn(16, 64)
    qt = rtn_quantize(w, QuantSpec(bits, 16, sym))
    st = to_storage("w", qt)
    assert st["w.qweight"].dtype == dtype and st["w.qweight"].shape == (16, cols)
    assert st["w.scale"].dtype == torch.float16 and st["w.scale"].shape == (16, 4)
    assert ("w.zero" in st) == (not sym)
    back = from_storage("w", st, {"bits": bits, "group_size": 16, "symmetric": sym, "shape": [16, 64]})
    assert torch.equal(back.dequantize(), qt.dequantize())
    # the error is at most half a step (symmetric), one step with a rounded zero point
    step = qt.scale[:, torch.arange(64) // 16]
    assert ((qt.dequantize() - w).abs() <= step * (0.5 if sym else 1.0) + 1e-6).all()
