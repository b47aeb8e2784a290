"""The GPU path on a real GPU: FlashInfer against torch attention, CUDA-graph replay against eager,
end-to-end greedy parity through the Engine with graphs and overlap on, replay memory, streams,
and the KV cache's host and storage tiers (pinned blocks, layer-wise loads on a side stream).

Models of GQA group 2 (FlashInfer's CUDA-core decode kernel), 4 and 8 (its tensor-core decode),
all head_dim 64, so one set of kernels serves them. Every test here skips without CUDA (and the
FlashInfer ones without flashinfer), saying why, except the CPU checks that the parity test's
reference yields enough compared tokens and that the host-tier test's prompts do reach the host. `python -m bench.gpu_check` runs this file on a GPU.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest
import torch

from api.frontend.engine import Engine
from gpu.attention import TorchAttention
from gpu.cuda_streams import StepStreams
from gpu.forward_batch import ForwardBatch
from gpu.graph_runner import capture_batch_sizes
from gpu.kv_pool import KVBuffers, KVMove, LayerLoads
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from gpu.sampler import Sampler, SamplingInfo, TokenSpans
from runtime.sampling_params import SamplingParams
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks
from tests.test_graph_runner import Seq, _advance, _decode_batch
from tests.test_hicache_pressure import run_pressure
from tests.test_storage_tier import run_restart

NO_CUDA = "needs a CUDA GPU (run `python -m bench.gpu_check` on one)"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
# The CUDA reason first: on a machine without a GPU that is the one worth reading.
needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason=NO_CUDA if not torch.cuda.is_available() else "flashinfer is not installed: pip install 'actorserve[gpu]'",
)

DTYPE = "bfloat16"
# bf16 keeps 8 significant bits; two tiny layers and a 512-way lm_head stay well inside these.
LOGIT_ATOL, LOGIT_RTOL = 0.08, 0.05
# Greedy parity is checked step by step with teacher forcing (the reference reads the engine's own
# tokens so far) wherever the reference's top two logits are at least this far apart: at a
# near-tie bf16 rounding may legitimately pick the other token.
NEAR_TIE = 0.25
PARITY_PROMPTS, PARITY_NEW_TOKENS = 24, 24
# Per-step gaps of these random models clear NEAR_TIE at about 70% of steps (the CPU check below
# measures it); comparing fewer than half would make the parity test mean little.
MIN_COMPARED = PARITY_PROMPTS * PARITY_NEW_TOKENS // 2
MAX_BS = 40  # buckets 1, 2, 4, 8, 12, 16, 24, 32, 40
GQA_HEADS = {2: (4, 2), 4: (8, 2), 8: (8, 1)}  # group: (query heads, kv heads)


def _gqa_model(factory, group: int):
    """A tiny model FlashInfer has kernels for (head_dim 64) with GQA group `group`."""
    heads, kv_heads = GQA_HEADS[group]
    return factory("qwen3", hidden_size=256, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def gpu_model(tiny_model_factory):
    return _gqa_model(tiny_model_factory, 2)


@pytest.fixture(scope="module", params=sorted(GQA_HEADS), ids=lambda g: f"gqa{g}")
def gqa_model(request, tiny_model_factory):
    """(model path, GQA group): group 2 takes the CUDA-core decode kernel, 4 and 8 tensor cores."""
    return _gqa_model(tiny_model_factory, request.param), request.param


def _runner(path, backend: str = "flashinfer", graphs: bool = True, page_size: int = 1) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(
            model_path=str(path), dtype=DTYPE, device="cuda", max_total_tokens=32768, max_running_requests=64,
            page_size=page_size, attention_backend=backend, disable_cuda_graph=not graphs, cuda_graph_max_bs=MAX_BS,
        )
    )


def _torch_attn(runner: ModelRunner) -> TorchAttention:
    return TorchAttention(runner.kv, runner.req_to_token.table, scale=runner.model_config.head_dim**-0.5)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), ref.float(), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


def _new_seqs(runner: ModelRunner, lens: list[int], rng: random.Random) -> tuple[list[Seq], list[list[int]]]:
    seqs, prompts = [], []
    for n in lens:
        row, slots = runner.req_to_token.alloc(), runner.allocator.alloc(n)
        runner.req_to_token.write(row, 0, slots)
        seqs.append(Seq(row, slots, 0, -1))
        prompts.append([rng.randrange(3, runner.vocab_size) for _ in range(n)])
    return seqs, prompts


def _grow(runner: ModelRunner, seqs: list[Seq], lens: list[int]) -> torch.Tensor:
    for s, n in zip(seqs, lens):
        more = runner.allocator.alloc_extend(s.length, int(s.slots[-1]), n)
        runner.req_to_token.write(s.row, s.length, more)
        s.slots = torch.cat([s.slots, more])
    return torch.cat([s.slots[s.length : s.length + n] for s, n in zip(seqs, lens)])


@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch_in_bf16(gqa_model, page_size):
    path, group = gqa_model
    runner = _runner(path, graphs=False, page_size=page_size)
    assert runner.attention_backend == "flashinfer"
    assert runner.attn.use_tensor_cores == (group >= 4)
    rng = random.Random(page_size)
    seqs, prompts = _new_seqs(runner, [5, 40, 17, 1], rng)
    # EXTEND from scratch (ragged), EXTEND over prefixes (paged), DECODE, MIXED.
    batch = ForwardBatch.build(prompts, [s.row for s in seqs], [0] * 4, torch.cat([s.slots for s in seqs]), "cuda", return_all_logits=True)
    _close(runner.model(batch, runner.attn), runner.model(batch, _torch_attn(runner)))
    for s, p in zip(seqs, prompts):
        s.length = len(p)
    for lens in ([9, 3, 33, 2], [1, 1, 1, 1], [1, 12, 1, 1]):
        out_loc = _grow(runner, seqs, lens)
        new = [[rng.randrange(3, runner.vocab_size) for _ in range(n)] for n in lens]
        batch = ForwardBatch.build(new, [s.row for s in seqs], [s.length for s in seqs], out_loc, "cuda", return_all_logits=True)
        _close(runner.model(batch, runner.attn), runner.model(batch, _torch_attn(runner)))
        for s, n in zip(seqs, lens):
            s.length += n


@needs_flashinfer
def test_graph_replay_matches_eager(gqa_model):
    path, group = gqa_model
    graphs = _runner(path, graphs=True)
    assert graphs.graph_runner is not None and graphs.graph_runner.capture_enabled
    assert graphs.graph_runner.buckets == capture_batch_sizes(MAX_BS)
    assert all(w.use_tensor_cores == (group >= 4) for w in graphs.attn.graph_decode.values())
    rng = random.Random(1)
    seqs, prompts = _new_seqs(graphs, [rng.randint(1, 60) for _ in range(MAX_BS)], rng)
    batch = ForwardBatch.build(prompts, [s.row for s in seqs], [0] * MAX_BS, torch.cat([s.slots for s in seqs]), "cuda")
    first = graphs.forward(batch)
    for s, p, tok in zip(seqs, prompts, first.argmax(-1).tolist()):
        s.length, s.next_token = len(p), tok
    for n in (1, 8, 9, MAX_BS, 13, 2, 33, 24, 25):  # across bucket boundaries
        sub = rng.sample(seqs, n)
        batch = _decode_batch(graphs, sub)
        eager = graphs.model(batch, graphs.attn).clone()
        replayed = graphs.forward(batch)
        _close(replayed, eager)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
        _advance(sub, eager)


@needs_flashinfer
def test_graph_generation_matches_eager_generation(gpu_model):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 9, 17, 30, 5, 11, 2, 64, 7, 100, 1, 45)]
    params = [SamplingParams(max_new_tokens=24, temperature=0.0)] * len(prompts)
    with_graphs = generate(_runner(gpu_model, graphs=True), prompts, params)
    without = generate(_runner(gpu_model, graphs=False), prompts, params)
    assert [o.output_ids for o in with_graphs] == [o.output_ids for o in without]


@needs_flashinfer
def test_no_gpu_memory_growth_across_1000_replays(gpu_model):
    runner = _runner(gpu_model, graphs=True)
    rng = random.Random(3)
    seqs, prompts = _new_seqs(runner, [rng.randint(1, 30) for _ in range(5)], rng)
    batch = ForwardBatch.build(prompts, [s.row for s in seqs], [0] * 5, torch.cat([s.slots for s in seqs]), "cuda")
    for s, p, tok in zip(seqs, prompts, runner.forward(batch).argmax(-1).tolist()):
        s.length, s.next_token = len(p), tok
    decode = _decode_batch(runner, seqs)
    for _ in range(10):  # caches (allocator blocks for the plan's small tensors) settle first
        runner.forward(decode)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(1000):
        runner.forward(decode)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved


@needs_cuda
def test_streams_copy_out_after_the_forward_stream():
    streams = StepStreams(torch.device("cuda"))
    x = torch.ones(1 << 20, device="cuda")  # written on the scheduling stream
    with streams.launch():
        y = (x * 2).sum().reshape(1)
        result = streams.copy_out([y, None], keep_alive=[x])
    assert result.tensors[0].is_pinned()
    values = asyncio.run(result.wait())
    assert values[0].item() == 2.0 * (1 << 20) and values[1] is None
    assert result.done() and result.keep_alive == ()
    streams.close()


@needs_cuda
def test_host_tier_loads_reach_the_forward_stream_layer_by_layer():
    """Loads issued on the side stream, each layer behind its event: once the forward stream has
    waited for a layer, its work reads that layer's loaded KV (pinned host memory, async copies)."""
    streams = StepStreams(torch.device("cuda"))
    device = KVBuffers.allocate(4, 64, 2, 8, torch.bfloat16, "cuda")
    host = device.host_buffers(64)
    assert host.k[0].is_pinned()
    for layer in range(4):
        host.k[layer][10:20], host.v[layer][10:20] = layer + 1.0, -(layer + 1.0)
    with streams.launch():
        loads = LayerLoads([KVMove(False, torch.arange(30, 40), torch.arange(10, 20))], host, device, streams.loads)
        sums = []
        for layer in range(4):
            loads.ready(layer)
            sums.append((device.k[layer][30:40].float().sum() - device.v[layer][30:40].float().sum()).reshape(1))
        result = streams.copy_out([torch.cat(sums)], keep_alive=[])
    # 10 slots x 2 heads x 8 values of l + 1 in K and -(l + 1) in V: 320 (l + 1) when read after the load
    assert asyncio.run(result.wait())[0].tolist() == [320.0, 640.0, 960.0, 1280.0]
    assert [device.k[layer][30:40].float().mean().item() for layer in range(4)] == [1.0, 2.0, 3.0, 4.0]
    streams.close()


@needs_cuda
def test_sampling_and_last_token_index_do_not_synchronize():
    """The launch path of a step: a blocking copy or a read back would wait for the step in flight."""
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(top_k=3, top_p=0.5, min_p=0.1, frequency_penalty=0.5, seed=4, top_logprobs_num=2),
        SamplingParams(logprobs=True),
    ]
    table = torch.randint(0, 30, (5, 20), device="cuda")
    logits = torch.randn(3, 30, device="cuda")
    batch = ForwardBatch.build([[1, 2], [3], [4, 5, 6]], [1, 2, 3], [0, 4, 0], torch.arange(6), "cuda")
    sampler = Sampler()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        info = SamplingInfo.from_params(params, "cuda")
        out = sampler.sample(
            logits,
            info,
            output_ids=TokenSpans(table, [1, 2, 3], [4, 5, 6], [8, 9, 10]),
            prompt_ids=TokenSpans(table, [1, 2, 3], [0, 0, 0], [4, 5, 6]),
            steps=[0, 1, 2],
        )
        index = batch.last_token_index()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (3,) and index.tolist() == [1, 2, 5]

@needs_cuda
def test_grammar_mask_does_not_synchronize(gpu_model):
    """A constrained row's mask reaches the device without a blocking copy (pinned, non-blocking)."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from actors.grammar import GrammarCompiler, mask_logits

    tokenizer = AutoTokenizer.from_pretrained(str(gpu_model))
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, (tokenizer.eos_token_id,))
    compiled = compiler.compile_now("regex", "[a-c]{2,4}")
    assert compiled.error is None
    constraints = [compiler.constraint(compiled) for _ in range(2)]
    logits = torch.randn(3, vocab, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask_logits(logits, [0, 2], constraints)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    allowed = set(tokenizer.convert_tokens_to_ids([t for t in tokenizer.get_vocab() if t and set(t) <= set("abc")]))
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) <= allowed
    assert torch.isfinite(logits[1]).all()  # the unconstrained row is untouched
    compiler.shutdown()


@needs_flashinfer
@pytest.mark.parametrize("group", [2, 8])
async def test_engine_greedy_parity_with_transformers(tiny_model_factory, group):
    """bf16 engine (FlashInfer, CUDA graphs, overlap) against fp32 transformers, step by step."""
    model = _gqa_model(tiny_model_factory, group)
    prompts = _parity_prompts()
    outputs = await _engine_greedy(model, prompts, device="cuda")
    compared, mismatches = _teacher_forced_parity(model, prompts, outputs, device="cuda")
    assert not mismatches, f"{len(mismatches)} of {compared} clear steps differ: {mismatches[:5]}"
    assert compared >= MIN_COMPARED, f"only {compared} steps clear of a near-tie"


HOST_TIER_SETTINGS = {  # name: (dtype, engine settings past the host tier's)
    "torch-fp32": ("float32", dict(attention_backend="torch", disable_cuda_graph=True)),
    "flashinfer-bf16-graphs": (DTYPE, dict(attention_backend="flashinfer", cuda_graph_max_bs=8)),
}


@needs_cuda
@pytest.mark.parametrize("variant", sorted(HOST_TIER_SETTINGS))
async def test_engine_host_tier_on_cuda_serves_the_tokens_of_no_cache(gpu_model, variant):
    """The host tier's CUDA path (pinned host blocks, loads on the side stream layer by layer):
    prompt A, then B, which pushes A out of a 96-token pool to the host, then A again, loaded back.
    In float32 the tokens equal an engine's with no cache; in bf16 with FlashInfer and graphs
    each clear step equals fp32 transformers' (the parity check above)."""
    if variant.startswith("flashinfer") and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    dtype, settings = HOST_TIER_SETTINGS[variant]
    outputs, host_hits, cached = await _host_tier_outputs(gpu_model, "cuda", dtype, settings)
    assert host_hits >= 48 and cached >= 48
    if dtype == "float32":
        async with Engine(model_path=str(gpu_model), device="cuda", dtype=dtype, max_total_tokens=96, disable_radix_cache=True, inline_core=True, **settings) as plain:
            expected = [(await plain.generate(input_ids=p, sampling_params=_HOST_TIER_PARAMS)).output_ids for p in _host_tier_prompts()]
        assert outputs == expected
    else:
        compared, mismatches = _teacher_forced_parity(gpu_model, _host_tier_prompts(), outputs, device="cuda")
        assert not mismatches and compared >= len(outputs) * PARITY_NEW_TOKENS // 2, (compared, mismatches[:5])


@needs_cuda
async def test_engine_storage_tier_on_cuda_serves_a_restarted_prefix(tiny_model_factory, tmp_path):
    """Blocks written from CUDA KV, read back after a restart through the host tier into device
    pages: tokens equal to no cache (fp32, torch attention)."""
    path = str(tiny_model_factory("llama", max_position_embeddings=512))
    await run_restart(path, tmp_path, "wait_complete", device="cuda", attention_backend="torch")


@needs_cuda
async def test_engine_host_tier_under_pressure_on_cuda_keeps_the_books(tiny_model_factory):
    """The burst beyond capacity of tests/test_hicache_pressure.py on a GPU (pages of 4, chunked
    prefill, loads and evictions in the same batches)."""
    await run_pressure(str(tiny_model_factory("llama", max_position_embeddings=512)), device="cuda", attention_backend="torch")


async def test_host_tier_check_runs_on_cpu(gpu_model):
    """The CUDA test's sequence on the CPU: the second A must come from the host tier."""
    outputs, host_hits, cached = await _host_tier_outputs(gpu_model, "cpu", "float32", {})
    assert host_hits >= 48 and cached >= 48 and len(outputs) == 3


_HOST_TIER_PARAMS = {"max_new_tokens": PARITY_NEW_TOKENS, "min_new_tokens": PARITY_NEW_TOKENS, "temperature": 0}


def _host_tier_prompts() -> list[list[int]]:
    a, b = ([5 + (i * 7 + j) % 300 for j in range(60)] for i in range(2))
    return [a, b, a]


async def _host_tier_outputs(model, device: str, dtype: str, settings: dict) -> tuple[list[list[int]], int, int]:
    """(each prompt's tokens, host-tier hit tokens, the last request's cached tokens), one at a time."""
    engine = Engine(
        model_path=str(model), device=device, dtype=dtype, max_total_tokens=96, inline_core=True,
        enable_hierarchical_cache=True, hicache_block_tokens=8, **settings,
    )
    async with engine:
        outs = [await engine.generate(input_ids=p, sampling_params=_HOST_TIER_PARAMS) for p in _host_tier_prompts()]
        stats = await engine.current_stats()
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)
    return [o.output_ids for o in outs], stats["hicache_host_hit_tokens"], outs[-1].cached_tokens


async def test_parity_reference_compares_enough_tokens_on_cpu(gpu_model):
    """The GPU parity test's comparison, run here with the bf16 engine on the CPU (torch attention):
    the reference must find enough clear steps for that test to mean something, and the CPU
    engine must pass it too."""
    model = gpu_model
    prompts = _parity_prompts()
    outputs = await _engine_greedy(model, prompts, device="cpu")
    compared, mismatches = _teacher_forced_parity(model, prompts, outputs, device="cpu")
    assert compared >= MIN_COMPARED, f"only {compared} steps clear of a near-tie"
    assert not mismatches, f"{len(mismatches)} of {compared} clear steps differ: {mismatches[:5]}"


def _parity_prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 80))] for _ in range(PARITY_PROMPTS)]


async def _engine_greedy(model, prompts: list[list[int]], device: str) -> list[list[int]]:
    params = {"max_new_tokens": PARITY_NEW_TOKENS, "min_new_tokens": PARITY_NEW_TOKENS, "temperature": 0}
    settings = dict(cuda_graph_max_bs=32) if device == "cuda" else {}
    # inline_core: the runner is in this process, where the test can see that graphs are on.
    async with Engine(model_path=str(model), device=device, dtype=DTYPE, inline_core=True, **settings) as engine:
        assert engine.runner is not None and engine.config.overlap_depth == 2
        assert engine.runner.uses_cuda_graphs == (device == "cuda")
        outs = await asyncio.gather(*(engine.generate(input_ids=p, sampling_params=params) for p in prompts))
    return [o.output_ids for o in outs]


def _teacher_forced_parity(model, prompts: list[list[int]], outputs: list[list[int]], device: str) -> tuple[int, list[str]]:
    """(steps compared, mismatches): each engine token against fp32 transformers' argmax after the
    same prefix (the prompt and the engine's tokens before it, in one forward pass), at the steps
    where transformers' top two logits are at least NEAR_TIE apart."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(device).eval()
    eos = hf.generation_config.eos_token_id
    banned = [eos] if isinstance(eos, int) else list(eos or [])  # min_new_tokens bans EOS in the engine
    compared, mismatches = 0, []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert len(out) == PARITY_NEW_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out], device=device)).logits[0, len(prompt) - 1 : -1].float()
        logits[:, banned] = float("-inf")
        top2 = logits.topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) >= NEAR_TIE
        wanted = top2.indices[:, 0].tolist()
        compared += int(clear.sum())
        mismatches += [f"prompt {i} step {t}: {out[t]} != {wanted[t]}" for t in clear.nonzero().flatten().tolist() if out[t] != wanted[t]]
    return compared, mismatches
