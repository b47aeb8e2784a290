"""dp_size > 1: several engine core processes behind the frontend's router (api/frontend/replicas.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from api import Engine
from api.frontend.engine import EngineError
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks, decoding, drain, process_alive, wait_gone

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
SYSTEM = list(range(40, 104))  # a 64-token shared prefix
PROMPTS = [SYSTEM + [1, 2, 3], [5, 6, 7], SYSTEM + [9, 9], [11] * 30, SYSTEM + [4], [3, 1, 4, 1, 5]]
KEYS = ["a", "b", "a", "c", "b", "a"]  # routing keys of PROMPTS


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("qwen3", max_position_embeddings=1024))


def _engine(model_path: str, **kw) -> Engine:
    # One torch thread per core process: two replicas share this machine's two cores.
    return Engine(model_path=model_path, dtype="float32", core_threads=1, **kw)


async def _answers(engine: Engine, keys: list[str | None] | None = None) -> list[list[int]]:
    keys = keys or [None] * len(PROMPTS)
    outs = await asyncio.gather(*[
        engine.generate(input_ids=p, sampling_params=GREEDY, routing_key=k) for p, k in zip(PROMPTS, keys)
    ])
    return [o.output_ids for o in outs]


def _replica_stat(engine: Engine, key: str) -> list[int]:
    return [r[key] for r in engine.stats()["replicas"]]


@pytest.fixture(scope="module")
def dp1_answers(model_path) -> list[list[int]]:
    """PROMPTS' answers from one core process: what dp=2 must give under every router policy."""

    async def answers() -> list[list[int]]:
        async with _engine(model_path) as single:
            return await _answers(single)
    return asyncio.run(answers())


async def _check_dp2_answers(engine: Engine, expected: list[list[int]]) -> None:
    """PROMPTS through `engine` (dp=2) give `expected`, and its stats add up its replicas'."""
    policy = engine.config.router_policy
    assert await _answers(engine, KEYS) == expected, policy
    stats = await engine.current_stats()
    assert stats["dp_size"] == 2 and [r["up"] for r in stats["replicas"]] == [True, True]
    # The sums are the replicas' counters added up.
    assert stats["generated_tokens"] == sum(_replica_stat(engine, "generated_tokens")) == 6 * len(PROMPTS)
    assert stats["kv_pool_size"] == sum(_replica_stat(engine, "kv_pool_size"))
    if policy == "round_robin":  # three each
        assert _replica_stat(engine, "generated_tokens") == [18, 18]
    await assert_idle_invariants(engine)


# cache_aware and routing_key: in their own tests below, which start a dp=2 engine anyway.
@pytest.mark.parametrize("policy", ["round_robin", "shortest_queue"])
async def test_dp2_gives_dp1_answers(model_path, dp1_answers, policy):
    engine = _engine(model_path, dp_size=2, router_policy=policy)
    async with engine:
        await _check_dp2_answers(engine, dp1_answers)
    await close_and_check_tasks(engine)


async def test_cache_aware_gives_dp1_answers_and_sends_a_shared_prefix_group_to_one_replica(model_path, dp1_answers):
    engine = _engine(model_path, dp_size=2, router_policy="cache_aware")
    async with engine:
        await _check_dp2_answers(engine, dp1_answers)
        assert await engine.flush_cache()  # and with it the router's view of each replica's cache
        before = _replica_stat(engine, "generated_tokens")
        first = await engine.generate(input_ids=SYSTEM + [1], sampling_params=GREEDY)
        assert first.cached_tokens == 0
        group = await asyncio.gather(*[engine.generate(input_ids=SYSTEM + [i, i], sampling_params=GREEDY) for i in range(2, 8)])
        # Every later request of the group found the prefix cached: it went where the first did.
        assert all(out.cached_tokens >= len(SYSTEM) for out in group), [o.cached_tokens for o in group]
        await asyncio.gather(*[engine.generate(input_ids=[200 + i] * 20, sampling_params=GREEDY) for i in range(2)])
        after = _replica_stat(await _refreshed(engine), "generated_tokens")
        generated = [a - b for a, b in zip(after, before)]
        assert sorted(generated) == [2 * 6, 7 * 6], generated  # unrelated prompts: the smaller tree
        assert await engine.flush_cache()
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_routing_key_gives_dp1_answers_and_keeps_a_key_on_one_replica(model_path, dp1_answers):
    engine = _engine(model_path, dp_size=2, router_policy="routing_key")
    async with engine:
        await _check_dp2_answers(engine, dp1_answers)
        homes = set()
        for key in ("alice", "bob", "carol", "dave"):
            before = _replica_stat(await _refreshed(engine), "generated_tokens")
            await asyncio.gather(*[engine.generate(input_ids=[7, i], sampling_params=GREEDY, routing_key=key) for i in range(4)])
            after = _replica_stat(await _refreshed(engine), "generated_tokens")
            grew = [i for i in range(2) if after[i] > before[i]]
            assert len(grew) == 1, (key, before, after)  # all four on one replica
            homes.add(grew[0])
            assert engine.replicas.router.choose([1], routing_key=key) == grew[0]
        assert homes == {0, 1}  # and the keys are spread
    await close_and_check_tasks(engine)


async def test_kill_9_of_one_replica_ends_its_requests_and_the_other_keeps_serving(model_path):
    engine = _engine(model_path, dp_size=2, router_policy="round_robin")
    await engine.start()
    pids = [c.pid for c in engine.replicas.clients]
    try:
        # Two decoding on each replica.
        streams = await decoding(engine, [[5 + i, 6, 7] for i in range(4)], {**GREEDY, "max_new_tokens": 900})
        os.kill(pids[0], signal.SIGKILL)
        results = await drain(streams, 30)
        failed = [r for r in results if isinstance(r, EngineError)]
        assert len(failed) == 2 and all("exited with code -9" in str(r) for r in failed), results
        assert sorted(r for r in results if isinstance(r, int)) == [900, 900]
        stats = engine.stats()
        assert stats["failure"] is None and [r["up"] for r in stats["replicas"]] == [False, True]
        assert "exited with code -9" in stats["replicas"][0]["failure"]
        # New requests all go to the live replica.
        outs = await asyncio.gather(*[engine.generate(input_ids=[9, i], sampling_params=GREEDY) for i in range(4)])
        assert all(o.finish_reason == "length" for o in outs)
        await wait_gone(pids[0], 5, "replica")
    finally:
        await close_and_check_tasks(engine)
    assert not any(process_alive(pid) for pid in pids)


async def test_an_abort_reaches_the_replica_that_holds_the_request(model_path):
    engine = _engine(model_path, dp_size=2, router_policy="round_robin")
    async with engine:
        long = {**GREEDY, "max_new_tokens": 900}
        streams = [engine.stream(input_ids=[5 + i, 6], sampling_params=long, rid=f"long-{i}") for i in range(2)]
        for agen in streams:
            await anext(agen)
        assert sorted(engine.replicas.owner.values()) == [0, 1]
        for i in range(2):
            await engine.abort(f"long-{i}")
        finals = [[d async for d in agen][-1] for agen in streams]
        assert [d.finish_reason for d in finals] == ["abort", "abort"]
        await assert_idle_invariants(engine)  # both replicas freed every slot and row
    await close_and_check_tasks(engine)


async def test_dp_needs_the_core_process(model_path):
    with pytest.raises(ValueError, match="dp_size > 1 runs each replica in its own core process"):
        Engine(model_path=model_path, dp_size=2, inline_core=True)
    with pytest.raises(ValueError, match="router_policy 'sticky' is unknown"):
        Engine(model_path=model_path, dp_size=2, router_policy="sticky")


async def _refreshed(engine: Engine) -> Engine:
    await engine.current_stats()  # every replica's counters as of now
    return engine


def test_server_shows_each_replica_and_the_sum(model_path):
    import http.client
    import json

    from api.server.app import ServerSettings
    from tests.test_server import ServerThread

    config = {"model_path": model_path, "dtype": "float32", "core_threads": 1, "dp_size": 2, "router_policy": "round_robin"}
    with ServerThread(config, ServerSettings()) as server:

        def call(method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            try:
                conn.request(method, path, body=json.dumps(body) if body else None, headers={"content-type": "application/json"})
                response = conn.getresponse()
                return response.status, response.read()
            finally:
                conn.close()

        for i in range(2):
            status, raw = call("POST", "/generate", {"input_ids": [5, i], "sampling_params": GREEDY})
            assert status == 200, raw
        status, raw = call("GET", "/get_server_info")
        info = json.loads(raw)
        assert status == 200 and info["dp_size"] == 2
        replicas = info["stats"]["replicas"]
        assert [r["generated_tokens"] for r in replicas] == [6, 6] and info["stats"]["generated_tokens"] == 12
        status, raw = call("GET", "/metrics")
        text = raw.decode()
        assert 'actorserve:replica_up{replica="0"} 1.0' in text and 'actorserve:replica_up{replica="1"} 1.0' in text
        assert 'actorserve:replica_generated_tokens_total{replica="1"} 6.0' in text
        status, raw = call("POST", "/flush_cache")
        assert status == 200, raw
