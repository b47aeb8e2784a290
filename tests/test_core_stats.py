"""CoreStats (runtime/stats.py): the core's counters as one typed record, across the process
boundary and merged over data-parallel replicas."""

from __future__ import annotations

import msgspec

from runtime.ipc import CoreStatsReport, FromCore
from runtime.stats import CoreStats, merged


def replica(n: int, *, host: bool) -> CoreStats:
    tier = {"hicache_host_tokens": 100 * n, "hicache_host_hit_tokens": n, "hicache_storage_read_s": 0.5 * n} if host else {}
    return CoreStats(
        kv_pool_size=1000 * n, kv_free=10 * n, kv_cached=5 * n, kv_evictable=4 * n, kv_protected=0, rows_free=n, rows_total=2 * n,
        num_running=n, num_waiting=2 * n, num_compiling=0, new_token_ratio=0.2 * n, steps=7 * n, retractions=n, preemptions=0,
        aborted=n, rejected=0, queue_timeouts=0, deadline_infeasible=0, scheduler_s=0.25 * n, adder_idle=n == 1,
        tenant_service={"a": 1.0 * n, f"t{n}": 2.0}, generated_tokens=3 * n, forward_steps=7 * n, forward_s=0.5 * n,
        loop_cpu_s=0.75 * n, actor_cpu_s={"adder": 0.125 * n}, time=10.0 + n, **tier,
    )


def test_stats_cross_the_boundary_typed() -> None:
    report = CoreStatsReport(replica(1, host=True), ticket=3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=FromCore)
    assert isinstance(back, CoreStatsReport) and back == report
    assert isinstance(back.stats, CoreStats) and back.stats.hicache_host_tokens == 100


def test_an_engine_without_tiers_reports_no_tier_counters() -> None:
    stats = replica(1, host=False).as_dict()
    assert stats["kv_pool_size"] == 1000 and stats["tenant_service"] == {"a": 1.0, "t1": 2.0}
    assert not [key for key in stats if key.startswith("hicache_")]


def test_replicas_merge_by_what_each_counter_means() -> None:
    one, two = replica(1, host=True), replica(2, host=False)
    both = merged([one, two])
    assert (both.kv_pool_size, both.num_waiting, both.steps, both.generated_tokens) == (3000, 6, 21, 9)  # counts: summed
    assert (both.scheduler_s, both.forward_s, both.loop_cpu_s) == (0.75, 1.5, 2.25)  # times: summed
    assert abs(both.new_token_ratio - 0.3) < 1e-12  # a ratio: the mean
    assert both.time == 12.0  # when read: the newest
    assert both.adder_idle is False  # idle only when every replica is
    assert both.tenant_service == {"a": 3.0, "t1": 2.0, "t2": 2.0} and both.actor_cpu_s == {"adder": 0.375}
    # a tier only one replica has: its counters; a tier none has: none
    assert (both.hicache_host_tokens, both.hicache_host_hit_tokens, both.hicache_storage_read_s) == (100, 1, 0.5)
    assert both.hicache_evicted_tokens is None and "hicache_evicted_tokens" not in both.as_dict()
    assert merged([one]) == one
