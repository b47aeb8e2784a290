"""`actorserve router`: one HTTP endpoint in front of several `actorserve serve` workers.

    actorserve router --worker-urls http://h1:30000 http://h2:30000 --port 31000

The generation endpoints (`/generate`, `/v1/completions`, `/v1/chat/completions`) are passed
through to the worker the router picks (api/routing.py's policies; the prompt key is the token
ids when the body has them, else the UTF-8 bytes of the prompt or the chat messages), streaming
included, byte for byte. `/flush_cache` and `/abort_request` go to every healthy worker;
`/health` is 200 while one worker is healthy; `/get_server_info` lists the workers.

A worker is taken out when its `/health` fails (checked every `health_check_interval_s`) or a
request to it cannot connect; its requests in flight end with 503 `worker_unavailable` (an SSE
error event when the stream had started). It comes back when `/health` answers 200 again.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from api.routing import NoHealthyReplica, Router, RouterConfig
from runtime.config import ROUTER_POLICIES

log = logging.getLogger("actorserve.router")

UNAVAILABLE = "worker_unavailable"
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"})


@dataclass(frozen=True, slots=True)
class RouterSettings:
    worker_urls: tuple[str, ...]
    routing: RouterConfig = RouterConfig()
    host: str = "127.0.0.1"
    port: int = 31000
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 2.0


@dataclass(eq=False, slots=True)
class _Exchange:
    """One request in flight to a worker."""

    worker: int
    response: web.StreamResponse | None = None  # once headers went to the client
    lost: str | None = None  # why the worker was lost, when it was
    task: asyncio.Task[None] | None = field(default=None)


class HttpRouter:
    def __init__(self, settings: RouterSettings):
        if not settings.worker_urls:
            raise ValueError("the router needs at least one --worker-urls entry")
        self.settings = settings
        self.urls = [u.rstrip("/") for u in settings.worker_urls]
        self.router = Router(settings.routing, len(self.urls))
        self.down_reason: dict[int, str] = {}
        self.in_flight: list[set[_Exchange]] = [set() for _ in self.urls]
        self.session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task[None] | None = None
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([web.post(path, self.proxy) for path in GENERATION_PATHS])
        app.add_routes([
            web.get("/health", self.health),
            web.get("/get_server_info", self.server_info),
            web.get("/v1/models", self.models),
            web.post("/flush_cache", self.broadcast),
            web.post("/abort_request", self.broadcast),
        ])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.settings.health_check_timeout_s))
        await self.check_health()
        self._health = asyncio.get_running_loop().create_task(self._health_loop())

    async def _stop(self, app: web.Application) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

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
                self.router.set_healthy(worker, True)
            elif why is not None:
                self._mark_down(worker, why)

    async def _probe(self, url: str) -> str | None:
        """None if the worker is healthy, else why not."""
        assert self.session is not None
        try:
            async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=self.settings.health_check_timeout_s)) as r:
                return None if r.status == 200 else f"/health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"/health failed: {exc!r}"

    def _mark_down(self, worker: int, why: str) -> None:
        if worker not in self.down_reason:
            log.warning("worker %s is down: %s", self.urls[worker], why)
        self.down_reason[worker] = why
        self.router.set_healthy(worker, False)
        for exchange in list(self.in_flight[worker]):
            exchange.lost = why
            if exchange.task is not None:
                exchange.task.cancel()

    # --- generation ---------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        payload = _json_object(body)
        prompt = _prompt_key(payload)
        routing_key = payload.get("routing_key") if isinstance(payload.get("routing_key"), str) else None
        try:
            worker = self.router.choose(prompt, routing_key)
        except NoHealthyReplica:
            return _error(503, "no worker is available", UNAVAILABLE)
        exchange = _Exchange(worker)
        self.router.started(worker, len(prompt))
        self.in_flight[worker].add(exchange)
        exchange.task = asyncio.get_running_loop().create_task(self._forward(request, body, exchange))
        try:
            await asyncio.shield(exchange.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # the client went away: so does the upstream request
                exchange.task.cancel()
                raise
            # else _mark_down cancelled the exchange: the worker was lost
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._mark_down(worker, f"a request failed: {exc!r}")
        finally:
            self.in_flight[worker].discard(exchange)
            self.router.finished(worker, len(prompt))
        if exchange.task.cancelled() or exchange.task.exception() is not None:
            return await self._lost(exchange)
        assert exchange.response is not None
        return exchange.response

    async def _forward(self, request: web.Request, body: bytes, exchange: _Exchange) -> None:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        url = f"{self.urls[exchange.worker]}{request.path_qs}"
        async with self.session.post(url, data=body, headers=headers, auto_decompress=False) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS:
                    response.headers[key] = value
            await response.prepare(request)
            exchange.response = response
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()

    async def _lost(self, exchange: _Exchange) -> web.StreamResponse:
        """The worker was lost mid-request: a 503, or an error event on a started stream."""
        message = f"worker {self.urls[exchange.worker]} is unavailable: {exchange.lost or 'connection lost'}"
        if exchange.response is None:
            return _error(503, message, UNAVAILABLE)
        response = exchange.response
        error = {"error": {"message": message, "type": "ServiceUnavailable", "param": None, "code": UNAVAILABLE}}
        try:
            await response.write(b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client is gone too
        return response

    # --- the rest -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        up = len(self.urls) - len(self.down_reason)
        return web.json_response({"healthy_workers": up}, status=200 if up else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        workers = [
            {
                "url": url,
                "healthy": i not in self.down_reason,
                "down_reason": self.down_reason.get(i),
                "requests": self.router.loads[i].requests,
                "tokens": self.router.loads[i].tokens,
            }
            for i, url in enumerate(self.urls)
        ]
        return web.json_response({"router_policy": self.settings.routing.policy, "workers": workers})

    async def models(self, request: web.Request) -> web.Response:
        for i, url in enumerate(self.urls):
            if i in self.down_reason:
                continue
            assert self.session is not None
            try:
                async with self.session.get(f"{url}/v1/models") as r:
                    return web.Response(body=await r.read(), status=r.status, content_type="application/json")
            except aiohttp.ClientError as exc:
                self._mark_down(i, f"/v1/models failed: {exc!r}")
        return _error(503, "no worker is available", UNAVAILABLE)

    async def broadcast(self, request: web.Request) -> web.Response:
        """Send the request to every healthy worker; 200 if each answered 200."""
        body = await request.read()
        live = [i for i in range(len(self.urls)) if i not in self.down_reason]
        if not live:
            return _error(503, "no worker is available", UNAVAILABLE)
        answers = await asyncio.gather(*(self._post(i, request.path, body) for i in live))
        status = 200 if all(code == 200 for code, _ in answers) else max(code for code, _ in answers)
        return web.json_response({"workers": [{"url": self.urls[i], "status": code, "body": text} for i, (code, text) in zip(live, answers)]}, status=status)

    async def _post(self, worker: int, path: str, body: bytes) -> tuple[int, str]:
        assert self.session is not None
        try:
            async with self.session.post(f"{self.urls[worker]}{path}", data=body, headers={"content-type": "application/json"}) as r:
                return r.status, await r.text()
        except aiohttp.ClientError as exc:
            self._mark_down(worker, f"{path} failed: {exc!r}")
            return 503, UNAVAILABLE


def _json_object(body: bytes) -> dict[str, Any]:
    """The body's JSON object, or {} (the worker answers what is wrong with it)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return payload if isinstance(payload, dict) else {}


def _prompt_key(payload: dict[str, Any]) -> list[int]:
    """What the cache-aware tree matches: token ids when given, else the prompt's UTF-8 bytes."""
    ids = payload.get("input_ids")
    if isinstance(ids, list) and _all_ints(ids):
        return ids
    prompt = payload.get("prompt", payload.get("text"))
    if isinstance(prompt, list) and _all_ints(prompt):
        return prompt
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(prompt.encode())
    messages = payload.get("messages")
    if isinstance(messages, list):
        return list(orjson.dumps(messages))
    return []


def _all_ints(values: list[Any]) -> bool:
    # The types gathered in C: a generator of isinstance calls cost ~150 us for a 576-token prompt.
    return bool(values) and set(map(type, values)) == {int}


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "ServiceUnavailable" if status == 503 else "BadRequest", "param": None, "code": code}}
    return web.json_response(body, status=status)


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
    )
    return uvloop.run(serve_router(settings))


async def start_router(router: HttpRouter) -> tuple[web.AppRunner, int]:
    """Listen on the settings' host:port (0: a free port); returns the runner and the port."""
    s = router.settings
    runner = web.AppRunner(router.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, s.host, s.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise RuntimeError(f"cannot listen on {s.host}:{s.port}: {exc.strerror or exc}") from None
    return runner, runner.addresses[0][1]


async def serve_router(settings: RouterSettings) -> int:
    """Run until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    router = HttpRouter(settings)
    runner, port = await start_router(router)
    log.info("actorserve router ready: http://%s:%d over %d workers", settings.host, port, len(router.urls))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
