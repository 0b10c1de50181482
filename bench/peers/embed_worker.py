"""One embedding engine in its own process, driven line by line over stdin/stdout by bench/embed_peers.py.

It runs under whichever Python it is started with (the peer's own virtual environment: sentence-transformers'
ONNX backend pins an older transformers than encoderkit's), imports only what its engine needs, and speaks
JSON lines:

    -> {"cmd": "load", "engine": "st-onnx-int8", "model": DIR, "work": DIR, "threads": 2, "batch": 32}
    <- {"ok": true, "info": {...}}            (the engine built and warmed up; info says what it runs)
    -> {"cmd": "run", "set": "docs", "start": 0, "end": 128}
    <- {"ok": true, "seconds": 1.23, "cpu_seconds": 2.4, "idle_seconds": 0.5, "idle_cpu_seconds": 0.2}
                                              (idle: since the last run ended; CPU then is threads spinning)
    -> {"cmd": "dump", "path": FILE}          (every set's vectors so far, in order, as .npz)
    -> {"cmd": "quit"}

Texts come once, from the JSON file named by ``--texts`` ({"docs": [...], "sst": [...], ...}). Vectors are
L2-normalised float32. Engines:

* ``st-torch``: ``SentenceTransformer(model)``, fp32 torch (the reference);
* ``st-onnx``: ``SentenceTransformer(model, backend="onnx")``, its exported FP32 graph;
* ``st-onnx-int8``: sentence-transformers' ``export_dynamic_quantized_onnx_model`` for this CPU's instruction set
  (``avx512_vnni`` when the CPU has it, else ``avx2``), loaded with ``backend="onnx"``;
* ``st-openvino``: ``SentenceTransformer(model, backend="openvino")``;
* ``fastembed``: fastembed's ``TextEmbedding`` on the INT8 graph ``st-onnx-int8`` wrote (a custom local model:
  fastembed downloads its own models from a hub this machine cannot reach);
* ``encoderkit``: ``Predictor.load(model, backend=...)`` (``auto`` by default); ``encoderkit:BACKEND`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np


def cpu_isa() -> str:
    flags = (Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace") if Path("/proc/cpuinfo").exists()
             else "")
    return "avx512_vnni" if "avx512_vnni" in flags else "avx2"


def st_copy(model: str, work: Path) -> Path:
    """A writable copy of the model folder (sentence-transformers writes its exported graphs into it)."""
    dst = work / "st-model"
    if not (dst / "config.json").exists():
        shutil.copytree(model, dst, dirs_exist_ok=True)
    return dst


def build(engine: str, model: str, work: Path, threads: int, batch: int, corpus: list[str]):
    """(encode(texts) -> (N, D) float32 normalised, info dict). ``corpus``: the passages; encoderkit's
    ``openvino-int8`` calibrates on a seeded sample of them, as ``index`` does on the corpus it indexes."""
    if engine.startswith("encoderkit"):
        import random

        from encoderkit.inference.predictor import Predictor

        backend = engine.partition(":")[2] or os.environ.get("EMBED_PEERS_BACKEND", "auto")
        sample = random.Random(0).sample(corpus, min(128, len(corpus))) if backend == "openvino-int8" else None
        p = Predictor.load(model, backend=backend, threads=threads, max_batch=batch, calibration=sample)
        return (lambda texts: p.embed(texts)), {"backend": p.backend, "max_length": p.max_length}
    if engine == "fastembed":
        from fastembed import TextEmbedding
        from fastembed.common.model_description import ModelSource, PoolingType

        folder = st_copy(model, work)
        graph = f"onnx/model_qint8_{cpu_isa()}.onnx"
        if not (folder / graph).exists():
            raise SystemExit(f"fastembed runs st-onnx-int8's graph {folder / graph}: run that engine first")
        TextEmbedding.add_custom_model(model="local/minilm-int8", pooling=PoolingType.MEAN, normalization=True,
                                       sources=ModelSource(hf="local/minilm-int8"), dim=384, model_file=graph)
        te = TextEmbedding(model_name="local/minilm-int8", specific_model_path=str(folder), threads=threads)
        return (lambda texts: np.stack(list(te.embed(texts, batch_size=batch)))), {"graph": graph}
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    if engine == "st-torch":
        st = SentenceTransformer(model, device="cpu")
        info = {}
    elif engine in ("st-onnx", "st-openvino"):
        st = SentenceTransformer(str(st_copy(model, work)), device="cpu", backend=engine.split("-")[1])
        info = {}
    elif engine == "st-onnx-int8":
        from sentence_transformers import export_dynamic_quantized_onnx_model

        folder = st_copy(model, work)
        graph = f"onnx/model_qint8_{cpu_isa()}.onnx"
        if not (folder / graph).exists():
            export_dynamic_quantized_onnx_model(SentenceTransformer(str(folder), device="cpu", backend="onnx"),
                                                cpu_isa(), str(folder))
        st = SentenceTransformer(str(folder), device="cpu", backend="onnx", model_kwargs={"file_name": graph})
        info = {"graph": graph}
    else:
        raise SystemExit(f"unknown engine {engine}")
    info["max_seq_length"] = st.max_seq_length
    return (lambda texts: st.encode(texts, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True)), info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", required=True)
    args = ap.parse_args()
    texts = json.loads(Path(args.texts).read_text(encoding="utf-8"))
    vecs: dict[str, list[np.ndarray]] = {k: [] for k in texts}
    encode = None
    last: tuple[float, float] | None = None  # (wall, CPU) when the last run ended: CPU spent between runs is spinning
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints go to stderr; stdout carries only the protocol
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "load":
            encode, info = build(msg["engine"], msg["model"], Path(msg["work"]), msg["threads"], msg["batch"],
                                 texts.get("docs", []))
            encode([t for t in next(iter(texts.values()))[:64]])  # warm-up
            reply = {"ok": True, "info": info}
        elif msg["cmd"] == "run":
            part = texts[msg["set"]][msg["start"] : msg["end"]]
            w, c = time.perf_counter(), time.process_time()
            idle = {"idle_seconds": w - last[0], "idle_cpu_seconds": c - last[1]} if last else {}
            v = np.asarray(encode(part), dtype=np.float32)
            last = (time.perf_counter(), time.process_time())
            reply = {"ok": True, "seconds": last[0] - w, "cpu_seconds": last[1] - c, **idle}
            vecs[msg["set"]].append(v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12))
        elif msg["cmd"] == "dump":
            np.savez(msg["path"], **{k: np.concatenate(v) for k, v in vecs.items() if v})
            reply = {"ok": True}
        else:
            break
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
