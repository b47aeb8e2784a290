"""`actorserve router`'s cost per request, in front of null workers, against two relays that
parse nothing: one in Python, one in C (the floor).

    .venv/bin/python -m bench.router_http [--rate 1000] [--requests 3000] [--workers 2] [--repeats 3]

Null workers (this module with `--null-worker PORT`: an aiohttp app in its own process that answers
/health and /generate at once with a fixed body). In front of them, each in its own process:
`actorserve router` (cache_aware) with its compiled data plane and with its Python one; SGLang's
own router (sglang-router, cache_aware, where `pip install 'actorserve[sglang-router]'` put it,
else skipped with a message; its process runs its Rust router in place); a bare Python relay (this module with `--bare-relay`: uvloop
protocols copying bytes to one worker and back, parsing nothing: what the event loop costs any
Python hop); a C relay (bench/c_relay.c, compiled into build/ with the system's `cc`, skipped with
a message when there is none: epoll copying bytes, what the kernel's loopback TCP costs any hop,
since on loopback the sender's CPU time includes the receiver's TCP processing).

This process is an open-loop client: W2-shared-prefix prompts (576 token ids each) sent at --rate
requests/s, straight to the workers (in turn) and through each relay, on the same schedule; each
path --repeats times, the paths interleaved, each run after --warmup unmeasured requests. Reported
per path, medians over the runs: the CPU time per request of the process that serves the path
(utime + stime from /proc; the null workers' for the direct path) and its kernel part, latency
(median, p99) and the difference of medians with the direct run of the same round (the hop added).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.http_overhead import free_port, wait_ready
from bench.workloads import make_workload

NULL_ANSWER = orjson.dumps({"text": "", "output_ids": [0], "meta_info": {"finish_reason": {"type": "length", "length": 1}}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs per path, interleaved")
    p.add_argument("--warmup", type=int, default=200, help="unmeasured requests before each run")
    p.add_argument("--null-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--bare-relay", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.null_worker is not None:
        _null_worker(args.null_worker)
        return
    if args.bare_relay is not None:
        _bare_relay(*args.bare_relay)
        return
    asyncio.run(_measure(args))


def _null_worker(port: int) -> None:
    import logging

    from aiohttp import web

    # SGLang's router probes each worker for gRPC (an HTTP/2 preface) as it starts: aiohttp answers
    # 400 and logs a traceback for it, noise in this benchmark's output.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=NULL_ANSWER, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/generate", answer), web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def _bare_relay(port: int, worker_port: int) -> None:
    """Client bytes to a kept-alive worker connection and back, unparsed. Enough for this
    benchmark's traffic only: one request in flight per connection, each response in one read."""
    import uvloop

    idle: list[Any] = []

    class Upstream(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport, self.client = transport, None

        def data_received(self, data: bytes) -> None:
            self.client.write(data)
            idle.append(self)

        def connection_lost(self, exc: Exception | None) -> None:
            if self in idle:  # the worker closed it while idle (its keep-alive ran out)
                idle.remove(self)

    class Client(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            if idle:
                self._send(idle.pop(), data)
            else:
                asyncio.get_running_loop().create_task(self._connect(data))

        async def _connect(self, data: bytes) -> None:
            _, upstream = await asyncio.get_running_loop().create_connection(Upstream, "127.0.0.1", worker_port)
            self._send(upstream, data)

        def _send(self, upstream: Any, data: bytes) -> None:
            upstream.client = self.transport
            upstream.transport.write(data)

    async def serve() -> None:
        await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(serve())


@dataclass(slots=True)
class PathRuns:
    """One path's runs: per run, the latencies and the CPU per request of the process measured."""

    name: str
    url: str
    pids: list[int]
    latencies: list[list[float]] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    system_us: list[float] = field(default_factory=list)  # the part of cpu_us in the kernel


async def _measure(args: argparse.Namespace) -> None:
    prompts = [r.input_ids for r in make_workload("W2-shared-prefix", vocab_size=4096).requests]
    bodies = [orjson.dumps({"input_ids": prompts[i % len(prompts)], "sampling_params": {"max_new_tokens": 1}}) for i in range(args.requests)]
    worker_ports = [free_port() for _ in range(args.workers)]
    worker_urls = [f"http://127.0.0.1:{p}" for p in worker_ports]
    workers = [subprocess.Popen([sys.executable, "-m", "bench.router_http", "--null-worker", str(p)]) for p in worker_ports]
    procs = list(workers)
    c_relay = _build_c_relay()
    try:
        paths = [PathRuns("direct", "", [w.pid for w in workers])]
        actorserve = str(Path(sys.executable).parent / "actorserve")
        for plane in ("compiled", "python"):
            port = free_port()
            procs.append(subprocess.Popen([actorserve, "router", "--worker-urls", *worker_urls, "--port", str(port), "--log-level", "warning",
                                           "--data-plane", plane]))
            paths.append(PathRuns(f"`actorserve router --data-plane {plane}` (cache_aware)", f"http://127.0.0.1:{port}", [procs[-1].pid]))
        sglang = _sglang_router(worker_urls)
        if sglang is not None:
            procs.append(sglang[0])
            paths.append(PathRuns("SGLang's router (sglang-router 0.3.2, cache_aware)", sglang[1], [sglang[0].pid]))
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.router_http", "--bare-relay", str(port), str(worker_ports[0])]))
        paths.append(PathRuns("bare Python relay (uvloop protocols, parses nothing)", f"http://127.0.0.1:{port}", [procs[-1].pid]))
        if c_relay is not None:
            port = free_port()
            procs.append(subprocess.Popen([str(c_relay), str(port), str(worker_ports[0])]))
            paths.append(PathRuns("C relay (epoll, parses nothing)", f"http://127.0.0.1:{port}", [procs[-1].pid]))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for url in worker_urls + [p.url for p in paths[1:]]:
                await wait_ready(url)
            if sglang is not None:
                await _wait_registered(session, sglang[1], len(worker_urls))
            for _ in range(args.repeats):
                for path in paths:
                    await _measure_path(session, path, worker_urls, bodies, args)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    _report(paths, args)


async def _measure_path(session: aiohttp.ClientSession, path: PathRuns, worker_urls: list[str], bodies: list[bytes], args: argparse.Namespace) -> None:
    """One run of `args.requests` on `path`, after a warm-up of `args.warmup` unmeasured ones."""
    urls = [path.url or worker_urls[i % len(worker_urls)] for i in range(len(bodies))]
    await _run(session, urls[: args.warmup], bodies[: args.warmup], args.rate)
    before = [_user_system_s(pid) for pid in path.pids]
    path.latencies.append(await _run(session, urls, bodies, args.rate))
    after = [_user_system_s(pid) for pid in path.pids]
    user = sum(a[0] - b[0] for a, b in zip(after, before))
    system = sum(a[1] - b[1] for a, b in zip(after, before))
    path.cpu_us.append((user + system) / len(bodies) * 1e6)
    path.system_us.append(system / len(bodies) * 1e6)


def _user_system_s(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _report(paths: list[PathRuns], args: argparse.Namespace) -> None:
    print(f"{args.requests} requests at {args.rate:.0f}/s, {args.workers} null workers, W2 prompts (576 token ids), "
          f"{args.repeats} runs per path interleaved: medians over the runs, [min-max]")
    print("| path | CPU us per request | of it in the kernel | median ms | added median us | p99 ms |\n| --- | --- | --- | --- | --- | --- |")
    direct = [statistics.median(lat) for lat in paths[0].latencies]
    for path in paths:
        medians = [statistics.median(lat) for lat in path.latencies]
        added = [(m - d) * 1e6 for m, d in zip(medians, direct)]
        name = "null worker (aiohttp, answers at once), direct" if path is paths[0] else path.name
        added_text = "-" if path is paths[0] else _spread(added, "{:.0f}")
        print(f"| {name} | {_spread(path.cpu_us, '{:.0f}')} | {statistics.median(path.system_us):.0f} | "
              f"{statistics.median(medians) * 1e3:.2f} | {added_text} | "
              f"{statistics.median(_p99(lat) for lat in path.latencies) * 1e3:.2f} |")
    if not paths[-1].name.startswith("C relay"):
        print("\n(no C relay: see the message above)")


def _spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _sglang_router(worker_urls: list[str]) -> tuple[subprocess.Popen, str] | None:
    """SGLang's router over the workers, on loopback (it and its metrics exporter bind 0.0.0.0 by
    default); None (and why, printed) where the sglang-router wheel is not installed."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        print("sglang-router is not installed (pip install 'actorserve[sglang-router]'): its row is skipped", file=sys.stderr)
        return None
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--host", "127.0.0.1",
           "--port", str(port), "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "error"]  # not the null workers' missing /server_info, each start
    return subprocess.Popen(cmd), f"http://127.0.0.1:{port}"


async def _wait_registered(session: aiohttp.ClientSession, url: str, n: int, timeout: float = 60.0) -> None:
    """SGLang's router answers /health before it has registered its workers: wait for them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with session.get(f"{url}/workers") as r:
            if r.status == 200 and sum(w.get("is_healthy", False) for w in (await r.json()).get("workers", [])) == n:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"SGLang's router at {url} did not register {n} workers in {timeout} s")


def _build_c_relay() -> Path | None:
    """bench/c_relay.c compiled into build/ with the system's cc; None (and why, printed) if it
    cannot be."""
    compiler = shutil.which("cc")
    if compiler is None:
        print("no C compiler (cc) on PATH: the C relay row is skipped", file=sys.stderr)
        return None
    source = Path(__file__).with_name("c_relay.c")
    binary = Path(__file__).resolve().parent.parent / "build" / "c_relay"
    binary.parent.mkdir(exist_ok=True)
    built = subprocess.run([compiler, "-O2", "-o", str(binary), str(source)], capture_output=True, text=True)
    if built.returncode != 0:
        print(f"cc could not build {source}: the C relay row is skipped\n{built.stderr}", file=sys.stderr)
        return None
    return binary


async def _run(session: aiohttp.ClientSession, urls: list[str], bodies: list[bytes], rate: float) -> list[float]:
    """Open loop: request i leaves at i / rate s, whatever the earlier ones are doing."""
    start = time.perf_counter()

    async def one(i: int) -> float:
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        sent = time.perf_counter()
        async with session.post(f"{urls[i]}/generate", data=bodies[i], headers={"content-type": "application/json"}) as r:
            await r.read()
            assert r.status == 200, r.status
        return time.perf_counter() - sent

    return list(await asyncio.gather(*(one(i) for i in range(len(urls)))))


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


if __name__ == "__main__":
    main()
