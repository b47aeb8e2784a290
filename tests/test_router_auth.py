"""`actorserve router --api-key` / `--worker-api-key` (api/router/http_router.py) on both data planes:
the router's own key checked before any worker is asked, and the credentials each request to a
worker carries. Scripted aiohttp workers record every request; one test runs real keyed
`actorserve serve` workers to see an abort through the router free the request's KV."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from api.router.http_router import HttpRouter, RouterSettings
from api.router.routing import RouterConfig
from tests.test_http_router import GREEDY, model_path, workers  # noqa: F401  (model_path: a fixture)

ROUTER_KEY, WORKER_KEY = "router-key", "worker-key"
WRONG_CREDENTIALS = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {ROUTER_KEY[:-1]}"},  # a prefix of the key
    {"Authorization": f"Bearer {ROUTER_KEY}x"},  # the key and more
    {"Authorization": f"Basic {ROUTER_KEY}"},
    {"Authorization": ROUTER_KEY},
    {"X-API-Key": "wrong"},
    {"Authorization": f"Bearer {WORKER_KEY}"},  # the workers' key is not the router's
]
PROTECTED = [
    ("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/flush_cache"),
    ("POST", "/abort_request"), ("GET", "/get_server_info"), ("GET", "/v1/models"), ("GET", "/nowhere"),
]


class KeyedWorker:
    """An aiohttp worker that answers as `actorserve serve --api-key key` does (every path but
    /health needs the key) and records each request's path and credentials."""

    def __init__(self, key: str):
        self.key = key
        self.seen: list[tuple[str, str | None, str | None]] = []  # (path, authorization, x-api-key)
        self.runner: web.AppRunner | None = None

    def paths(self, exclude: str = "/health") -> list[str]:
        return [path for path, _, _ in self.seen if path != exclude]

    def credentials(self, path: str) -> set[tuple[str | None, str | None]]:
        return {(authorization, x_api_key) for seen, authorization, x_api_key in self.seen if seen == path}

    @web.middleware
    async def _check(self, request: web.Request, handler) -> web.StreamResponse:
        self.seen.append((request.path, request.headers.get("Authorization"), request.headers.get("X-API-Key")))
        given = request.headers.get("Authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("X-API-Key", "")
        if request.path != "/health" and token != self.key:
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        return await handler(request)

    async def start(self) -> str:
        async def ok(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"success": True, "path": request.path})

        app = web.Application(middlewares=[self._check])
        app.add_routes([web.get("/health", ok), web.post("/generate", ok), web.post("/v1/chat/completions", ok),
                        web.post("/flush_cache", ok), web.post("/abort_request", ok), web.get("/v1/models", ok)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"


@asynccontextmanager
async def keyed_router(plane: str, n: int, worker_key: str, **keys: str | None) -> AsyncIterator[tuple[list[KeyedWorker], str]]:
    """n KeyedWorkers behind a round_robin router with `keys` (api_key, worker_api_key)."""
    fakes = [KeyedWorker(worker_key) for _ in range(n)]
    async with AsyncExitStack() as stack:
        urls = []
        for fake in fakes:
            urls.append(await fake.start())
            stack.push_async_callback(fake.runner.cleanup)
        settings = RouterSettings(worker_urls=tuple(urls), routing=RouterConfig(policy="round_robin"), port=0,
                                  health_check_interval_s=0.1, health_check_timeout_s=0.5, data_plane=plane, **keys)
        router = HttpRouter(settings)
        port = await router.start()
        stack.push_async_callback(router.close)
        yield fakes, f"http://127.0.0.1:{port}"


async def _call(session: aiohttp.ClientSession, base: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    body = {"rid": "r1"} if path == "/abort_request" else {"text": "a"}
    async with session.request(method, f"{base}{path}", json=body if method == "POST" else None, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_a_wrong_or_missing_key_is_401_from_the_router_and_no_worker_is_asked(router_plane):
    async with keyed_router(router_plane, 2, WORKER_KEY, api_key=ROUTER_KEY, worker_api_key=WORKER_KEY) as (fakes, base):
        async with aiohttp.ClientSession() as session:
            for method, path in PROTECTED:
                for headers in WRONG_CREDENTIALS:
                    status, body = await _call(session, base, method, path, headers)
                    assert status == 401, (method, path, headers)
                    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "authentication_error"
            assert [fake.paths() for fake in fakes] == [[], []]
            async with session.get(f"{base}/health") as r:  # open for load balancers
                assert r.status == 200
            # The right key, in each form `actorserve serve` takes.
            for headers in ({"Authorization": f"Bearer {ROUTER_KEY}"}, {"Authorization": f"bearer {ROUTER_KEY}"}, {"X-API-Key": ROUTER_KEY}):
                assert (await _call(session, base, "POST", "/generate", headers))[0] == 200
                assert (await _call(session, base, "GET", "/get_server_info", headers))[0] == 200


async def test_with_a_worker_key_every_request_to_a_worker_carries_it_and_never_the_clients(router_plane):
    async with keyed_router(router_plane, 2, WORKER_KEY, api_key=ROUTER_KEY, worker_api_key=WORKER_KEY) as (fakes, base):
        async with aiohttp.ClientSession() as session:
            mine = {"Authorization": f"Bearer {ROUTER_KEY}", "X-API-Key": ROUTER_KEY}
            for path in ("/generate", "/generate", "/v1/chat/completions", "/v1/chat/completions"):
                assert (await _call(session, base, "POST", path, mine))[0] == 200
            for path in ("/flush_cache", "/abort_request"):
                status, body = await _call(session, base, "POST", path, mine)
                assert status == 200 and [w["status"] for w in body["workers"]] == [200, 200]
            assert (await _call(session, base, "GET", "/v1/models", mine))[0] == 200
            theirs = {(f"Bearer {WORKER_KEY}", None)}
            for fake in fakes:  # round robin: each got two of the four generations, and every broadcast
                assert sorted(fake.paths()) == sorted(["/abort_request", "/flush_cache", "/generate", "/v1/chat/completions"] + ["/v1/models"] * (fake is fakes[0]))
                for path in {*fake.paths(), "/health"}:
                    assert fake.credentials(path) == theirs, path


@pytest.mark.parametrize("router_key", [None, WORKER_KEY], ids=["no_router_key", "same_key"])
async def test_without_a_worker_key_the_clients_credentials_reach_every_worker(router_plane, router_key):
    async with keyed_router(router_plane, 2, WORKER_KEY, api_key=router_key) as (fakes, base):
        async with aiohttp.ClientSession() as session:
            for headers in ({"Authorization": f"Bearer {WORKER_KEY}"}, {"X-API-Key": WORKER_KEY}):
                for path in ("/flush_cache", "/abort_request"):
                    status, body = await _call(session, base, "POST", path, headers)
                    assert status == 200 and [w["status"] for w in body["workers"]] == [200, 200], body
                assert (await _call(session, base, "POST", "/generate", headers))[0] == 200
                assert (await _call(session, base, "GET", "/v1/models", headers))[0] == 200
            assert all(fake.paths().count("/flush_cache") == 2 and fake.paths().count("/abort_request") == 2 for fake in fakes)
            before = [len(fake.paths()) for fake in fakes]
            status, body = await _call(session, base, "POST", "/flush_cache", {"Authorization": "Bearer wrong"})
            assert status == 401
            # Without a router key the workers refuse it, each asked; with one, none is.
            assert [len(fake.paths()) - n for fake, n in zip(fakes, before)] == ([1, 1] if router_key is None else [0, 0])


async def _stats(session: aiohttp.ClientSession, url: str, key: dict[str, str]) -> dict:
    async with session.get(f"{url}/get_server_info", headers=key) as r:
        assert r.status == 200
        return (await r.json())["stats"]


def _kv_held(stats: dict) -> int:
    return stats["kv_pool_size"] - stats["kv_free"] - stats["kv_cached"]


@pytest.fixture(scope="module")
def keyed_workers(model_path) -> Iterator[list[str]]:  # noqa: F811
    """Two `actorserve serve --api-key WORKER_KEY` workers, shared by both planes' runs."""
    with workers(model_path, 2, ("--api-key", WORKER_KEY)) as procs:
        yield [url for _, url in procs]


async def test_an_abort_through_a_keyed_router_frees_the_requests_kv_on_its_worker(keyed_workers, router_plane):
    key, urls = {"Authorization": f"Bearer {WORKER_KEY}"}, keyed_workers
    settings = RouterSettings(worker_urls=tuple(urls), routing=RouterConfig(policy="round_robin"), port=0,
                              health_check_interval_s=0.2, data_plane=router_plane, api_key=WORKER_KEY)
    router = HttpRouter(settings)
    base = f"http://127.0.0.1:{await router.start()}"
    try:
        async with aiohttp.ClientSession() as session:
            body = {"input_ids": [5, 6], "rid": f"abort-me-{router_plane}", "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 1000}}
            async with session.post(f"{base}/generate", json=body, headers=key) as stream:
                assert stream.status == 200
                await stream.content.readline()  # generating: its KV is held
                held = [_kv_held(await _stats(session, url, key)) for url in urls]
                assert sorted(held)[0] == 0 and sorted(held)[1] > 0, held
                aborted = [(await _stats(session, url, key))["aborted"] for url in urls]
                async with session.post(f"{base}/abort_request", json={"rid": f"abort-me-{router_plane}"}, headers=key) as r:
                    assert r.status == 200 and [w["status"] for w in (await r.json())["workers"]] == [200, 200]
                tail = await asyncio.wait_for(stream.content.read(), 30)  # a hang guard
            events = [json.loads(line[6:]) for line in tail.splitlines() if line.startswith(b"data: {")]
            assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(events[-1]["output_ids"]) < 1000
            deadline = time.monotonic() + 10  # the KV is freed once the last step with it completes
            while [_kv_held(await _stats(session, url, key)) for url in urls] != [0, 0]:
                assert time.monotonic() < deadline, "the aborted request's KV is still held"
                await asyncio.sleep(0.05)
            stats = [await _stats(session, url, key) for url in urls]
            assert sorted(s["aborted"] - n for s, n in zip(stats, aborted)) == [0, 1] and all(s["num_running"] == 0 for s in stats)
    finally:
        await router.close()


@pytest.mark.parametrize("key", ["", "two words", "new\nline", "clé"])
def test_a_key_that_cannot_travel_in_a_header_is_refused_by_name(key):
    for flag, field in (("--api-key", "api_key"), ("--worker-api-key", "worker_api_key")):
        with pytest.raises(ValueError, match=f"^{flag} must be"):
            RouterSettings(worker_urls=("http://127.0.0.1:1",), **{field: key})
