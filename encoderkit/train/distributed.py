"""Data-parallel plumbing: one process, or ``torchrun --nproc_per_node=N`` (DDP; gloo on CPU, nccl on GPU).

The engine asks :func:`current` once and never branches on the backend again; only rank 0 writes files, and
logged values are averaged over ranks.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def mean_dict(self, values: dict[str, float]) -> dict[str, float]:
        """Average float values over ranks (all ranks must hold the same keys)."""
        if not self.active or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(keys, t.tolist())}

    def broadcast_obj(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]


def current() -> DistInfo:
    """The process group if one is set up, else one from torchrun's environment variables
    (``WORLD_SIZE`` > 1), else a single process. CUDA device per local rank when available."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1 and not tdist.is_initialized():
        if cuda:
            torch.cuda.set_device(local)
        tdist.init_process_group(backend="nccl" if cuda else "gloo")
    if tdist.is_initialized():
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        return DistInfo(tdist.get_rank(), tdist.get_world_size(), local, device)
    return DistInfo(device=torch.device("cuda") if cuda else torch.device("cpu"))


def wrap(module: nn.Module, info: DistInfo) -> nn.Module:
    """``module`` in DDP when there is more than one process, else itself."""
    if not info.active:
        return module

    ids = [info.local_rank] if info.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)


def maybe_no_sync(module: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on accumulation micro-steps that are not the last."""
    inner = getattr(module, "_orig_mod", module)
    if sync or not hasattr(inner, "no_sync"):
        return contextlib.nullcontext()
    return inner.no_sync()
