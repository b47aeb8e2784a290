"""Queue ordering (actors/policy_order.py) against reference/sglang-behaviour.md, "Policies"."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors import policy_order
from actors.policy_order import QueueOrderer
from cache import ChunkCache, RadixCache
from gpu.kv_pool import TokenSlotAllocator
from runtime.config import SCHEDULE_POLICIES, EngineConfig
from runtime.req import OutputState, CallerRequest, Req, SchedState
from runtime.sampling_params import SamplingParams

# -- helpers ----------------------------------------------------------------------------------


def req(
    rid: str,
    tokens: list[int] | None = None,
    *,
    priority: int = 0,
    enqueue_time: float | None = None,
    max_new_tokens: int = 16,
    routing_key: str | None = None,
    extra_key: str | None = None,
) -> Req:
    return Req(CallerRequest(rid=rid, input_ids=tokens if tokens is not None else [1, 2, 3], sampling=SamplingParams(max_new_tokens=max_new_tokens), priority=priority, routing_key=routing_key, extra_key=extra_key), sched=SchedState(enqueue_time=enqueue_time if enqueue_time is not None else 0.0))


def radix(size: int = 8192, page_size: int = 1) -> RadixCache:
    return RadixCache(TokenSlotAllocator(size, page_size))


def cache_tokens(cache: RadixCache, tokens: list[int], extra_key: str | None = None) -> None:
    """Cache `tokens` the way the Adder would, handing back the slots the tree did not take."""
    assert cache.allocator is not None
    slots = cache.allocator.alloc(len(tokens))
    assert slots is not None
    present = cache.insert(tokens, slots, extra_key)
    aligned = len(tokens) // cache.page_size * cache.page_size
    cache.allocator.free(torch.cat([slots[:present], slots[aligned:]]))


def orderer(policy: str = "fcfs", cache: RadixCache | None = None, seed: int = 0, **config: object) -> QueueOrderer:
    return QueueOrderer(EngineConfig(schedule_policy=policy, **config), cache, random.Random(seed))  # type: ignore[arg-type]


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def seq(start: int, n: int) -> list[int]:
    """`n` distinct token ids from `start`: no accidental prefix sharing between sequences."""
    return list(range(start, start + n))


# -- cache-agnostic ---------------------------------------------------------------------------


def test_fcfs_keeps_queue_order_without_priority():
    queue = [req("a", priority=9, enqueue_time=3.0), req("b", priority=1, enqueue_time=1.0), req("c", enqueue_time=2.0)]
    out = orderer("fcfs").order(queue)
    assert rids(out) == ["a", "b", "c"]
    assert out is not queue


def _priority_queue() -> list[Req]:
    # "d" was requeued (preempted): it sits at the back but entered the queue before "b".
    return [
        req("a", priority=5, enqueue_time=1.0),
        req("b", priority=1, enqueue_time=2.0),
        req("c", priority=3, enqueue_time=3.0),
        req("d", priority=1, enqueue_time=0.5),
    ]


def test_fcfs_priority_high_values_first_by_default():
    out = orderer("fcfs", enable_priority_scheduling=True).order(_priority_queue())
    assert rids(out) == ["a", "c", "d", "b"]


def test_fcfs_priority_low_values_first():
    o = orderer("fcfs", enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert rids(o.order(_priority_queue())) == ["d", "b", "c", "a"]


def test_lof_longest_output_first_and_stable():
    queue = [req("a", max_new_tokens=8), req("b", max_new_tokens=64), req("c", max_new_tokens=8), req("d", max_new_tokens=32)]
    assert rids(orderer("lof").order(queue)) == ["b", "d", "a", "c"]


def test_lof_with_priority_puts_priority_first():
    queue = [
        req("a", priority=1, max_new_tokens=100),
        req("b", priority=2, max_new_tokens=10),
        req("c", priority=2, max_new_tokens=50),
        req("d", priority=1, max_new_tokens=200),
    ]
    assert rids(orderer("lof", enable_priority_scheduling=True).order(queue)) == ["c", "b", "d", "a"]
    low_first = orderer("lof", enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert rids(low_first.order(queue)) == ["d", "a", "c", "b"]


def test_random_is_a_seeded_permutation():
    queue = [req(str(i)) for i in range(20)]
    first = rids(orderer("random", seed=7).order(queue))
    assert sorted(first, key=int) == rids(queue)
    assert first != rids(queue)
    assert rids(orderer("random", seed=7).order(queue)) == first
    assert rids(orderer("random", seed=8).order(queue)) != first


def test_routing_key_matched_first_by_count_then_key_then_unmatched_by_key():
    queue = [
        req("none", routing_key=None),
        req("z", routing_key="z"),
        req("b1", routing_key="b"),
        req("a", routing_key="a"),
        req("c", routing_key="c"),
        req("b2", routing_key="b"),
        req("y", routing_key="y"),
    ]
    running = Counter({"a": 2, "b": 2, "c": 5, "gone": 0})
    out = orderer("routing-key").order(queue, running)
    # c (5 running) first; a and b tie on count and sort by key; then the unmatched by key ("" first).
    assert rids(out) == ["c", "a", "b1", "b2", "none", "y", "z"]


def test_routing_key_without_running_keys_keeps_order():
    queue = [req("z", routing_key="z"), req("a", routing_key="a"), req("n")]
    o = orderer("routing-key")
    assert rids(o.order(queue, Counter())) == ["z", "a", "n"]
    assert rids(o.order(queue, None)) == ["z", "a", "n"]
    assert rids(o.order(queue, Counter({"a": 0}))) == ["z", "a", "n"]


# -- lpm --------------------------------------------------------------------------------------


def test_lpm_orders_by_cached_prefix_length():
    cache = radix()
    cache_tokens(cache, seq(1000, 80))
    cache_tokens(cache, seq(2000, 40))
    queue = [
        req("miss", seq(5000, 10)),
        req("p40", seq(2000, 40) + [7, 8]),
        req("p80", seq(1000, 80) + [9]),
        req("p60", seq(1000, 60) + [1, 2, 3]),
        req("miss2", seq(6000, 10)),
    ]
    out = orderer("lpm", cache).order(queue)
    assert rids(out) == ["p80", "p60", "p40", "miss", "miss2"]


def test_lpm_matches_the_whole_prompt():
    """SGLang's calc_priority matches origin_input_ids + output_ids whole (admission alone leaves
    the last token): a prompt that is exactly the cached 50 tokens ranks with one that extends them."""
    cache = radix()
    cache_tokens(cache, seq(1000, 50))
    queue = [req("short", seq(1000, 40) + [7] * 5), req("whole", seq(1000, 50)), req("longer", seq(1000, 50) + [1])]
    assert rids(orderer("lpm", cache).order(queue)) == ["whole", "longer", "short"]


def test_lpm_in_batch_check_uses_page_size_one():
    """SGLang's waiting_queue_radix_tree has pages of 1 whatever the cache's: with pages of 64, a
    request sharing 40 uncached tokens with one earlier in the queue still goes after the others."""
    cache = radix(page_size=64)
    queue = [req("first", seq(5000, 40) + [1] * 30), req("twin", seq(5000, 40) + [2] * 30), req("other", seq(9000, 70))]
    assert rids(orderer("lpm", cache).order(queue)) == ["first", "other", "twin"]


def test_lpm_priority_goes_first():
    cache = radix()
    cache_tokens(cache, seq(1000, 80))
    queue = [req("hit-low", seq(1000, 80) + [1], priority=1), req("miss-high", seq(5000, 5), priority=9)]
    assert rids(orderer("lpm", cache).order(queue)) == ["hit-low", "miss-high"]
    assert rids(orderer("lpm", cache, enable_priority_scheduling=True).order(queue)) == ["miss-high", "hit-low"]


def test_in_batch_prefix_caching_defers_all_but_the_first_sharer():
    cache = radix()
    cache_tokens(cache, seq(9000, 40))
    shared = seq(1000, 64)  # uncached
    queue = [
        req("s1", shared + [1, 2]),
        req("s2", shared + [3, 4]),
        req("other", seq(5000, 20)),
        req("hit", seq(9000, 40) + [5]),
        req("s3", shared + [6]),
    ]
    o = orderer("lpm", cache)
    assert rids(o.order(queue)) == ["hit", "s1", "other", "s2", "s3"]
    # The in-batch prefix set is reset every round: the same queue gives the same order again.
    assert rids(o.order(queue)) == ["hit", "s1", "other", "s2", "s3"]
    # Once s1's prefix is cached, nobody is held back and s2, s3 (64 cached tokens) lead.
    cache_tokens(cache, shared + [1, 2])
    assert rids(o.order(queue[1:])) == ["s2", "s3", "hit", "other"]


def test_in_batch_thresholds():
    cache = radix()
    short = seq(1000, 31)  # a shared prefix below the deprioritize threshold holds nobody back
    queue = [req("a", short + [1, 2]), req("b", short + [3, 4]), req("c", seq(5000, 3))]
    assert rids(orderer("lpm", cache).order(queue)) == ["a", "b", "c"]
    # A real-cache hit above the check threshold skips the check, even with a long shared tail.
    cache_tokens(cache, seq(2000, 33))
    tail = seq(3000, 64)
    queue = [req("x", seq(2000, 33) + tail + [1]), req("y", seq(2000, 33) + tail + [2])]
    assert rids(orderer("lpm", cache).order(queue)) == ["x", "y"]
    # -1 disables the check.
    shared = seq(7000, 64)
    queue = [req("p", shared + [1]), req("q", shared + [2]), req("r", seq(8000, 3))]
    assert rids(orderer("lpm", cache).order(queue)) == ["p", "r", "q"]
    disabled = QueueOrderer(EngineConfig(schedule_policy="lpm"), cache, random.Random(0), in_batch_check_threshold=-1)
    assert rids(disabled.order(queue)) == ["p", "q", "r"]
    assert policy_order.IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD == 32
    assert policy_order.IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD == 32


def test_lpm_falls_back_to_fcfs_over_the_configured_length():
    cache = radix()
    cache_tokens(cache, seq(1000, 80))
    queue = [req("m1", seq(5000, 4), enqueue_time=1), req("m2", seq(6000, 4), enqueue_time=2), req("hit", seq(1000, 80) + [1], enqueue_time=3)]
    o = orderer("lpm", cache, lpm_fallback_queue_len=3)
    assert rids(o.order(queue)) == ["hit", "m1", "m2"]  # 3 is not longer than 3: lpm
    longer = queue + [req("m3", seq(7000, 4), enqueue_time=4)]
    assert o.active_policy(4) == "fcfs"
    assert rids(o.order(longer)) == ["m1", "m2", "hit", "m3"]
    # The fallback is our fcfs, priority included.
    prio = orderer("lpm", cache, lpm_fallback_queue_len=3, enable_priority_scheduling=True)
    urgent = [*longer[:3], req("m3", seq(7000, 4), priority=5, enqueue_time=4)]
    assert rids(prio.order(urgent)) == ["m3", "m1", "m2", "hit"]


def test_lpm_extra_key_isolation():
    cache = radix()
    cache_tokens(cache, seq(1000, 80), extra_key="tenant-a")
    queue = [
        req("b", seq(1000, 80) + [1], extra_key="tenant-b"),
        req("none", seq(1000, 80) + [2]),
        req("a", seq(1000, 80) + [3], extra_key="tenant-a"),
    ]
    assert rids(orderer("lpm", cache).order(queue)) == ["a", "b", "none"]
    # In-batch sharing is namespaced too: equal uncached prefixes under different keys hold nobody back.
    shared = seq(3000, 64)
    queue = [req("x", shared + [1], extra_key="k1"), req("y", shared + [2], extra_key="k2"), req("z", seq(9000, 3))]
    assert rids(orderer("lpm", radix()).order(queue)) == ["x", "y", "z"]


def test_lpm_with_pages():
    cache = radix(page_size=4)
    cache_tokens(cache, seq(1000, 40))
    # 38 tokens: 37 may be matched, rounded down to 36 (whole pages); "full" matches all 40.
    queue = [req("part", seq(1000, 38)), req("full", seq(1000, 40) + [1]), req("miss", seq(5000, 9))]
    assert rids(orderer("lpm", cache).order(queue)) == ["full", "part", "miss"]


# -- dfs-weight -------------------------------------------------------------------------------

A, B, C, D, E, F, G = (seq(100 * (i + 1), 4) for i in range(7))


def _seed_004_tree() -> RadixCache:
    """root{A{C, D}, B{E{F, G}}} (seed 004's worked example)."""
    cache = radix()
    for path in (A + C, A + D, B, B + E + F, B + E + G):
        cache_tokens(cache, path)
    return cache


def _at(rid: str, path: list[int], extra: int = 0, **kw: object) -> Req:
    """A request whose match ends exactly at the node that `path` ends at."""
    return req(rid, path + [90_000 + extra], **kw)  # type: ignore[arg-type]


def test_dfs_weight_seed_004_worked_example():
    cache = _seed_004_tree()
    ac, ad, bef, beg = A + C, A + D, B + E + F, B + E + G
    queue = [
        _at("D1", ad), _at("F1", bef), _at("C1", ac), _at("G1", beg), _at("C2", ac),
        _at("D2", ad), _at("F2", bef), _at("C3", ac), _at("G2", beg), _at("C4", ac),
    ]  # fmt: skip
    out = orderer("dfs-weight", cache).order(queue)
    assert rids(out) == ["C1", "C2", "C3", "C4", "D1", "D2", "F1", "F2", "G1", "G2"]


def test_dfs_weight_post_order_and_ties():
    cache = _seed_004_tree()
    queue = [
        _at("root", seq(50_000, 3)),
        _at("G1", B + E + G),
        _at("A", A),
        _at("F1", B + E + F),
        _at("C1", A + C),
    ]
    # Branches A (A, C1) and B (G1, F1) both weigh 2: B holds the earlier arrival (G1), so it goes
    # first, and inside E, G before F for the same reason. A node's own requests follow its
    # subtree (C1 before A); the unmatched request sits at the root, so it comes last.
    out = orderer("dfs-weight", cache).order(queue)
    assert rids(out) == ["G1", "F1", "C1", "A", "root"]


def test_dfs_weight_with_priority_keeps_tree_order_within_a_level():
    cache = _seed_004_tree()
    queue = [_at("C1", A + C), _at("F1", B + E + F, priority=3), _at("C2", A + C), _at("D1", A + D, priority=3)]
    assert rids(orderer("dfs-weight", cache).order(queue)) == ["C1", "C2", "D1", "F1"]
    o = orderer("dfs-weight", cache, enable_priority_scheduling=True)
    assert rids(o.order(queue)) == ["D1", "F1", "C1", "C2"]


def test_dfs_weight_is_not_limited_by_the_lpm_fallback():
    cache = _seed_004_tree()
    queue = [_at("D1", A + D), _at("C1", A + C), _at("C2", A + C)]
    assert rids(orderer("dfs-weight", cache, lpm_fallback_queue_len=0).order(queue)) == ["C1", "C2", "D1"]


# -- cache disabled ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_without_cache_is_fcfs(policy: str):
    queue = [req("b", priority=1, enqueue_time=2), req("a", priority=2, enqueue_time=1), req("c", priority=2, enqueue_time=3)]
    allocator = TokenSlotAllocator(64)
    cases = [
        (EngineConfig(schedule_policy=policy, disable_radix_cache=True), ChunkCache(allocator)),
        (EngineConfig(schedule_policy=policy), None),
        (EngineConfig(schedule_policy=policy), ChunkCache(allocator)),
    ]
    for config, cache in cases:
        o = QueueOrderer(config, cache, random.Random(0))
        assert o.policy == "fcfs"
        assert rids(o.order(queue)) == ["b", "a", "c"]
    prio = QueueOrderer(EngineConfig(schedule_policy=policy, disable_radix_cache=True, enable_priority_scheduling=True), None, random.Random(0))
    assert rids(prio.order(queue)) == ["a", "c", "b"]


# -- properties -------------------------------------------------------------------------------

_tokens = st.lists(st.integers(0, 5), min_size=0, max_size=48)


@st.composite
def _queues(draw: st.DrawFn) -> tuple[list[Req], list[list[int]], Counter[str]]:
    n = draw(st.integers(0, 24))
    queue = [
        Req(CallerRequest(rid=f"r{i}", input_ids=draw(_tokens), sampling=SamplingParams(max_new_tokens=draw(st.integers(0, 50))), priority=draw(st.integers(-3, 3)), routing_key=draw(st.sampled_from([None, "a", "b", "c"])), extra_key=draw(st.sampled_from([None, "x"]))), sched=SchedState(enqueue_time=draw(st.floats(0, 10))), out=OutputState(output_ids=draw(st.lists(st.integers(0, 5), max_size=4))))
        for i in range(n)
    ]
    cached = draw(st.lists(_tokens, max_size=6))
    running = Counter(draw(st.lists(st.sampled_from(["a", "b", "d"]), max_size=5)))
    return queue, cached, running


@settings(max_examples=150, deadline=None)
@given(
    data=_queues(),
    policy=st.sampled_from(SCHEDULE_POLICIES),
    priority=st.sampled_from([(False, False), (True, False), (True, True)]),
    page_size=st.sampled_from([1, 4]),
    fallback=st.integers(0, 30),
    check=st.sampled_from([-1, 0, 2, 32]),
    deprioritize=st.sampled_from([1, 4, 32]),
    aging=st.sampled_from([None, 0.5, 3.0]),
)
def test_every_policy_returns_a_permutation(data, policy, priority, page_size, fallback, check, deprioritize, aging):
    queue, cached, running = data
    cache = radix(512, page_size)
    for tokens in cached:
        cache_tokens(cache, tokens)
    config = EngineConfig(
        schedule_policy=policy,
        enable_priority_scheduling=priority[0],
        schedule_low_priority_values_first=priority[1],
        lpm_fallback_queue_len=fallback,
        priority_aging_s=aging,
    )
    o = QueueOrderer(config, cache, random.Random(1), in_batch_check_threshold=check, in_batch_deprioritize_threshold=deprioritize)
    now = 10.0  # every enqueue_time is in [0, 10]
    for _ in range(2):  # a second round reuses the cached match keys and the reset in-batch prefix set
        out = o.order(queue, running, now=now)
        assert len(out) == len(queue)
        assert {id(r) for r in out} == {id(r) for r in queue}
    # Levels: the priority (where the policy uses it), less one per aging period waited.
    sign = (1 if priority[1] else -1) if priority[0] and policy not in ("random", "routing-key") else 0
    aging_s = config.effective_aging_s
    levels = [r.asked.priority * sign - (int((now - r.sched.enqueue_time) // aging_s) if aging_s else 0) for r in out]
    assert levels == sorted(levels)
    assert cache.protected_size() == 0  # ordering never locks


# -- a large queue ---------------------------------------------------------------------------


def test_large_queue_ordering():
    """1,024 requests in 16 groups sharing 512-token prefixes (its cost is bench.overhead's
    prefill-rounds scenario, not timed here)."""
    groups, per_group, prefix_len = 16, 64, 512
    queue = [
        req(f"g{g}-{i}", seq(100_000 * (g + 1), prefix_len) + seq(10_000 + 100 * i, 32))
        for i in range(per_group)
        for g in range(groups)
    ]
    for policy, warm in (("lpm", False), ("lpm", True), ("dfs-weight", True)):
        cache = radix(1 << 16)
        if warm:
            for g in range(groups):
                cache_tokens(cache, seq(100_000 * (g + 1), prefix_len))
        o = orderer(policy, cache, lpm_fallback_queue_len=1 << 30)
        first = o.order(queue)
        rounds = [o.order(queue) for _ in range(3)]
        assert all(rids(r) == rids(first) for r in rounds)
        if policy == "dfs-weight":  # whole groups, one after another
            assert all(first[i].rid.split("-")[0] == first[i - 1].rid.split("-")[0] for i in range(1, per_group))
        elif warm:  # every request hits exactly its group's 512 tokens: a tie, so queue order
            assert rids(first) == rids(queue)
        else:  # one request per group now, the rest next round
            assert rids(first[:groups]) == rids(queue[:groups])
