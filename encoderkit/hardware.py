"""The machine we run on, found rather than assumed: CPU model and instruction sets (``/proc/cpuinfo``, else
torch's probes), usable threads, CUDA devices. Nothing here raises: an unknown machine is described as such.

Every hardware-dependent choice (bf16 autocast, the planner's ``--hardware auto``, ``encoderkit doctor``) asks
this module, so that the reasons agree.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# flag spellings of /proc/cpuinfo that decide something here, in the order they are printed
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
# torch.cpu probes used when /proc/cpuinfo is missing: probe name -> flag
TORCH_PROBES = {"_is_avx2_supported": "avx2", "_is_avx512_supported": "avx512f", "_is_vnni_supported": "avx512_vnni",
                "_is_avx512_bf16_supported": "avx512_bf16", "_is_amx_tile_supported": "amx_tile"}


@dataclass(frozen=True)
class CudaDevice:
    """One CUDA device; ``capability`` is (major, minor) compute capability."""

    index: int
    name: str
    capability: tuple[int, int]
    memory_gib: float = 0.0

    @property
    def sparse_tensor_cores(self) -> bool:
        """2:4 semi-structured sparse tensor cores exist from Ampere (compute capability 8.0) on."""
        return tuple(self.capability) >= (8, 0)

    @property
    def bf16(self) -> bool:
        """Native bf16 tensor-core matmuls (Ampere and later); older GPUs emulate bf16 slowly."""
        return tuple(self.capability) >= (8, 0)

    def describe(self) -> str:
        sparse = ", 2:4 sparse tensor cores" if self.sparse_tensor_cores else ""
        return f"cuda:{self.index} {self.name} (compute {self.capability[0]}.{self.capability[1]}{sparse})"


@dataclass(frozen=True)
class Hardware:
    """What :func:`detect` found; build one from canned text with :meth:`from_cpuinfo` in tests."""

    cpu: str
    isa: frozenset[str]
    threads: int
    cuda: tuple[CudaDevice, ...] = ()
    source: str = "/proc/cpuinfo"  # where ``isa`` came from: /proc/cpuinfo, torch, or none
    arch: str = field(default_factory=platform.machine)

    @classmethod
    def from_cpuinfo(cls, text: str, threads: int = 1, cuda: tuple[CudaDevice, ...] = ()) -> Hardware:
        model, flags = parse_cpuinfo(text)
        return cls(cpu=model or "unknown CPU", isa=flags, threads=threads, cuda=cuda)

    # -- capabilities --------------------------------------------------------------------------
    @property
    def avx2(self) -> bool:
        return "avx2" in self.isa

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.isa

    @property
    def vnni(self) -> bool:
        """INT8 dot-product instructions: AVX512-VNNI, AVX-VNNI (256-bit) or AMX-INT8 tiles."""
        return bool(self.isa & {"avx512_vnni", "avx_vnni", "amx_int8"})

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.isa

    def vnni_names(self) -> list[str]:
        """The INT8 dot-product instruction sets this CPU has, by name (AVX512-VNNI, AVX-VNNI, AMX-INT8)."""
        return [n for n, f in (("AVX512-VNNI", "avx512_vnni"), ("AVX-VNNI", "avx_vnni"), ("AMX-INT8", "amx_int8"))
                if f in self.isa]

    @property
    def bf16(self) -> bool:
        """Native bf16 matmuls on the CPU: AVX512-BF16 or AMX-BF16 (elsewhere bf16 is emulated)."""
        return bool(self.isa & {"avx512_bf16", "amx_bf16"})

    @property
    def sparse_gpu(self) -> CudaDevice | None:
        """The first CUDA device with 2:4 sparse tensor cores, if any."""
        return next((d for d in self.cuda if d.sparse_tensor_cores), None)

    # -- description ---------------------------------------------------------------------------
    def isa_words(self) -> list[str]:
        """The instruction sets that matter here, AMX's three flags shown as one word ``amx``."""
        words = [f for f in ISA_FLAGS if f in self.isa and not f.startswith("amx")]
        if self.amx:
            kinds = [k for k in ("int8", "bf16") if f"amx_{k}" in self.isa]
            words.append("amx" + (f"({','.join(kinds)})" if kinds and len(kinds) < 2 else ""))
        return words

    def describe(self) -> str:
        """One line: CPU model | usable threads | instruction sets | CUDA devices."""
        isa = " ".join(self.isa_words()) or ("no AVX2" if self.arch.lower() in ("x86_64", "amd64", "i686")
                                             else f"{self.arch or 'unknown arch'}, no x86 vector extensions")
        if self.source == "torch":
            isa += " (from torch's probes)"
        gpus = "; ".join(d.describe() for d in self.cuda) if self.cuda else "no CUDA"
        return f"CPU {self.cpu} | {self.threads} threads | {isa} | {gpus}"

    def as_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "arch": self.arch, "threads": self.threads, "isa": self.isa_words(),
                "isa_source": self.source, "avx2": self.avx2, "avx512": self.avx512, "vnni": self.vnni,
                "bf16": self.bf16, "amx": self.amx,
                "cuda": [asdict(d) | {"sparse_tensor_cores": d.sparse_tensor_cores} for d in self.cuda]}


# -- detection ---------------------------------------------------------------------------------

def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags from ``/proc/cpuinfo`` text (x86 ``flags``,
    ARM ``Features``)."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = clean_model_name(value)
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def clean_model_name(name: str) -> str:
    """'Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz' -> 'Intel Xeon Platinum 8480+ CPU @ 2.00GHz'."""
    return re.sub(r"\s+", " ", re.sub(r"\((R|TM|tm|r)\)", "", name)).strip()


def usable_threads() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _torch_isa() -> frozenset[str]:
    try:
        cpu = getattr(torch, "cpu", None)
        found = {flag for probe, flag in TORCH_PROBES.items() if getattr(cpu, probe, lambda: False)()}
        cap = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
        if cap in ("AVX2", "AVX512"):
            found.add("avx2")
        if cap == "AVX512":
            found.add("avx512f")
        return frozenset(found)
    except Exception:  # noqa: BLE001 -- an exotic build or platform: report nothing rather than fail
        return frozenset()


def _cuda_devices() -> tuple[CudaDevice, ...]:
    try:
        if not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(CudaDevice(i, p.name, (p.major, p.minor), round(p.total_memory / 2**30, 1)))
        return tuple(out)
    except Exception:  # noqa: BLE001 -- a broken driver must not stop a CPU run: report no CUDA
        return ()


@functools.lru_cache(maxsize=1)
def detect() -> Hardware:
    """This machine (cached: the hardware does not change while we run)."""
    model, flags, source = "", frozenset(), "none"
    try:
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
        source = "/proc/cpuinfo" if flags else source
    except OSError:
        pass
    if not flags:
        flags = _torch_isa()
        source = "torch" if flags else "none"
    model = model or clean_model_name(platform.processor() or "") or "unknown CPU"
    return Hardware(cpu=model, isa=frozenset(flags), threads=usable_threads(), cuda=_cuda_devices(), source=source)


def describe() -> str:
    """The one-line description of this machine that every benchmark and report prints."""
    return detect().describe()


def result_field() -> str:
    """``hardware="..."``: the machine as one field of a benchmark's ``RESULT key=value ...`` line."""
    return "hardware=" + json.dumps(describe())


# -- decisions ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    """A hardware-dependent decision and why it was taken."""

    value: Any
    why: str


def bf16_choice(hw: Hardware, device_type: str = "cpu", index: int = 0) -> Choice:
    """Whether bf16 autocast pays on ``device_type`` (training and evaluation); off where bf16
    would be emulated, which costs time instead of saving it."""
    if device_type == "cuda":
        dev = next((d for d in hw.cuda if d.index == index), None)
        if dev is None:
            return Choice(False, f"no CUDA device {index}")
        return Choice(dev.bf16, f"{dev.name} has {'native' if dev.bf16 else 'no native'} bf16 tensor cores "
                                f"(compute {dev.capability[0]}.{dev.capability[1]}; native from 8.0)")
    if device_type != "cpu":
        return Choice(False, f"bf16 autocast is not planned for device type {device_type!r}")
    if hw.bf16:
        which = "AMX-BF16" if "amx_bf16" in hw.isa else "AVX512-BF16"
        return Choice(True, f"the CPU has {which}: bf16 matmuls are native")
    return Choice(False, "the CPU has neither AVX512-BF16 nor AMX: bf16 matmuls would be emulated (slower than fp32)")


def native_bf16(device: Any) -> bool:
    """Whether bf16 autocast pays on a ``torch.device`` of this machine."""
    return bool(bf16_choice(detect(), device.type, device.index or 0).value)


PLANNER_HARDWARE = ("cpu", "cpu-vnni", "gpu-sparse")


def planner_hardware(hw: Hardware) -> Choice:
    """The planner's hardware kind (``cpu``, ``cpu-vnni`` or ``gpu-sparse``) for ``hw``, with why."""
    sparse = hw.sparse_gpu
    if sparse is not None:
        return Choice("gpu-sparse", f"{sparse.describe()}: 2:4 sparsity runs faster there")
    no_sparse = ""
    if hw.cuda:
        names = ", ".join(d.describe() for d in hw.cuda)
        no_sparse = f"{names} has no 2:4 sparse tensor cores (compute < 8.0), so the plan is for the CPU; "
    if hw.vnni:
        which = ", ".join(hw.vnni_names())
        return Choice("cpu-vnni", f"{no_sparse}the CPU has {which}: INT8 matrix multiplies run on int8 dot-product "
                                  "instructions")
    isa = "AVX2 only" if hw.avx2 and not hw.avx512 else "AVX-512 without VNNI" if hw.avx512 else "no AVX2"
    return Choice("cpu", f"{no_sparse}the CPU has no VNNI/AMX int8 dot products ({isa}): "
                         "INT8 still cuts bytes, with a smaller speed-up")
