"""`encoderkit doctor`: what this machine is, how fast it multiplies matrices, and which backend
each stage will pick here and why.

Peaks are measured on the kernels the backends run (fp32/bf16 ``torch.matmul``, int8 ``torch._int_mm`` and
ONNX Runtime's ``MatMulInteger``), at torch's current thread count, so a choice can be checked on the machine.
"""

from __future__ import annotations

import importlib.metadata as md
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from encoderkit import hardware
from encoderkit.compress.plan import PlanConfig, make_plan
from encoderkit.config import StageConfig, arg, check
from encoderkit.hardware import Choice, Hardware
from encoderkit.inference.policy import MEASURED, auto_by_cpu_class, cpu_class, serve_rule


@dataclass
class DoctorConfig(StageConfig):
    """Settings of `encoderkit doctor`."""

    size: int = arg(512, help="Side of the square matrices of the peak measurement (size x size @ size x size).")
    seconds: float = arg(0.3, help="Seconds of repeated products per dtype (the best run counts).")
    json: bool = arg(False, help="Print one JSON object instead of text.")

    def validate(self) -> None:
        check(self.size >= 16 and self.size % 8 == 0, f"size must be a multiple of 8, at least 16; got {self.size}")
        check(self.seconds > 0, f"seconds must be > 0, got {self.seconds}")


@dataclass
class Peak:
    """One measured matrix-multiply rate; ``ops_per_s`` is None when the kernel is not available."""

    dtype: str
    kernel: str
    device: str
    shape: str
    ops_per_s: float | None
    note: str = ""


def _best_rate(fn: Callable[[], Any], ops: float, seconds: float, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()  # warm-up (and kernel selection) outside the timing
    best, start = 0.0, time.perf_counter()
    while True:
        t = time.perf_counter()
        fn()
        sync()
        best = max(best, ops / (time.perf_counter() - t))
        if time.perf_counter() - start >= seconds:
            return best


def matmul_rate(dtype: Any, n: int = 512, seconds: float = 0.3, device: str = "cpu") -> float:
    """FLOP/s of ``torch.matmul`` of two (n, n) matrices in ``dtype`` on ``device`` (best run)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    return _best_rate(lambda: x @ y, 2 * n**3, seconds, sync)


def torch_peaks(n: int, seconds: float, device: str = "cpu") -> list[Peak]:
    """fp32 and bf16 ``torch.matmul`` and int8 ``torch._int_mm`` (int32 out) of (n, n) @ (n, n)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    g = torch.Generator().manual_seed(0)
    shape = f"({n}, {n}) @ ({n}, {n})"
    out = [Peak(name, "torch.matmul", device, shape, matmul_rate(dtype, n, seconds, device))
           for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))]
    xi = torch.randint(-128, 128, (n, n), dtype=torch.int8, generator=g).to(device)
    yi = torch.randint(-128, 128, (n, n), dtype=torch.int8, generator=g).to(device)
    try:
        rate = _best_rate(lambda: torch._int_mm(xi, yi), 2 * n**3, seconds, sync)
        out.append(Peak("int8", "torch._int_mm", device, shape, rate))
    except (RuntimeError, AttributeError) as e:
        out.append(Peak("int8", "torch._int_mm", device, shape, None, f"not available: {str(e).splitlines()[0][:80]}"))
    return out


def onnx_int8_peak(n: int, seconds: float, threads: int) -> Peak:
    """ONNX Runtime ``MatMulInteger`` (uint8 activations x int8 weights, as dynamic INT8 runs them)."""
    shape = f"({n}, {n}) @ ({n}, {n})"
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return Peak("int8", "onnxruntime MatMulInteger", "cpu", shape, None,
                    "onnxruntime not installed (pip install encoderkit[deploy])")
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "B"], ["Y"])], "matmul_integer",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, [n, n]),
         helper.make_tensor_value_info("B", TensorProto.INT8, [n, n])],
        [helper.make_tensor_value_info("Y", TensorProto.INT32, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"A": rng.integers(0, 256, (n, n), dtype=np.uint8), "B": rng.integers(-128, 128, (n, n), dtype=np.int8)}
    rate = _best_rate(lambda: sess.run(None, feeds), 2 * n**3, seconds)
    return Peak("int8", "onnxruntime MatMulInteger (u8 x s8)", "cpu", shape, rate)


def backend_choices(hw: Hardware) -> dict[str, Choice]:
    """What each stage picks on ``hw`` and why (pure: no measurement, no files)."""
    device = "cuda" if hw.cuda else "cpu"
    bf16 = hardware.bf16_choice(hw, device)
    train = Choice(f"bf16 autocast {'on' if bf16.value else 'off'} ({device})", bf16.why)

    int8_why = ("INT8 matrix multiplies run on the CPU's VNNI/AMX int8 dot products here" if hw.vnni else
                "this CPU has no VNNI/AMX: ONNX Runtime's u8 x s8 INT8 runs on AVX2 multiply-adds, gains less and "
                "can saturate (quantizing with reduce_range is ONNX Runtime's advice for such CPUs)")
    serve = Choice(serve_rule(hw),  # the engine policy: what ``--backend auto`` runs
                   "for embeddings the fastest faithful engine whose output does not depend on the batch (per CPU "
                   "class below); INT8 for the other tasks where the "
                   "folder's own dev rows say INT8 and FP32 agree (each folder's reason: Predictor.backend_reason, "
                   f"serve's startup line; --backend onnx-int8 forces it); {int8_why}")

    kind = hardware.planner_hardware(hw)
    plans = []
    for budget, teacher in (("none", False), ("some", True)):
        plan = make_plan(PlanConfig(budget=budget, teacher=teacher, goal="latency", hardware=kind.value))
        quant = plan.quantization()
        steps = [s.lever + (f"({', '.join(f'{k}={v}' for k, v in s.params.items())})" if s is quant else "")
                 for s in plan.steps]
        plans.append(f"budget {budget}{' + teacher' if teacher else ''}: {' -> '.join(steps)}")
    planner = Choice(f"--hardware auto = {kind.value}; " + "; ".join(plans), kind.why)
    return {"pretrain / finetune / distill": train, "predict / serve (--backend auto)": serve,
            "compress plan (latency goal)": planner}


@dataclass
class DoctorResult:
    hardware: Hardware
    peaks: list[Peak]
    choices: dict[str, Choice]
    threads: int
    versions: dict[str, str] = field(default_factory=dict)
    as_json: bool = False

    def by_cpu_class(self) -> list[dict[str, Any]]:
        """What ``auto`` runs a plain embed folder on per CPU class, why, and its measured ratio to the best peer."""
        here = cpu_class(self.hardware)
        return [{"cpu_class": kind, "this_cpu": kind == here, "backend": c.value, "why": c.why,
                 "against_best_peer": MEASURED[kind]} for kind, c in auto_by_cpu_class()]

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware.describe(), "details": self.hardware.as_dict(), "threads": self.threads,
                "versions": self.versions,
                "peaks": [{"dtype": p.dtype, "kernel": p.kernel, "device": p.device, "shape": p.shape,
                           "gops": None if p.ops_per_s is None else round(p.ops_per_s / 1e9, 1), "note": p.note}
                          for p in self.peaks],
                "choices": {k: {"choice": c.value, "why": c.why} for k, c in self.choices.items()},
                "embed_auto_by_cpu_class": self.by_cpu_class()}

    def text(self) -> str:
        lines = [f"hardware: {self.hardware.describe()}",
                 "versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()), "",
                 f"matrix-multiply peaks (best of repeated runs, {self.threads} torch thread(s); int8 in GOP/s):"]
        fp32 = {p.device: p.ops_per_s for p in self.peaks if p.dtype == "fp32"}
        for p in self.peaks:
            if p.ops_per_s is None:
                lines.append(f"  {p.dtype:<5} {p.kernel:<38} {p.device:<6} {p.shape}: {p.note}")
                continue
            base = fp32.get(p.device)
            ratio = f"  ({p.ops_per_s / base:.1f}x fp32)" if base and p.dtype != "fp32" else ""
            lines.append(f"  {p.dtype:<5} {p.kernel:<38} {p.device:<6} {p.shape}: {p.ops_per_s / 1e9:8.1f} "
                         f"G{'FLOP' if p.dtype != 'int8' else 'OP'}/s{ratio}")
        lines += ["", "backends each stage picks on this machine:"]
        for stage, c in self.choices.items():
            lines += [f"  {stage}: {c.value}", f"    why: {c.why}"]
        lines += ["", ("embed --backend auto per CPU class (a plain weights folder; ratio: bench/embed_peers.py "
                       "against the best peer, docs/deploy.md):")]
        for row in self.by_cpu_class():
            mark = " (this CPU)" if row["this_cpu"] else ""
            lines += [(f"  {row['cpu_class']}{mark}: {row['backend']}; against the best peer: "
                      f"{row['against_best_peer']}"), f"    because: {row['why'].split('; CPU class')[0]}"]
        return "\n".join(lines)

    def summary(self) -> dict[str, Any] | str:
        return self.to_dict() if self.as_json else self.text()


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "onnxruntime", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run(cfg: DoctorConfig) -> DoctorResult:
    """Print this machine's hardware line, measured matrix-multiply peaks (fp32, bf16, int8) and
    which backend each stage picks here and why; exits 0 on any machine."""
    hw = hardware.detect()
    threads = torch.get_num_threads()
    peaks = torch_peaks(cfg.size, cfg.seconds, "cpu") + [onnx_int8_peak(cfg.size, cfg.seconds, threads)]
    if hw.cuda:
        peaks += torch_peaks(cfg.size, cfg.seconds, "cuda:0")
    return DoctorResult(hw, peaks, with_measurements(backend_choices(hw), peaks), threads, _versions(), cfg.json)


def with_measurements(choices: dict[str, Choice], peaks: list[Peak]) -> dict[str, Choice]:
    """The choices with the measured ratio that backs (or questions) each: bf16 and ONNX INT8 against fp32."""
    def rate(dtype: str, kernel: str) -> float | None:
        return next((p.ops_per_s for p in peaks if p.dtype == dtype and p.kernel.startswith(kernel)
                     and p.device == "cpu"), None)

    fp32, out = rate("fp32", "torch"), dict(choices)
    for key, dtype, kernel, name in (("pretrain / finetune / distill", "bf16", "torch", "bf16 torch.matmul"),
                                     ("predict / serve (--backend auto)", "int8", "onnxruntime", "ONNX Runtime int8")):
        other = rate(dtype, kernel)
        if key in out and fp32 and other and not out[key].value.endswith("(cuda)"):
            shape = peaks[0].shape
            out[key] = Choice(out[key].value, f"{out[key].why}; measured here: {name} {other / fp32:.1f}x fp32 on the "
                                              f"CPU at {shape}")
    return out
