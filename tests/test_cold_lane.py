"""The cold lane (`cold_lane_share`): the share and wait bounds stated in actors/cold_lane.py,
checked on a simulated clock with the real QueueOrderer, where the Adder may hand candidates back."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.cold_lane import ColdLane
from actors.policy_order import QueueOrderer
from api.frontend.engine import Engine
from runtime.config import EngineConfig
from runtime.req import CallerRequest, Req, SchedState
from runtime.sampling_params import SamplingParams
from tests.test_aging import HOT, ROUND_S, Arrival, arriving, simulate
from tests.test_policy_order import cache_tokens, radix

# Hot prompts are HOT (24 tokens, cached) + at most 30 more: at least 44% cached. Cold ones share
# nothing with the cache. A threshold of 25% tells them apart.
THRESHOLD = 0.25


@dataclass
class Admission:
    req: Req
    arrival: Arrival
    round: int
    promoted: bool  # cold, and a hot request came after it in its round's order


def simulate_with_returns(orderer: QueueOrderer, arrivals: list[Arrival], rounds: list[tuple[int, int]]) -> list[Admission]:
    """As the Policy and Adder do: each round the first `offer` of the order are handed out, the
    Adder admits the first `admit` of them and hands the rest back to the front of the queue
    (`rounds` is cycled)."""
    waiting: list[Req] = []
    by_rid: dict[str, Arrival] = {}
    out: list[Admission] = []
    last = max((a.round for a in arrivals), default=0)
    r = 0
    while r <= last or waiting:
        for req, a in arriving(arrivals, r):
            by_rid[req.rid] = a
            waiting.append(req)
        ordered = orderer.order(waiting, None, now=r * ROUND_S)
        offer, admit = rounds[r % len(rounds)]
        admit = min(admit, offer)
        for j, req in enumerate(ordered[:admit]):
            cold = not by_rid[req.rid].hot
            promoted = cold and any(by_rid[q.rid].hot for q in ordered[j + 1 :])
            out.append(Admission(req, by_rid[req.rid], r, promoted))
        waiting = ordered[admit:offer] + ordered[offer:]
        r += 1
    return out


def _orderer(policy: str, share: float, *, priority: bool = False, aging_s: float | None = None) -> QueueOrderer:
    cache = radix(4096)
    cache_tokens(cache, HOT)
    config = EngineConfig(
        schedule_policy=policy, cold_lane_share=share, cold_lane_threshold=THRESHOLD, lpm_fallback_queue_len=1 << 20,
        enable_priority_scheduling=priority, priority_aging_s=aging_s,
    )
    return QueueOrderer(config, cache, random.Random(0), in_batch_check_threshold=-1)


@st.composite
def arrivals(draw: st.DrawFn) -> list[Arrival]:
    """Up to 80 arrivals in 16 rounds, mostly hot in some examples (long hot-only stretches, then
    cold bursts: what banked credit would turn into a run of lane picks)."""
    cold_odds = draw(st.sampled_from([2, 5, 20]))  # one in this many is cold
    arrival = st.builds(
        Arrival, round=st.integers(0, 15), priority=st.just(0), hot=st.integers(1, cold_odds).map(lambda x: x > 1), length=st.integers(1, 30),
    )
    return sorted(draw(st.lists(arrival, max_size=80)), key=lambda x: x.round)


# (offered, admitted) per round; some round admits, or the queue would never drain.
rounds = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=6).filter(lambda rs: any(min(a, o) for o, a in rs))
shares = st.sampled_from([0.1, 0.2, 0.25, 1 / 3, 0.5, 1.0])


@settings(max_examples=300, deadline=None)
@given(arrivals=arrivals(), policy=st.sampled_from(["lpm", "dfs-weight"]), share=shares, rounds=rounds)
def test_a_cold_request_waits_for_the_cold_backlog_ahead_of_it_and_the_lane_keeps_its_share(arrivals, policy, share, rounds):
    orderer = _orderer(policy, share)
    assert orderer.cold_lane is not None
    f = orderer.cold_lane.share  # the exact fraction the lane runs at
    admitted = simulate_with_returns(orderer, arrivals, rounds)
    assert sorted(a.req.rid for a in admitted) == sorted(f"r{i}" for i in range(len(arrivals)))
    # Share: in any n consecutive admissions at most floor(n F) + 1 cold ones overtook a hot one.
    promoted = [a.promoted for a in admitted]
    for start in range(len(promoted)):
        count = 0
        for n, flag in enumerate(promoted[start:], 1):
            count += flag
            assert count <= math.floor(n * f) + 1, (start, n)
    # Wait: a cold R is among the first ceil((C_R + 1) / F) admissions from its arrival round on,
    # C_R the cold requests enqueued no later than it and still waiting when it arrived.
    for a in admitted:
        if a.arrival.hot:
            continue
        arrived = a.arrival.round
        ahead = sum(1 for b in admitted if not b.arrival.hot and b.req is not a.req and b.arrival.round <= arrived and b.round >= arrived)
        since = [b for b in admitted if b.round >= arrived]
        position = next(i for i, b in enumerate(since) if b.req is a.req)
        assert position < math.ceil((ahead + 1) / f), (a.req.rid, ahead, position)


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(
        st.builds(Arrival, round=st.integers(0, 15), priority=st.sampled_from([0, 5, 10]), hot=st.booleans(), length=st.integers(1, 30)),
        max_size=80,
    ).map(lambda a: sorted(a, key=lambda x: x.round)),
    policy=st.sampled_from(["lpm", "dfs-weight"]),
    share=st.sampled_from([0.1, 0.25, 0.5, 0.75]),
    aging_s=st.sampled_from([0.25, 0.5, 1.0, 3.0]),
    per_round=st.integers(1, 2),
)
def test_with_aging_only_the_lane_overtakes_from_outside_the_window_and_the_wait_bound_holds(arrivals, policy, share, aging_s, per_round):
    orderer = _orderer(policy, share, priority=True, aging_s=aging_s)
    assert orderer.cold_lane is not None
    f = orderer.cold_lane.share
    admitted = simulate(orderer, arrivals, per_round)
    best = max((a.priority for a in arrivals), default=0)
    for position, r in enumerate(admitted):
        window = (best - r.arrival.priority + 1) * aging_s
        arrived = r.arrival.round
        for q in admitted[:position]:
            assert q.arrival.round * ROUND_S - arrived * ROUND_S <= window or not q.arrival.hot, (r.req.rid, q.req.rid)
        # Among the first floor((B + W + 1) / (1 - F)) + 1 admissions from its arrival round on.
        queued = sum(1 for q in admitted if q.arrival.round <= arrived and q.round >= arrived) - 1
        in_window = sum(1 for a in arrivals if 0 < (a.round - arrived) * ROUND_S <= window)
        since = [q for q in admitted if q.round >= arrived]
        assert next(i for i, q in enumerate(since) if q is r) <= math.floor((queued + in_window + 1) / (1 - f)), r.req.rid


def test_plain_lpm_starves_a_cold_prompt_and_the_lane_serves_it_within_its_bound():
    # One admission per round; a hot request arrives every round; one cold one at round 0.
    arrivals = [Arrival(0, 0, False, 5)] + [Arrival(r, 0, True, 5) for r in range(100)]
    plain = simulate(_orderer_without_lane(), arrivals, per_round=1)
    assert [a.req.rid for a in plain].index("r0") == 100  # last
    lane = simulate(_orderer("lpm", 0.25), arrivals, per_round=1)
    # No cold request ahead of it: among the first ceil(1 / 0.25) = 4 admissions, and not sooner
    # (the credit starts at 0 and gains 1/4 per admission).
    assert [a.req.rid for a in lane].index("r0") == 3


def test_no_credit_is_banked_while_nothing_cold_waits():
    # 40 hot requests go first (credit capped at 1), then 6 cold ones arrive beside a hot stream:
    # one lane pick on the capped credit (1 + 1/4 - 1 left), then every fourth admission; banked
    # credit (40 x 1/4) would have let all six through in a row.
    arrivals = [Arrival(0, 0, True, 5) for _ in range(40)] + [Arrival(40, 0, False, 5) for _ in range(6)]
    arrivals += [Arrival(r, 0, True, 5) for r in range(40, 80)]
    lane = simulate(_orderer("lpm", 0.25), arrivals, per_round=1)
    cold_rounds = [a.round for a in lane if not a.arrival.hot]
    assert cold_rounds == [40, 43, 47, 51, 55, 59]


def test_the_lane_passes_aging_levels_but_never_a_better_priority():
    # Every request at round 0, one admitted per round, share 1: the cold one goes first among
    # equal priorities, but not ahead of hot requests of a better priority.
    arrivals = [Arrival(0, 10, True, 5) for _ in range(5)] + [Arrival(0, 0, False, 5)]
    assert simulate(_orderer("lpm", 1.0, priority=True), arrivals, per_round=1)[-1].req.rid == "r5"
    equal = [Arrival(0, 0, True, 5) for _ in range(5)] + [Arrival(0, 0, False, 5)]
    assert simulate(_orderer("lpm", 1.0, priority=True), equal, per_round=1)[0].req.rid == "r5"
    # Once the better priority is placed, the lane serves the next: share 1/2, all in one round.
    mixed = [Arrival(0, 10, True, 5)] + equal
    assert [a.req.rid for a in simulate(_orderer("lpm", 0.5, priority=True), mixed, per_round=7)][:2] == ["r0", "r6"]
    # A cold request one round younger than five hot ones is an aging level behind them, and the
    # lane still serves it next.
    aged = [Arrival(0, 0, True, 5) for _ in range(5)] + [Arrival(1, 0, False, 5)]
    admitted = simulate(_orderer("lpm", 1.0, aging_s=ROUND_S), aged, per_round=1)
    assert [a.req.rid for a in admitted].index("r5") == 1


def test_candidates_handed_back_cost_the_lane_nothing():
    lane = ColdLane(0.5)
    reqs = [Req(CallerRequest(rid=f"r{i}", input_ids=[1], sampling=SamplingParams(max_new_tokens=1)), sched=SchedState(enqueue_time=float(i))) for i in range(4)]
    h0, h1, h2, cold = reqs
    # Credit 1/2 at the first position, 1 at the second: the lane's pick.
    assert lane.interleave([h0, h1, h2, cold], {id(cold)}, None) == [h0, cold, h1, h2]
    # The Adder admitted h0 only and handed the rest back: the credit is what it was after h0's
    # position, so the cold request takes the next position again.
    assert lane.interleave([h1, h2, cold], {id(cold)}, None) == [cold, h1, h2]
    assert lane.credit == Fraction(1, 2)
    # Now cold and h1 were admitted, and h1 was retracted: it is back with a new enqueue time and
    # its position counts (1/2 + 1/2 - 1 for the lane's pick, + 1/2 for h1's).
    h1.sched.enqueue_time = 10.0
    lane.interleave([h2, h1], set(), None)
    assert lane.credit == Fraction(1, 2)


def _orderer_without_lane() -> QueueOrderer:
    cache = radix(4096)
    cache_tokens(cache, HOT)
    config = EngineConfig(schedule_policy="lpm", lpm_fallback_queue_len=1 << 20)
    return QueueOrderer(config, cache, random.Random(0), in_batch_check_threshold=-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule_policy": "lpm", "cold_lane_share": 0.0}, r"cold_lane_share must be in \(0, 1\]"),
        ({"schedule_policy": "lpm", "cold_lane_share": 1.5}, r"cold_lane_share must be in \(0, 1\]"),
        ({"schedule_policy": "lpm", "cold_lane_share": float("nan")}, r"cold_lane_share must be in \(0, 1\]"),
        ({"schedule_policy": "lpm", "cold_lane_share": 0.2, "cold_lane_threshold": 0.0}, r"cold_lane_threshold must be in \(0, 1\]"),
        ({"schedule_policy": "fcfs", "cold_lane_share": 0.2}, "cold_lane_share reorders the cache-aware policies: use schedule_policy lpm or dfs-weight"),
        ({"schedule_policy": "lpm", "cold_lane_share": 0.2, "fairness": "vtc"}, "cold_lane_share cannot be combined with fairness vtc"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_tiny_share_still_serves_the_lane():
    assert ColdLane(1e-9).share == Fraction(1, 10_000)


async def test_an_engine_with_the_cold_lane_serves_every_request(tiny_llama):
    async with Engine(model_path=str(tiny_llama), dtype="float32", inline_core=True, schedule_policy="lpm",
                      cold_lane_share=0.3, max_running_requests=2) as engine:
        hot = [9] * 24
        prompts = [hot + [i] for i in range(6)] + [[5 + i] * 20 for i in range(3)]
        outs = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 3, "ignore_eos": True}) for p in prompts]
        results = await asyncio.gather(*outs)
        assert [len(r.output_ids) for r in results] == [3] * len(prompts)
