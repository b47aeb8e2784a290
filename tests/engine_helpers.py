"""Shared checks for end-to-end Engine tests."""

from __future__ import annotations

import asyncio

from api.engine import Engine


async def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    """Wait until every launched step has reported and every ended request is released."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    adder = engine.adder
    while adder.in_flight or adder.ending or adder.running or adder.chunked or engine.policy.waiting:
        assert loop.time() < deadline, f"engine not idle: {engine.stats()}"
        await asyncio.sleep(0.01)


async def assert_idle_invariants(engine: Engine) -> None:
    """KV accounting, no held request row, empty queue, nothing live in the Receiver."""
    await wait_idle(engine)
    stats = engine.stats()
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_pool_size"], stats
    assert engine.prefix_cache.protected_size() == 0, stats
    assert stats["rows_free"] == engine.runner.req_to_token.max_requests, stats
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0, stats
    assert not engine.receiver.live, list(engine.receiver.live)


async def close_and_check_tasks(engine: Engine) -> None:
    actors = list(engine._actors)
    await engine.close()
    assert all(not actor.alive for actor in actors)
