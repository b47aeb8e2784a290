"""Aging (`priority_aging_s`) and shortest-first (`sjf`): the wait bound stated in
actors/policy_order.py, checked on a simulated clock with the real QueueOrderer."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.policy_order import QueueOrderer
from api.frontend.engine import Engine
from cache import token_array
from runtime.config import SJF_DEFAULT_AGING_S, EngineConfig
from runtime.req import CallerRequest, Req, SchedState
from runtime.sampling_params import SamplingParams
from tests.test_policy_order import cache_tokens, radix

ROUND_S = 0.25  # simulated seconds per scheduling round
HOT = list(range(100, 124))  # a cached prefix: lpm and dfs-weight favour prompts that start with it


@dataclass
class Arrival:
    round: int
    priority: int
    hot: bool  # starts with the cached prefix
    length: int  # prompt tokens after that


@dataclass
class Admitted:
    req: Req
    arrival: Arrival
    round: int


def arriving(arrivals: list[Arrival], r: int) -> list[tuple[Req, Arrival]]:
    """The requests arriving in round r (request i from arrivals[i]), enqueued at its start."""
    out = []
    for i, a in enumerate(arrivals):
        if a.round == r:
            prompt = (HOT if a.hot else [7]) + [1 + (i + j) % 50 for j in range(a.length)]
            req = Req(CallerRequest(rid=f"r{i}", input_ids=prompt, sampling=SamplingParams(max_new_tokens=8), priority=a.priority), prompt_key=token_array(prompt), sched=SchedState(enqueue_time=r * ROUND_S))
            out.append((req, a))
    return out


def simulate(orderer: QueueOrderer, arrivals: list[Arrival], per_round: int) -> list[Admitted]:
    """Each round: the round's arrivals join the queue, the orderer orders it at the round's
    time, and the first `per_round` are admitted (the Adder admits in order and stops at the first
    that does not fit: here every round fits exactly `per_round`)."""
    waiting: list[Req] = []
    admitted: list[Admitted] = []
    by_rid: dict[str, Arrival] = {}
    last = max((a.round for a in arrivals), default=0)
    r = 0
    while r <= last or waiting:
        for req, a in arriving(arrivals, r):
            by_rid[req.rid] = a
            waiting.append(req)
        ordered = orderer.order(waiting, None, now=r * ROUND_S)
        for req in ordered[:per_round]:
            admitted.append(Admitted(req, by_rid[req.rid], r))
        waiting = ordered[per_round:]
        r += 1
    return admitted


def _orderer(policy: str, aging_s: float | None) -> QueueOrderer:
    cache = radix(4096)
    cache_tokens(cache, HOT)
    config = EngineConfig(schedule_policy=policy, enable_priority_scheduling=True, priority_aging_s=aging_s, lpm_fallback_queue_len=1 << 20)
    return QueueOrderer(config, cache, random.Random(0), in_batch_check_threshold=-1)


# Overload: up to 80 arrivals in 16 rounds, 1-2 admitted per round, so queues build up and
# better requests keep arriving behind worse ones.
arrivals = st.lists(
    st.builds(Arrival, round=st.integers(0, 15), priority=st.sampled_from([0, 5, 10]), hot=st.booleans(), length=st.integers(1, 30)),
    max_size=80,
).map(lambda a: sorted(a, key=lambda x: x.round))


@settings(max_examples=200, deadline=None)
@given(
    arrivals=arrivals,
    policy=st.sampled_from(["fcfs", "lof", "random", "lpm", "dfs-weight", "sjf"]),
    aging_s=st.sampled_from([0.25, 0.5, 1.0, 3.0]),
    per_round=st.integers(1, 2),
)
def test_no_request_is_overtaken_from_outside_its_window_and_the_wait_bound_holds(arrivals, policy, aging_s, per_round):
    admitted = simulate(_orderer(policy, aging_s), arrivals, per_round)
    assert len(admitted) == len(arrivals)
    best = max((a.priority for a in arrivals), default=0)
    for position, r in enumerate(admitted):
        window = (best - r.arrival.priority + 1) * aging_s
        arrived_at = r.arrival.round * ROUND_S
        # Nothing admitted before R arrived more than `window` after it...
        for q in admitted[:position]:
            assert q.arrival.round * ROUND_S - arrived_at <= window, (r.req.rid, q.req.rid)
        # ...so R waits at most for those queued at its arrival and those arriving in the window.
        queued_before = sum(1 for q in admitted if q.arrival.round <= r.arrival.round and q.round >= r.arrival.round) - 1
        in_window = sum(1 for a in arrivals if 0 < a.round * ROUND_S - arrived_at <= window)
        assert (r.round - r.arrival.round) * ROUND_S <= ROUND_S * math.ceil((queued_before + in_window + 1) / per_round)


def test_without_aging_a_stream_of_better_requests_starves_a_request_and_with_aging_it_runs():
    # One admission per round; a priority-10 request arrives every round; one priority-0 at round 0.
    arrivals = [Arrival(0, 0, False, 5)] + [Arrival(r, 10, False, 5) for r in range(0, 200)]
    plain = simulate(_orderer("fcfs", None), arrivals, per_round=1)
    assert [a.req.rid for a in plain].index("r0") == 200  # last: after every priority-10 request
    aged = simulate(_orderer("fcfs", 1.0), arrivals, per_round=1)
    low = next(a for a in aged if a.req.rid == "r0")
    # Its window is (10 + 1) * 1 s = 44 rounds: at most 1 queued ahead plus 44 arrivals.
    assert low.round <= 1 + 44
    assert low.round >= 40  # ...and not much before: aging only levels the field


def test_lpm_with_aging_lets_cold_prompts_through_a_hot_stream():
    arrivals = [Arrival(0, 0, False, 5)] + [Arrival(r, 0, True, 5) for r in range(200)]
    plain = simulate(_orderer("lpm", None), arrivals, per_round=1)
    assert [a.req.rid for a in plain].index("r0") == 200  # lpm alone: the cold prompt goes last
    aged = simulate(_orderer("lpm", 0.5), arrivals, per_round=1)
    assert next(a for a in aged if a.req.rid == "r0").round <= math.ceil((1 + 1) * 0.5 / ROUND_S) + 1


def test_sjf_runs_the_fewest_uncached_tokens_first():
    o = _orderer("sjf", None)
    assert o.aging_s == SJF_DEFAULT_AGING_S  # shortest-first always ages
    reqs = [
        Req(CallerRequest(rid=rid, input_ids=p, sampling=SamplingParams(max_new_tokens=8)), prompt_key=token_array(p), sched=SchedState(enqueue_time=0.0))
        for rid, p in [("long-cold", [7] * 40), ("short-cold", [7] * 10), ("long-hot", HOT + [1] * 5)]
    ]
    # long-hot has 29 tokens but 24 are cached: 5 to compute.
    assert [r.rid for r in o.order(reqs, None, now=1.0)] == ["long-hot", "short-cold", "long-cold"]
    # After a full aging period the long one has waited, a fresh short one has not.
    reqs[0].sched.enqueue_time = -SJF_DEFAULT_AGING_S
    assert [r.rid for r in o.order(reqs, None, now=1.0)][0] == "long-cold"


def test_aging_must_be_positive():
    with pytest.raises(ValueError, match="priority_aging_s must be positive"):
        EngineConfig(priority_aging_s=0)


async def test_an_engine_with_sjf_and_aging_serves_every_request(tiny_llama):
    async with Engine(model_path=str(tiny_llama), dtype="float32", inline_core=True, schedule_policy="sjf",
                      enable_priority_scheduling=True, priority_aging_s=0.05, max_running_requests=2) as engine:
        prompts = [[5] * n for n in (40, 3, 20, 7, 1, 33)]
        outs = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 4, "ignore_eos": True}, priority=i % 3)
                for i, p in enumerate(prompts)]
        results = await asyncio.gather(*outs)
        assert [len(r.output_ids) for r in results] == [4] * len(prompts)
