"""`actorserve router`'s cost per request, in front of null workers.

    .venv/bin/python -m bench.router_http [--rate 1000] [--requests 3000] [--workers 2]

Null workers (this module with `--null-worker PORT`: an aiohttp app in its own process that answers
/health and /generate at once with a fixed body) and `actorserve router` (cache_aware) in its own
process in front of them. This process is an open-loop client: W2-shared-prefix prompts (576
token ids each) sent at --rate requests/s, first straight to the workers (in turn), then through
the router, on the same schedule. Reported: latency both ways (median, p99), the difference of the
medians (the hop the router adds), and the router process's CPU time per request (utime + stime
from /proc over the routed run). Two figures for scale, from the same run: a null worker's CPU per
request (what aiohttp costs to serve one), and a bare relay's (this module with `--bare-relay`:
uvloop protocols that copy bytes to one worker and back, parsing nothing: what the kernel's
loopback TCP and the event loop cost any Python hop).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.http_overhead import cpu_seconds, free_port, wait_ready
from bench.workloads import make_workload

NULL_ANSWER = orjson.dumps({"text": "", "output_ids": [0], "meta_info": {"finish_reason": {"type": "length", "length": 1}}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2)
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
    from aiohttp import web

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


async def _measure(args: argparse.Namespace) -> None:
    prompts = [r.input_ids for r in make_workload("W2-shared-prefix", vocab_size=4096).requests]
    worker_ports = [free_port() for _ in range(args.workers)]
    router_port = free_port()
    worker_urls = [f"http://127.0.0.1:{p}" for p in worker_ports]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.router_http", "--null-worker", str(p)]) for p in worker_ports]
    actorserve = str(Path(sys.executable).parent / "actorserve")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for url in worker_urls:
                await wait_ready(url)
            router = subprocess.Popen([actorserve, "router", "--worker-urls", *worker_urls, "--port", str(router_port)])
            procs.append(router)
            router_url = f"http://127.0.0.1:{router_port}"
            await wait_ready(router_url)
            bodies = [orjson.dumps({"input_ids": prompts[i % len(prompts)], "sampling_params": {"max_new_tokens": 1}}) for i in range(args.requests)]
            workers_before = sum(cpu_seconds(p.pid) for p in procs[: args.workers])
            direct = await _run(session, [worker_urls[i % len(worker_urls)] for i in range(args.requests)], bodies, args.rate)
            worker_cpu_us = (sum(cpu_seconds(p.pid) for p in procs[: args.workers]) - workers_before) / args.requests * 1e6
            cpu_before = cpu_seconds(router.pid)
            routed = await _run(session, [router_url] * args.requests, bodies, args.rate)
            router_cpu_us = (cpu_seconds(router.pid) - cpu_before) / args.requests * 1e6
            bare_port = free_port()
            bare = subprocess.Popen([sys.executable, "-m", "bench.router_http", "--bare-relay", str(bare_port), str(worker_ports[0])])
            procs.append(bare)
            await wait_ready(f"http://127.0.0.1:{bare_port}")
            cpu_before = cpu_seconds(bare.pid)
            await _run(session, [f"http://127.0.0.1:{bare_port}"] * args.requests, bodies, args.rate)
            bare_cpu_us = (cpu_seconds(bare.pid) - cpu_before) / args.requests * 1e6
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    print(f"{args.requests} requests at {args.rate:.0f}/s, {args.workers} null workers, W2 prompts (576 token ids)")
    print("| path | median ms | p99 ms |\n| --- | --- | --- |")
    for name, lat in (("direct", direct), ("through the router", routed)):
        print(f"| {name} | {statistics.median(lat) * 1e3:.2f} | {_p99(lat) * 1e3:.2f} |")
    added = (statistics.median(routed) - statistics.median(direct)) * 1e6
    print(f"\nadded median latency {added:.0f} us; router CPU {router_cpu_us:.0f} us per request")
    print(f"for scale: a null worker (an aiohttp server answering at once) takes {worker_cpu_us:.0f} us CPU per request,")
    print(f"a bare relay (uvloop protocols copying bytes, parsing nothing) {bare_cpu_us:.0f} us")


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
