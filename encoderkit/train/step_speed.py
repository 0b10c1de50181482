"""What makes a training step fast on the device it runs on, without changing what it computes.

:func:`fused_adamw` (AdamW's fused kernel); on CPU :func:`training_attention` (the eager attention while training:
the backward of CPU SDPA's flash kernel is slow in bf16), :func:`embedding_grad_buffer` (one kept gradient buffer
for the input embedding instead of a fresh vocabulary-sized tensor of zeros every step) and :func:`quick_dropout`
(masks from 16-bit lanes of random words instead of one draw per element). Each gives the same update up to float
rounding (the measurements: docs/results/adapt-from-code.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel


def fused_adamw(module: nn.Module, device: torch.device) -> bool | None:
    """``fused=`` for ``torch.optim.AdamW``: True on CPU and CUDA with float parameters, else None (its default)."""
    floats = all(p.is_floating_point() for p in module.parameters())
    return True if device.type in ("cpu", "cuda") and floats else None


def _models(module: nn.Module) -> list[nn.Module]:
    """The outermost transformers models inside ``module`` (itself included)."""
    found: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if isinstance(m, PreTrainedModel):
            found.append(m)
            return
        for child in m.children():
            walk(child)

    walk(module)
    return found


@contextlib.contextmanager
def training_attention(module: nn.Module, device: torch.device) -> Iterator[None]:
    """On CPU, every transformers model inside ``module`` runs its eager attention inside the block; the
    attention each had is restored after it (also on an error). Elsewhere (CUDA: SDPA's fused kernels pay)
    nothing changes."""
    switched: list[tuple[nn.Module, str]] = []
    if device.type == "cpu":
        for model in _models(module):
            before = getattr(model.config, "_attn_implementation", None)
            if before in (None, "eager") or not hasattr(model, "set_attn_implementation"):
                continue
            try:
                model.set_attn_implementation("eager")
            except (ValueError, NotImplementedError):  # a model without an eager path keeps its own
                continue
            switched.append((model, before))
    try:
        yield
    finally:
        for model, before in switched:
            model.set_attn_implementation(before)


def _embeddings_alone(module: nn.Module) -> list[nn.Embedding]:
    """The input embeddings of the transformers models in ``module`` whose weight trains and is used by no
    other module (a weight tied to an output layer also gets a dense gradient there, so it is left alone)."""
    found = []
    for model in _models(module):
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if not isinstance(emb, nn.Embedding) or emb.sparse or not emb.weight.requires_grad:
            continue
        holders = [m for m in module.modules() if any(q is emb.weight for q in m.parameters(recurse=False))]
        if len(holders) == 1:
            found.append(emb)
    return found


@contextlib.contextmanager
def embedding_grad_buffer(module: nn.Module, device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Inside the block, on CPU (and when ``enabled``: one process, not compiled), each untied input embedding
    of ``module`` computes its gradient sparsely, and a hook run after the gradient is accumulated adds it into
    a dense buffer kept for the run (rows the previous step touched zeroed first: the others are zero already),
    which becomes ``weight.grad``. Micro-batches accumulate into that buffer as into any dense gradient. The
    embeddings are as they were after the block (also on an error)."""
    undo: list[Any] = []
    if enabled and device.type == "cpu":
        for emb in _embeddings_alone(module):
            undo.append(_buffer_grads(emb))
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _buffer_grads(emb: nn.Embedding) -> Any:
    """Turn the buffer on for ``emb``; returns the function that turns it off."""
    weight = emb.weight
    state: dict[str, Any] = {"buffer": None, "rows": None, "pending": []}

    def record(_module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled() and emb.training:
            state["pending"].append(args[0].reshape(-1))

    def accumulated(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and grad.is_sparse:  # the step's first micro-batch: start from zeros
            buffer = state["buffer"]
            if buffer is None:
                buffer = state["buffer"] = torch.zeros_like(param)
            elif state["rows"] is not None:
                buffer.index_fill_(0, state["rows"], 0)
            state["rows"] = None
            buffer.add_(grad)
            param.grad = buffer
        if state["pending"]:  # rows that may now be non-zero in the buffer
            rows = torch.cat([*([state["rows"]] if state["rows"] is not None else []), *state["pending"]])
            state["rows"], state["pending"] = torch.unique(rows), []

    emb.sparse = True
    handles = [emb.register_forward_pre_hook(record), weight.register_post_accumulate_grad_hook(accumulated)]

    def restore() -> None:
        emb.sparse = False
        for h in handles:
            h.remove()
        if weight.grad is not None and weight.grad is state["buffer"]:
            weight.grad = weight.grad.clone()  # the run's buffer is not handed on

    return restore


class _MaskedScale(torch.autograd.Function):
    """``x * keep * scale`` with ``keep`` a bool mask: saves the mask (1 byte per element), not ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None, None


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout of ``x`` with drop probability ``p`` rounded to 1/65,536; the kept values are scaled by
    its exact inverse (unbiased), and the masks come from torch's generator (a seeded run repeats itself)."""
    drop = round(p * 65536)
    if drop <= 0:
        return x
    if drop >= 65536:
        return x * 0
    n = x.numel()
    lanes = torch.empty((n + 3) // 4 * 4, dtype=torch.int16, device=x.device)
    lanes.view(torch.int64).random_(-(2**63), 2**63 - 1)  # the whole 64-bit range: every lane uniform
    keep = lanes[:n].view(x.shape) >= drop - 32768
    return _MaskedScale.apply(x, keep, 65536 / (65536 - drop))


@contextlib.contextmanager
def quick_dropout(module: nn.Module, device: torch.device) -> Iterator[None]:
    """On CPU, every ``nn.Dropout`` in ``module`` runs :func:`dropout` while it trains, inside the block; the
    layers are as they were after it (also on an error). Elsewhere nothing changes."""
    changed = []
    if device.type == "cpu":
        for m in module.modules():
            if type(m) is nn.Dropout and not m.inplace and "forward" not in vars(m):
                m.forward = _dropout_forward(m)
                changed.append(m)
    try:
        yield
    finally:
        for m in changed:
            del m.forward


def _dropout_forward(layer: nn.Dropout) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dropout(x, layer.p) if layer.training else x  # p = 0 returns x there
    return forward
