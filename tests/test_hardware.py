"""Hardware detection: canned /proc/cpuinfo texts of the three CPUs seen so far, parsed into
capabilities and into the decisions that depend on them."""

from __future__ import annotations

import pytest
import torch

from encoderkit import hardware
from encoderkit.hardware import CudaDevice, Hardware, bf16_choice, parse_cpuinfo, planner_hardware

BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 fma avx f16c"
AVX2_ONLY = f"""processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: {BASE} avx2 bmi2
"""
VNNI_NO_BF16 = f"""processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz
flags\t\t: {BASE} avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni
"""
BF16_AMX = f"""processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: {BASE} avx2 avx512f avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: {BASE} avx2 avx512f avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\nCPU part\t: 0xd0c\n"


def test_parse_reads_the_first_processor_model_and_flags():
    model, flags = parse_cpuinfo(BF16_AMX)
    assert model == "Intel Xeon Platinum 8480+"
    assert {"avx512_bf16", "amx_tile", "amx_int8"} <= flags and "sse4_2" in flags


@pytest.mark.parametrize("text, avx512, vnni, bf16, amx, words", [
    (AVX2_ONLY, False, False, False, False, "avx2"),
    (VNNI_NO_BF16, True, True, False, False, "avx2 avx512f avx512_vnni"),
    (BF16_AMX, True, True, True, True, "avx2 avx512f avx512_vnni avx_vnni avx512_bf16 amx"),
])
def test_capabilities_from_flags(text, avx512, vnni, bf16, amx, words):
    hw = Hardware.from_cpuinfo(text, threads=2)
    assert hw.avx2 and (hw.avx512, hw.vnni, hw.bf16, hw.amx) == (avx512, vnni, bf16, amx)
    assert " ".join(hw.isa_words()) == words
    line = hw.describe()
    assert line.startswith("CPU ") and f"| 2 threads | {words} | no CUDA" in line


@pytest.mark.parametrize("text, bf16, kind", [
    (AVX2_ONLY, False, "cpu"),
    (VNNI_NO_BF16, False, "cpu-vnni"),
    (BF16_AMX, True, "cpu-vnni"),
])
def test_backend_choices_follow_the_flags(text, bf16, kind):
    hw = Hardware.from_cpuinfo(text)
    choice = bf16_choice(hw)
    assert choice.value is bf16
    assert ("emulated" in choice.why) is not bf16
    planned = planner_hardware(hw)
    assert planned.value == kind
    assert ("AVX2 only" in planned.why) is (text is AVX2_ONLY)


def test_gpus_decide_sparse_planning_and_bf16_by_compute_capability():
    v100, a100 = CudaDevice(0, "Tesla V100", (7, 0), 16.0), CudaDevice(1, "A100", (8, 0), 80.0)
    old = Hardware.from_cpuinfo(AVX2_ONLY, cuda=(v100,))
    assert planner_hardware(old).value == "cpu" and "no 2:4 sparse tensor cores" in planner_hardware(old).why
    assert bf16_choice(old, "cuda", 0).value is False
    both = Hardware.from_cpuinfo(AVX2_ONLY, cuda=(v100, a100))
    assert both.sparse_gpu is a100 and planner_hardware(both).value == "gpu-sparse"
    assert bf16_choice(both, "cuda", 1).value is True
    assert "A100 (compute 8.0, 2:4 sparse tensor cores)" in both.describe()


def test_other_platforms_never_crash():
    hw = Hardware.from_cpuinfo(ARM, threads=4)
    hw = Hardware(cpu=hw.cpu, isa=hw.isa, threads=4, arch="aarch64")
    assert not hw.avx2 and planner_hardware(hw).value == "cpu"
    assert "aarch64, no x86 vector extensions" in hw.describe()
    empty = Hardware.from_cpuinfo("")
    assert empty.cpu == "unknown CPU" and bf16_choice(empty).value is False


def test_this_machine_is_described_and_engine_uses_the_same_answer():
    from encoderkit.train import engine

    hw = hardware.detect()
    assert hw.threads >= 1 and hardware.describe() == hw.describe()
    assert engine.native_bf16 is hardware.native_bf16
    assert hardware.native_bf16(torch.device("cpu")) is hw.bf16


def test_result_field_quotes_the_line_and_every_benchmark_prints_it():
    import shlex
    from pathlib import Path

    fields = dict(kv.split("=", 1) for kv in shlex.split("RESULT a=1 " + hardware.result_field())[1:])
    assert fields == {"a": "1", "hardware": hardware.describe()}
    benches = sorted((Path(__file__).resolve().parents[1] / "bench").glob("*.py"))
    assert benches
    for path in benches:
        text = path.read_text()
        if "__main__" not in text:  # a module the benches share (bench/quality_common.py), not a bench
            continue
        assert 'print(f"hardware: {describe()}", flush=True)' in text, path.name
        assert "result_field()" in text or '"hardware": describe()' in text, path.name
