"""Shared checks for end-to-end Engine tests, the same for an inline core and a core process:
they read the core's counters (`Engine.current_stats`), never its actors."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from api.frontend.engine import Engine
from runtime.stream import Delta


def _idle(stats: dict[str, Any]) -> bool:
    return stats["adder_idle"] and stats["num_waiting"] == 0 and stats.get("num_compiling", 0) == 0


async def wait_idle(engine: Engine, timeout: float = 10.0) -> dict[str, Any]:
    """Wait until every launched step has reported and every ended request is released; the
    core's counters then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not _idle(stats := await engine.current_stats()):
        assert loop.time() < deadline, f"engine not idle: {stats}"
        await asyncio.sleep(0.01)
    return stats


async def assert_idle_invariants(engine: Engine) -> None:
    """KV accounting, no held request row, empty queue, nothing live in the frontend."""
    stats = await wait_idle(engine)
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_pool_size"], stats
    assert stats["kv_protected"] == 0, stats
    assert stats["rows_free"] == stats["rows_total"], stats
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0, stats
    assert not engine.receiver.live, list(engine.receiver.live)
    for client in engine.replicas.clients if engine.replicas is not None else []:
        assert not (client.live or client.backlog), list(client.live)
    assert engine.replicas is None or not engine.replicas.owner, engine.replicas.owner
    if engine.replicas is not None:  # the router's accounting of what it sent is back to zero
        assert all(load.requests == 0 and load.tokens == 0 for load in engine.replicas.router.loads), engine.replicas.router.loads


async def close_and_check_tasks(engine: Engine) -> None:
    actors = list(engine._actors)
    clients = engine.replicas.clients if engine.replicas is not None else []
    await engine.close()
    assert all(not actor.alive for actor in actors)
    assert all(client.pid is None for client in clients), "a core process was not reaped"


async def decoding(engine: Engine, prompts: list[list[int]], sampling_params: dict[str, Any]) -> list[AsyncIterator[Delta]]:
    """Streams of `prompts`, returned once each has delivered its first delta (every request is
    decoding); each stream yields that delta again first."""
    streams = [engine.stream(input_ids=p, sampling_params=sampling_params) for p in prompts]
    return [_replay(await anext(agen), agen) for agen in streams]


async def _replay(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    async for delta in rest:
        yield delta


async def drain(streams: list[AsyncIterator[Delta]], timeout: float) -> list[int | BaseException]:
    """Read every stream to its end at once: the output tokens each delivered, or the exception
    that ended it."""

    async def tokens(agen: AsyncIterator[Delta]) -> int:
        return sum([len(d.output_ids) async for d in agen])

    return await asyncio.wait_for(asyncio.gather(*[tokens(a) for a in streams], return_exceptions=True), timeout)


def process_alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


async def wait_gone(pid: int, timeout: float, what: str) -> None:
    """Until the process has exited (or is a zombie); fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        assert time.monotonic() < deadline, f"{what} {pid} is still running"
        await asyncio.sleep(0.02)
