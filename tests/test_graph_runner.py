"""The decode graph runner in eager-replay mode, the FlashInfer backend's glue, backend selection.

Everything here runs on a CPU. The graph runner runs its real bucket / padding / static-buffer
logic with a plain forward instead of a graph replay; the FlashInfer backend runs against
tests/fake_flashinfer.py, a pure-torch stand-in that follows FlashInfer's documented API, in its
strict mode (the kernels' dtypes, head sizes, GQA groups and strides) on models of real shapes.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass

import pytest
import torch

import tests.fake_flashinfer as fake_flashinfer
from gpu.attention import TorchAttention
from gpu.cuda_streams import HostResult, StepStreams
from gpu.flashinfer_backend import AttentionShape, FlashInferAttention, PlanFence, paged_kv_plan_args, resolve_attention_backend
from gpu.forward_batch import ForwardBatch
from gpu.graph_runner import (
    DUMMY_ROW,
    DUMMY_SLOT,
    DecodeGraphRunner,
    bucket_for,
    capture_batch_sizes,
    default_cuda_graph_max_bs,
)
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from runtime.forward_mode import ForwardMode
from runtime.sampling_params import SamplingParams

MAX_BS = 20  # buckets [1, 2, 4, 8, 12, 16, 20]
BUCKETS = [1, 2, 4, 8, 12, 16, 20]
# Attention shapes of real models, which FlashInfer has kernels for: GQA group 2 takes the CUDA-core
# decode kernel, groups 4 and 8 the tensor-core one.
REAL_SHAPES = {
    "gqa2-d64": dict(num_heads=4, num_kv_heads=2, head_dim=64),
    "gqa4-d64": dict(num_heads=8, num_kv_heads=2, head_dim=64),
    "gqa8-d128": dict(num_heads=8, num_kv_heads=1, head_dim=128),
}
# bf16 keeps 8 significant bits: FlashInfer's (here the fake's) and torch's attention round apart
# by a few units in the last place, which moves a row of logits by well under 2% of its norm (a
# wrong mask or page moves it by tens of percent); a greedy token may change only at a near-tie.
HALF_REL_ERROR = 0.04
NEAR_TIE = 0.25
# Each shape once, page sizes 1 and 4 among them (the layout does not depend on the group).
GLUE_CASES = [("gqa2-d64", 1), ("gqa2-d64", 4), ("gqa4-d64", 4), ("gqa8-d128", 1)]


# --- buckets --------------------------------------------------------------------------------------
def test_capture_batch_sizes_follow_sglang():
    sizes = capture_batch_sizes(256)
    assert sizes[:7] == [1, 2, 4, 8, 12, 16, 24]
    assert sizes[-1] == 256 and len(sizes) == 5 + 31
    assert all(b - a == 8 for a, b in zip(sizes[5:], sizes[6:]))
    big = capture_batch_sizes(640)
    assert big[big.index(256) + 1 : big.index(256) + 3] == [272, 288]
    assert 496 in big and 512 in big and 544 in big and big[-1] == 640
    assert capture_batch_sizes(MAX_BS) == BUCKETS
    assert capture_batch_sizes(10) == [1, 2, 4, 8, 10]  # the limit itself gets a graph
    assert capture_batch_sizes(1) == [1]
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1, got 0"):
        capture_batch_sizes(0)


def test_bucket_choice():
    assert [bucket_for(BUCKETS, n) for n in (1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 20)] == [1, 2, 4, 4, 8, 8, 12, 12, 16, 20, 20]
    sizes = capture_batch_sizes(256)
    assert bucket_for(sizes, 17) == 24 and bucket_for(sizes, 250) == 256
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(BUCKETS, 21)


def test_default_max_bs_by_gpu_memory():
    gib = 1 << 30
    assert default_cuda_graph_max_bs(16 * gib) == 8
    assert default_cuda_graph_max_bs(24 * gib) == 24
    assert default_cuda_graph_max_bs(40 * gib) == 32
    assert default_cuda_graph_max_bs(80 * gib) == 256
    assert default_cuda_graph_max_bs(141 * gib) == 256
    assert default_cuda_graph_max_bs(192 * gib) == 512


# --- live requests on a runner ------------------------------------------------------------------
@dataclass
class Seq:
    row: int
    slots: torch.Tensor
    length: int  # tokens whose KV is in the pool
    next_token: int


def _runner(path, page_size: int = 1, dtype: str = "float32") -> ModelRunner:
    config = RunnerConfig(model_path=str(path), dtype=dtype, max_total_tokens=8192, max_running_requests=32, page_size=page_size, cuda_graph_max_bs=MAX_BS)
    return ModelRunner(config)


def _prefill(runner: ModelRunner, n: int, rng: random.Random) -> list[Seq]:
    """n requests with random prompts, prefilled with the torch backend (the reference)."""
    prompts = [[rng.randrange(3, runner.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    seqs = []
    for prompt in prompts:
        row = runner.req_to_token.alloc()
        slots = runner.allocator.alloc(len(prompt))
        runner.req_to_token.write(row, 0, slots)
        seqs.append(Seq(row, slots, 0, -1))
    out_loc = torch.cat([s.slots for s in seqs])
    batch = ForwardBatch.build(prompts, [s.row for s in seqs], [0] * n, out_loc)
    logits = runner.model(batch, _torch_attn(runner))
    for s, p, tok in zip(seqs, prompts, logits.argmax(-1).tolist()):
        s.length, s.next_token = len(p), tok
    return seqs


def _torch_attn(runner: ModelRunner) -> TorchAttention:
    return TorchAttention(runner.kv, runner.req_to_token.table, scale=runner.model_config.head_dim**-0.5)


def _decode_batch(runner: ModelRunner, seqs: list[Seq]) -> ForwardBatch:
    """One decode step of `seqs`: each gets the slot of its next position."""
    for s in seqs:
        if s.slots.numel() == s.length:
            more = runner.allocator.alloc_extend(s.length, int(s.slots[-1]), 1)
            runner.req_to_token.write(s.row, s.length, more)
            s.slots = torch.cat([s.slots, more])
    out_loc = torch.stack([s.slots[s.length] for s in seqs])
    return ForwardBatch.build([[s.next_token] for s in seqs], [s.row for s in seqs], [s.length for s in seqs], out_loc, runner.device)


def _advance(seqs: list[Seq], logits: torch.Tensor) -> None:
    for s, tok in zip(seqs, logits.argmax(-1).tolist()):
        s.length += 1
        s.next_token = tok


def _assert_same(out: torch.Tensor, ref: torch.Tensor) -> None:
    # Padding changes the matmul shapes, which may change float rounding in the last bits; the
    # greedy tokens must not change.
    assert out.shape == ref.shape
    assert (out - ref).abs().max() <= 1e-5
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def _assert_close_half(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Half-precision logits: each row close to the reference's, and the same greedy token
    wherever the reference's top two are not a near-tie."""
    out, ref = out.float(), ref.float()
    assert out.shape == ref.shape
    error = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
    assert error <= HALF_REL_ERROR, f"logits differ by {float(error):.1%} of their norm"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > NEAR_TIE
    assert torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory("qwen3", max_position_embeddings=512)


def _real_shape(tiny_model_factory, name: str):
    """(model path, GQA group) of a model shaped as REAL_SHAPES[name]."""
    sizes = REAL_SHAPES[name]
    path = tiny_model_factory("qwen3", hidden_size=256, max_position_embeddings=512, **sizes)
    return path, sizes["num_heads"] // sizes["num_kv_heads"]


# --- eager replay ----------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_eager_replay_matches_eager_across_bucket_boundaries(tiny_path, page_size):
    runner = _runner(tiny_path, page_size)
    graph = runner.init_graph_runner(capture=False)
    assert graph.buckets == BUCKETS and not graph.capture_enabled
    rng = random.Random(page_size)
    live = _prefill(runner, 24, rng)
    sizes = [1, 8, 9, 20, 12, 13, 2, 3, 16, 17] + [rng.randint(1, MAX_BS) for _ in range(6)]
    for n in sizes:
        seqs = rng.sample(live, n)  # any rows, in any order
        batch = _decode_batch(runner, seqs)
        ref = runner.model(batch, runner.attn)
        out = runner.forward(batch)  # through the graph runner
        _assert_same(out, ref)
        _advance(seqs, ref)
    assert graph.replays == len(sizes)


def test_padded_rows_write_only_the_reserved_slot(tiny_path):
    runner = _runner(tiny_path)
    graph = runner.init_graph_runner(capture=False)
    live = _prefill(runner, 9, random.Random(1))
    batch = _decode_batch(runner, live)  # 9 rows -> bucket 12: three padded rows
    for layer in range(len(runner.kv.k)):
        runner.kv.k[layer][DUMMY_SLOT] = 0
        runner.kv.v[layer][DUMMY_SLOT] = 0
    before = [t.clone() for t in runner.kv.k + runner.kv.v]
    graph.run(batch)
    changed: set[int] = set()
    for old, new in zip(before, runner.kv.k + runner.kv.v):
        changed |= set(torch.nonzero((old != new).flatten(1).any(1)).flatten().tolist())
    live_slots = set(batch.out_cache_loc.tolist())
    assert changed == live_slots | {DUMMY_SLOT}
    inputs = graph.inputs
    assert inputs.req_rows[9:12].tolist() == [DUMMY_ROW] * 3
    assert inputs.out_cache_loc[9:12].tolist() == [DUMMY_SLOT] * 3
    assert inputs.positions[9:12].tolist() == [0] * 3
    assert int(runner.req_to_token.table[DUMMY_ROW, 0]) == DUMMY_SLOT  # what a padded row reads


def test_buffers_reused_without_stale_rows(tiny_path):
    runner = _runner(tiny_path)
    graph = runner.init_graph_runner(capture=False)
    rng = random.Random(2)
    live = _prefill(runner, 16, rng)
    ptrs = [t.data_ptr() for t in (graph.inputs.input_ids, graph.inputs.positions, graph.inputs.out_cache_loc, graph.inputs.req_rows)]
    out_ptr = None
    for n in (16, 13, 5, 14, 16, 1):  # 16 fills bucket 16; 13 and 14 reuse it with stale rows behind
        seqs = rng.sample(live, n)
        batch = _decode_batch(runner, seqs)
        ref = runner.model(batch, runner.attn)
        out = graph.run(batch)
        _assert_same(out, ref)
        bucket = graph.bucket_for(n)
        assert graph.inputs.req_rows[n:bucket].tolist() == [DUMMY_ROW] * (bucket - n)
        assert graph.inputs.out_cache_loc[n:bucket].tolist() == [DUMMY_SLOT] * (bucket - n)
        assert graph.inputs.input_ids[n:bucket].tolist() == [0] * (bucket - n)
        out_ptr = out_ptr or out.data_ptr()
        assert out.data_ptr() == out_ptr  # logits live in one static buffer
        _advance(seqs, ref)
    assert ptrs == [t.data_ptr() for t in (graph.inputs.input_ids, graph.inputs.positions, graph.inputs.out_cache_loc, graph.inputs.req_rows)]


def test_runner_dispatch_and_generation_parity(tiny_path):
    runner = _runner(tiny_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, runner.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 17, 30, 5, 11, 2, 40, 7)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0)] * len(prompts)
    eager = generate(runner, prompts, params)
    graph = runner.init_graph_runner(capture=False)
    replayed = generate(runner, prompts, params)
    assert [o.output_ids for o in replayed] == [o.output_ids for o in eager]
    assert graph.replays > 0  # decode steps went through the runner; the prefill did not
    assert runner.allocator.available_size() == runner.allocator.size


def test_graph_runner_rejects_what_it_cannot_run(tiny_path):
    runner = _runner(tiny_path)
    graph = runner.init_graph_runner(capture=False)
    extend = ForwardBatch.build([[5, 6]], [1], [0], torch.tensor([1, 2]))
    assert not graph.can_run(extend)
    with pytest.raises(ValueError, match=r"the graph runner takes decode batches of 1\.\.\d+ rows, got EXTEND x 1"):
        graph.run(extend)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(runner.model, runner.attn, BUCKETS, device=torch.device("cpu"), capture=True)
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphRunner(runner.model, runner.attn, BUCKETS, device=torch.device("cuda"), capture=True)
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphRunner(runner.model, runner.attn, [4, 2], device=torch.device("cpu"), capture=False)


# --- FlashInfer glue against the fake -------------------------------------------------------------
@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    fake_flashinfer.plans.clear()
    return fake_flashinfer


@pytest.fixture
def strict_fi(monkeypatch):
    """The fake with the kernels' limits; the CPU stands in for the GPU."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.strict_module(fake_flashinfer.KernelLimits(cpu_stands_for_cuda=True)))
    fake_flashinfer.plans.clear()
    return fake_flashinfer


def _fi_attn(runner: ModelRunner) -> FlashInferAttention:
    mc = runner.model_config
    shape = AttentionShape(mc.num_heads, mc.num_kv_heads, mc.head_dim, runner.config.page_size, mc.head_dim**-0.5)
    return FlashInferAttention(runner.kv, runner.req_to_token.table, shape, runner.context_len)


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_kv_plan_args_match_the_table(page_size):
    rng = random.Random(page_size)
    table = torch.zeros((6, 64), dtype=torch.int32)
    seq_lens, rows = [], [3, 1, 5, 0]
    for r in rows:
        n = 1 if r == 0 else rng.randint(1, 64)
        first_pages = rng.sample(range(1, 200), -(-n // page_size))
        slots = [p * page_size + o for p in first_pages for o in range(page_size)][:n]
        table[r, :n] = torch.tensor(slots, dtype=torch.int32) if r else 0
        seq_lens.append(n)
    indptr, indices, last = paged_kv_plan_args(table, torch.tensor(rows), seq_lens, page_size)
    expected = [int(table[r, j]) // page_size for r, n in zip(rows, seq_lens) for j in range(0, n, page_size)]
    assert indices.tolist() == expected and indices.dtype == torch.int32
    assert indptr.tolist() == [0, *torch.tensor([-(-n // page_size) for n in seq_lens]).cumsum(0).tolist()]
    assert last.tolist() == [(n - 1) % page_size + 1 for n in seq_lens]
    assert indptr.dtype == last.dtype == torch.int32 and indptr.device.type == "cpu"


@pytest.mark.parametrize("shape, page_size", GLUE_CASES)
def test_flashinfer_paths_match_torch(tiny_model_factory, strict_fi, shape, page_size):
    path, group = _real_shape(tiny_model_factory, shape)
    runner = _runner(path, page_size, dtype="bfloat16")
    fi = _fi_attn(runner)
    assert fi.use_tensor_cores == (group >= 4)
    decode_path = "tensor_core_decode" if group >= 4 else "decode"
    # The warm-up ran every path once, on the dummy row only.
    assert [kind for kind, _ in strict_fi.plans] == [decode_path, "ragged_prefill", "paged_prefill"]
    rng = random.Random(10 + page_size)
    seqs = _prefill(runner, 4, rng)  # KV written by the torch backend
    # EXTEND from scratch (ragged) for fresh requests, compared with torch on the same pool.
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (7, 1, 19)]
    rows = [runner.req_to_token.alloc() for _ in prompts]
    slots = [runner.allocator.alloc(len(p)) for p in prompts]
    for r, s in zip(rows, slots):
        runner.req_to_token.write(r, 0, s)
    batch = ForwardBatch.build(prompts, rows, [0] * 3, torch.cat(slots), return_all_logits=True)
    _assert_close_half(runner.model(batch, fi), runner.model(batch, _torch_attn(runner)))
    assert strict_fi.plans[-1] == ("ragged_prefill", 3)
    # EXTEND over cached prefixes (paged prefill), then MIXED (one extends, the rest decode).
    for lens in ([5, 3, 9, 2], [1, 6, 1, 1]):
        new = [[rng.randrange(3, 500) for _ in range(n)] for n in lens]
        for s, n in zip(seqs, lens):
            more = runner.allocator.alloc_extend(s.length, int(s.slots[-1]), n)
            runner.req_to_token.write(s.row, s.length, more)
            s.slots = torch.cat([s.slots, more])
        out_loc = torch.cat([s.slots[s.length : s.length + n] for s, n in zip(seqs, lens)])
        batch = ForwardBatch.build(new, [s.row for s in seqs], [s.length for s in seqs], out_loc, return_all_logits=True)
        _assert_close_half(runner.model(batch, fi), runner.model(batch, _torch_attn(runner)))
        assert strict_fi.plans[-1] == ("paged_prefill", 4)
        for s, n, ids in zip(seqs, lens, new):
            s.length += n
            s.next_token = ids[-1]
    # DECODE (eager decode wrapper).
    batch = _decode_batch(runner, seqs)
    _assert_close_half(runner.model(batch, fi), runner.model(batch, _torch_attn(runner)))
    assert strict_fi.plans[-1] == (decode_path, 4)


@pytest.mark.parametrize("shape, page_size", GLUE_CASES)
def test_flashinfer_graph_decode_plans_into_static_buffers(tiny_model_factory, strict_fi, shape, page_size):
    path, group = _real_shape(tiny_model_factory, shape)
    runner = _runner(path, page_size, dtype="bfloat16")
    runner.attn = _fi_attn(runner)
    graph = runner.init_graph_runner(capture=False)
    assert sorted(runner.attn.graph_decode) == BUCKETS
    assert all(w.use_tensor_cores == (group >= 4) for w in runner.attn.graph_decode.values())
    decode_path = "tensor_core_decode" if group >= 4 else "decode"
    rng = random.Random(20 + page_size)
    live = _prefill(runner, 24, rng)
    for n in (1, 8, 9, 20, 13, 3, 16, 17, 2):
        seqs = rng.sample(live, n)
        batch = _decode_batch(runner, seqs)
        ref = runner.model(batch, _torch_attn(runner))
        out = runner.forward(batch)
        _assert_close_half(out, ref)
        bucket = graph.bucket_for(n)
        assert strict_fi.plans[-1] == (decode_path, bucket)  # the bucket's graph-mode wrapper
        # Padded rows: one page each (page 0, the reserved slot's), holding one token.
        indptr, indices, last = runner.attn.graph_decode[bucket].csr
        assert indptr.numel() == bucket + 1 and last.numel() == bucket
        assert last[n:].tolist() == [1] * (bucket - n)
        assert (indptr[n + 1 :] - indptr[n:-1]).tolist() == [1] * (bucket - n)
        assert indices[int(indptr[n]) : int(indptr[-1])].tolist() == [DUMMY_SLOT // page_size] * (bucket - n)
        _advance(seqs, ref)


def test_fake_flashinfer_refuses_what_flashinfer_0_7_refuses():
    """The fake mirrors the real signatures (flashinfer 0.7.2.post1 decode.py / prefill.py), so a
    misnamed or misplaced argument in our glue fails on a CPU instead of on the first GPU run."""
    ws = torch.zeros(16, dtype=torch.uint8)
    indptr, indices, last = (torch.tensor(v, dtype=torch.int32) for v in ([0, 1], [3], [1]))
    decode = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    with pytest.raises(TypeError):  # decode has no `causal` (its mask follows q_len_per_req)
        decode.plan(indptr, indices, last, 4, 2, 8, 1, causal=True)
    with pytest.raises(TypeError):  # the decode wrapper's graph buffers are `paged_kv_*_buffer`
        fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buf=indptr)
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer should be a torch.Tensor in cudagraph mode"):
        fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True)
    decode.plan(indptr, indices, last, 4, 2, 8, 4)
    assert decode.planned["q_dtype"] == torch.float16  # q_data_type defaults to float16, not the cache's dtype
    ragged = fake_flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    with pytest.raises(TypeError):  # ragged plan has no page_size; a sixth positional is head_dim_vo
        ragged.plan(indptr, indptr, 4, 2, 8, 1)


def test_strict_fake_refuses_what_the_kernels_refuse():
    """Strict mode: the inputs FlashInfer 0.7.2's kernels have no instance for, or reject."""
    cpu = fake_flashinfer.KernelLimits(cpu_stands_for_cuda=True)
    fi = fake_flashinfer.strict_module(cpu)
    ws = torch.zeros(16, dtype=torch.uint8)
    indptr, indices, last = (torch.tensor(v, dtype=torch.int32) for v in ([0, 2], [3, 4], [1]))
    half = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    with pytest.raises(AssertionError, match="CUDA tensors"):
        fake_flashinfer.strict_module().BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    decode = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    with pytest.raises(AssertionError, match="float16 or bfloat16"):
        decode.plan(indptr, indices, last, 4, 2, 64, 1, q_data_type=torch.float32, kv_data_type=torch.float32)
    with pytest.raises(AssertionError, match="head_dim 96"):
        decode.plan(indptr, indices, last, 4, 2, 96, 1, **half)
    with pytest.raises(AssertionError, match="group_size: 5"):  # no CUDA-core decode kernel for a group of 5
        decode.plan(indptr, indices, last, 10, 2, 64, 1, **half)
    tensor_cores = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    tensor_cores.plan(indptr, indices, last, 10, 2, 64, 1, **half)  # any group on tensor cores
    assert fake_flashinfer.plans[-1] == ("tensor_core_decode", 1)
    decode.plan(indptr, indices, last, 4, 2, 64, 1, **half)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    pages = torch.zeros(8, 1, 2, 64, dtype=torch.bfloat16)
    assert decode.run(q, (pages, pages.clone())).shape == (1, 4, 64)
    with pytest.raises(AssertionError, match="strides differ"):
        decode.run(q, (pages, torch.zeros(8, 1, 2, 128, dtype=torch.bfloat16)[..., :64]))
    with pytest.raises(AssertionError, match="contiguous"):
        decode.run(torch.zeros(1, 64, 4, dtype=torch.bfloat16).transpose(1, 2), (pages, pages))
    with pytest.raises(AssertionError, match="the workspace on cpu"):
        decode.run(q.to("meta"), (pages, pages))
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    qo = torch.tensor([0, 2], dtype=torch.int32)
    ragged.plan(qo, qo, 10, 2, 64, causal=True, **half)  # prefill kernels take any group
    kv = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="strides differ"):
        ragged.run(torch.zeros(2, 10, 64, dtype=torch.bfloat16), kv, torch.zeros(2, 4, 64, dtype=torch.bfloat16)[:, ::2])


def test_plan_fence_waits_on_a_blocking_event(monkeypatch):
    """The fence sleeps in a blocking event's synchronize (a default event spins a core), one
    event per wrapper, waited on before each plan and recorded after it."""
    calls: list[tuple[str, int]] = []

    class Event:
        made = 0

        def __init__(self, blocking: bool = False):
            assert blocking, "a non-blocking event's synchronize() spins"
            Event.made += 1
            self.id = Event.made

        def synchronize(self) -> None:
            calls.append(("wait", self.id))

        def record(self) -> None:
            calls.append(("record", self.id))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    fence = PlanFence(torch.device("cuda"))
    first, second = object(), object()
    for wrapper in (first, second, first):
        with fence.guard(wrapper):
            calls.append(("plan", 0))
    assert calls == [("wait", 1), ("plan", 0), ("record", 1), ("wait", 2), ("plan", 0), ("record", 2), ("wait", 1), ("plan", 0), ("record", 1)]


# --- backend selection ----------------------------------------------------------------------------
def test_backend_resolution(monkeypatch, tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention_backend("torch", cpu, torch.float32, 16) == "torch"
    assert resolve_attention_backend("auto", cpu, torch.float32, 64) == "torch"
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_attention_backend("flashinfer", cpu, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        resolve_attention_backend("flashinfer", cuda, torch.float32, 64)
    with pytest.raises(ValueError, match="head_dim"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 16)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 64) == "torch"
    with pytest.raises(ValueError, match="actorserve\\[gpu\\]"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 64)
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setenv("CUDA_HOME", str(_fake_cuda_home(tmp_path, "13.0")))
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 128) == "flashinfer"
    assert resolve_attention_backend("auto", cuda, torch.float16, 16) == "torch"


def _fake_cuda_home(root, release: str | None):
    """A CUDA_HOME whose bin/nvcc prints `nvcc --version` of `release` (None: no nvcc there)."""
    home = root / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    if release is not None:
        nvcc = home / "bin" / "nvcc"
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
        nvcc.chmod(0o755)
    return home


def test_flashinfer_needs_nvcc_or_its_precompiled_kernels(monkeypatch, tmp_path):
    """FlashInfer compiles its kernels at first use: without a suitable nvcc (or its precompiled
    kernels) an explicit flashinfer is refused at startup, and auto takes torch."""
    cuda = torch.device("cuda")
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setenv("CUDA_HOME", str(_fake_cuda_home(tmp_path, None)))
    with pytest.raises(ValueError, match="compiles its attention kernels with nvcc.*finds none.*install-jit-cache-wheel"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 64)
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 64) == "torch"
    monkeypatch.setenv("CUDA_HOME", str(_fake_cuda_home(tmp_path, "12.2")))  # too old for Hopper's fa3 prefill
    with pytest.raises(ValueError, match="need CUDA >= 12.3.*is 12.2"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))  # an A100 builds fa2 only
    assert resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 64) == "flashinfer"


def test_flashinfer_on_cpu_fails_at_startup(tiny_path):
    with pytest.raises(ValueError, match="--attention-backend flashinfer cannot be used: FlashInfer runs on CUDA only"):
        ModelRunner(RunnerConfig(model_path=str(tiny_path), attention_backend="flashinfer"))
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_path), max_total_tokens=256, max_running_requests=4))
    assert runner.attention_backend == "torch" and runner.graph_runner is None and not runner.uses_cuda_graphs


def test_engine_passes_gpu_settings_to_the_runner():
    from api.core.engine_core import runner_config
    from api.frontend.engine import Engine

    config = runner_config(Engine(attention_backend="torch", disable_cuda_graph=True, cuda_graph_max_bs=24).config)
    assert (config.attention_backend, config.disable_cuda_graph, config.cuda_graph_max_bs) == ("torch", True, 24)
    assert runner_config(Engine().config).attention_backend == "auto"


# --- streams on a CPU -----------------------------------------------------------------------------
def test_host_result_on_cpu_is_ready_at_once():
    ids = torch.tensor([3, 4])
    result = HostResult.ready(ids, None)
    assert result.done()
    tensors = asyncio.run(result.wait())
    assert tensors[0].tolist() == [3, 4] and tensors[1] is None
    with pytest.raises(ValueError, match="CUDA"):
        StepStreams(torch.device("cpu"))


def test_forward_mode_of_padded_view_is_decode(tiny_path):
    runner = _runner(tiny_path)
    graph = runner.init_graph_runner(capture=False)
    view = graph.inputs.dummy(4)
    assert view.mode == ForwardMode.DECODE and view.seq_lens == [1, 1, 1, 1] and view.return_all_logits
