"""`actorserve router`: one HTTP endpoint in front of several `actorserve serve` workers.

    actorserve router --worker-urls http://h1:30000 http://h2:30000 --port 31000

The generation endpoints (`/generate`, `/v1/completions`, `/v1/chat/completions`) are passed
through to the worker the router picks (api/router/routing.py's policies; the prompt key is the JSON
text of the body's token ids, prompt or chat messages), streaming
included: the body's bytes pass unchanged as they arrive (api/router/relay.py). `/flush_cache`, `/abort_request` and `/clear_hicache_storage_backend` (POST) go to every healthy worker;
`/health` is 200 while one worker is healthy; `/get_server_info` lists the workers.

Keys: with `api_key` every path but `/health` (open for load balancers) needs it, sent as
`actorserve serve` takes it (`Authorization: Bearer <key>`, else `X-API-Key`), checked in constant
time on both data planes before any worker is asked. Towards the workers, what a client asks
(relays, broadcasts, `/v1/models`) carries the client's credentials unchanged, so one key shared by
router and workers needs nothing more; with `worker_api_key` the router sends
`Authorization: Bearer <worker_api_key>` instead, on those and on its health checks, so that clients
never hold the workers' key.

Generation requests are relayed by the compiled data plane (api/router/csrc/relay.c, on a thread; see
api/router/native_plane.py) where it could be built, else by api/router/relay.py in Python: `--data-plane`.

A worker is taken out when its `/health` fails (checked every `health_check_interval_s`) or a
request's connection to it fails; its requests in flight end with 503 `worker_unavailable` (an SSE
error event when the stream had started). It comes back when `/health` answers 200 again.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hmac
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import orjson

from api.router import relay
from api.router.native import native_library
from api.router.native_plane import NativePlane
from api.server.openai_schema import error_body
from api.router.relay import CREDENTIAL_HEADERS, ClientConnection, Exchange, Request, UpstreamPool
from api.router.routing import NoHealthyReplica, Router, RouterConfig
from runtime.config import ROUTER_POLICIES

log = logging.getLogger("actorserve.router")

UNAVAILABLE = "worker_unavailable"
GENERATION_PATHS = frozenset({b"/generate", b"/v1/completions", b"/v1/chat/completions"})
DATA_PLANES = ("auto", "compiled", "python")  # auto: compiled where it could be built
OPEN_PATH = b"/health"  # answered without a key: load balancers' probes carry none
UNAUTHORIZED = "invalid or missing API key (send 'Authorization: Bearer <key>')"  # as `actorserve serve` says it

Answer = tuple[int, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class RouterSettings:
    worker_urls: tuple[str, ...]
    routing: RouterConfig = RouterConfig()
    host: str = "127.0.0.1"
    port: int = 31000
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 2.0
    data_plane: str = "auto"
    api_key: str | None = None  # what clients must send; None: no check
    worker_api_key: str | None = None  # what the router sends workers; None: the client's credentials pass on

    def __post_init__(self) -> None:
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane {self.data_plane!r} is unknown; choose one of {', '.join(DATA_PLANES)}")
        for flag, key in (("--api-key", self.api_key), ("--worker-api-key", self.worker_api_key)):
            if key is not None and not _is_header_value(key):
                raise ValueError(f"{flag} must be non-empty printable ASCII without spaces (it travels in an HTTP header)")


class HttpRouter:
    """The workers' health and load, and what each request path does. Generation requests are
    relayed by the compiled data plane, or by api/router/relay.py with `router`, `in_flight` and `pool`
    (the Python data plane's state); the other paths are answered here (off the hot path, with
    aiohttp's client)."""

    def __init__(self, settings: RouterSettings):
        if not settings.worker_urls:
            raise ValueError("the router needs at least one --worker-urls entry")
        self.settings = settings
        self.urls = [u.rstrip("/") for u in settings.worker_urls]
        self.router = Router(settings.routing, len(self.urls))
        self.down_reason: dict[int, str] = {}
        self.in_flight: list[set[Exchange]] = [set() for _ in self.urls]
        self.pool = UpstreamPool(self.urls, settings.health_check_timeout_s, self._request_failed, settings.worker_api_key)
        self._api_key = None if settings.api_key is None else settings.api_key.encode()
        self._worker_auth = None if settings.worker_api_key is None else {"Authorization": f"Bearer {settings.worker_api_key}"}
        self.native: NativePlane | None = None
        self.session: aiohttp.ClientSession | None = None
        self._server: asyncio.Server | None = None
        self._clients: set[ClientConnection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._answers: dict[tuple[bytes, bytes], Callable[[Request], Awaitable[Answer]]] = {
            (b"GET", b"/health"): self.health,
            (b"GET", b"/get_server_info"): self.server_info,
            (b"GET", b"/v1/models"): self.models,
            (b"POST", b"/flush_cache"): self.broadcast,
            (b"POST", b"/abort_request"): self.broadcast,
            (b"POST", b"/clear_hicache_storage_backend"): self.broadcast,
        }

    async def start(self) -> int:
        """Listen on the settings' host:port (0: a free port); returns the port."""
        s = self.settings
        library = self._compiled_data_plane()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.health_check_timeout_s))
        loop = asyncio.get_running_loop()
        serve = lambda: ClientConnection(self.handle, self._clients)  # noqa: E731
        try:
            if library is None:
                self._server = await loop.create_server(serve, s.host, s.port)
                return await self._started(self._server.sockets[0].getsockname()[1])
            listener = socket.create_server((s.host, s.port), family=socket.AF_INET6 if ":" in s.host else socket.AF_INET, backlog=1024)
        except OSError as exc:
            await self.close()
            raise RuntimeError(f"cannot listen on {s.host}:{s.port}: {exc.strerror or exc}") from None
        try:  # the private listener for what the compiled plane passes on
            self._server = await loop.create_server(serve, "127.0.0.1", 0)
            self.native = NativePlane(library, self.urls, s.routing, s.health_check_timeout_s, relay.MAX_BODY, self._worker_failed,
                                      s.api_key, s.worker_api_key)
            await self.native.start(listener, self._server.sockets[0].getsockname()[1])
        except BaseException:
            listener.close()
            await self.close()
            raise
        return await self._started(listener.getsockname()[1])

    def _compiled_data_plane(self) -> ctypes.CDLL | None:
        if self.settings.data_plane == "python":
            return None
        library = native_library()
        if library is None and self.settings.data_plane == "compiled":
            raise RuntimeError("the compiled data plane is unavailable here (see the warning above); use --data-plane python")
        return library

    async def _started(self, port: int) -> int:
        await self.check_health()
        self._spawn(self._health_loop())
        return port

    def load(self, worker: int) -> tuple[int, int]:
        """Requests in flight to the worker and their prompt bytes."""
        if self.native is not None:
            return self.native.load(worker)
        return self.router.loads[worker].requests, self.router.loads[worker].tokens

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for exchanges in self.in_flight:
            for exchange in list(exchanges):
                exchange.abandon()
        for client in list(self._clients):
            client.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.native is not None:
            await self.native.close()
        await self.pool.close()
        if self.session is not None:
            await self.session.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- health -------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        results = await asyncio.gather(*(self._probe(url) for url in self.urls))
        for worker, why in enumerate(results):
            if why is None and worker in self.down_reason:
                log.info("worker %s is back", self.urls[worker])
                del self.down_reason[worker]
                if self.native is not None:
                    self.native.worker_up(worker)
                else:
                    self.router.set_healthy(worker, True)
            elif why is not None:
                self._mark_down(worker, why)

    async def _probe(self, url: str) -> str | None:
        """None if the worker is healthy, else why not."""
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.health_check_timeout_s)
            async with self.session.get(f"{url}/health", timeout=timeout, headers=self._worker_auth) as r:
                return None if r.status == 200 else f"/health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"/health failed: {exc!r}"

    def _mark_down(self, worker: int, why: str) -> None:
        if worker not in self.down_reason:
            log.warning("worker %s is down: %s", self.urls[worker], why)
        self.down_reason[worker] = why
        body = _error_body(503, f"worker {self.urls[worker]} is unavailable: {why}", UNAVAILABLE)
        if self.native is not None:
            self.native.worker_down(worker, body)
            return
        self.router.set_healthy(worker, False)
        self.pool.drop_idle(worker)
        event = b"data: " + body + b"\n\ndata: [DONE]\n\n"
        for exchange in list(self.in_flight[worker]):
            exchange.lose(body, event)

    def _request_failed(self, exchange: Exchange, why: str) -> None:
        self._worker_failed(exchange.worker, why)

    def _worker_failed(self, worker: int, why: str) -> None:
        self._mark_down(worker, f"a request failed: {why}")

    # --- requests -----------------------------------------------------------------------------
    def handle(self, request: Request, client: ClientConnection) -> None:
        path = request.path
        if self._api_key is not None and path != OPEN_PATH and not hmac.compare_digest(client_key(request.headers), self._api_key):
            client.respond(401, _error_body(401, UNAUTHORIZED, "invalid_api_key"), request.keep_alive)
            return
        if path in GENERATION_PATHS and request.method == b"POST":
            self._relay(request, client)
            return
        answer = self._answers.get((request.method, path))
        if answer is None:
            known = any(p == path for _, p in self._answers) or path in GENERATION_PATHS
            status = 405 if known else 404
            client.respond(status, _error_body(status, f"{request.method.decode()} {path.decode()} is not served here", "not_found"), request.keep_alive)
            return
        task = self._spawn(answer(request))
        task.add_done_callback(lambda t: client.respond(*_answer_bytes(t), request.keep_alive))

    def _relay(self, request: Request, client: ClientConnection) -> None:
        prompt, routing_key = _routing_of(request.body)
        try:
            worker = self.router.choose(prompt, routing_key)
        except NoHealthyReplica:
            client.respond(503, _error_body(503, "no worker is available", UNAVAILABLE), request.keep_alive)
            return
        size = len(prompt)  # the load in bytes of prompt: the router does not tokenize

        def ended(exchange: Exchange) -> None:
            self.in_flight[worker].discard(exchange)
            self.router.finished(worker, size)

        exchange = Exchange(worker, client, request, ended)
        client.exchange = exchange
        self.router.started(worker, size)
        self.in_flight[worker].add(exchange)
        self.pool.send(exchange)

    # --- the rest -----------------------------------------------------------------------------
    async def health(self, request: Request) -> Answer:
        up = len(self.urls) - len(self.down_reason)
        return (200 if up else 503), {"healthy_workers": up}

    async def server_info(self, request: Request) -> Answer:
        loads = [self.load(i) for i in range(len(self.urls))]  # one snapshot per worker
        workers = [
            {
                "url": url,
                "healthy": i not in self.down_reason,
                "down_reason": self.down_reason.get(i),
                "requests": requests,
                "prompt_bytes": prompt_bytes,
            }
            for i, (url, (requests, prompt_bytes)) in enumerate(zip(self.urls, loads))
        ]
        return 200, {"router_policy": self.settings.routing.policy, "workers": workers}

    async def models(self, request: Request) -> Answer:
        assert self.session is not None
        for i, url in enumerate(self.urls):
            if i in self.down_reason:
                continue
            try:
                async with self.session.get(f"{url}/v1/models", headers=self._credentials(request)) as r:
                    return r.status, await r.json()
            except (aiohttp.ClientError, ValueError) as exc:
                self._mark_down(i, f"/v1/models failed: {exc!r}")
        return 503, error_body(503, "no worker is available", code=UNAVAILABLE)

    async def broadcast(self, request: Request) -> Answer:
        """Send the request to every healthy worker; 200 if each answered 200."""
        live = [i for i in range(len(self.urls)) if i not in self.down_reason]
        if not live:
            return 503, error_body(503, "no worker is available", code=UNAVAILABLE)
        headers = {"content-type": "application/json", **self._credentials(request)}
        answers = await asyncio.gather(*(self._post(i, request.path.decode(), request.body, headers) for i in live))
        status = 200 if all(code == 200 for code, _ in answers) else max(code for code, _ in answers)
        return status, {"workers": [{"url": self.urls[i], "status": code, "body": text} for i, (code, text) in zip(live, answers)]}

    def _credentials(self, request: Request) -> dict[str, str]:
        """What a request made to the workers for a client authenticates with: the router's own key, else the client's."""
        if self._worker_auth is not None:
            return self._worker_auth
        return {name.decode("latin-1"): value.decode("latin-1") for name, value in request.headers if name in CREDENTIAL_HEADERS}

    async def _post(self, worker: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
        assert self.session is not None
        try:
            async with self.session.post(f"{self.urls[worker]}{path}", data=body, headers=headers) as r:
                return r.status, await r.text()
        except aiohttp.ClientError as exc:
            self._mark_down(worker, f"{path} failed: {exc!r}")
            return 503, UNAVAILABLE


class _RoutingFields(msgspec.Struct):
    """What routing reads of a request body, left as raw JSON: the rest is skipped unparsed."""

    input_ids: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    text: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    routing_key: msgspec.Raw = msgspec.Raw()


_routing_fields = msgspec.json.Decoder(_RoutingFields)


def _routing_of(body: bytes) -> tuple[bytes, str | None]:
    """The prompt key and routing key of a request body.

    The key is the prompt as the client wrote it in JSON (token ids, text or chat messages), not
    parsed: prompts that share leading tokens share leading bytes when one client serialises
    them, and parsing 576 ids would cost more than routing on them. A body that is not a JSON
    object routes with an empty key; the worker answers what is wrong with it."""
    try:
        fields = _routing_fields.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return b"", None
    prompt = fields.input_ids or fields.prompt or fields.text or fields.messages
    routing_key = None
    if fields.routing_key:
        try:  # scanned as Raw, a value can still fail to decode (bad UTF-8, a number past float range)
            value = msgspec.json.decode(fields.routing_key)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            value = None
        routing_key = value if isinstance(value, str) else None
    return bytes(prompt), routing_key


def client_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key a client sent, read as `actorserve serve` reads it: `Authorization: Bearer <key>`,
    else `X-API-Key` (the first of each; b"" for none). httptools leaves a value's trailing
    whitespace, which HTTP does not count as part of it."""
    given = dict(reversed(headers))  # names are lower case; reversed: the first of each wins
    authorization = given.get(b"authorization", b"").rstrip(b" \t")
    if authorization[:7].lower() == b"bearer ":
        return authorization[7:]
    return given.get(b"x-api-key", b"").rstrip(b" \t")


def _is_header_value(key: str) -> bool:
    return key != "" and key.isascii() and key.isprintable() and " " not in key


def _error_body(status: int, message: str, code: str) -> bytes:
    return orjson.dumps(error_body(status, message, code=code))


def _answer_bytes(task: asyncio.Task[Answer]) -> tuple[int, bytes]:
    if task.cancelled():
        return 503, _error_body(503, "the router is shutting down", UNAVAILABLE)
    if task.exception() is not None:
        log.error("answering failed", exc_info=task.exception())
        return 500, _error_body(500, f"the router failed: {task.exception()!r}", "internal_error")
    status, body = task.result()
    return status, orjson.dumps(body)


# --- the command ------------------------------------------------------------------------------------
def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "router", help="route requests over several `actorserve serve` workers", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--worker-urls", nargs="+", required=True, metavar="URL", help="the workers, e.g. http://h1:30000")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=31000, help="port to bind")
    p.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES)
    p.add_argument("--cache-threshold", type=float, default=0.3)
    p.add_argument("--balance-abs-threshold", type=int, default=64)
    p.add_argument("--balance-rel-threshold", type=float, default=1.5)
    p.add_argument("--health-check-interval-s", type=float, default=5.0)
    p.add_argument("--health-check-timeout-s", type=float, default=2.0)
    p.add_argument("--data-plane", default="auto", choices=DATA_PLANES,
                   help="who relays generation requests: compiled C (api/router/csrc/relay.c), Python (api/router/relay.py), or auto: compiled where it could be built")
    p.add_argument("--api-key", default=None, help="the key clients must send (Authorization: Bearer KEY, or X-API-Key); /health stays open")
    p.add_argument("--worker-api-key", default=None,
                   help="the key the router sends the workers (Authorization: Bearer) in place of the client's; unset: the client's credentials pass on")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    routing = RouterConfig(
        policy=args.router_policy, cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold, balance_rel_threshold=args.balance_rel_threshold,
    )
    settings = RouterSettings(
        worker_urls=tuple(args.worker_urls), routing=routing, host=args.host, port=args.port,
        health_check_interval_s=args.health_check_interval_s, health_check_timeout_s=args.health_check_timeout_s,
        data_plane=args.data_plane, api_key=args.api_key, worker_api_key=args.worker_api_key,
    )
    return uvloop.run(serve_router(settings))


async def serve_router(settings: RouterSettings) -> int:
    """Run until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    router = HttpRouter(settings)
    port = await router.start()
    log.info("actorserve router ready: http://%s:%d over %d workers", settings.host, port, len(router.urls))
    try:
        await stop.wait()
    finally:
        await router.close()
    return 0
