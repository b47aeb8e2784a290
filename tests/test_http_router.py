"""`actorserve router` (api/router/http_router.py) over live `actorserve serve` workers on loopback ports."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import aiohttp
import pytest

from api.router.http_router import HttpRouter, RouterSettings
from api.router.routing import RouterConfig

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("qwen3", max_position_embeddings=1024))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def workers(model_path: str, n: int, extra: tuple[str, ...] = ()) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    """n `actorserve serve` processes (inline core, one torch thread each; `extra`: more flags), healthy on return."""
    procs = []
    try:
        for _ in range(n):
            port = _free_port()
            cmd = [sys.executable, "-m", "api.cli", "serve", "--model-path", model_path, "--port", str(port), "--inline-core",
                   "--dtype", "float32", "--log-level", "warning", *extra]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            procs.append((subprocess.Popen(cmd, env=env), f"http://127.0.0.1:{port}"))
        for proc, url in procs:
            _wait_healthy(proc, url)
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"worker {url} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"worker {url} did not start"
        time.sleep(0.1)


@asynccontextmanager
async def _router(urls: list[str], plane: str, interval: float = 0.2, timeout: float = 0.5) -> AsyncIterator[str]:
    """A round_robin router over `urls` on a free port: its base URL, while the block runs."""
    settings = RouterSettings(
        worker_urls=tuple(urls), routing=RouterConfig(policy="round_robin"), port=0,
        health_check_interval_s=interval, health_check_timeout_s=timeout, data_plane=plane,
    )
    router = HttpRouter(settings)
    port = await router.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await router.close()


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def _sse(session: aiohttp.ClientSession, url: str, body: dict) -> list[str]:
    async with session.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        return [line.decode().strip()[6:] async for line in r.content if line.startswith(b"data: ")]


async def test_requests_pass_through_to_every_worker_with_the_same_answers(model_path, router_plane):
    with workers(model_path, 2) as procs:
        urls = [url for _, url in procs]
        async with _router(urls, router_plane) as base:
            async with aiohttp.ClientSession() as session:
                prompts = [[5, 6, 7], [9, 9, 9, 9], [11, 12], [3, 1, 4, 1, 5]]
                direct = [await _post(session, f"{urls[0]}/generate", {"input_ids": p, "sampling_params": GREEDY}) for p in prompts]
                routed = await asyncio.gather(*[_post(session, f"{base}/generate", {"input_ids": p, "sampling_params": GREEDY}) for p in prompts])
                assert [(s, b["output_ids"]) for s, b in routed] == [(s, b["output_ids"]) for s, b in direct]
                # round_robin: each worker served two of them (plus the direct four on worker 0).
                infos = [await (await session.get(f"{u}/get_server_info")).json() for u in urls]
                assert [i["stats"]["generated_tokens"] for i in infos] == [6 * 8, 2 * 8]
                # A stream passes through event by event, ending as the worker ends it.
                events = await _sse(session, f"{base}/generate", {"input_ids": prompts[0], "sampling_params": GREEDY})
                assert events[-1] == "[DONE]" and len(events) >= 3
                assert json.loads(events[-2])["output_ids"] == direct[0][1]["output_ids"]
                chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
                status, body = await _post(session, f"{base}/v1/chat/completions", chat)
                assert status == 200 and body["usage"]["completion_tokens"] == 4
                status, body = await _post(session, f"{base}/generate", {"input_ids": "nonsense"})
                assert status == 400  # the worker's own validation answers
                async with session.post(f"{base}/flush_cache") as r:
                    assert r.status == 200 and [w["status"] for w in (await r.json())["workers"]] == [200, 200]
                info = await (await session.get(f"{base}/get_server_info")).json()
                assert [w["healthy"] for w in info["workers"]] == [True, True]
                assert all(w["requests"] == 0 for w in info["workers"])


async def test_kill_9_of_a_worker_mid_stream_ends_its_requests_with_503_and_the_other_keeps_serving(model_path, router_plane):
    with workers(model_path, 2) as procs:
        urls = [url for _, url in procs]
        async with _router(urls, router_plane) as base:
            async with aiohttp.ClientSession() as session:
                long = {**GREEDY, "max_new_tokens": 900}
                responses = [await session.post(f"{base}/generate", json={"input_ids": [5 + i, 6], "sampling_params": long, "stream": True}) for i in range(2)]
                for r in responses:
                    assert r.status == 200
                    await r.content.readline()  # the first event: both are streaming, one per worker
                procs[0][0].kill()
                reads = [asyncio.ensure_future(r.content.read()) for r in responses]
                done, _ = await asyncio.wait(reads, timeout=30, return_when=asyncio.FIRST_COMPLETED)  # a hang guard
                # The dead worker's request ends while the live worker's is still streaming its 900 tokens.
                assert len(done) == 1 and b"worker_unavailable" in done.pop().result()
                tails = await asyncio.wait_for(asyncio.gather(*reads), 30)
                lost = [t for t in tails if b"worker_unavailable" in t]
                assert len(lost) == 1 and lost[0].endswith(b"data: [DONE]\n\n"), tails
                info = await (await session.get(f"{base}/get_server_info")).json()
                assert [w["healthy"] for w in info["workers"]] == [False, True]
                async with session.get(f"{base}/health") as r:
                    assert r.status == 200  # one worker is enough
                for i in range(3):  # every new request goes to the live one
                    status, body = await _post(session, f"{base}/generate", {"input_ids": [7, i], "sampling_params": GREEDY})
                    assert status == 200 and len(body["output_ids"]) == 8


async def test_a_worker_that_never_answers_is_taken_out_and_none_left_is_503(router_plane):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    try:
        async with _router([f"http://127.0.0.1:{silent.getsockname()[1]}"], router_plane, timeout=0.3) as base:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{base}/health") as r:
                    assert r.status == 503
                status, body = await _post(session, f"{base}/generate", {"input_ids": [1, 2]})
                assert status == 503 and body["error"]["code"] == "worker_unavailable"
                info = await (await session.get(f"{base}/get_server_info")).json()
                assert "health" in info["workers"][0]["down_reason"]
    finally:
        silent.close()


async def test_router_that_cannot_bind_says_why(router_plane):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        settings = RouterSettings(worker_urls=("http://127.0.0.1:1",), port=port, data_plane=router_plane)
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            await HttpRouter(settings).start()
        cli = subprocess.run(
            [sys.executable, "-m", "api.cli", "router", "--worker-urls", "http://127.0.0.1:1", "--port", str(port), "--data-plane", router_plane],
            capture_output=True, text=True, timeout=60,
        )
        assert cli.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in cli.stderr, cli.stderr


async def test_a_worker_that_fails_its_health_check_leaves_and_comes_back(router_plane):
    from aiohttp import web

    healthy = {"ok": True}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if healthy["ok"] else 503)

    async def generate(request: web.Request) -> web.Response:
        return web.json_response({"text": "hi", "output_ids": [1]})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/generate", generate)])
    worker = web.AppRunner(app)
    await worker.setup()
    site = web.TCPSite(worker, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{worker.addresses[0][1]}"
    try:
        async with _router([url], router_plane, interval=0.05) as base:
            async with aiohttp.ClientSession() as session:

                async def routed_status() -> int:
                    return (await _post(session, f"{base}/generate", {"text": "x"}))[0]

                async def wait_for(status: int) -> None:
                    deadline = time.monotonic() + 5
                    while (await routed_status()) != status:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.02)

                assert await routed_status() == 200
                healthy["ok"] = False
                await wait_for(503)
                assert (await (await session.get(f"{base}/get_server_info")).json())["workers"][0]["down_reason"] == "/health answered 503"
                healthy["ok"] = True
                await wait_for(200)
    finally:
        await worker.cleanup()
