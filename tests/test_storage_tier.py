"""The storage tier under the host tier (issue 32, SGLang's HiCache L3): block files, their
checksums and namespaces, prefetch policies, and an engine restarted on the same directory serving
a repeated prompt's prefix from storage with the tokens an engine without any cache gives."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from api.frontend.engine import Engine
from api.server.metrics import ServerMetrics
from bench.trace_replay import BLOCK as REPLAY_BLOCK
from bench.trace_replay import TraceRequest, replay
from cache.host_tier import HostTier, chain_digests
from cache.keys import encode_tokens
from cache import storage_tier
from cache.storage_tier import KVLayout, Prefetch, StorageTier
from runtime.config import EngineConfig
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks

GREEDY = {"temperature": 0.0, "ignore_eos": True}
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
BLOCK = 4


def _tier(root: Path, identity: str = "model-a", policy: str = "wait_complete") -> StorageTier:
    return StorageTier(root, {"model": identity}, LAYOUT, BLOCK, policy)  # type: ignore[arg-type]


def _block(seed: float) -> torch.Tensor:
    return torch.arange(2 * 2 * BLOCK * 2, dtype=torch.float32).view(4, BLOCK, 1, 2) + seed


def _write_chain(tier: StorageTier, tokens: list[int], blocks: int) -> list[bytes]:
    keys = chain_digests(tokens, None, BLOCK, blocks)
    encoded = encode_tokens(tokens)
    for i, key in enumerate(keys):
        tier.write(key, encoded[i * BLOCK * 4 : (i + 1) * BLOCK * 4], _block(float(i)))
    return keys


def _read_all(tier: StorageTier, tokens: list[int], matched: int = 0) -> list[torch.Tensor]:
    prefetch = tier.prefetch(tokens, None, matched)
    assert prefetch is not None and prefetch.future is not None
    prefetch.future.result(timeout=10)
    return prefetch.take()


def test_blocks_written_are_read_back_bit_for_bit_and_only_under_the_same_identity(tmp_path: Path):
    tokens = list(range(100, 112))
    writer = _tier(tmp_path)
    _write_chain(writer, tokens, 3)
    writer.close()  # the queued writes are on disk once close returns
    assert writer.stats.written_blocks == 3
    reader = _tier(tmp_path)
    blocks = _read_all(reader, tokens)
    assert [torch.equal(b, _block(float(i))) for i, b in enumerate(blocks)] == [True] * 3
    assert len(_read_all(reader, tokens, matched=4)) == 2  # from the block after a device match
    assert len(_read_all(reader, tokens, matched=6)) == 2  # a match inside a block: from that block on
    changed = _read_all(reader, tokens[:4] + [0] + tokens[5:])
    assert len(changed) == 1  # block 2 differs: the chain (and the read) stops there
    other = _tier(tmp_path, identity="model-b")
    assert other.dir != reader.dir and _read_all(other, tokens) == []
    assert reader.stats.corrupt_blocks == 0
    for tier in (reader, other):
        tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_or_truncated_block_is_a_miss_and_is_removed(tmp_path: Path, damage: str):
    tokens = list(range(100, 112))
    writer = _tier(tmp_path)
    keys = _write_chain(writer, tokens, 3)
    writer.close()
    path = writer.path(keys[1])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-40] ^= 1  # inside the KV payload
    else:
        del data[-10:]
    path.write_bytes(bytes(data))
    reader = _tier(tmp_path)
    assert len(_read_all(reader, tokens)) == 1  # block 0 only: block 1 is never served
    assert reader.stats.corrupt_blocks == 1 and not path.exists()
    reader.close()


def test_a_file_of_other_tokens_under_a_key_is_a_miss_but_stays(tmp_path: Path):
    """A digest collision: the file is whole, its tokens are not the request's."""
    tier = _tier(tmp_path)
    key = chain_digests([1, 2, 3, 4], None, BLOCK, 1)[0]
    tier.write(key, encode_tokens([9, 9, 9, 9]), _block(0.0))
    tier.close()
    reader = _tier(tmp_path)
    assert _read_all(reader, [1, 2, 3, 4, 5]) == []
    assert reader.stats.corrupt_blocks == 0 and tier.path(key).exists()
    reader.close()


def test_prefetch_policies_decide_when_a_queued_request_may_go():
    pending = Prefetch([], [], deadline=10.0)
    pending.future = Future()
    assert pending.may_end("best_effort", now=0.0)
    assert not pending.may_end("wait_complete", now=100.0)
    assert not pending.may_end("timeout", now=9.0) and pending.may_end("timeout", now=10.0)
    pending.future.set_result(None)
    assert pending.may_end("wait_complete", now=0.0) and pending.may_end("timeout", now=0.0)


def test_adopted_blocks_join_the_host_tier_and_a_match_loads_them():
    host = HostTier(8 * BLOCK, BLOCK, 1, "write_through")
    tokens = list(range(100, 112))
    keys = chain_digests(tokens, None, BLOCK, 3)
    encoded = encode_tokens(tokens)
    parts = [encoded[i * 16 : (i + 1) * 16] for i in range(3)]
    assert host.adopt(keys[:2], parts[:2], [_block(0.0), _block(1.0)]) == 2 * BLOCK
    staged = host.take_pending()
    assert [c.staged is not None and c.device_slots.numel() == 0 for c in staged] == [True, True]
    assert host.find(tokens, None, 0, 12) == 8  # the third block was never read
    assert host.adopt(keys[:1], parts[:1], [_block(0.0)]) == 0  # held already: not read in twice
    host.check()


def _engine(path: str, storage_dir: Path, policy: str, **extra) -> Engine:
    return Engine(
        model_path=path, dtype="float32", max_total_tokens=96, inline_core=True,
        enable_hierarchical_cache=True, hicache_block_tokens=8, hicache_storage_backend="file",
        hicache_storage_dir=str(storage_dir), hicache_storage_prefetch_policy=policy, **extra,
    )


def _scrape(engine: Engine) -> dict[str, float]:
    """/metrics as the server renders it (its collector reads Engine.stats())."""
    lines = ServerMetrics(engine.stats).render().decode().splitlines()
    return {name: float(value) for name, value in (line.split(" ") for line in lines if line.startswith("actorserve:hicache"))}


async def _expected(path: str, prompts: list[list[int]], params: dict, **extra) -> list[list[int]]:
    async with Engine(model_path=path, dtype="float32", max_total_tokens=96, disable_radix_cache=True, inline_core=True, **extra) as plain:
        return [(await plain.generate(input_ids=p, sampling_params=params)).output_ids for p in prompts]


async def _fill_storage(path: str, storage_dir: Path, prompts: list[list[int]], params: dict, **extra) -> None:
    """Serve every prompt once, then stop once idle: the last one's blocks reach storage with the
    copies-only step an idle engine takes (ForwardMode.IDLE), no later request needed."""
    engine = _engine(path, storage_dir, "best_effort", **extra)
    async with engine:
        for p in prompts:
            await engine.generate(input_ids=p, sampling_params=params)
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
async def test_an_engine_restarted_on_the_directory_serves_the_prefix_from_storage(policy, tiny_model_factory, tmp_path: Path):
    await run_restart(str(tiny_model_factory("llama", max_position_embeddings=512)), tmp_path, policy)


async def test_an_engine_closed_right_after_its_request_leaves_the_blocks_in_storage(tiny_model_factory, tmp_path: Path):
    """No wait for idle before the close: the close itself lets the core make the copies its
    last request left (Engine.close, ForwardMode.IDLE) before it stops."""
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    prompt = [5 + (j * 7) % 300 for j in range(60)]
    params = {**GREEDY, "max_new_tokens": 8}
    async with _engine(path, tmp_path, "best_effort") as engine:
        await engine.generate(input_ids=prompt, sampling_params=params)
    async with _engine(path, tmp_path, "wait_complete", hicache_storage_prefetch_timeout_s=30.0) as engine:
        out = await engine.generate(input_ids=prompt, sampling_params=params)
        assert out.cached_tokens >= 48 and (await engine.current_stats())["hicache_storage_hit_tokens"] >= 48


@pytest.mark.parametrize("inline_core", [True, False], ids=["inline", "core-process"])
async def test_clearing_the_storage_tier_removes_its_files_and_a_restart_finds_none(tiny_model_factory, tmp_path: Path, inline_core: bool):
    """SGLang's /clear_hicache_storage_backend (Engine.clear_hicache_storage): every block file
    goes, also while the engine runs; an engine without a storage tier answers False."""
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    prompt = [5 + (j * 7) % 300 for j in range(60)]
    params = {**GREEDY, "max_new_tokens": 8}
    await _fill_storage(path, tmp_path, [prompt], params)
    assert list(tmp_path.rglob("*.kv"))
    settings = dict(model_path=path, dtype="float32", max_total_tokens=96, inline_core=inline_core, enable_hierarchical_cache=True, hicache_block_tokens=8)
    async with Engine(**settings, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path)) as engine:
        assert await engine.clear_hicache_storage() is True
        assert not list(tmp_path.rglob("*.kv")) and list(tmp_path.rglob("manifest.json"))
    async with _engine(path, tmp_path, "wait_complete") as engine:
        await engine.generate(input_ids=prompt, sampling_params=params)
        assert (await engine.current_stats())["hicache_storage_hit_tokens"] == 0
    async with Engine(**settings) as engine:
        assert await engine.clear_hicache_storage() is False


async def run_restart(path: str, tmp_path: Path, policy: str, **extra) -> None:
    """The test above with engine settings `extra` added (tests/test_cuda.py runs it on a GPU)."""
    prompt = [5 + (j * 7) % 300 for j in range(60)]
    params = {**GREEDY, "max_new_tokens": 8}
    expected = await _expected(path, [prompt], params, **extra)
    await _fill_storage(path, tmp_path, [prompt], params, **extra)
    engine = _engine(path, tmp_path, policy, hicache_storage_prefetch_timeout_s=30.0, **extra)
    async with engine:
        out = await engine.generate(input_ids=prompt, sampling_params=params)
        assert out.output_ids == expected[0]
        assert out.cached_tokens >= 48  # 7 blocks of 8 precede the last prompt token
        stats = await engine.current_stats()
        assert stats["hicache_storage_hit_tokens"] >= 48 and stats["hicache_storage_corrupt_blocks"] == 0
        scraped = _scrape(engine)
        assert scraped["actorserve:hicache_storage_hit_tokens_total"] == stats["hicache_storage_hit_tokens"]
        assert scraped["actorserve:hicache_storage_read_bytes_total"] > 0
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_a_corrupt_block_after_a_restart_is_a_miss_with_the_right_tokens(tiny_model_factory, tmp_path: Path):
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    prompt = [5 + (j * 11) % 300 for j in range(60)]
    params = {**GREEDY, "max_new_tokens": 8}
    expected = await _expected(path, [prompt], params)
    await _fill_storage(path, tmp_path, [prompt], params)
    (namespace,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    files = sorted(namespace.glob("*.kv"))
    assert len(files) >= 7
    for f in files:  # every block: the first one read fails whichever it is
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    engine = _engine(path, tmp_path, "wait_complete")
    async with engine:
        out = await engine.generate(input_ids=prompt, sampling_params=params)
        assert out.output_ids == expected[0]
        assert out.cached_tokens == 0
        stats = await engine.current_stats()
        assert stats["hicache_storage_corrupt_blocks"] == 1 and stats["hicache_storage_hit_tokens"] == 0
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_best_effort_never_holds_a_request_and_gives_the_same_tokens(tiny_model_factory, tmp_path: Path):
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    prompts = [[5 + (i * 13 + j * 7) % 300 for j in range(40)] for i in range(3)]
    params = {**GREEDY, "max_new_tokens": 6}
    expected = await _expected(path, prompts, params)
    await _fill_storage(path, tmp_path, prompts, params)
    engine = _engine(path, tmp_path, "best_effort")
    async with engine:
        outs = [await engine.generate(input_ids=p, sampling_params=params) for p in prompts]
        assert [o.output_ids for o in outs] == expected
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


def test_the_storage_flags_are_checked_at_construction():
    with pytest.raises(ValueError, match="hicache_storage_backend needs the host tier: add enable_hierarchical_cache"):
        EngineConfig(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="hicache_storage_prefetch_timeout_s must be positive"):
        EngineConfig(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_prefetch_timeout_s=0)


async def test_a_request_aborted_while_its_blocks_are_read_ends_and_leaves_nothing(tiny_model_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    prompt = [5 + (j * 5) % 300 for j in range(40)]
    params = {**GREEDY, "max_new_tokens": 4}
    expected = await _expected(path, [prompt], params)
    await _fill_storage(path, tmp_path, [prompt], params)
    engine = _engine(path, tmp_path, "wait_complete")
    async with engine:
        assert engine.core is not None and engine.core.policy.storage is not None
        policy, storage, release = engine.core.policy, engine.core.policy.storage, threading.Event()
        read = storage.read
        monkeypatch.setattr(storage, "read", lambda key, tokens: release.wait(10) and read(key, tokens))
        held = asyncio.create_task(engine.generate(input_ids=prompt, sampling_params=params, rid="held"))
        for _ in range(500):
            if "held" in policy.prefetching:
                break
            await asyncio.sleep(0.01)
        assert "held" in policy.prefetching  # wait_complete: not queued while its blocks are read
        await engine.abort("held")
        assert (await asyncio.wait_for(held, 10)).finish_reason == "abort"
        assert not policy.prefetching
        release.set()
        again = await engine.generate(input_ids=prompt, sampling_params=params)
        assert again.output_ids == expected[0] and again.cached_tokens >= 32
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


def test_a_failed_or_overflowing_write_is_dropped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    full, overflowing = _tier(tmp_path), _tier(tmp_path)

    def disk_full(path: Path, *parts: bytes) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(storage_tier, "_write_atomic", disk_full)
        _write_chain(full, list(range(100, 104)), 1)
        full.close()  # the failed write is done
    monkeypatch.setattr(storage_tier, "MAX_PENDING_WRITES", 0)
    _write_chain(overflowing, list(range(200, 204)), 1)  # the queue is "full": not even queued
    overflowing.close()
    assert [(t.stats.dropped_writes, t.stats.written_blocks) for t in (full, overflowing)] == [(1, 0), (1, 0)]
    assert list(full.dir.glob("*.kv")) == []


async def test_a_device_match_ending_inside_a_block_continues_from_storage(tiny_model_factory, tmp_path: Path):
    """The restarted engine first serves a prompt sharing 12 tokens (a block and a half) with the
    stored one: the stored prompt's device match then ends inside block 1, which storage must
    supply with the rest, or the chain stops at 12 tokens."""
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    prompt = [5 + (j * 3) % 300 for j in range(60)]
    sharing = prompt[:12] + [301 + j for j in range(20)]
    params = {**GREEDY, "max_new_tokens": 4}
    expected = await _expected(path, [prompt], params)
    await _fill_storage(path, tmp_path, [prompt], params)
    engine = _engine(path, tmp_path, "wait_complete")
    async with engine:
        await engine.generate(input_ids=sharing, sampling_params=params)
        out = await engine.generate(input_ids=prompt, sampling_params=params)
        assert out.output_ids == expected[0]
        assert out.cached_tokens >= 48
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


def test_the_trace_replay_with_storage_finds_what_the_host_tier_dropped(tmp_path: Path):
    """bench/trace_replay.py: a host tier of two blocks cannot keep request 0's two blocks past
    request 1's; the storage tier gives them back to request 2, as an unbounded pool would."""
    trace = [
        TraceRequest(0, 2 * REPLAY_BLOCK, 4, [0, 1]),
        TraceRequest(10, 2 * REPLAY_BLOCK, 4, [2, 3]),
        TraceRequest(20, 3 * REPLAY_BLOCK, 4, [0, 1, 4]),
    ]
    pool, host = 3 * REPLAY_BLOCK + 64, 2 * REPLAY_BLOCK
    unbounded = replay(trace, "unbounded", 8 * REPLAY_BLOCK, page_size=16)
    tiered = replay(trace, "host", pool, host_tokens=host, page_size=16)
    stored = replay(trace, "storage", pool, host_tokens=host, page_size=16, storage=True)
    assert unbounded.hit_tokens == 2 * REPLAY_BLOCK
    assert tiered.hit_tokens < unbounded.hit_tokens
    assert stored.hit_tokens == unbounded.hit_tokens and stored.storage_hit_tokens > 0


# --- the capacity: least recently used files go first ------------------------------------------------


def _bounded(root: Path, files: float) -> StorageTier:
    """A tier whose capacity holds `files` block files of LAYOUT."""
    size = storage_tier._HEADER.size + BLOCK * 4 + math.prod(LAYOUT.block_shape(BLOCK)) * 4 + storage_tier._CHECKSUM_BYTES
    return StorageTier(root, {"model": "model-a"}, LAYOUT, BLOCK, "wait_complete", capacity_bytes=int(files * size))


def _blocks_of(tokens: list[int], n: int) -> tuple[list[bytes], list[bytes]]:
    encoded = encode_tokens(tokens)
    return chain_digests(tokens, None, BLOCK, n), [encoded[i * BLOCK * 4 : (i + 1) * BLOCK * 4] for i in range(n)]


def _settle(tier: StorageTier, writes: int) -> None:
    """Wait until the writer thread has handled `writes` writes in all."""
    for _ in range(1000):
        if tier.stats.written_blocks + tier.stats.dropped_writes >= writes:
            return
        time.sleep(0.005)
    raise AssertionError(f"{writes} writes not done: {tier.stats}")


def test_the_directory_stays_within_its_capacity_and_a_removed_block_is_a_miss(tmp_path: Path):
    tokens = list(range(100, 112))
    tier = _bounded(tmp_path, 2.5)
    keys = _write_chain(tier, tokens, 3)
    _settle(tier, 3)
    assert [tier.path(k).exists() for k in keys] == [False, True, True]  # the oldest went
    assert tier.stats.evicted_blocks == 1 and tier.stored_bytes() == sum(tier.path(k).stat().st_size for k in keys[1:])
    assert tier.stored_bytes() <= tier.capacity_bytes  # type: ignore[operator]
    assert _read_all(tier, tokens) == []  # the chain's first block is gone: a miss, not an error
    assert tier.stats.corrupt_blocks == 0 and tier.stats.dropped_writes == 0
    tier.close()


def test_a_read_hit_keeps_a_block_and_the_least_recently_used_goes(tmp_path: Path):
    tier = _bounded(tmp_path, 2)
    (a, b, c), parts = _blocks_of(list(range(100, 112)), 3)
    tier.write(a, parts[0], _block(0.0))
    tier.write(b, parts[1], _block(1.0))
    _settle(tier, 2)
    assert tier.read(a, parts[0]) is not None  # a is now more recent than b
    tier.write(c, parts[2], _block(2.0))
    _settle(tier, 3)
    assert [tier.path(k).exists() for k in (a, b, c)] == [True, False, True]
    assert tier.read(b, parts[1]) is None and tier.stats.corrupt_blocks == 0
    tier.close()


def test_a_restarted_tier_counts_the_files_there_and_removes_the_oldest(tmp_path: Path):
    (a, b, c), parts = _blocks_of(list(range(100, 112)), 3)
    first = _tier(tmp_path)  # no capacity
    for key, part, seed in ((a, parts[0], 0.0), (b, parts[1], 1.0)):
        first.write(key, part, _block(seed))
        _settle(first, 1 if key == a else 2)  # a is written before b: older
    first.close()
    os.utime(first.path(a), ns=(1, 1))  # and older on the clock, whatever its resolution
    again = _bounded(tmp_path, 2)
    assert again.stored_bytes() == first.path(a).stat().st_size + first.path(b).stat().st_size
    again.write(c, parts[2], _block(2.0))
    _settle(again, 1)
    assert [again.path(k).exists() for k in (a, b, c)] == [False, True, True]
    again.close()
    os.utime(again.path(b), ns=(2, 2))  # c is the newest whatever the clock's resolution
    smaller = _bounded(tmp_path, 1)  # restarted with less room than the files take
    assert [smaller.path(k).exists() for k in (a, b, c)] == [False, False, True]
    assert smaller.stored_bytes() == smaller.path(c).stat().st_size and smaller.stats.evicted_blocks == 1
    smaller.close()


def test_a_block_larger_than_the_capacity_is_not_written(tmp_path: Path):
    tier = _bounded(tmp_path, 0.5)
    _write_chain(tier, list(range(100, 104)), 1)
    _settle(tier, 1)
    assert (tier.stats.dropped_writes, tier.stats.written_blocks) == (1, 0) and list(tier.dir.glob("*.kv")) == []
    tier.close()
    with pytest.raises(ValueError, match="capacity must be positive"):
        StorageTier(tmp_path, {"model": "model-a"}, LAYOUT, BLOCK, capacity_bytes=0)
    with pytest.raises(ValueError, match="hicache_storage_capacity_gb must be positive"):
        EngineConfig(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_capacity_gb=0)
