"""The GPU path on a real GPU: FlashInfer against torch attention, CUDA-graph replay against eager,
end-to-end greedy parity through the Engine with graphs and overlap on, replay memory, streams.

Every test here skips without CUDA (and the FlashInfer ones without flashinfer), saying why.
`python -m bench.gpu_check` runs this file on a GPU machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest
import torch

from gpu.attention import TorchAttention
from gpu.cuda_streams import StepStreams
from gpu.forward_batch import ForwardBatch
from gpu.graph_runner import capture_batch_sizes
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from gpu.sampler import Sampler, SamplingInfo, TokenSpans
from runtime.sampling_params import SamplingParams
from tests.test_graph_runner import Seq, _advance, _decode_batch

NO_CUDA = "needs a CUDA GPU (run `python -m bench.gpu_check` on one)"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
# The CUDA reason first: on a machine without a GPU that is the one worth reading.
needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason=NO_CUDA if not torch.cuda.is_available() else "flashinfer is not installed: pip install 'actorserve[gpu]'",
)

DTYPE = "bfloat16"
# bf16 keeps 8 significant bits; two tiny layers and a 512-way lm_head stay well inside these.
LOGIT_ATOL, LOGIT_RTOL = 0.08, 0.05
# Greedy parity is demanded up to the first step where the reference's top two logits are this
# close: beyond a near-tie, bf16 rounding may legitimately pick the other token.
NEAR_TIE = 0.25
MAX_BS = 40  # buckets 1, 2, 4, 8, 12, 16, 24, 32, 40


@pytest.fixture(scope="module")
def gpu_model(tiny_model_factory):
    """A tiny model FlashInfer has kernels for (head_dim 64), grouped-query (4 heads, 2 kv heads)."""
    return tiny_model_factory("qwen3", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=1024)


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
def test_flashinfer_matches_torch_in_bf16(gpu_model, page_size):
    runner = _runner(gpu_model, graphs=False, page_size=page_size)
    assert runner.attention_backend == "flashinfer"
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
def test_graph_replay_matches_eager(gpu_model):
    graphs = _runner(gpu_model, graphs=True)
    assert graphs.graph_runner is not None and graphs.graph_runner.capture_enabled
    assert graphs.graph_runner.buckets == capture_batch_sizes(MAX_BS)
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

@needs_flashinfer
async def test_engine_greedy_parity_with_transformers(gpu_model):
    from transformers import AutoModelForCausalLM

    from api.engine import Engine

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 80))] for _ in range(24)]
    max_new = 24
    hf = AutoModelForCausalLM.from_pretrained(str(gpu_model), dtype=torch.float32).cuda().eval()
    expected = [_hf_greedy(hf, p, max_new) for p in prompts]
    async with Engine(model_path=str(gpu_model), device="cuda", dtype=DTYPE, cuda_graph_max_bs=32) as engine:
        assert engine.runner.uses_cuda_graphs and engine.config.overlap_depth == 2
        outs = await asyncio.gather(
            *(engine.generate(input_ids=p, sampling_params={"max_new_tokens": max_new, "min_new_tokens": max_new, "temperature": 0}) for p in prompts)
        )
    compared = 0
    for out, (ref, sure) in zip(outs, expected):
        assert out.output_ids[:sure] == ref[:sure]
        compared += sure
    assert compared >= len(prompts) * max_new // 2, "too many near-ties for the comparison to mean anything"


def _hf_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], int]:
    """transformers' greedy tokens and how many of them are clear of a near-tie."""
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt) :].tolist()
    sure = len(tokens)
    for step, scores in enumerate(out.scores):
        top2 = scores[0].float().topk(2).values
        if float(top2[0] - top2[1]) < NEAR_TIE:
            sure = step  # this step's token may differ, and every later one depends on it
            break
    return tokens, sure
