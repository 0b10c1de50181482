"""What makes a training step fast on the device it runs on, without changing what it computes.

Each lever is measured (2 threads of an AMX Xeon, all-MiniLM-L6-v2 classify at batch 32, and a 4 x 256
BERT pretraining at 32 x 128; bench/finetune_speed.py and bench/pretrain_speed.py):

* :func:`fused_adamw`: AdamW's fused kernel (one vectorised pass over each parameter) on CPU and CUDA; the
  update is AdamW's to float rounding. Pretraining 720 -> 640 ms a step.
* :func:`training_attention`: on CPU, the eager (matmul + softmax) attention of a transformers model while
  it trains. PyTorch's CPU SDPA picks its flash kernel wherever dropout is off or a mask allows it, and that
  kernel's backward is slow in bf16: 14.6 ms of a MiniLM layer's step at 32 x 20 tokens, against 4 ms for the
  eager path; a step is 7-10% faster in bf16 and no slower in fp32 (32 x 20 to 32 x 128). The model's own
  setting (``sdpa``, what inference and export use) is back in place when training ends; nothing is saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def fused_adamw(module: nn.Module, device: torch.device) -> bool | None:
    """``fused=`` for ``torch.optim.AdamW``: True on CPU and CUDA with float parameters, else None (its default)."""
    floats = all(p.is_floating_point() for p in module.parameters())
    return True if device.type in ("cpu", "cuda") and floats else None


def _models(module: nn.Module) -> list[nn.Module]:
    """The outermost transformers models inside ``module`` (itself included)."""
    from transformers import PreTrainedModel

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
