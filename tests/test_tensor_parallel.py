"""tp_size > 1: the model split over ranks in a gloo group (gpu/tensor_parallel.py, gpu/tp_ranks.py).

Every answer under tp=2 is compared with tp=1 in the same test: greedy tokens exactly, logprobs
within float32 tolerance (the sharded matmuls and the all-reduce add in a different order).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch

from api import Engine
from api.frontend.engine import EngineError
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import ReqToTokenPool
from gpu.model_config import ModelConfig
from gpu.tensor_parallel import SliceReader, TPLayout
from gpu.tp_ranks import Rendezvous
from gpu.tp_batch import BatchChannel
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks, decoding, drain, process_alive, wait_gone

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
PROMPTS = [[5, 7, 9, 11], list(range(40, 100)), [3] * 17, [300, 2, 77, 5, 6, 8, 13]]


def _engine(model_path: Path, tp_size: int, **kw) -> Engine:
    # One torch thread per rank: two ranks share this machine's two cores. tp=1, the reference,
    # runs its core in this process: a core process's start (mostly importing torch) is saved.
    return Engine(model_path=str(model_path), dtype="float32", core_threads=1, tp_size=tp_size, max_total_tokens=4096,
                  inline_core=tp_size == 1, **kw)


# Sampled on rank 0 from the gathered logits: seeds and penalties see the same distribution.
SAMPLED = {**GREEDY, "temperature": 1.0, "top_p": 0.9, "seed": 7, "frequency_penalty": 0.5, "repetition_penalty": 1.2}


async def _answers(engine: Engine, prompts=PROMPTS, **kw) -> list:
    return await asyncio.gather(*[
        engine.generate(input_ids=p, sampling_params=params, return_logprob=True, top_logprobs_num=3, **kw)
        for p in prompts for params in (GREEDY, SAMPLED)
    ])


def _rank_pids(core_pid: int) -> list[int]:
    """The core process's tensor-parallel ranks (its children running gpu.tp_ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.split(") ", 1)[1].split()[1]) == core_pid and b"gpu.tp_ranks" in cmdline:
                pids.append(int(entry.name))
    return pids


def _assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for out, want in zip(got, expected):
        assert out.output_ids == want.output_ids and len(out.logprobs) == GREEDY["max_new_tokens"]
        assert out.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        for top, want_top in zip(out.top_logprobs, want.top_logprobs, strict=True):
            assert [t[0] for t in top] == [t[0] for t in want_top]
            assert [t[1] for t in top] == pytest.approx([t[1] for t in want_top], abs=1e-4)
        assert out.input_token_ids == want.input_token_ids
        assert out.input_logprobs[1:] == pytest.approx(want.input_logprobs[1:], abs=1e-4)


async def _compare(model_path: Path, **kw) -> None:
    async with _engine(model_path, 1, **kw) as single:
        expected = await _answers(single)
    engine = _engine(model_path, 2, **kw)
    async with engine:
        ranks = _rank_pids(engine.client.pid)
        assert len(ranks) == 1
        assert engine.config.tp_size == 2
        _assert_same(await _answers(engine), expected)
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)
    assert not any(process_alive(pid) for pid in ranks)


# --- the layout, without processes ---------------------------------------------------------------
def _config(**kw) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 515, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}
    return ModelConfig.from_dict({**raw, **kw})


@pytest.mark.parametrize(("kw", "size", "message"), [
    ({"num_attention_heads": 3, "num_key_value_heads": 1}, 2, "does not divide the model's 3 attention heads"),
    ({"num_key_value_heads": 6, "num_attention_heads": 12}, 4, "does not divide the model's 6 key/value heads"),
    ({"num_key_value_heads": 2}, 8, None),  # two K/V heads, each held by four ranks
    ({"num_key_value_heads": 3, "num_attention_heads": 12}, 4, "must be a multiple of 3"),
    ({"intermediate_size": 90}, 4, "intermediate_size 90"),
    ({}, 0, "tp_size must be >= 1"),
])
def test_layout_refuses_what_does_not_split(kw, size, message):
    why = TPLayout.check(_config(**kw), size)
    assert why is None if message is None else message in why


@pytest.mark.parametrize(("kv_heads", "size"), [(2, 2), (2, 4), (1, 2), (8, 2)])
def test_shards_put_back_together_are_the_checkpoint(kv_heads, size):
    config = _config(num_key_value_heads=kv_heads)
    hd, heads = config.head_dim, config.num_heads
    full = {
        "model.embed_tokens.weight": torch.randn(config.vocab_size, 64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(heads * hd, 64),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv_heads * hd, 64),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, heads * hd),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 64),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96),
        "model.layers.0.mlp.down_proj.bias": torch.randn(64),
    }
    layouts = [TPLayout(config, r, size) for r in range(size)]
    shards = {name: [lay.shard(name, SliceReader(t)) for lay in layouts] for name, t in full.items()}
    vocab = torch.cat(shards["model.embed_tokens.weight"])
    assert vocab.shape[0] == -(-config.vocab_size // size) * size  # padded to a multiple of size
    assert torch.equal(vocab[: config.vocab_size], full["model.embed_tokens.weight"]) and not vocab[config.vocab_size :].any()
    assert torch.equal(torch.cat(shards["model.layers.0.self_attn.q_proj.weight"]), full["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(torch.cat(shards["model.layers.0.mlp.up_proj.weight"]), full["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(torch.cat(shards["model.layers.0.self_attn.o_proj.weight"], 1), full["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(torch.cat(shards["model.layers.0.mlp.down_proj.weight"], 1), full["model.layers.0.mlp.down_proj.weight"])
    assert all(torch.equal(b, full["model.layers.0.mlp.down_proj.bias"]) for b in shards["model.layers.0.mlp.down_proj.bias"])
    # Each rank's K/V heads are the ones its query heads read (GQA group = heads // kv_heads).
    k = full["model.layers.0.self_attn.k_proj.weight"].view(kv_heads, hd, 64)
    for lay, shard in zip(layouts, shards["model.layers.0.self_attn.k_proj.weight"]):
        first_q = lay.rank * lay.num_heads
        wanted = sorted({q // (heads // kv_heads) for q in range(first_q, first_q + lay.num_heads)})
        assert torch.equal(shard.view(-1, hd, 64), k[wanted])


# --- the batch channel, with an in-process pipe for the broadcasts -------------------------------
class _Pipe:
    """Stands for the groups' broadcasts: what the sender broadcasts, the receiver gets, in order."""

    def __init__(self):
        self.sent: deque[torch.Tensor] = deque()

    def sender(self):
        pipe = self

        class Sender:
            def broadcast(self, x):
                pipe.sent.append(x.clone())
                return x

            broadcast_header = broadcast  # the idle group's, in the same order here
        return Sender()

    def receiver(self):
        pipe = self

        class Receiver:
            def broadcast(self, x):
                got = pipe.sent.popleft()
                assert got.shape == x.shape and got.dtype == x.dtype
                return x.copy_(got)

            broadcast_header = broadcast
        return Receiver()


def test_the_channel_keeps_every_ranks_table_equal_to_rank_0s():
    rng = random.Random(0)
    pipe = _Pipe()
    table0, table1 = ReqToTokenPool(8, 64, record_writes=True), ReqToTokenPool(8, 64)
    send = BatchChannel(pipe.sender(), table0, torch.device("cpu"))
    receive = BatchChannel(pipe.receiver(), table1, torch.device("cpu"))
    for step in range(300):
        # Any mix of range writes and scattered writes, some overwriting entries already sent
        # (as a cache rewrite under overlap does), then one batch.
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.5:
                row, start, n = rng.randint(1, 8), rng.randint(0, 60), rng.randint(1, 4)
                table0.write(row, start, torch.tensor([rng.randint(1, 999) for _ in range(n)]))
            else:
                rows = torch.tensor(rng.sample(range(1, 9), 3))
                table0.write_at(rows, torch.tensor([rng.randint(0, 63) for _ in range(3)]), torch.tensor([rng.randint(1, 999) for _ in range(3)]))
        extend = [[rng.randint(0, 99) for _ in range(rng.randint(1, 3))] for _ in range(2)]
        batch = ForwardBatch.build(extend, [1, 2], [rng.randint(0, 8), 0], torch.arange(sum(map(len, extend))))
        if step % 3 == 0:
            batch.logit_index = torch.tensor([0])
        send.send(batch)
        got = receive.receive()
        assert torch.equal(table1.table, table0.table), step
        assert torch.equal(got.input_ids, batch.input_ids) and torch.equal(got.positions, batch.positions)
        assert torch.equal(got.out_cache_loc, batch.out_cache_loc) and torch.equal(got.req_rows, batch.req_rows)
        assert (got.prefix_lens, got.extend_lens, got.mode) == (batch.prefix_lens, batch.extend_lens, batch.mode)
        assert (got.logit_index is None) == (batch.logit_index is None)
    send.send_stop()
    assert receive.receive() is None and not pipe.sent


# --- tp=2 against tp=1, end to end -----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2-tied", "qwen3"])
async def test_tp2_gives_tp1_tokens_and_logprobs(tiny_model_factory, arch):
    if arch == "qwen2-tied":
        path = tiny_model_factory("qwen2", tie_word_embeddings=True)
    else:
        path = tiny_model_factory(arch)
    await _compare(path)


async def test_tp2_with_one_kv_head_and_a_vocabulary_that_does_not_split_evenly(tiny_model_factory):
    await _compare(tiny_model_factory("qwen3", num_kv_heads=1, vocab_size=515))


async def test_tp2_chunked_prefill_pages_and_prompt_logprobs(tiny_model_factory):
    path = tiny_model_factory("llama")
    kw = {"chunked_prefill_size": 16, "page_size": 4, "schedule_policy": "lpm"}
    prompts = [list(range(40, 100)) + [i] for i in range(4)]  # one cached 60-token prefix, chunked

    async def run(tp: int):
        async with _engine(path, tp, **kw) as engine:
            out = await _answers(engine, prompts, logprob_start_len=0)
            out += await _answers(engine, prompts)  # the prefix from the cache this time
            stats = await engine.current_stats()
            assert stats["kv_cached"] > 0
            return out

    got, want = await run(2), await run(1)
    assert all(len(o.input_logprobs) == 61 for o in want[:8])
    _assert_same(got, want)


async def test_tp2_retraction_keeps_tp1_answers(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20)] for i in range(4)]
    sampling = {"max_new_tokens": 118, "temperature": 0, "ignore_eos": True}

    async def run(tp: int):
        # A new request is charged its whole max_new_tokens, a running one new_token_ratio (0.07
        # here) of what it has left: requests that arrive once the first decodes are admitted
        # beside it and together outgrow the pool, so decode must retract.
        engine = Engine(model_path=str(path), dtype="float32", core_threads=1, tp_size=tp, max_total_tokens=256, schedule_conservativeness=0.1,
                        inline_core=tp == 1)
        async with engine:
            first = engine.stream(input_ids=prompts[0], sampling_params=sampling)
            head = [await anext(first) for _ in range(3)]
            later = asyncio.gather(*(engine.generate(input_ids=p, sampling_params=sampling) for p in prompts[1:]))
            rest = [delta async for delta in first]
            outs = [[t for d in head + rest for t in d.output_ids]] + [o.output_ids for o in await later]
            assert (await engine.current_stats())["retractions"] > 0
            await assert_idle_invariants(engine)
        return outs

    assert await run(2) == await run(1)


async def test_tp2_host_tier_serves_an_evicted_prompt_as_no_cache_would(tiny_model_factory):
    """With the host tier every rank moves its own heads' KV to host memory and back: a prompt
    evicted from a small pool, matched on the host and loaded back, decodes as with no cache."""
    path = tiny_model_factory("llama", max_position_embeddings=512)
    prompts = [[5 + (i * 7 + j) % 300 for j in range(60)] for i in range(2)]
    params = {**GREEDY, "max_new_tokens": 8}
    small = {"model_path": str(path), "dtype": "float32", "max_total_tokens": 96}
    async with Engine(**small, disable_radix_cache=True, inline_core=True) as plain:
        expected = [(await plain.generate(input_ids=p, sampling_params=params)).output_ids for p in prompts]
    engine = Engine(**small, core_threads=1, tp_size=2, enable_hierarchical_cache=True, hicache_block_tokens=8)
    async with engine:
        outs = [await engine.generate(input_ids=p, sampling_params=params) for p in prompts + prompts[:1]]
        assert [o.output_ids for o in outs] == expected + expected[:1]
        assert outs[2].cached_tokens >= 48 and (await engine.current_stats())["hicache_host_hit_tokens"] >= 48
        await assert_idle_invariants(engine)


# --- failures --------------------------------------------------------------------------------------
async def test_heads_that_do_not_split_are_refused_at_startup(tiny_model_factory):
    path = tiny_model_factory("llama", num_heads=3, num_kv_heads=1, hidden_size=48)
    engine = _engine(path, 2)
    with pytest.raises(RuntimeError, match="tp_size 2 does not divide the model's 3 attention heads"):
        await engine.start()


async def test_a_rendezvous_port_in_use_is_a_clear_error(tiny_model_factory):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = _engine(tiny_model_factory("llama"), 2, dist_init_addr=f"127.0.0.1:{port}")
        with pytest.raises(RuntimeError, match=f"cannot listen at 127.0.0.1:{port}.*address already in use"):
            await engine.start()


def test_tp_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="drop inline_core"):
        Engine(tp_size=2, inline_core=True)
    with pytest.raises(ValueError, match="dist_init_addr must be host:port"):
        Engine(tp_size=2, dist_init_addr="localhost")
    with pytest.raises(ValueError, match="hicache_storage_backend is not supported with tp_size > 1"):
        Engine(tp_size=2, enable_hierarchical_cache=True, hicache_storage_backend="file")


@contextlib.asynccontextmanager
async def _started_with_its_rank(path: Path, **kw) -> AsyncIterator[tuple[Engine, int, int]]:
    """A tp=2 engine, its core's pid and its rank's; both are gone once it is closed."""
    engine = _engine(path, 2, **kw)
    await engine.start()
    core = engine.client.pid
    [rank] = _rank_pids(core)
    try:
        yield engine, core, rank
    finally:
        await engine.close()
    assert not process_alive(core) and not process_alive(rank)


async def test_kill_9_of_a_rank_mid_stream_fails_its_requests_and_stops_the_core(tiny_model_factory):
    async with _started_with_its_rank(tiny_model_factory("llama")) as (engine, core, rank):
        # 900: all four fit the pool at once (a new request is charged its whole max_new_tokens)
        streams = await decoding(engine, PROMPTS, {**GREEDY, "max_new_tokens": 900})
        os.kill(rank, signal.SIGKILL)
        results = await drain(streams, 30)  # a hang guard
        assert all(isinstance(r, EngineError) for r in results), results
        # The rank's death ended them (its exit, or its connection closed or reset: whichever the core
        # sees first), not the collective's timeout (dist_timeout_s, 120 s).
        failure = engine.stats()["failure"]
        deaths = (f"(pid {rank}) exited with code -9", "Connection closed", "Connection reset by peer")
        assert any(death in failure for death in deaths), failure


async def test_a_rank_that_never_answers_fails_the_engine_after_the_timeout_an_idle_one_does_not(tiny_model_factory):
    async with _started_with_its_rank(tiny_model_factory("llama"), dist_timeout_s=3) as (engine, core, rank):
        # Idle longer than the timeout first: waiting for work is not failing to answer.
        await asyncio.sleep(3.5)
        assert len((await engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)).output_ids) == GREEDY["max_new_tokens"]
        os.kill(rank, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        try:
            # Its sockets stay open, so only the collective's timeout can end this (gloo: "Timed out
            # waiting 3000ms for recv operation to complete").
            start = time.monotonic()
            with pytest.raises(EngineError, match="(?i)timed out"):
                await asyncio.wait_for(engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY), 30)
            assert time.monotonic() - start >= 2.9
        finally:
            # Whatever happened above: a stopped rank cannot see its core go and exit, so it is
            # woken (the engine's close kills it, or it finds itself orphaned).
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGCONT)


def test_a_rank_that_never_takes_the_next_header_fails_rank_0_after_the_timeout():
    """Stopped between two steps, before it waits for the next header again, a rank never takes
    it (gloo sends only to a posted receive): rank 0 gives up after dist_timeout_s, not the idle
    group's year. Rank 1 here joins and then never receives."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rendezvous = Rendezvous("127.0.0.1", port, 2, "gloo", 1.0)
    joins = (
        "import sys, time, torch, msgspec; from gpu.tp_ranks import Rendezvous; "
        "r = msgspec.json.decode(sys.argv[1].encode(), type=Rendezvous); "
        "r.join(torch.distributed.TCPStore(r.host, r.port, r.size, is_master=False, timeout=r.join_timeout), 1); time.sleep(60)"
    )
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, timeout=rendezvous.join_timeout)
    rank_1 = subprocess.Popen([sys.executable, "-c", joins, msgspec.json.encode(rendezvous).decode()])
    try:
        group = rendezvous.join(store, 0)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timed out"):
            group.broadcast_header(torch.zeros(4, dtype=torch.int64))
        assert 0.9 <= time.monotonic() - start < 30
    finally:
        rank_1.kill()
        rank_1.wait()
        torch.distributed.destroy_process_group()


async def test_kill_9_of_the_core_takes_its_ranks_with_it(tiny_model_factory):
    async with _started_with_its_rank(tiny_model_factory("llama")) as (engine, core, rank):
        os.kill(core, signal.SIGKILL)
        await wait_gone(rank, 5, "rank")


async def test_close_frees_the_rendezvous_port_and_dp_replicas_each_get_their_ranks(tiny_model_factory):
    path = tiny_model_factory("llama")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with _engine(path, 1) as single:
        expected = [o.output_ids for o in await _answers(single, PROMPTS[:2])]
    engine = _engine(path, 2, dp_size=2, dist_init_addr=f"127.0.0.1:{port}")
    async with engine:
        ranks = [pid for client in engine.replicas.clients for pid in _rank_pids(client.pid)]
        assert len(ranks) == 2  # one rank 1 per replica, each replica on its own port (port, port + 1)
        assert [o.output_ids for o in await _answers(engine, PROMPTS[:2])] == expected
    await close_and_check_tasks(engine)
    assert not any(process_alive(pid) for pid in ranks)
    for p in (port, port + 1):  # nothing listens there any more
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            s.listen()
