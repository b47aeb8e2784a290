"""bench/trace_serving.py: Mooncake prompts in a micro model's vocabulary, the cost-model device's
charge for host-to-device loads, its modelled disk under the storage tier, a three-request trace
through the real actors whose third request finds its prefix in the host tier (and pays for
loading it), and one whose last request finds it only in the storage tier (and waits in the queue
for reading it)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from bench.device_model import DEVICE_MODELS
from bench.overhead import TOKEN_MARGIN
from bench.trace_replay import BLOCK, TraceRequest
from bench.trace_serving import STORAGE_CONFIG, VOCAB, HostLinkDevice, block_ids, prompt_ids, serve
from cache.host_tier import chain_digests
from cache.keys import encode_tokens
from cache.storage_tier import KVLayout, StorageTier
from runtime.forward_mode import ForwardMode
from runtime.messages import Batch, KVCopy, StorageBlock

H100 = DEVICE_MODELS["h100-qwen3-8b"]


def test_blocks_are_equal_only_for_equal_ids_and_stay_in_the_vocabulary():
    ids = [0, 1, 491, 492, 182789, 182789 + 492**2]
    blocks = [block_ids(h) for h in ids]
    assert all(len(b) == BLOCK and min(b) >= TOKEN_MARGIN and max(b) < VOCAB - TOKEN_MARGIN for b in blocks)
    assert len({tuple(b[:3]) for b in blocks}) == len(ids)  # two ids differ within a block's first 3 tokens
    assert block_ids(7) == block_ids(7)
    req = TraceRequest(0, 2 * BLOCK - 100, 1, [7, 9])
    assert prompt_ids(req) == (block_ids(7) + block_ids(9))[: 2 * BLOCK - 100]


def _batch(copies: list[KVCopy]) -> Batch:
    return Batch(step=0, mode=ForwardMode.EXTEND, reqs=[], rows=[1], prefix_lens=[0], extend_lens=[1024], extend_ids=[[11] * 1024],
                 out_cache_loc=torch.zeros(1024, dtype=torch.int64), produces_token=[True], final_token=[False], kv_copies=copies)


def test_host_to_device_loads_are_charged_at_the_host_link_rate():
    device = HostLinkDevice(VOCAB, H100)
    load = KVCopy(to_host=False, device_slots=torch.arange(4096), host_slots=torch.arange(4096))
    store = KVCopy(to_host=True, device_slots=torch.arange(512), host_slots=torch.arange(512))
    plain = H100.step_s([0], [1024])
    assert device.sleep_s(_batch([])) == pytest.approx(plain)
    assert device.sleep_s(_batch([store])) == pytest.approx(plain)  # the other way, on a side stream: not charged
    charged = device.sleep_s(_batch([load, store]))
    assert charged - plain == pytest.approx(4096 * H100.kv_bytes_per_token / H100.host_link_bytes_per_s)
    assert H100.host_load_s(4096) == pytest.approx(4096 * 36 * 8 * 128 * 2 * 2 / 51.2e9)  # 144 KiB a token at 51.2 GB/s: 11.8 ms
    assert (device.loaded_tokens, device.load_s) == (4096, pytest.approx(charged - plain))


async def test_a_prefix_pushed_out_of_the_pool_is_served_from_the_host_tier(tiny_model_factory: Any):
    model = tiny_model_factory("llama", vocab_size=VOCAB, max_position_embeddings=4096)
    # Two seconds apart (0.1 s here): one request at a time. Arriving together, the third would wait
    # beside the second, and a prefix-aware policy would run it first, while its prefix is still on device.
    trace = [TraceRequest(2000 * i, 2 * BLOCK, 2, ids) for i, ids in enumerate([[1, 2], [3, 4], [1, 2]])]
    pool = {"max_total_tokens": 3 * BLOCK}  # request 1 pushes most of request 0's blocks out
    radix = await serve(trace, "radix", H100, pool, sim_speed=20, model_dir=model)
    host = await serve(trace, "host", H100, {**pool, "enable_hierarchical_cache": True, "hicache_ratio": 2}, sim_speed=20, model_dir=model)
    assert [o.ttft_s is not None for o in radix.outcomes + host.outcomes] == [True] * 6
    radix_hit, host_hit = radix.outcomes[2].cached_tokens, host.outcomes[2].cached_tokens
    assert host_hit == 2 * BLOCK - 64 and radix_hit < host_hit  # all but the last page (always computed)
    assert host.host_hit_tokens == host.loaded_tokens == host_hit - radix_hit and host.load_s > 0
    assert radix.loaded_tokens == 0
    row = host.row(sim_speed=20)
    assert row["prefill_tokens_saved"] == sum(o.cached_tokens for o in host.outcomes) and row["refused"] == 0


def test_storage_reads_are_paced_at_the_disk_rate_not_charged_in_the_step_and_persisted_blocks_written(tmp_path: Any):
    storage = StorageTier(tmp_path, {"model": "micro"}, KVLayout(1, 1, 16, torch.float32), block_tokens=64)
    slow = replace(H100, storage_read_bytes_per_s=64 * H100.kv_bytes_per_token / 0.05)  # 50 ms a block
    device = HostLinkDevice(VOCAB, slow, storage)
    ids = list(range(192))
    keys = chain_digests(ids, None, 64, 3)
    tokens = [encode_tokens(ids[i * 64 : (i + 1) * 64]) for i in range(3)]
    persisted = [KVCopy(to_host=True, device_slots=torch.arange(64), host_slots=torch.arange(64), persist=StorageBlock(k, t)) for k, t in zip(keys, tokens)]
    device.run(_batch(persisted))
    device.close()  # closes the tier: its queued writes are done
    assert storage.stats.written_blocks == 3 and storage.read(keys[0], tokens[0]) is not None

    reader = StorageTier(tmp_path, {"model": "micro"}, KVLayout(1, 1, 16, torch.float32), block_tokens=64, prefetch_policy="wait_complete")
    device = HostLinkDevice(VOCAB, slow, reader)
    start = time.monotonic()
    prefetch = reader.prefetch(ids, None, matched=0)
    assert prefetch is not None
    prefetch.future.result(timeout=10)
    assert time.monotonic() - start >= 3 * 0.05 and len(prefetch.take()) == 3  # one block per 50 ms
    read = KVCopy(to_host=True, device_slots=torch.arange(0), host_slots=torch.arange(64, 256), staged=torch.zeros(2, 192, 1, 16))
    load = KVCopy(to_host=False, device_slots=torch.arange(192), host_slots=torch.arange(64, 256))
    plain = slow.step_s([0], [1024])
    assert device.sleep_s(_batch([read, load])) - plain == pytest.approx(slow.host_load_s(192))  # the disk was paid in the queue
    assert (device.storage_tokens, device.storage_s, device.loaded_tokens) == (192, pytest.approx(3 * 0.05), 192)
    assert H100.storage_read_s(128) == pytest.approx(128 * 147456 / (7.88e9 * 0.8))  # 9.4 MB a 64-token block: 1.5 ms
    device.close()


async def test_a_prefix_pushed_out_of_device_and_host_is_served_from_storage(tiny_model_factory: Any):
    model = tiny_model_factory("llama", vocab_size=VOCAB, max_position_embeddings=4096)
    # Two seconds apart (0.1 s here): one request at a time. Requests 1-3 push request 0's blocks
    # out of the pool (3 blocks of the trace) and out of a host tier of the same size.
    trace = [TraceRequest(2000 * i, 2 * BLOCK, 2, ids) for i, ids in enumerate([[1, 2], [3, 4], [5, 6], [7, 8], [1, 2]])]
    host = {"max_total_tokens": 3 * BLOCK, "enable_hierarchical_cache": True, "hicache_ratio": 1}
    without = await serve(trace, "host", H100, host, sim_speed=20, model_dir=model)
    tiered = await serve(trace, "storage", H100, {**host, **STORAGE_CONFIG}, sim_speed=20, model_dir=model)
    assert [o.ttft_s is not None for o in without.outcomes + tiered.outcomes] == [True] * 10
    assert without.outcomes[4].cached_tokens < BLOCK and without.storage_tokens == 0  # gone from device and host
    assert tiered.outcomes[4].cached_tokens == 2 * BLOCK - 64  # all but the last page (always computed)
    from_storage = tiered.outcomes[4].cached_tokens - without.outcomes[4].cached_tokens
    assert tiered.storage_hit_tokens == tiered.storage_tokens >= from_storage
    assert tiered.storage_s == pytest.approx(tiered.storage_tokens * H100.kv_bytes_per_token / H100.storage_read_bytes_per_s / 20)
    assert tiered.storage_written_blocks >= 2 * BLOCK // 64  # request 0's blocks at least (read back above)
    row = tiered.row(sim_speed=20)
    assert row["storage_hit_rate"] == round(tiered.storage_hit_tokens / row["prompt_tokens"], 4) > 0
    assert 0 < row["device_busy"] < 1 and tiered.loop_cpu_s > 0 and tiered.actor_cpu_s["adder"] > 0


async def test_the_real_engine_serves_a_scaled_trace_and_reads_a_prefix_back_from_storage(tiny_model_factory: Any):
    """`--real-model`: the micro model's own forward at an eighth of the lengths (hash ids of 64
    tokens, pages and host blocks of 8); the last request's prefix was pushed out of the pool and
    the host tier, and comes back from the storage tier's files."""
    model = tiny_model_factory("llama", vocab_size=VOCAB, max_position_embeddings=4096)
    trace = [TraceRequest(2000 * i, 2 * BLOCK, 16, ids) for i, ids in enumerate([[1, 2], [3, 4], [5, 6], [7, 8], [1, 2]])]
    host = {"max_total_tokens": 3 * BLOCK // 8, "enable_hierarchical_cache": True, "hicache_ratio": 1}
    without = await serve(trace, "host", H100, host, time_scale=20, model_dir=model, real_scale=1 / 8)
    tiered = await serve(trace, "storage", H100, {**host, **STORAGE_CONFIG}, time_scale=20, model_dir=model, real_scale=1 / 8)
    assert [o.ttft_s is not None for o in without.outcomes + tiered.outcomes] == [True] * 10
    assert [o.prompt_tokens for o in tiered.outcomes] == [2 * BLOCK // 8] * 5
    assert without.outcomes[4].cached_tokens < BLOCK // 8 and without.storage_hit_tokens == 0
    assert tiered.outcomes[4].cached_tokens == 2 * BLOCK // 8 - 8  # all but the last page (always computed)
    assert tiered.storage_hit_tokens >= tiered.outcomes[4].cached_tokens - without.outcomes[4].cached_tokens
    assert tiered.storage_written_blocks >= 2 * BLOCK // 8 // 8 and 0 < tiered.device_busy < 1
