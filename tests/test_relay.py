"""The router's data planes (api/relay.py in Python, api/csrc/relay.c compiled) over scripted
aiohttp workers: framing, keep-alive, pipelining, bad requests and the ways a client or a worker
can leave mid-request. Each test runs on both planes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from api import relay
from api.http_router import HttpRouter, RouterSettings
from api.routing import RouterConfig


class Worker:
    """An aiohttp worker whose /generate streams `events` SSE events, one per `gap_s`, when the
    body asks for a stream, else answers one JSON body; it records what it saw."""

    def __init__(self, events: int = 3, gap_s: float = 0.0):
        self.events, self.gap_s = events, gap_s
        self.peers: list[tuple[str, int]] = []  # the connection of each request
        self.streams: list[asyncio.Transport] = []  # the connection of each streamed request
        self.bodies: list[bytes] = []
        self.disconnected = asyncio.Event()
        self.runner: web.AppRunner | None = None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        self.bodies.append(await request.read())
        if b'"stream": true' not in self.bodies[-1]:
            return web.json_response({"text": "hi", "path_qs": request.path_qs})
        self.streams.append(request.transport)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(self.events):
                await response.write(b'data: {"i": %d}\n\n' % i)
                await asyncio.sleep(self.gap_s)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([web.post("/generate", self.generate), web.get("/health", self.health)])
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"


@asynccontextmanager
async def routed(worker: Worker, plane: str, interval: float = 5.0) -> AsyncIterator[tuple[HttpRouter, str]]:
    url = await worker.start()
    router = HttpRouter(RouterSettings(worker_urls=(url,), routing=RouterConfig(policy="round_robin"), port=0,
                                       health_check_interval_s=interval, health_check_timeout_s=0.5, data_plane=plane))
    port = await router.start()
    try:
        yield router, f"http://127.0.0.1:{port}"
    finally:
        await router.close()
        assert worker.runner is not None
        await worker.runner.cleanup()


async def _raw(base: str, data: bytes, until: bytes, timeout: float = 5) -> bytes:
    """Send `data` on a fresh connection; read until `until` has been seen (or EOF)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        got = b""
        while until not in got:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                break
            got += chunk
        return got
    finally:
        writer.close()


async def _streaming(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streamed /generate on a fresh connection, once its first event has come."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(_post(b"/generate", b'{"text": "a", "stream": true}'))
    assert b"data:" in await asyncio.wait_for(reader.readuntil(b"\n\n"), 5)
    return reader, writer


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (path, len(body), extra, body)


async def test_requests_reuse_one_worker_connection_and_keep_their_query_and_body(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base), aiohttp.ClientSession() as session:
        for i in range(3):
            async with session.post(f"{base}/generate?x={i}", data=b'{"text": "a"}') as r:
                assert r.status == 200 and (await r.json())["path_qs"] == f"/generate?x={i}"
        assert len(set(worker.peers)) == 1  # one kept-alive connection carried all three
        assert worker.bodies == [b'{"text": "a"}'] * 3
        assert router.load(0) == (0, 0)


async def test_a_stream_passes_through_event_by_event_in_chunks(router_plane):
    worker = Worker(events=4)
    async with routed(worker, router_plane) as (_, base), aiohttp.ClientSession() as session:
        async with session.post(f"{base}/generate", data=b'{"text": "a", "stream": true}') as r:
            assert r.headers["content-type"] == "text/event-stream" and r.headers["transfer-encoding"] == "chunked"
            body = await r.read()
        assert body == b"".join(b'data: {"i": %d}\n\n' % i for i in range(4)) + b"data: [DONE]\n\n"


async def test_pipelined_requests_are_answered_in_order(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (_, base):
        got = await _raw(base, _post(b"/generate?n=1", b"{}") + _post(b"/generate?n=2", b"{}"), b"n=2")
        assert got.count(b"HTTP/1.1 200") == 2 and got.index(b"n=1") < got.index(b"n=2")


async def test_expect_100_continue_is_answered_before_the_body(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (_, base):
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"{}")
            assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()


async def test_bad_requests_get_a_status_that_names_the_problem(router_plane, monkeypatch):
    worker = Worker()
    monkeypatch.setattr(relay, "MAX_BODY", 100)
    async with routed(worker, router_plane) as (_, base), aiohttp.ClientSession() as session:
        got = await _raw(base, b"NOT HTTP AT ALL\r\n\r\n", b"}")
        assert got.startswith(b"HTTP/1.1 400") and b"malformed HTTP request" in got
        error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]  # the server's own error shape
        assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed HTTP request")
        got = await _raw(base, _post(b"/generate", b"x" * 200), b"}")
        assert got.startswith(b"HTTP/1.1 413") and b"larger than 100 bytes" in got
        async with session.get(f"{base}/nowhere") as r:
            assert r.status == 404
        async with session.get(f"{base}/generate") as r:
            assert r.status == 405
        assert worker.bodies == []  # none of them reached the worker


async def test_a_client_that_leaves_mid_stream_ends_the_workers_request(router_plane):
    worker = Worker(events=1000, gap_s=0.01)
    async with routed(worker, router_plane) as (router, base):
        _, writer = await _streaming(base)
        writer.close()
        await asyncio.wait_for(worker.disconnected.wait(), 5)
        assert router.load(0) == (0, 0)
        assert not router.down_reason  # a client leaving says nothing about the worker


async def test_a_worker_lost_mid_stream_ends_the_stream_with_an_error_event_and_leaves(router_plane):
    worker = Worker(events=1000, gap_s=0.01)
    async with routed(worker, router_plane) as (router, base):
        reader, writer = await _streaming(base)
        worker.streams[-1].abort()  # the worker's connection drops mid-stream
        tail = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)  # the stream's last chunk
        writer.close()
        assert b"worker_unavailable" in tail and tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert router.load(0) == (0, 0)
        assert "a request failed" in router.down_reason[0]


async def test_a_worker_lost_inside_a_body_of_known_length_closes_the_client_connection(router_plane):
    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(worker, "127.0.0.1", 0)
    router = HttpRouter(RouterSettings(worker_urls=(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",), port=0, data_plane=router_plane))
    port = await router.start()
    try:
        got = await _raw(f"http://127.0.0.1:{port}", _post(b"/generate", b"{}"), b"never")
        assert got.startswith(b"HTTP/1.1 200") and b"content-length: 100" in got and got.endswith(b"only part")
        assert router.load(0) == (0, 0) and "a request failed" in router.down_reason[0]
    finally:
        await router.close()
        server.close()
        await server.wait_closed()
