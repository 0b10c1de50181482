"""GPTQ weight-only quantization (Frantar et al., 2022) of the encoder's Linear layers.

Each column of ``W (out, in)`` is rounded in turn and its error, scaled by the Cholesky factor of the inverse
Hessian ``H = 2 X X^T`` of the calibration inputs, pushed onto the columns not yet quantized. :func:`gptq_encoder`
goes layer by layer, collecting each layer's Hessians with the layers before it already quantized, so each layer
corrects for its predecessors' error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from encoderkit.compress.packing import QTensor, QuantSpec, scale_zero
from encoderkit.errors import EncoderkitError
from encoderkit.models.rebuild import encoder_layers
from encoderkit.progress import progress


class HessianAccumulator:
    """Running ``H = 2/n * sum_t x_t x_t^T`` over the input vectors ``x_t (in,)`` of one Linear."""

    def __init__(self, in_features: int) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        """Add inputs ``x (..., in)`` (all leading dimensions are tokens)."""
        x = x.reshape(-1, x.shape[-1]).double()
        m = x.shape[0]
        if m == 0:
            return
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H += x.T @ x


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, spec: QuantSpec, *, act_order: bool = True,
                  damp: float = 0.01, block_size: int = 128) -> QTensor:
    """Quantize ``weight (out, in)`` given the Hessian ``H (in, in)`` of its inputs; returns codes + scales.
    Updates are applied lazily in blocks of ``block_size`` columns; ``act_order`` takes the columns by decreasing
    ``diag(H)`` (the groups follow that order, recorded in ``g_idx``)."""
    W = weight.detach().float().clone()
    H = H.double().clone()
    out_f, in_f = W.shape
    if H.shape != (in_f, in_f):
        raise EncoderkitError(f"GPTQ: Hessian shape {tuple(H.shape)} does not match weight {tuple(W.shape)}")
    dead = torch.diag(H) == 0  # inputs that were always 0: their weights do not matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_f)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(in_f, dtype=H.dtype)
    try:  # U: upper Cholesky factor of H^-1 (float64 for the factorisations, float32 for the sweep)
        Hinv = torch.cholesky_solve(torch.eye(in_f, dtype=H.dtype), torch.linalg.cholesky(H))
        U = torch.linalg.cholesky(Hinv, upper=True).float()
    except torch.linalg.LinAlgError as e:
        raise EncoderkitError("GPTQ: the Hessian is not positive definite; raise --damp (e.g. 0.1) "
                              "or use more calibration samples") from e

    # The column sweep runs in NumPy on the transposed matrix (columns as contiguous rows): it is
    # thousands of tiny rank-1 updates, where torch's intra-op threading costs more than the math.
    gs = in_f if spec.group_size <= 0 else spec.group_size
    lo, hi = spec.qrange()
    Wt = W.T.contiguous().numpy()  # (in, out), permuted column order
    Un = U.numpy()
    codes = np.zeros_like(Wt)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    scale = zero = np.zeros(out_f, dtype=np.float32)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = Wt[i1:i2].copy()
        Err1 = np.zeros_like(W1)
        U1 = Un[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:  # new group: range from its (error-updated) columns
                group = np.concatenate([W1[i:], Wt[i2:]], axis=0)[:gs]
                s_t, z_t = scale_zero(torch.from_numpy(np.ascontiguousarray(group.T)), spec)
                scales.append(s_t)
                zeros.append(z_t if z_t is not None else torch.zeros_like(s_t))
                scale = s_t.numpy()
                zero = z_t.numpy() if z_t is not None else np.zeros_like(scale)
            w = W1[i]
            q = np.clip(np.rint(w / scale) + zero, lo, hi)
            codes[col] = q
            err = (w - (q - zero) * scale) / U1[i, i]
            W1[i:] -= np.outer(U1[i, i:], err)
            Err1[i] = err
        Wt[i2:] -= Un[i1:i2, i2:].T @ Err1
    codes = torch.from_numpy(codes.T.copy())

    inv = torch.argsort(perm)
    g_idx = (torch.arange(in_f) // gs)[inv] if act_order and spec.group_size > 0 else None
    return QTensor(codes[:, inv].to(torch.int32), torch.stack(scales, dim=1).float(),
                   torch.stack(zeros, dim=1).float() if not spec.symmetric else None, g_idx, spec)


class _StopForward(Exception):
    pass


def quantizable_linears(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Linear]]]:
    """Per encoder layer, the (state-dict prefix, Linear) pairs GPTQ/RTN quantize."""
    names = {m: n for n, m in model.named_modules()}
    return [[(names[m], m) for m in layer.modules() if isinstance(m, torch.nn.Linear)]
            for layer in encoder_layers(model)]


@torch.no_grad()
def gptq_encoder(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], spec: QuantSpec, *,
                 act_order: bool = True, damp: float = 0.01, block_size: int = 128) -> dict[str, QTensor]:
    """Quantize every Linear of every encoder layer with GPTQ, sequentially, in place, on tokenised calibration
    ``batches`` (padding left out of the Hessians). The Linear weights then hold their dequantized values; returns
    ``"<module>.weight"`` -> the codes to store."""
    batches = list(batches)
    if not batches:
        raise EncoderkitError("GPTQ needs calibration data: pass --calib-data with at least one text")
    layers = encoder_layers(model)
    result: dict[str, QTensor] = {}
    current_mask: dict[str, torch.Tensor] = {}
    model.eval()
    for li, linears in enumerate(progress(quantizable_linears(model), desc="GPTQ layers")):
        accs = {name: HessianAccumulator(mod.in_features) for name, mod in linears}
        hooks = []
        for name, mod in linears:
            def hook(_m: Any, inputs: tuple[torch.Tensor, ...], _o: Any, name: str = name, accs: dict = accs) -> None:
                x = inputs[0]  # (B, T, in)
                accs[name].add(x[current_mask["m"].bool()])
            hooks.append(mod.register_forward_hook(hook))

        def stop(*_: Any) -> None:
            raise _StopForward

        hooks.append(layers[li].register_forward_hook(stop))
        try:
            for batch in batches:
                current_mask["m"] = batch["attention_mask"]
                try:
                    model(**batch)
                except _StopForward:
                    pass
        finally:
            for h in hooks:
                h.remove()
        for name, mod in linears:
            qt = gptq_quantize(mod.weight, accs[name].H, spec, act_order=act_order, damp=damp, block_size=block_size)
            mod.weight.copy_(qt.dequantize().to(mod.weight.dtype))
            result[f"{name}.weight"] = qt
    return result


def layer_output_error(weight: torch.Tensor, qt: QTensor, X: torch.Tensor) -> float:
    """Relative output error ``||W X - Q X||_F / ||W X||_F`` for inputs ``X (n, in)``."""
    ref = X @ weight.float().T
    return float(torch.linalg.norm(ref - X @ qt.dequantize().T) / torch.linalg.norm(ref))
