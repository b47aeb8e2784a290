"""The router's data planes (api/router/relay.py in Python, api/router/csrc/relay.c compiled) over scripted
workers (aiohttp, or raw asyncio streams for what aiohttp would not write): framing, keep-alive,
pipelining, bad requests and the ways a client or a worker can leave mid-request. Each test runs on
both planes."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import aiohttp
import pytest
from aiohttp import web

from api.router import relay
from api.router.http_router import HttpRouter, RouterSettings
from api.router.routing import RouterConfig


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
async def router_for(urls: list[str], plane: str, interval: float = 5.0) -> AsyncIterator[tuple[HttpRouter, str]]:
    router = HttpRouter(RouterSettings(worker_urls=tuple(urls), routing=RouterConfig(policy="round_robin"), port=0,
                                       health_check_interval_s=interval, health_check_timeout_s=0.5, data_plane=plane))
    port = await router.start()
    try:
        yield router, f"http://127.0.0.1:{port}"
    finally:
        await router.close()


@asynccontextmanager
async def routed(worker: Worker, plane: str, interval: float = 5.0) -> AsyncIterator[tuple[HttpRouter, str]]:
    url = await worker.start()
    try:
        async with router_for([url], plane, interval) as (router, base):
            yield router, base
    finally:
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


# --- edge cases of framing, clients and workers ------------------------------------------------------
class RawWorker:
    """A worker on raw asyncio streams, for responses aiohttp would not write: /health answers
    200; every other request is answered by `reply(writer)`, which returns False to close the
    connection after it."""

    def __init__(self, reply: Callable[[asyncio.StreamWriter], Awaitable[bool]]):
        self.reply = reply
        self.heads: list[bytes] = []  # of the requests `reply` answered
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                if head.startswith(b"GET /health "):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                self.heads.append(head)
                if not await self.reply(writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


def sends(data: bytes, keep: bool = True) -> Callable[[asyncio.StreamWriter], Awaitable[bool]]:
    async def reply(writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        return keep

    return reply


@asynccontextmanager
async def raw_routed(reply: Callable[[asyncio.StreamWriter], Awaitable[bool]], plane: str) -> AsyncIterator[tuple[HttpRouter, str, RawWorker]]:
    worker = RawWorker(reply)
    url = await worker.start()
    try:
        async with router_for([url], plane) as (router, base):
            yield router, base, worker
    finally:
        await worker.stop()


async def _connect(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One response: its status line, headers (names lower-cased) and body (de-chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status, *lines = head[:-4].split(b"\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines)}
    if b"content-length" in headers:
        return status, headers, await asyncio.wait_for(reader.readexactly(int(headers[b"content-length"])), 5)
    if headers.get(b"transfer-encoding") != b"chunked":
        no_body = status.split(b" ")[1] in (b"204", b"304")
        return status, headers, b"" if no_body else await asyncio.wait_for(reader.read(), 5)
    body = b""
    while size := int((await asyncio.wait_for(reader.readline(), 5)).split(b";")[0], 16):
        body += (await asyncio.wait_for(reader.readexactly(size + 2), 5))[:-2]
    while await asyncio.wait_for(reader.readline(), 5) != b"\r\n":  # trailers
        pass
    return status, headers, body


def _fed(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=2**26)
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def _eventually(condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within 5 s (the compiled plane's thread sees a client leave a
    moment after it left)."""
    for _ in range(500):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


async def _settled(router: HttpRouter, workers: int = 1) -> None:
    """Every request has left the router's loads."""
    await _eventually(lambda: all(router.load(i) == (0, 0) for i in range(workers)))
    assert [router.load(i) for i in range(workers)] == [(0, 0)] * workers


async def _still_serves(base: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(f"{base}/generate", data=b'{"text": "a"}') as r:
        assert r.status == 200 and (await r.json())["text"] == "hi"


async def test_chunked_request_bodies_reach_the_worker_whole_with_a_length(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        reader, writer = await _connect(base)
        writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (b'5;name=value\r\n{"tex\r\n', b'4\r\nt": \r\n', b'5;x\r\n"abc"\r\n1\r\n}\r\n', b"0\r\nx-trailer: 1\r\n\r\n"):
            writer.write(piece)
            await asyncio.sleep(0.01)  # each piece arrives on its own
        status, _, body = await _response(reader)
        assert status == b"HTTP/1.1 200 OK" and json.loads(body)["text"] == "hi"
        writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n")
        assert (await _response(reader))[0] == b"HTTP/1.1 200 OK"
        writer.close()
        assert worker.bodies == [b'{"text": "abc"}', b""]
        await _settled(router)
        await _still_serves(base)


async def test_expect_100_continue_with_a_chunked_body(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        reader, writer = await _connect(base)
        writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ntransfer-encoding: chunked\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"2\r\n{}\r\n0\r\n\r\n")
        status, _, _ = await _response(reader)
        writer.close()
        assert status == b"HTTP/1.1 200 OK" and worker.bodies == [b"{}"]
        await _settled(router)


async def test_an_http_1_0_client_gets_connection_close_and_the_connection_closes(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        reader, writer = await _connect(base)
        writer.write(b"POST /generate HTTP/1.0\r\ncontent-length: 2\r\n\r\n{}")
        status, headers, body = await _response(reader)
        assert status == b"HTTP/1.1 200 OK" and headers[b"connection"] == b"close" and json.loads(body)["text"] == "hi"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
        writer.close()
        await _settled(router)
        await _still_serves(base)


async def test_many_requests_in_turn_on_one_kept_alive_connection(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        reader, writer = await _connect(base)
        for i in range(50):
            writer.write(_post(b"/generate?i=%d" % i, b"{}"))
            status, _, body = await _response(reader)
            assert status == b"HTTP/1.1 200 OK" and json.loads(body)["path_qs"] == f"/generate?i={i}"
        writer.close()
        assert len(set(worker.peers)) == 1
        await _settled(router)


async def test_pipelined_generation_and_control_requests_are_answered_in_order(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        reader, writer = await _connect(base)
        health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
        writer.write(_post(b"/generate?n=1", b"{}") + health + _post(b"/generate?n=2", b"{}") + health + _post(b"/generate?n=3", b"{}"))
        answers = [json.loads((await _response(reader))[2]) for _ in range(5)]
        writer.close()
        assert answers == [{"text": "hi", "path_qs": "/generate?n=1"}, {"healthy_workers": 1}, {"text": "hi", "path_qs": "/generate?n=2"},
                           {"healthy_workers": 1}, {"text": "hi", "path_qs": "/generate?n=3"}]
        await _settled(router)


WORKER_RESPONSES = {  # what the worker writes -> the status line, headers and body the client gets
    "content-length": (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-kept: 1\r\n\r\nhello", b"HTTP/1.1 200 OK", b"hello"),
    "chunked": (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nx-t: 1\r\n\r\n",
                b"HTTP/1.1 200 OK", b"hello world"),
    "no content": (b"HTTP/1.1 204 No Content\r\nx-kept: 1\r\n\r\n", b"HTTP/1.1 204 No Content", b""),
    "interim first": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b"HTTP/1.1 200 OK", b"ok"),
    "reason and hop-by-hop headers": (
        b"HTTP/1.1 299 Made Up Reason\r\nconnection: keep-alive\r\nkeep-alive: timeout=5\r\nproxy-connection: x\r\n"
        b"trailer: x-t\r\nupgrade: h2c\r\nx-kept: 1\r\ncontent-length: 2\r\n\r\nok", b"HTTP/1.1 299 Made Up Reason", b"ok"),
}


@pytest.mark.parametrize("case", list(WORKER_RESPONSES))
async def test_worker_responses_reach_the_client_in_the_relays_framing(router_plane, case):
    written, status_line, body = WORKER_RESPONSES[case]
    async with raw_routed(sends(written), router_plane) as (router, base, worker):
        reader, writer = await _connect(base)
        for _ in range(2):  # the second shows the framing of the first held
            writer.write(_post(b"/generate", b"{}"))
            status, headers, got = await _response(reader)
            assert (status, got) == (status_line, body)
            assert not {b"connection", b"keep-alive", b"proxy-connection", b"trailer", b"upgrade", b"x-t"} & set(headers)
            assert headers.get(b"x-kept") == (b"1" if b"\r\nx-kept: 1\r\n" in written else None)
        writer.close()
        assert len(worker.heads) == 2
        await _settled(router)
        assert not router.down_reason


async def test_a_response_without_length_is_read_until_the_worker_closes(router_plane):
    async with raw_routed(sends(b"HTTP/1.1 200 OK\r\nx-kept: 1\r\n\r\nhello world", keep=False), router_plane) as (router, base, _):
        reader, writer = await _connect(base)
        for _ in range(2):
            writer.write(_post(b"/generate", b"{}"))
            status, headers, body = await _response(reader)
            assert (status, headers[b"transfer-encoding"], body) == (b"HTTP/1.1 200 OK", b"chunked", b"hello world")
        writer.close()
        await _settled(router)
        assert not router.down_reason


def _streams(size: int, chunked: bool) -> Callable[[asyncio.StreamWriter], Awaitable[bool]]:
    data = random.Random(size).randbytes(size)

    async def reply(writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n%s\r\n" % (b"transfer-encoding: chunked\r\n" if chunked else b"content-length: %d\r\n" % size))
        for i in range(0, size, 65536):
            piece = data[i:i + 65536]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
        writer.write(b"0\r\n\r\n" if chunked else b"")
        return True

    return reply


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
async def test_a_large_response_to_a_slow_reader_arrives_intact(router_plane, chunked):
    size = 24 * 2**20  # more than the kernel's socket buffers on loopback hold (~10 MB): the relay must pause the worker
    async with raw_routed(_streams(size, chunked), router_plane) as (router, base, _):
        reader, writer = await _connect(base)
        writer.write(_post(b"/generate", b"{}"))
        await asyncio.sleep(0.2)  # every buffer on the way fills
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        got = bytearray()
        # No bound on the bytes: the chunk framing grows with how finely the relay's reads split the body.
        while piece := await asyncio.wait_for(reader.read(262144), 5):
            got += piece
            await asyncio.sleep(0.002)
            if not chunked and len(got) == size or chunked and got.endswith(b"\r\n0\r\n\r\n"):
                break
        writer.close()
        status, _, body = await _response(_fed(head + got))
        assert status == b"HTTP/1.1 200 OK" and body == random.Random(size).randbytes(size)
        await _settled(router)


async def test_a_kept_alive_connection_the_worker_closes_as_it_is_reused_is_retried_on_a_fresh_one(router_plane):
    answered: set[asyncio.StreamWriter] = set()

    async def once_per_connection(writer: asyncio.StreamWriter) -> bool:
        if writer in answered:
            return False  # the keep-alive race: the worker closes the connection the router just reused
        answered.add(writer)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    async with raw_routed(once_per_connection, router_plane) as (router, base, worker):
        reader, writer = await _connect(base)
        for _ in range(3):
            writer.write(_post(b"/generate", b"{}"))
            status, _, body = await _response(reader)
            assert (status, body) == (b"HTTP/1.1 200 OK", b"{}")
        writer.close()
        assert not router.down_reason
        # Requests 2 and 3 each went out twice: on the reused connection, then on a fresh one.
        assert len(answered) == 3 and len(worker.heads) == 5
        await _settled(router)


async def test_a_worker_whose_listener_closed_after_its_health_check_gets_503_and_is_taken_out(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        assert worker.runner is not None
        for site in list(worker.runner.sites):
            await site.stop()  # healthy a moment ago; now refuses connections
        got = await _raw(base, _post(b"/generate", b"{}"), b"}}")
        assert got.startswith(b"HTTP/1.1 503") and b"cannot connect" in got
        assert "a request failed" in router.down_reason[0]
        await _settled(router)


async def test_a_garbage_status_line_from_the_worker_is_503_and_takes_it_out(router_plane):
    async with raw_routed(sends(b"GARBAGE\r\n\r\n"), router_plane) as (router, base, _):
        got = await _raw(base, _post(b"/generate", b"{}"), b"}}")
        assert got.startswith(b"HTTP/1.1 503") and b"worker_unavailable" in got
        assert "a request failed" in router.down_reason[0]
        await _settled(router)
        async with aiohttp.ClientSession() as session, session.get(f"{base}/health") as r:
            assert r.status == 503  # the router still answers: no worker is left


BAD_FRAMING = {
    "two content-lengths": b"content-length: 2\r\ncontent-length: 3\r\n",
    "content-length and chunked": b"content-length: 2\r\ntransfer-encoding: chunked\r\n",
    "content-length not a number": b"content-length: 2x\r\n",
    "content-length of high bytes": b"content-length: " + b"\x80" * 18 + b"\r\n",
    "content-length of 20 digits": b"content-length: " + b"9" * 20 + b"\r\n",
}


@pytest.mark.parametrize("case", list(BAD_FRAMING))
async def test_ambiguous_or_bad_request_framing_is_400(router_plane, case):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        got = await _raw(base, b"POST /generate HTTP/1.1\r\nhost: x\r\n%s\r\n{}" % BAD_FRAMING[case], b"}}")
        assert got.startswith(b"HTTP/1.1 400") and b"connection: close" in got
        assert worker.bodies == []
        await _settled(router)
        await _still_serves(base)


async def test_random_bytes_from_clients_are_400_and_the_router_goes_on(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        for seed in range(8):
            noise = random.Random(seed).randbytes(64 + 256 * seed).replace(b"\r\n\r\n", b"")
            got = await _raw(base, noise + b"\r\n\r\n", b"}}")
            assert got.startswith(b"HTTP/1.1 400"), got[:100]
        assert worker.bodies == []
        await _settled(router)
        await _still_serves(base)


async def test_a_body_shorter_than_its_content_length_then_a_close_leaves_no_load(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        _, writer = await _connect(base)
        writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{}")
        await writer.drain()
        writer.close()
        await _settled(router)
        await _still_serves(base)
        assert worker.bodies == [b'{"text": "a"}']


async def test_bytes_past_a_body_are_the_next_request_and_a_bad_one_is_400_after_the_first_answer(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        got = _fed(await _raw(base, _post(b"/generate", b"{}") + b"NOT A REQUEST\r\n\r\n", b"never sent"))  # to EOF: the 400 closes
        (status, _, body), (refused, _, why) = await _response(got), await _response(got)
        assert (status, json.loads(body)["text"]) == (b"HTTP/1.1 200 OK", "hi")
        assert refused == b"HTTP/1.1 400 Bad Request" and b"malformed" in why and got.at_eof()
        await _settled(router)
        await _still_serves(base)


async def test_chunked_bodies_over_the_limit_are_413(router_plane, monkeypatch):
    monkeypatch.setattr(relay, "MAX_BODY", 100)
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        chunks = b"".join(b"20\r\n%s\r\n" % (b"x" * 32) for _ in range(5))
        got = await _raw(base, b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunks, b"}}")
        assert got.startswith(b"HTTP/1.1 413") and b"larger than 100 bytes" in got
        assert worker.bodies == []
        await _settled(router)
        await _still_serves(base)


async def test_a_client_closing_at_any_byte_of_its_request_leaves_no_load(router_plane):
    worker = Worker()
    async with routed(worker, router_plane) as (router, base):
        request = _post(b"/generate", b'{"text": "a"}')
        for offset in range(len(request)):
            _, writer = await _connect(base)
            writer.write(request[:offset])
            await writer.drain()
            writer.close()
        await _settled(router)
        await _still_serves(base)


async def test_clients_closing_mid_response_leave_no_load_and_the_worker_up(router_plane):
    async with raw_routed(_streams(4 * 2**20, chunked=False), router_plane) as (router, base, _):
        for read in (0, 1, 100, 65536, 2**20):
            reader, writer = await _connect(base)
            writer.write(_post(b"/generate", b"{}"))
            if read:
                await asyncio.wait_for(reader.readexactly(read), 5)
            writer.close()
        await _settled(router)
        assert not router.down_reason
        reader, writer = await _connect(base)
        writer.write(_post(b"/generate", b"{}"))
        assert len((await _response(reader))[2]) == 4 * 2**20
        writer.close()


async def test_thousands_of_pipelined_requests_answered_at_once_are_all_answered(router_plane):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{closed.getsockname()[1]}"
    async with router_for([nobody], router_plane) as (router, base):  # its worker is down: every answer is an immediate 503
        reader, writer = await _connect(base)
        writer.write(_post(b"/generate", b"{}") * 3000)
        statuses = [(await _response(reader))[0] for _ in range(3000)]
        writer.close()
        assert set(statuses) == {b"HTTP/1.1 503 Service Unavailable"}
        await _settled(router)


async def test_a_burst_of_concurrent_clients_over_two_workers(router_plane):
    workers = [Worker(), Worker()]
    urls = [await w.start() for w in workers]
    try:
        async with router_for(urls, router_plane) as (router, base):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

                async def one(i: int) -> str:
                    async with session.post(f"{base}/generate?i={i}", data=b"{}") as r:
                        assert r.status == 200
                        return (await r.json())["path_qs"]

                assert await asyncio.gather(*(one(i) for i in range(200))) == [f"/generate?i={i}" for i in range(200)]
            assert [len(w.bodies) for w in workers] == [100, 100]
            await _settled(router, workers=2)
    finally:
        for w in workers:
            assert w.runner is not None
            await w.runner.cleanup()


@contextmanager
def _full_backlog(port: int) -> Iterator[None]:
    """`port` listens but its accept queue is full and nothing accepts: connecting hangs."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(0)
        fillers = [socket.socket() for _ in range(3)]
        try:
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
            yield
        finally:
            for filler in fillers:
                filler.close()


async def test_a_connect_that_times_out_is_503_and_takes_the_worker_out(router_plane):
    async with raw_routed(sends(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"), router_plane) as (router, base, worker):
        assert worker.server is not None
        port = worker.server.sockets[0].getsockname()[1]
        await worker.stop()
        await worker.server.wait_closed()
        with _full_backlog(port):
            got = await _raw(base, _post(b"/generate", b"{}"), b"}}")
            assert got.startswith(b"HTTP/1.1 503") and b"cannot connect" in got
            assert "a request failed: cannot connect" in router.down_reason[0]
            await _settled(router)


async def test_a_client_leaving_while_its_worker_connection_is_pending_leaves_no_load(router_plane):
    async with raw_routed(sends(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"), router_plane) as (router, base, worker):
        assert worker.server is not None
        port = worker.server.sockets[0].getsockname()[1]
        await worker.stop()
        await worker.server.wait_closed()
        with _full_backlog(port):
            _, writer = await _connect(base)
            writer.write(_post(b"/generate", b"{}"))
            await writer.drain()
            assert await _eventually(lambda: router.load(0) == (1, 0))  # in flight, its connect pending
            writer.close()
            await _settled(router)
        assert not router.down_reason


async def test_pipelining_past_the_buffer_limit_waits_and_every_request_is_answered(router_plane, monkeypatch):
    monkeypatch.setattr(relay, "MAX_BODY", 100)
    worker = Worker(events=20, gap_s=0.01)
    async with routed(worker, router_plane) as (router, base):
        reader, writer = await _connect(base)
        padding = b"x-pad: %s\r\n" % (b"p" * 2000)
        writer.write(_post(b"/generate", b'{"stream": true}'))
        for i in range(100):  # ~200 KB behind a stream: more than a head and a body
            writer.write(_post(b"/generate?i=%d" % i, b"{}", padding))
        first = await _response(reader)
        assert first[0] == b"HTTP/1.1 200 OK" and first[2].endswith(b"data: [DONE]\n\n")
        answers = [json.loads((await _response(reader))[2])["path_qs"] for _ in range(100)]
        writer.close()
        assert answers == [f"/generate?i={i}" for i in range(100)]
        await _settled(router)


SEED_REQUESTS = (
    _post(b"/generate", b'{"text": "a"}'),
    _post(b"/v1/completions?x=1", b'{"prompt": [1, 2, 3], "routing_key": "k"}', b"expect: 100-continue\r\n"),
    b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5;a=b\r\n{\"a\":\r\n2\r\n1}\r\n0\r\nt: 1\r\n\r\n",
    b"GET /health HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
)


def _mutated(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(out) + 1)
        match rng.randrange(4):
            case 0:
                out[at:at + 1] = bytes([rng.randrange(256)])
            case 1:
                out[at:at] = rng.choice([b"\r\n", b"\r\n\r\n", b":", b" ", b";", b"ffffffffffffffff", b"\x00", b"\x80"])
            case 2:
                del out[at:at + rng.randint(1, 8)]
            case _:
                out[at:at] = out[rng.randrange(len(out) + 1):][:rng.randint(1, 40)]
    return bytes(out)


async def test_mutated_requests_split_anywhere_leave_the_router_serving(router_plane):
    worker = Worker()
    rng = random.Random(7)
    async with routed(worker, router_plane) as (router, base):

        async def one() -> None:
            data = b"".join(_mutated(rng, rng.choice(SEED_REQUESTS)) for _ in range(rng.randint(1, 3)))
            reader, writer = await _connect(base)
            cuts = [0, *sorted(rng.randrange(len(data) + 1) for _ in range(3)), len(data)]
            for start, end in zip(cuts, cuts[1:]):
                if writer.is_closing():  # the router answered and closed already
                    break
                writer.write(data[start:end])
                await asyncio.sleep(0.001)
            try:
                await asyncio.wait_for(reader.read(65536), 0.05)
            except (TimeoutError, ConnectionError):
                pass  # a head left incomplete waits for more, as it should
            writer.close()

        for _ in range(15):
            await asyncio.gather(*(one() for _ in range(10)))
        await _settled(router)
        await _still_serves(base)
