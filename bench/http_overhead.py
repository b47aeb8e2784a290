"""The HTTP server's own overhead: max_tokens=1 requests through HTTP against `Engine` directly.

    python -m bench.http_overhead [--model tiny|PATH] [--requests 1000] [--repeats 3] [--concurrency 1,64]

Engine rows call `Engine.generate` from tasks in this process. HTTP rows start
`actorserve serve` in a subprocess (the way it is deployed) and send the same requests from
this process with aiohttp over keep-alive connections, to the native /generate and to
/v1/completions. Each request has its own prompt (so it is tokenized and prefilled as usual),
one output token, greedy. Latency is per request, send to full answer; throughput is requests
over the wall time of the whole run at a fixed number of requests in flight. `cpu ms/req` is
the CPU time (all threads) of the process that runs the engine, per request: this process for
Engine rows (the load generator included, which costs little), the server process for HTTP rows
(the HTTP client excluded). On a machine with few cores the client competes with the server for
CPU, so the cpu column is the steadier measure of the server's own cost.

Both sides freeze the objects loaded at startup out of the garbage collector's view, as
`actorserve serve` does (see api/server/app.py `freeze_startup_objects`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import uvloop

from bench import cpu_servers

PROMPT = "Request {i}: summarise the plot of a short story about a lighthouse keeper."


def main() -> None:
    args = _args()
    model = _model_path(args.model)
    print(f"model={args.model} requests={args.requests} warmup={args.warmup} repeats={args.repeats} cpus={os.cpu_count()}")
    print("| path | concurrency | req/s | p50 ms | p99 ms | cpu ms/req |\n| --- | --- | --- | --- | --- | --- |")
    uvloop.run(_engine_rows(model, args))
    _http_rows(model, args)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (a tiny random llama), or a checkpoint path")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    return p.parse_args()


def _model_path(name: str) -> str:
    if name != "tiny":
        return name
    from gpu.tiny_model import make_tiny_model

    out = Path(tempfile.gettempdir()) / "actorserve-bench-tiny-llama"
    make_tiny_model(out, "llama")  # the test suite's tiny model: the forward is cheap, overhead shows
    return str(out)


Send = Callable[[int], Awaitable[None]]


async def _load(send: Send, requests: int, concurrency: int) -> tuple[float, list[float]]:
    """Run `requests` sends with `concurrency` in flight; (wall seconds, per-request latencies)."""
    latencies: list[float] = []
    counter = iter(range(requests))

    async def worker() -> None:
        for i in counter:
            start = time.perf_counter()
            await send(i)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


def _row(path: str, concurrency: int, wall: float, latencies: list[float], cpu_s: float) -> None:
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    n = len(latencies)
    print(f"| {path} | {concurrency} | {n / wall:.0f} | {q[49] * 1e3:.2f} | {q[98] * 1e3:.2f} | {cpu_s / n * 1e3:.2f} |", flush=True)


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU of a process, all its threads."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measured(send: Send, args: argparse.Namespace, concurrency: int, pid: int | None = None) -> tuple[float, list[float], float]:
    """Warm up, then `--repeats` runs; the run with the median throughput stands for the row
    (the machine is shared: single runs swing by tens of percent)."""
    await _load(send, args.warmup, concurrency)
    runs = []
    for _ in range(args.repeats):
        cpu = cpu_seconds(pid)
        wall, latencies = await _load(send, args.requests, concurrency)
        runs.append((wall, latencies, cpu_seconds(pid) - cpu))
    runs.sort(key=lambda run: run[0])
    return runs[len(runs) // 2]


async def _engine_rows(model: str, args: argparse.Namespace) -> None:
    from api.frontend.engine import Engine

    sampling = {"max_new_tokens": 1, "temperature": 0.0}
    async with Engine(model_path=model) as engine:
        from api.server.app import freeze_startup_objects

        freeze_startup_objects()

        async def send(i: int) -> None:
            await engine.generate(PROMPT.format(i=i), sampling_params=sampling)

        for c in args.concurrency:
            _row("Engine.generate", c, *await _measured(send, args, c))


def _http_rows(model: str, args: argparse.Namespace) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model-path", model, "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(cmd)
    try:
        uvloop.run(_http_load(f"http://127.0.0.1:{port}", args, server.pid))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


async def _http_load(url: str, args: argparse.Namespace, pid: int) -> None:
    await wait_ready(url)
    bodies = {
        "/generate": lambda i: {"text": PROMPT.format(i=i), "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        "/v1/completions": lambda i: {"prompt": PROMPT.format(i=i), "max_tokens": 1, "temperature": 0},
    }
    for c in args.concurrency:
        connector = aiohttp.TCPConnector(limit=c)
        async with aiohttp.ClientSession(connector=connector) as session:
            for path, body in bodies.items():

                async def send(i: int, path: str = path, body=body) -> None:
                    async with session.post(url + path, json=body(i)) as r:
                        await r.read()
                        assert r.status == 200, r.status

                _row(f"HTTP {path}", c, *await _measured(send, args, c, pid))


async def wait_ready(url: str, timeout: float = 120.0) -> None:
    async with aiohttp.ClientSession() as session:
        await cpu_servers.wait_ready(session, url, timeout_s=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
