"""`actorserve serve` workers behind SGLang's own router (sglang-router 0.3.2, a Rust binary wheel:
`pip install 'actorserve[sglang-router]'`): what it reads from a worker, and serving through it.
The router tests skip, saying so, where the wheel is not installed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from tests.test_http_router import GREEDY, model_path, workers  # noqa: F401  (model_path: a fixture)

KEY = "shared-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# What SGLang's router reads of a worker's /server_info and /model_info, with the types it parses
# them as (its ServerInfo and ModelInfo: every field optional; a wrong type loses the whole answer).
SERVER_INFO_FIELDS = {
    "model_path": str, "served_model_name": str, "tp_size": int, "dp_size": int, "load_balance_method": str,
    "disaggregation_mode": str, "version": str, "max_batch_size": int, "max_total_tokens": int,
    "max_prefill_tokens": int, "max_running_requests": int, "max_num_reqs": int,
}
MODEL_INFO_FIELDS = {"model_path": str, "tokenizer_path": str, "is_generation": bool, "model_type": str, "architectures": list}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> tuple[int, object]:
    async with session.get(url, headers=AUTH if headers is None else headers) as r:
        return r.status, await r.json(content_type=None)


def _typed_as_sglang_reads(body: dict, fields: dict[str, type]) -> dict[str, object]:
    """The fields whose values SGLang's router would fail to parse (non-negative ints: usize)."""
    wrong = {}
    for name, kind in fields.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            wrong[name] = value
    return wrong


async def test_a_worker_answers_what_sglangs_router_reads_under_sglangs_current_names(model_path, capfd):  # noqa: F811
    with workers(model_path, 1, ("--api-key", KEY)) as [(_, url)]:
        # SGLang's router first probes for gRPC with an HTTP/2 preface: a 400, logged as one warning line
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.0 400")
        writer.close()
        logged = ""
        for _ in range(50):  # the worker's stderr, as it comes
            logged += capfd.readouterr().err
            if "Error handling request" in logged:
                break
            await asyncio.sleep(0.1)
        assert "WARNING aiohttp.server: Error handling request" in logged and "Traceback" not in logged, logged
        async with aiohttp.ClientSession() as session:
            for new, old in (("/server_info", "/get_server_info"), ("/model_info", "/get_model_info"), ("/get_load", None)):
                assert (await _get(session, f"{url}{new}", {}))[0] == 401  # keyed as the old names are
            (status, info), (_, old_info) = await _get(session, f"{url}/server_info"), await _get(session, f"{url}/get_server_info")
            assert status == 200 and {k: v for k, v in info.items() if k != "stats"} == {k: v for k, v in old_info.items() if k != "stats"}
            assert info["served_model_name"] and info["dp_size"] == 1
            assert _typed_as_sglang_reads(info, SERVER_INFO_FIELDS) == {}
            (status, model), (_, old_model) = await _get(session, f"{url}/model_info"), await _get(session, f"{url}/get_model_info")
            assert status == 200 and model == old_model and model["is_generation"] is True
            assert _typed_as_sglang_reads(model, MODEL_INFO_FIELDS) == {}
            # /get_load as SGLang answers it: a list, one entry per data-parallel rank.
            assert await _get(session, f"{url}/get_load") == (200, [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
            body = {"input_ids": [5, 6], "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 900}}
            async with session.post(f"{url}/generate", json=body, headers=AUTH) as stream:
                await stream.content.readline()
                status, [load] = await _get(session, f"{url}/get_load")
                assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0 and load["num_tokens"] >= 3
                await session.post(f"{url}/abort_request", json={"abort_all": True}, headers=AUTH)
                await asyncio.wait_for(stream.content.read(), 30)


# --- SGLang's router in front of two workers ---------------------------------------------------------
@pytest.fixture(scope="module")
def sglang_router_module() -> str:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        pytest.skip("sglang-router is not installed: pip install 'actorserve[sglang-router]' (a manylinux x86_64 wheel)")
    return "sglang_router.launch_router"


@contextmanager
def sglang_router(module: str, urls: list[str], log: Path, *flags: str) -> Iterator[str]:
    """SGLang's router (cache_aware; it and its metrics exporter on loopback only: both bind
    0.0.0.0 by default) over `urls`, its log in `log`: its URL once every worker is registered."""
    port = _free_port()
    cmd = [sys.executable, "-m", module, "--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port),
           "--policy", "cache_aware", "--api-key", KEY, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()), *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        _wait_for_workers(proc, f"http://127.0.0.1:{port}", len(urls), log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_workers(proc: subprocess.Popen, base: str, n: int, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"SGLang's router exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            request = urllib.request.Request(f"{base}/workers", headers=AUTH)
            with urllib.request.urlopen(request, timeout=1) as r:
                listed = json.loads(r.read())
            if sum(1 for w in listed.get("workers", []) if w.get("is_healthy")) == n:
                return
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"SGLang's router did not register {n} workers:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


async def _events(response: aiohttp.ClientResponse) -> list[str]:
    return [line.decode().strip()[6:] async for line in response.content if line.startswith(b"data: ")]


async def _generated(session: aiohttp.ClientSession, urls: list[str]) -> list[int]:
    return [(await _get(session, f"{url}/get_server_info"))[1]["stats"]["generated_tokens"] for url in urls]


async def test_behind_sglangs_router(model_path, sglang_router_module, tmp_path):  # noqa: F811
    with workers(model_path, 2, ("--api-key", KEY)) as procs:
        urls = [url for _, url in procs]
        log = tmp_path / "sglang_router.log"
        flags = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")
        with sglang_router(sglang_router_module, urls, log, *flags) as base:
            startup = log.read_text()
            assert "falling back" not in startup and "returned 404" not in startup, startup
            async with aiohttp.ClientSession(headers=AUTH) as session:
                # generate and chat, answered as the workers answer them
                body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY}
                async with session.post(f"{urls[0]}/generate", json=body) as r:
                    direct = (await r.json())["output_ids"]
                async with session.post(f"{base}/generate", json=body) as r:
                    assert r.status == 200 and (await r.json())["output_ids"] == direct
                chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
                async with session.post(f"{base}/v1/chat/completions", json=chat) as r:
                    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
                # streaming, native and OpenAI
                async with session.post(f"{base}/generate", json={**body, "stream": True}) as r:
                    events = await _events(r)
                assert r.status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["output_ids"] == direct
                stream = {"model": "default", "prompt": "once upon", "max_tokens": 5, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}
                async with session.post(f"{base}/v1/completions", json=stream) as r:
                    events = await _events(r)
                assert r.status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 5

                # cache-aware stickiness: one long prompt, again and again, stays on one worker and hits its cache
                prompt = {"text": "the quick brown fox jumps over the lazy dog " * 20, "sampling_params": GREEDY}
                before = await _generated(session, urls)
                cached = []
                for _ in range(4):
                    async with session.post(f"{base}/generate", json=prompt) as r:
                        assert r.status == 200
                        cached.append((await r.json())["meta_info"]["cached_tokens"])
                gained = [after - b for after, b in zip(await _generated(session, urls), before)]
                assert sorted(gained) == [0, 4 * 8], gained
                assert cached[0] == 0 and all(c > 100 for c in cached[1:]), cached

                # kill -9 of a worker mid-stream: the other's streams and new requests go on. New
                # prompts go to the worker with the smaller tree, so a few make both busy.
                long = {**GREEDY, "max_new_tokens": 600}
                streams, running = [], [0, 0]
                for i in range(6):
                    streams.append(await session.post(f"{base}/generate", json={"text": f"story {i} " * 30, "sampling_params": long, "stream": True}))
                    assert streams[-1].status == 200
                    await streams[-1].content.readline()
                    running = [(await _get(session, f"{url}/get_server_info"))[1]["stats"]["num_running"] for url in urls]
                    if min(running) > 0:
                        break
                assert min(running) > 0, running
                # the router's load figures are read from each worker's /get_load: KV slots held
                status, loads = await _get(session, f"{base}/get_loads")
                assert status == 200 and all(w["load"] > 0 for w in loads["workers"]), loads
                procs[0][0].kill()
                ends = await asyncio.wait_for(asyncio.gather(*(s.content.read() for s in streams), return_exceptions=True), 60)  # a hang guard
                whole = [end for end in ends if isinstance(end, bytes) and end.rstrip().endswith(b"data: [DONE]")]
                assert len(whole) == running[1], ends
                for end in whole:
                    last = json.loads(end.rstrip().split(b"\n\n")[-2][6:])
                    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 600
                for s in streams:
                    s.close()
                for i in range(3):
                    async with session.post(f"{base}/generate", json={"input_ids": [9, i], "sampling_params": GREEDY}) as r:
                        assert r.status == 200, await r.text()
