"""The host tier under the radix cache (issue 32, SGLang's HiCache L2): what it books, what the
Executor copies, and that a prompt served from it gives the same tokens as no cache at all."""

from __future__ import annotations

import pytest
import torch

from actors.executor import _split_loads
from actors.kv_ledger import KVLedger
from api.frontend.engine import Engine
from cache import RadixCache
from cache.host_tier import HostTier
from gpu.kv_pool import KVBuffers, KVMove, LayerLoads, ReqToTokenPool, TokenSlotAllocator, _run_start
from runtime.messages import KVCopy
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _tier(blocks: int = 4, block: int = 4, policy: str = "write_back") -> HostTier:
    return HostTier(blocks * block, block, 1, policy)


def test_stored_blocks_are_found_again_from_a_device_match_and_loaded():
    tier = _tier()
    tokens = list(range(100, 112))
    tier.store(tokens, torch.arange(1, 13), None)
    (store, *_), = [tier.take_pending()]
    assert store.to_host and store.device_slots.tolist() == [1, 2, 3, 4]
    assert tier.find(tokens, None, 0, 12) == 12
    assert tier.find(tokens, None, 6, 12) == 12  # a device match inside a block: the rest of it loads
    assert tier.find(tokens, "other", 0, 12) == 0  # another namespace
    assert tier.find(tokens[:4] + [0] + tokens[5:], None, 0, 12) == 4  # a different block 2: the chain stops
    tier.load(tokens, None, 6, torch.arange(50, 56))
    loads = tier.take_pending()
    assert [c.to_host for c in loads] == [False, False]
    assert [c.device_slots.tolist() for c in loads] == [[50, 51], [52, 53, 54, 55]]
    assert tier.stats.loaded_tokens == 6
    tier.check()


def test_a_full_tier_drops_its_least_recently_used_block():
    tier = _tier(blocks=2)
    a, b, c = list(range(0, 4)), list(range(10, 14)), list(range(20, 24))
    tier.store(a, torch.arange(1, 5), None)
    tier.store(b, torch.arange(5, 9), None)
    assert tier.find(a, None, 0, 4) == 4  # a is now the most recent
    tier.store(c, torch.arange(9, 13), None)
    assert (tier.find(a, None, 0, 4), tier.find(b, None, 0, 4), tier.find(c, None, 0, 4)) == (4, 0, 4)
    assert tier.stats.evicted_tokens == 4
    tier.check()


def test_a_digest_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch):
    tier = _tier()
    tier.store([1, 2, 3, 4], torch.arange(1, 5), None)
    monkeypatch.setattr(tier, "digests", lambda tokens, extra_key, n: [b"same"] * n)
    tier._blocks = {b"same": next(iter(tier._blocks.values()))}  # type: ignore[assignment]
    assert tier.find([9, 9, 9, 9], None, 0, 4) == 0


def _ledger(pool: int, host_blocks: int, policy: str = "write_back") -> KVLedger:
    allocator = TokenSlotAllocator(pool, 1)
    cache = RadixCache(allocator, host_tier=_tier(blocks=host_blocks, policy=policy))
    return KVLedger(allocator, ReqToTokenPool(4, 64), cache)


def _cache_sequence(ledger: KVLedger, tokens: list[int]) -> None:
    """What a request's life does to the ledger: a row, its KV, cached when it closes."""
    match = ledger.match(tokens, None)
    ledger.cache.inc_lock_ref(match.last_node)
    row = ledger.open_row(match)
    ledger.make_room(len(tokens) - match.length)
    assert ledger.extend(row, len(tokens) - match.length) is not None
    ledger.close_row(row, tokens, None)
    ledger.check()


def test_eviction_writes_back_and_a_later_match_loads_the_pages_into_the_tree():
    ledger = _ledger(pool=16, host_blocks=8)
    first = list(range(100, 112))
    _cache_sequence(ledger, first)
    assert ledger.take_kv_copies() == []  # write_back: nothing until an eviction
    _cache_sequence(ledger, list(range(200, 212)))  # evicts the first
    stores = ledger.take_kv_copies()
    assert stores and all(c.to_host for c in stores) and sum(c.device_slots.numel() for c in stores) == 12
    match = ledger.match(first + [7], None)
    assert match.length == 12
    loads = [c for c in ledger.take_kv_copies() if not c.to_host]
    assert sum(c.device_slots.numel() for c in loads) == 12
    assert torch.equal(torch.cat([c.device_slots for c in loads]), match.slots)
    ledger.check()


def test_write_through_copies_pages_as_they_are_cached():
    ledger = _ledger(pool=64, host_blocks=8, policy="write_through")
    _cache_sequence(ledger, list(range(100, 110)))  # two whole blocks of 4, a partial one
    copies = ledger.take_kv_copies()
    assert [c.to_host for c in copies] == [True, True]
    ledger.flush_cache()
    assert ledger.host_tier is not None and ledger.host_tier.stored_tokens() == 0
    ledger.check()


def test_copies_move_kv_both_ways():
    device = KVBuffers.allocate(2, 8, 1, 2, torch.float32, "cpu")
    host = KVBuffers.allocate(2, 8, 1, 2, torch.float32, "cpu")
    for layer in range(2):
        device.k[layer][3] = layer + 1.0
        device.v[layer][3] = -(layer + 1.0)
    device.copy_to(torch.tensor([3]), host, torch.tensor([5]))
    host.copy_to(torch.tensor([5]), device, torch.tensor([6]))
    assert [float(device.k[layer][6, 0, 0]) for layer in range(2)] == [1.0, 2.0]
    assert [float(device.v[layer][6, 0, 1]) for layer in range(2)] == [-1.0, -2.0]


def test_loads_are_made_layer_by_layer_as_the_forward_asks():
    device = KVBuffers.allocate(3, 8, 1, 2, torch.float32, "cpu")
    host = KVBuffers.allocate(3, 8, 1, 2, torch.float32, "cpu")
    for layer in range(3):
        host.k[layer][5], host.v[layer][5] = layer + 1.0, -(layer + 1.0)
    loads = LayerLoads([KVMove(False, torch.tensor([2]), torch.tensor([5]))], host, device)
    loads.ready(0)
    assert [float(device.k[layer][2, 0, 0]) for layer in range(3)] == [1.0, 0.0, 0.0]
    loads.ready(1)
    assert [float(device.v[layer][2, 0, 1]) for layer in range(3)] == [-1.0, -2.0, 0.0]
    loads.finish()
    assert [float(device.k[layer][2, 0, 0]) for layer in range(3)] == [1.0, 2.0, 3.0]


def test_a_run_of_host_slots_is_read_as_one_view():
    assert _run_start(torch.tensor([4, 5, 6])) == 4  # a block: copied from a pinned view, asynchronously
    assert _run_start(torch.tensor([4, 6, 7])) is None and _run_start(torch.tensor([5, 4])) is None


def test_only_the_loads_after_every_other_copy_wait_for_the_forward():
    def copy(to_host: bool, staged: bool = False) -> KVCopy:
        return KVCopy(to_host, torch.tensor([1]), torch.tensor([2]), staged=torch.zeros(1) if staged else None)

    evict, load, fill = copy(True), copy(False), copy(False, staged=True)
    assert _split_loads([evict, load, load]) == ([evict], [load, load])
    assert _split_loads([load, evict, load]) == ([load, evict], [load])  # a load before an eviction keeps its place
    assert _split_loads([fill, load]) == ([fill], [load])  # a block read from storage reaches the host first
    assert _split_loads([evict]) == ([evict], [])


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_a_prompt_served_from_the_host_tier_decodes_as_with_no_cache(policy, tiny_model_factory):
    """A pool of 96 tokens: the second long prompt evicts the first; the first again is matched
    on the host, loaded back and gives the tokens an engine without any cache gives."""
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    prompts = [[5 + (i * 7 + j) % 300 for j in range(60)] for i in range(2)]
    params = {**GREEDY, "max_new_tokens": 8}
    async with Engine(model_path=path, dtype="float32", max_total_tokens=96, disable_radix_cache=True, inline_core=True) as plain:
        expected = [(await plain.generate(input_ids=p, sampling_params=params)).output_ids for p in prompts]
    engine = Engine(
        model_path=path, dtype="float32", max_total_tokens=96, inline_core=True,
        enable_hierarchical_cache=True, hicache_block_tokens=8, hicache_write_policy=policy,
    )
    async with engine:
        outs = [await engine.generate(input_ids=p, sampling_params=params) for p in prompts + prompts[:1]]
        assert [o.output_ids for o in outs] == expected + expected[:1]
        stats = await engine.current_stats()
        assert stats["hicache_host_hit_tokens"] >= 48
        assert outs[2].cached_tokens >= 48
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)
