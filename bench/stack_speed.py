"""A compressed model folder against its teacher, timed side by side in one process.

A recipe report times each step when it is made, so its speed-ups carry whatever else the machine
ran at the time. This re-times two folders alternately (teacher, student, teacher, ...) with the
deploy runtime the report uses (teacher: ONNX fp32 with BERT fusions; student: its
``model.int8.onnx`` when it has one), at batch 1 and 32, random token ids at a fixed length.

    python bench/stack_speed.py --teacher runs/sst2-minilm-e1 --student runs/sst2-stack/03-quantize --threads 1

Ends with ``RESULT speedup_b1=... speedup_b32=... bytes_saved=...``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from encoderkit.hardware import describe, result_field


def _weights_bytes(folder: Path) -> int:
    onnx = folder / "model.int8.onnx"
    if onnx.is_file():
        return onnx.stat().st_size
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7, help="alternating rounds per batch size (median reported)")
    args = ap.parse_args()
    print(f"hardware: {describe()}", flush=True)

    from encoderkit.inference.predictor import Predictor

    teacher, student = Path(args.teacher), Path(args.student)
    preds = {"teacher": Predictor.load(teacher, backend="onnx-fp32", threads=args.threads),
             "student": Predictor.load(student,
                                       backend="onnx-int8" if (student / "model.int8.onnx").is_file() else "onnx-fp32",
                                       threads=args.threads)}
    rng = np.random.default_rng(0)
    fields = [f"threads={args.threads}", f"seq_len={args.seq_len}", result_field()]
    for b in (1, 32):
        ids = rng.integers(1000, 5000, (b, args.seq_len)).astype(np.int64)  # ids every vocabulary keeps
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        times: dict[str, list[float]] = {k: [] for k in preds}
        for _ in range(args.repeats + 1):
            for k, p in preds.items():
                t0 = time.perf_counter()
                p.engine.run(feed)
                times[k].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v[1:]) * 1000 for k, v in times.items()}  # the first round warms up
        print(f"batch {b}: teacher {ms['teacher']:.1f} ms, student {ms['student']:.1f} ms")
        fields += [f"teacher_b{b}_ms={ms['teacher']:.1f}", f"student_b{b}_ms={ms['student']:.1f}",
                   f"speedup_b{b}={ms['teacher'] / ms['student']:.2f}"]
    tb, sb = _weights_bytes(teacher), _weights_bytes(student)
    fields += [f"teacher_MB={tb / 1e6:.2f}", f"student_MB={sb / 1e6:.2f}", f"bytes_saved={1 - sb / tb:.3f}"]
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
