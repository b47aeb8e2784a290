"""HTTP/1.1 relayed with raw asyncio protocols: `actorserve router`'s data plane.

aiohttp's server and client together cost the router ~400 us of CPU per relayed request, four
times the budget; a null aiohttp worker alone costs ~170 us. Here requests and responses are
parsed by httptools (llhttp, the parser aiohttp and Node use) and bodies are copied between
transports as they arrive, over connections to the workers that are kept alive and reused.

    ClientConnection   one client's connection: parses its requests, hands each to the router,
                       writes what comes back; one request at a time (a pipelined next request
                       waits its turn)
    Exchange           one request relayed to one worker: frames the worker's response for the
                       client, or ends it with the error the router gives when the worker is lost
    UpstreamPool       kept-alive connections to each worker (UpstreamConnection)

Response bodies keep their bytes; the framing is the relay's own (the worker's content-length
when it gave one, else chunked), so an error event can always be appended at a chunk boundary.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast
from urllib.parse import urlsplit

import httptools
import orjson

from api.server.openai_schema import error_body

MAX_BODY = 64 * 2**20
# Dropped when passing headers on: they describe one connection, not the message.
HOP_HEADERS = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host", b"te", b"trailer",
    b"upgrade", b"proxy-connection", b"expect",
})
# A client's credentials: dropped when the router authenticates to the workers with its own key.
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key"})
# Below aiohttp's server keep-alive (75 s): an idle connection is dropped here before a worker
# could close it under a request just sent.
UPSTREAM_IDLE_S = 30.0


@dataclass(slots=True)
class Request:
    method: bytes
    target: bytes  # path and query, as sent
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool

    @property
    def path(self) -> bytes:
        return self.target.split(b"?", 1)[0]


def response_bytes(status: int, body: bytes, keep_alive: bool, content_type: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (status, _reason(status), content_type, len(body))
    return head + (b"\r\n" if keep_alive else b"connection: close\r\n\r\n") + body


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


# --- the client side -------------------------------------------------------------------------------
class ClientConnection(asyncio.Protocol):
    """One client connection. `handle(request, connection)` is called once per request and must
    end it with `respond` or through an Exchange."""

    def __init__(self, handle: Callable[[Request, ClientConnection], None], connections: set[ClientConnection]):
        self._handle = handle
        self._connections = connections
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self._busy = False
        self._waiting: deque[Request] = deque()
        self._url = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._out: list[bytes] = []  # written at once by flush(): one send per upstream read
        self._refusal: bytes | None = None  # the answer to bad bytes, due once the requests before them are answered

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:  # llhttp stays in its error; the connection ends once answered
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            if self._body_size > MAX_BODY:
                self._refuse(413, f"the request body is larger than {MAX_BODY} bytes")
            else:
                self._refuse(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self.transport = None
        self._waiting.clear()
        if self.exchange is not None:
            self.exchange.abandon()

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.pause_upstream(True)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.pause_upstream(False)

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if (b"expect", b"100-continue") in self._headers and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > MAX_BODY:
            raise ValueError("too large")  # stops the parser; data_received answers 413
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(self._parser.get_method(), bytes(self._url), self._headers, body, self._parser.should_keep_alive())
        self._url, self._headers, self._body, self._body_size = bytearray(), [], [], 0
        self._waiting.append(request)
        if self._busy:
            if self.transport is not None:
                self.transport.pause_reading()
        else:
            self._next()

    # the router's side
    def write(self, data: bytes) -> None:
        self._out.append(data)

    def flush(self) -> None:
        if self._out and self.transport is not None:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def respond(self, status: int, body: bytes, keep_alive: bool = True) -> None:
        self.write(response_bytes(status, body, keep_alive))
        self.done(keep_alive)

    def done(self, keep_alive: bool) -> None:
        """The current response was written in full."""
        self.flush()
        self.exchange = None
        self._busy = False
        if self.transport is None:
            return
        if not keep_alive:
            self.transport.close()
            return
        self.transport.resume_reading()
        self._next()

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()

    def _next(self) -> None:
        if self.transport is None:
            return
        if self._waiting:
            self._busy = True
            self._handle(self._waiting.popleft(), self)
        elif self._refusal is not None:
            self.write(self._refusal)
            self.close()

    def _refuse(self, status: int, message: str) -> None:
        """Bad bytes end the connection, but the requests parsed before them are answered first,
        in order, as HTTP/1.1 pipelining asks."""
        self._refusal = response_bytes(status, orjson.dumps(error_body(status, message)), False)
        if self.transport is not None:
            self.transport.pause_reading()
        if not self._busy:
            self._next()


# --- the worker side -------------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class Exchange:
    """One request relayed to `worker`. `on_end(exchange)` is called once, however it ends."""

    worker: int
    client: ClientConnection
    request: Request
    on_end: Callable[[Exchange], None]
    upstream: UpstreamConnection | None = None
    ended: bool = False
    keep_alive: bool = True
    chunked: bool = False  # the framing towards the client
    head_sent: bool = False
    connecting: asyncio.Task[None] | None = None
    retried: bool = False  # sent again on a fresh connection once (UpstreamConnection._lost)

    def response_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], content_length: int | None) -> None:
        self.keep_alive = self.request.keep_alive
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason or _reason(status))]
        lines += [b"%s: %s\r\n" % (name, value) for name, value in headers if name not in HOP_HEADERS]
        self.chunked = content_length is None
        lines.append(b"transfer-encoding: chunked\r\n" if self.chunked else b"content-length: %d\r\n" % content_length)
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        self.client.write(b"".join(lines))
        self.head_sent = True

    def response_body(self, data: bytes) -> None:
        if self.chunked:
            self.client.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.client.write(data)

    def response_complete(self) -> None:
        if self.chunked:
            self.client.write(b"0\r\n\r\n")
        self._end()
        self.client.done(self.keep_alive)

    def lose(self, body: bytes, event: bytes) -> None:
        """The worker is lost: a 503 with `body`, or `event` ending a started stream."""
        if self.ended:
            return
        self._drop_upstream()
        self._end()
        if not self.head_sent:
            self.client.respond(503, body, self.request.keep_alive)
        elif self.chunked:
            self.client.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
            self.client.done(self.keep_alive)
        else:  # a body of announced length cannot be finished: the connection is
            self.client.close()
            self.client.done(False)

    def abandon(self) -> None:
        """The client left, or the router is closing. Closing the worker's connection is what
        makes the worker abort the request."""
        if not self.ended:
            self._drop_upstream()
            self._end()

    def pause_upstream(self, paused: bool) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            (self.upstream.transport.pause_reading if paused else self.upstream.transport.resume_reading)()

    def _drop_upstream(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        if self.upstream is not None:
            self.upstream.exchange = None
            self.upstream.close()
            self.upstream = None

    def _end(self) -> None:
        self.ended = True
        self.on_end(self)


class UpstreamConnection(asyncio.Protocol):
    """A kept-alive connection to one worker, carrying one Exchange at a time."""

    def __init__(self, pool: UpstreamPool, worker: int):
        self._pool = pool
        self.worker = worker
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._content_length: int | None = None
        self._worker_chunked = False
        self._interim = False  # the head parsed is a 1xx: the final response follows
        self.reused = False  # taken from the idle pool
        self._answering = False  # bytes came for the current exchange

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        client = self.exchange.client if self.exchange is not None else None
        self._answering = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lost(f"malformed response: {exc}")
        if client is not None:
            client.flush()

    def eof_received(self) -> bool | None:
        # httptools cannot be told of the EOF (it has no llhttp_finish), so a body delimited by the
        # worker's close is ended here; any other response cut short is lost in connection_lost.
        if self._reads_until_close():
            self.on_message_complete()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._pool.forget(self)
        self._lost(f"connection lost: {exc!r}" if exc else "connection closed by the worker")

    def _reads_until_close(self) -> bool:
        """A final head came without content-length or chunked: the worker's close ends the body
        (1xx, 204 and 304 have no body and are complete before this could be asked)."""
        exchange = self.exchange
        return exchange is not None and exchange.head_sent and self._content_length is None and not self._worker_chunked

    def send(self, exchange: Exchange) -> None:
        assert self.transport is not None and self.exchange is None
        self.exchange = exchange
        exchange.upstream = self
        self.transport.write(self._pool.request_bytes(self.worker, exchange.request))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self._content_length = int(value)
        elif name == b"transfer-encoding":
            self._worker_chunked = True  # or a coding relay.c refuses: either way the worker's close cuts the body short
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._interim = self._parser.get_status_code() < 200
        if self.exchange is not None and not self._interim:
            self.exchange.response_head(self._parser.get_status_code(), self._reason, self._headers, self._content_length)

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.response_body(body)

    def on_message_complete(self) -> None:
        self._reason, self._headers, self._content_length, self._worker_chunked = b"", [], None, False
        if self._interim:  # llhttp ends a 1xx as a message of its own; the exchange waits on
            self._interim = False
            return
        exchange, self.exchange = self.exchange, None
        self._answering = False
        reusable = self._parser.should_keep_alive()
        if exchange is not None:
            exchange.upstream = None
            exchange.response_complete()
        if reusable and self.transport is not None:
            self._pool.release(self)
        else:
            self.close()

    def _lost(self, why: str) -> None:
        exchange, self.exchange = self.exchange, None
        self.close()
        if exchange is None:
            return
        exchange.upstream = None
        if self.reused and not self._answering and not exchange.retried:
            # The worker may have closed this kept-alive connection as it was reused (its keep-alive
            # ran out at that moment): once more on a fresh connection before the worker is blamed.
            # Generation has no side effects to repeat.
            exchange.retried = True
            self._pool.send(exchange, fresh=True)
        else:
            self._pool.on_lost(exchange, why)


class UpstreamPool:
    """Kept-alive connections to each worker. `on_lost(exchange, why)` is told when a worker's
    connection fails under a request (the router marks the worker down and ends the exchange).
    With `worker_api_key`, requests carry it as `Authorization: Bearer` instead of the client's
    credentials; without, the client's pass on."""

    def __init__(self, urls: list[str], connect_timeout_s: float, on_lost: Callable[[Exchange, str], None],
                 worker_api_key: str | None = None):
        self._addresses = [host_port(url) for url in urls]
        credentials = b"" if worker_api_key is None else b"authorization: Bearer %s\r\n" % worker_api_key.encode()
        self._own_headers = [b"host: %s:%d\r\n%s" % (host.encode(), port, credentials) for host, port in self._addresses]
        self._dropped = HOP_HEADERS if worker_api_key is None else HOP_HEADERS | CREDENTIAL_HEADERS
        self._connect_timeout_s = connect_timeout_s
        self.on_lost = on_lost
        self._idle: list[list[UpstreamConnection]] = [[] for _ in urls]
        self._connecting: set[asyncio.Task[None]] = set()

    def send(self, exchange: Exchange, fresh: bool = False) -> None:
        """Send on an idle connection to the exchange's worker, or on a new one (`fresh`: new)."""
        idle = self._idle[exchange.worker]
        now = time.monotonic()
        while idle and not fresh:
            connection = idle.pop()
            if connection.transport is not None and now - connection.idle_since < UPSTREAM_IDLE_S:
                connection.reused = True
                connection.send(exchange)
                return
            connection.close()
        task = asyncio.get_running_loop().create_task(self._connect_and_send(exchange))
        exchange.connecting = task
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect_and_send(self, exchange: Exchange) -> None:
        host, port = self._addresses[exchange.worker]
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(lambda: UpstreamConnection(self, exchange.worker), host, port)
        except (OSError, TimeoutError) as exc:
            exchange.connecting = None
            self.on_lost(exchange, f"cannot connect: {exc!r}")
            return
        exchange.connecting = None
        if exchange.ended:  # the client left while connecting
            connection.close()
        else:
            connection.send(exchange)

    def request_bytes(self, worker: int, request: Request) -> bytes:
        lines = [b"%s %s HTTP/1.1\r\n" % (request.method, request.target), self._own_headers[worker]]
        lines += [b"%s: %s\r\n" % (name, value) for name, value in request.headers if name not in self._dropped]
        lines.append(b"content-length: %d\r\n\r\n" % len(request.body))
        lines.append(request.body)
        return b"".join(lines)

    def release(self, connection: UpstreamConnection) -> None:
        connection.idle_since = time.monotonic()
        self._idle[connection.worker].append(connection)

    def forget(self, connection: UpstreamConnection) -> None:
        idle = self._idle[connection.worker]
        if connection in idle:
            idle.remove(connection)

    def drop_idle(self, worker: int) -> None:
        for connection in self._idle[worker]:
            connection.close()
        self._idle[worker].clear()

    async def close(self) -> None:
        for task in list(self._connecting):
            task.cancel()
        await asyncio.gather(*self._connecting, return_exceptions=True)
        for worker in range(len(self._idle)):
            self.drop_idle(worker)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"worker URL {url!r}: expected http://host:port (the router speaks plain HTTP/1.1 to workers)")
    return parts.hostname, parts.port or 80
