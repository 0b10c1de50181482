"""`encoderkit doctor`: the backend each stage picks on the three CPUs seen so far (and a sparse
GPU), and a real run that prints every section."""

from __future__ import annotations

import json

import pytest

from encoderkit.doctor import backend_choices
from encoderkit.hardware import CudaDevice, Hardware
from encoderkit.inference.engines import openvino_installed, openvino_ready
from tests.test_hardware import AVX2_ONLY, BF16_AMX, VNNI_NO_BF16

TRAIN, SERVE, PLAN = "pretrain / finetune / distill", "predict / serve (--backend auto)", "compress plan (latency goal)"


@pytest.mark.parametrize("text, bf16, kind", [
    (AVX2_ONLY, "off", "cpu"),
    (VNNI_NO_BF16, "off", "cpu-vnni"),
    (BF16_AMX, "on", "cpu-vnni"),
])
def test_choices_follow_the_cpu(text, bf16, kind):
    c = backend_choices(Hardware.from_cpuinfo(text, threads=2))
    assert c[TRAIN].value == f"bf16 autocast {bf16} (cpu)"
    openvino_class = text is VNNI_NO_BF16 and openvino_ready()  # AVX-512 VNNI without AMX: OpenVINO's static INT8
    precision = "bf16" if bf16 == "on" else "fp32"
    elsewhere = f"OpenVINO {precision} for embed" if openvino_installed() else "ONNX FP32 for embed"
    assert c[SERVE].value.startswith("OpenVINO static INT8 for embed" if openvino_class else
                                     "ONNX INT8 one text at a time for embed" if text is VNNI_NO_BF16 else elsewhere)
    measured = ("for classify, ner, qa, rerank, multilabel ONNX INT8 (one text at a time) where the folder's card "
                "records INT8 agreement")
    assert (measured in c[SERVE].value) is (kind != "cpu")
    no_vnni = "ONNX FP32 for classify, ner, qa, rerank, multilabel (this CPU has no VNNI/AMX int8)"
    assert (no_vnni in c[SERVE].value) is (kind == "cpu")
    assert ("no VNNI/AMX" in c[SERVE].why) is (kind == "cpu")
    assert c[PLAN].value.startswith(f"--hardware auto = {kind};")
    assert "budget none: quantize(method=dynamic-int8" in c[PLAN].value and "2:4" not in c[PLAN].value


def test_doctor_names_the_openvino_install_where_it_is_the_faster_int8(monkeypatch):
    from encoderkit.inference import engines

    monkeypatch.setattr(engines, "openvino_ready", lambda: False)
    c = backend_choices(Hardware.from_cpuinfo(VNNI_NO_BF16, threads=2))
    assert c[SERVE].value.startswith("ONNX INT8 one text at a time for embed (CPU class AVX-512 VNNI")
    monkeypatch.setattr(engines, "openvino_ready", lambda: True)
    monkeypatch.setattr(engines, "openvino_installed", lambda: True)
    vnni, amx = (backend_choices(Hardware.from_cpuinfo(t, threads=2))[SERVE].value for t in (VNNI_NO_BF16, BF16_AMX))
    assert vnni.startswith("OpenVINO static INT8 for embed")
    assert amx.startswith("OpenVINO bf16 for embed (CPU class AMX;")


def test_a_sparse_gpu_trains_in_bf16_and_plans_2_4():
    hw = Hardware.from_cpuinfo(AVX2_ONLY, cuda=(CudaDevice(0, "NVIDIA H200", (9, 0), 139.8),))
    c = backend_choices(hw)
    assert c[TRAIN].value == "bf16 autocast on (cuda)" and "H200" in c[TRAIN].why
    assert c[PLAN].value.startswith("--hardware auto = gpu-sparse;") and "2:4" in c[PLAN].why
    assert "distill -> prune -> quantize" in c[PLAN].value


def test_doctor_prints_every_section(capsys):
    from encoderkit.cli import main

    assert main(["--threads", "1", "doctor", "--size", "32", "--seconds", "0.01"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("hardware: CPU ") and "threads |" in text
    for line in ("fp32  torch.matmul", "bf16  torch.matmul", "int8  torch._int_mm", "int8  onnxruntime MatMulInteger",
                 "(32, 32) @ (32, 32)", f"  {TRAIN}: bf16 autocast", f"  {SERVE}: ", " for embed",
                 f"  {PLAN}: --hardware auto"):
        assert line in text, line
    assert text.count("    why: ") == 3
    # every CPU class: auto's embed backend, why, and its measured ratio to the best peer (or "not measured")
    for kind in ("AVX2", "AVX-512 VNNI", "AVX-512 BF16", "AMX"):
        assert f"\n  {kind}" in text, kind
    assert text.count("(this CPU)") == 1 and text.count("    because: ") == 4
    assert "AVX2: openvino; against the best peer: not measured" in text or "AVX2: onnx-fp32; against" in text
    from encoderkit.inference.policy import MEASURED

    assert "AVX-512 BF16" in text and MEASURED["AVX-512 BF16"] in text  # the measured ratio, from its one home

    assert main(["--threads", "1", "doctor", "--size", "32", "--seconds", "0.01", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["threads"] == 1 and data["hardware"].startswith("CPU ")
    rates = {(p["dtype"], p["kernel"]): p["gops"] for p in data["peaks"]}
    assert rates[("fp32", "torch.matmul")] > 0 and rates[("bf16", "torch.matmul")] > 0
    assert set(data["choices"]) == {TRAIN, SERVE, PLAN} and all(c["why"] for c in data["choices"].values())
    rows = data["embed_auto_by_cpu_class"]
    assert [r["cpu_class"] for r in rows] == ["AVX2", "AVX-512 VNNI", "AVX-512 BF16", "AMX"]
    assert sum(r["this_cpu"] for r in rows) == 1 and all(r["why"] and r["against_best_peer"] for r in rows)
    assert all(r["backend"] != "onnx-int8" or "one text at a time" in r["why"] for r in rows)
