"""`CoreStats`: an engine core's counters, as one typed record.

The core builds it (api/core/engine_core.py), a core process sends it to the frontend in
`runtime.ipc.CoreStatsReport`, data-parallel replicas are merged with `merged`, and
`Engine.stats()` hands it out as a plain dict (`as_dict`) for /get_server_info and /metrics.
The hierarchical cache's counters are None when the engine has no such tier, and left out of the
dict then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec


class CoreStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # the KV pool and its request rows (the Adder's)
    kv_pool_size: int
    kv_free: int
    kv_cached: int
    kv_evictable: int
    kv_protected: int
    rows_free: int
    rows_total: int
    # scheduling (the Adder's and the Policy's)
    num_running: int
    num_waiting: int
    num_compiling: int  # the grammar queue
    new_token_ratio: float
    steps: int
    retractions: int
    preemptions: int
    aborted: int
    rejected: int
    queue_timeouts: int
    deadline_infeasible: int
    scheduler_s: float
    adder_idle: bool
    # vtc: each tenant's weighted service (prompt + 2 x generated tokens, / its weight)
    tenant_service: dict[str, float]
    # the forward and the outputs
    generated_tokens: int
    forward_steps: int
    forward_s: float
    loop_cpu_s: float  # CPU time of the thread running the core's loop (the whole process's when inline)
    actor_cpu_s: dict[str, float]
    time: float  # time.monotonic() when these were read
    # the host tier (HiCache L2); None without one
    hicache_host_tokens: int | None = None
    hicache_host_cached: int | None = None
    hicache_host_hit_tokens: int | None = None
    hicache_stored_tokens: int | None = None
    hicache_evicted_tokens: int | None = None
    # the storage tier (HiCache L3); None without one
    hicache_storage_hit_tokens: int | None = None
    hicache_storage_written_blocks: int | None = None
    hicache_storage_written_bytes: int | None = None
    hicache_storage_write_s: float | None = None
    hicache_storage_dropped_writes: int | None = None
    hicache_storage_read_blocks: int | None = None
    hicache_storage_read_bytes: int | None = None
    hicache_storage_read_s: float | None = None
    hicache_storage_corrupt_blocks: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def merged(parts: Sequence[CoreStats]) -> CoreStats:
    """Replicas' counters as one engine's: counts and times summed, the token ratio averaged, the
    newest reading time, idle only when every replica is."""

    def total(read: Callable[[CoreStats], int]) -> int:
        return sum(read(p) for p in parts)

    def seconds(read: Callable[[CoreStats], float]) -> float:
        return sum(read(p) for p in parts)

    return CoreStats(
        kv_pool_size=total(lambda p: p.kv_pool_size),
        kv_free=total(lambda p: p.kv_free),
        kv_cached=total(lambda p: p.kv_cached),
        kv_evictable=total(lambda p: p.kv_evictable),
        kv_protected=total(lambda p: p.kv_protected),
        rows_free=total(lambda p: p.rows_free),
        rows_total=total(lambda p: p.rows_total),
        num_running=total(lambda p: p.num_running),
        num_waiting=total(lambda p: p.num_waiting),
        num_compiling=total(lambda p: p.num_compiling),
        new_token_ratio=sum(p.new_token_ratio for p in parts) / len(parts),
        steps=total(lambda p: p.steps),
        retractions=total(lambda p: p.retractions),
        preemptions=total(lambda p: p.preemptions),
        aborted=total(lambda p: p.aborted),
        rejected=total(lambda p: p.rejected),
        queue_timeouts=total(lambda p: p.queue_timeouts),
        deadline_infeasible=total(lambda p: p.deadline_infeasible),
        scheduler_s=seconds(lambda p: p.scheduler_s),
        adder_idle=all(p.adder_idle for p in parts),
        tenant_service=_summed_by_key([p.tenant_service for p in parts]),
        generated_tokens=total(lambda p: p.generated_tokens),
        forward_steps=total(lambda p: p.forward_steps),
        forward_s=seconds(lambda p: p.forward_s),
        loop_cpu_s=seconds(lambda p: p.loop_cpu_s),
        actor_cpu_s=_summed_by_key([p.actor_cpu_s for p in parts]),
        time=max(p.time for p in parts),
        hicache_host_tokens=_optional_sum([p.hicache_host_tokens for p in parts]),
        hicache_host_cached=_optional_sum([p.hicache_host_cached for p in parts]),
        hicache_host_hit_tokens=_optional_sum([p.hicache_host_hit_tokens for p in parts]),
        hicache_stored_tokens=_optional_sum([p.hicache_stored_tokens for p in parts]),
        hicache_evicted_tokens=_optional_sum([p.hicache_evicted_tokens for p in parts]),
        hicache_storage_hit_tokens=_optional_sum([p.hicache_storage_hit_tokens for p in parts]),
        hicache_storage_written_blocks=_optional_sum([p.hicache_storage_written_blocks for p in parts]),
        hicache_storage_written_bytes=_optional_sum([p.hicache_storage_written_bytes for p in parts]),
        hicache_storage_write_s=_optional_sum([p.hicache_storage_write_s for p in parts]),
        hicache_storage_dropped_writes=_optional_sum([p.hicache_storage_dropped_writes for p in parts]),
        hicache_storage_read_blocks=_optional_sum([p.hicache_storage_read_blocks for p in parts]),
        hicache_storage_read_bytes=_optional_sum([p.hicache_storage_read_bytes for p in parts]),
        hicache_storage_read_s=_optional_sum([p.hicache_storage_read_s for p in parts]),
        hicache_storage_corrupt_blocks=_optional_sum([p.hicache_storage_corrupt_blocks for p in parts]),
    )


def _summed_by_key(parts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out


Number = TypeVar("Number", int, float)


def _optional_sum(values: list[Number | None]) -> Number | None:
    """None when no replica has the tier."""
    present = [v for v in values if v is not None]
    return sum(present) if present else None
