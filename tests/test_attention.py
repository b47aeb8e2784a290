"""TorchAttention's length buckets against a plain per-request attention, on a CPU.

Each case stores random prefix K/V in a paged pool (slots scattered, as a long-running pool leaves
them), runs the backend over a batch of new tokens, and compares with float64 attention over each
request's own sequence, computed without the pool, padding or buckets. The same batch through a
single bucket (the old one-padding-per-batch path) must agree too.
"""

from __future__ import annotations

import random

import pytest
import torch

import gpu.attention as attention
from gpu.attention import TorchAttention, plan_buckets
from gpu.cpu_ops import CpuKernels
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVBuffers
from runtime.forward_mode import ForwardMode

LAYERS = 2
TOLERANCE = 1e-5


def _run(prefix_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int, dim: int = 16, seed: int = 0,
         dtype: torch.dtype = torch.float32, shared: list[tuple[list[int], int]] = (),
         backend_out: list[TorchAttention] | None = None, kernels: CpuKernels | None = None,
         ) -> tuple[list[torch.Tensor], list[torch.Tensor], ForwardBatch]:
    """(backend outputs per layer, float64 reference outputs per layer, the batch).

    `shared`: (requests, length) pairs; those requests' first `length` positions use the first
    request's slots, as the radix cache gives one prefix's slots to every request that matches it.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(seq_lens) + 8
    # Slot 0 is the reserved padding target; requests get the other slots in random order.
    slots = [s.clone() for s in (torch.randperm(num_slots - 1, generator=gen) + 1)[: sum(seq_lens)].split(seq_lens)]
    for members, length in shared:
        for i in members[1:]:
            slots[i][:length] = slots[members[0]][:length]
    table = torch.zeros((len(seq_lens) + 1, max(seq_lens) + 3), dtype=torch.int32)
    for i, s in enumerate(slots):
        table[i + 1, : s.numel()] = s.to(torch.int32)
    kv = KVBuffers.allocate(LAYERS, num_slots, kv_heads, dim, dtype, "cpu")
    for buf in kv.k + kv.v:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    out_loc = torch.cat([s[p:] for s, p in zip(slots, prefix_lens)])
    new_ids = [[1] * e for e in extend_lens]
    batch = ForwardBatch.build(new_ids, list(range(1, len(seq_lens) + 1)), prefix_lens, out_loc)
    scale = dim**-0.5
    backend = TorchAttention(kv, table, scale, kernels=kernels)
    backend.init_forward_metadata(batch)
    if backend_out is not None:
        backend_out.append(backend)
    outs, refs = [], []
    for layer in range(LAYERS):
        q = torch.randn((batch.num_tokens, heads, dim), generator=gen).to(dtype)
        k = torch.randn((batch.num_tokens, kv_heads, dim), generator=gen).to(dtype)
        v = torch.randn((batch.num_tokens, kv_heads, dim), generator=gen).to(dtype)
        keys = [kv.k[layer][s].double() for s in slots]  # prefix from the pool ...
        values = [kv.v[layer][s].double() for s in slots]
        outs.append(backend.forward(q, k, v, layer))
        start = 0
        for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):  # ... new tokens from k/v
            keys[i][p:] = k[start : start + e].double()
            values[i][p:] = v[start : start + e].double()
            start += e
        refs.append(_reference(q.double(), keys, values, prefix_lens, extend_lens, scale))
    return outs, refs, batch


def _reference(q, keys, values, prefix_lens, extend_lens, scale) -> torch.Tensor:
    out, start = [], 0
    for key, value, p, e in zip(keys, values, prefix_lens, extend_lens):
        group = q.shape[1] // key.shape[1]
        qi = q[start : start + e].transpose(0, 1)  # [heads, e, dim]
        ki = key.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq, dim]
        vi = value.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) * scale
        causal = torch.arange(p + e)[None, :] <= (p + torch.arange(e))[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out.append((scores.softmax(-1) @ vi).transpose(0, 1))
        start += e
    return torch.cat(out)


def _random_batch(rng: random.Random, size: int, kind: str) -> tuple[list[int], list[int]]:
    prefix, extend = [], []
    for _ in range(size):
        decode = kind == "decode" or (kind == "mixed" and rng.random() < 0.7)
        prefix.append(rng.randint(1, 90) if decode else rng.choice([0, rng.randint(1, 60)]))
        extend.append(1 if decode else rng.randint(2, 40))
    return prefix, extend


CASES = {
    "decode batch 1": ([37], [1]),
    "decode equal lengths": ([20] * 6, [1] * 6),
    "decode spread lengths": ([1, 5, 60, 61, 200, 7, 33, 120], [1] * 8),
    "extend batch 1 with prefix": ([13], [9]),
    "extend equal, no prefix": ([0] * 3, [17] * 3),
    "extend ragged": ([0, 4, 0, 30], [5, 12, 40, 3]),
    "mixed": ([0, 50, 3, 100, 1], [24, 1, 6, 1, 1]),
    # What the graph runner's padding adds: dummy rows with no prefix and one new token.
    "decode with dummy rows": ([40, 90, 0, 0], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (9, 3), (4, 4)])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_per_request_attention(case, heads, kv_heads):
    prefix, extend = CASES[case]
    outs, refs, _ = _run(prefix, extend, heads, kv_heads)
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("kind", ["decode", "extend", "mixed"])
def test_random_batches_match_reference_and_single_bucket(kind, monkeypatch):
    rng = random.Random(kind)
    for trial in range(8):
        prefix, extend = _random_batch(rng, rng.choice([1, 2, 5, 17, 40]), kind)
        outs, refs, batch = _run(prefix, extend, 6, 2, seed=trial)
        assert kind != "decode" or batch.mode == ForwardMode.DECODE
        with monkeypatch.context() as m:  # everything in one bucket: the old single-padding path
            m.setattr(attention, "plan_buckets", lambda extend_lens, seq_lens: [list(range(len(seq_lens)))])
            single, _, _ = _run(prefix, extend, 6, 2, seed=trial)
        for out, ref, one in zip(outs, refs, single):
            torch.testing.assert_close(out.double(), ref, atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(out, one, atol=TOLERANCE, rtol=0)


def test_bfloat16_runs_every_bucket_kind():
    prefix, extend = CASES["mixed"]
    outs, refs, _ = _run(prefix, extend, 8, 4, dtype=torch.bfloat16)
    for out, ref in zip(outs, refs):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.05)


def test_plan_buckets_covers_every_request_once_and_bounds_padding():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 200)
        extend = [1 if rng.random() < 0.8 else rng.randint(2, 300) for _ in range(n)]
        seq = [e + rng.randint(0, 800) for e in extend]
        buckets = plan_buckets(extend, seq)
        assert sorted(i for b in buckets for i in b) == list(range(n))
        for b in buckets:
            padded = len(b) * max(extend[i] for i in b) * max(seq[i] for i in b)
            useful = sum(extend[i] * seq[i] for i in b)
            assert padded - useful <= attention.MIN_WASTE or useful >= attention.FILL * padded
            assert len(b) == 1 or len(b) * max(seq[i] for i in b) <= attention.MAX_KV_ROWS


def test_plan_buckets_shapes():
    assert plan_buckets([1], [5]) == [[0]]
    assert plan_buckets([1] * 4, [9] * 4) == [[0, 1, 2, 3]]  # equal lengths: one bucket, batch order
    # Decode rows never share a bucket with a long extend (their padding would be the extend's length).
    assert plan_buckets([1, 500, 1], [3000, 600, 2900], min_waste=0) == [[1], [0, 2]]
    # Far-apart lengths split; close ones stay together.
    assert plan_buckets([1] * 4, [1000, 100, 990, 95], min_waste=0) == [[0, 2], [1, 3]]
    assert plan_buckets([1] * 4, [1000] * 4, max_rows=2500) == [[0, 1], [2, 3]]
    assert plan_buckets([1] * 2, [3000, 3000], max_rows=2500) == [[0], [1]]  # a longer request goes alone


# --- shared prefixes (cascade decode) ----------------------------------------------------------


def _groups(backend: TorchAttention) -> dict[tuple[int, ...], int]:
    shared = backend._meta.shared
    assert shared is not None
    members = shared.members.split(shared.sizes)
    return {tuple(m.tolist()): n for m, n in zip(members, shared.lengths)}


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (9, 3), (4, 4)])
def test_shared_prefixes_are_attended_once_and_match_the_reference(heads, kv_heads):
    prefix = [80, 150, 95, 120, 130, 101, 70, 90, 200]
    groups = [
        ([0, 1, 2, 3], 70),  # four requests behind one 70-token prefix
        ([4, 5], 100),  # two behind 100 tokens; request 5 has just one key of its own
        ([6, 7], 40),  # too short to attend separately (< SHARED_PREFIX_MIN)
    ]
    backends: list[TorchAttention] = []
    outs, refs, _ = _run(prefix, [1] * len(prefix), heads, kv_heads, shared=groups, backend_out=backends)
    assert _groups(backends[0]) == {(0, 1, 2, 3): 70, (4, 5): 100}
    for out, ref in zip(outs, refs):
        assert torch.allclose(out.double(), ref, atol=TOLERANCE)


def test_shared_prefix_is_the_longest_common_one_of_its_group():
    # Requests 0 and 1 share 90 tokens, request 2 only the first 75 of them: the group takes 75.
    prefix = [120, 110, 100]
    backends: list[TorchAttention] = []
    outs, refs, _ = _run(prefix, [1, 1, 1], 8, 4, shared=[([0, 1], 90), ([0, 2], 75)], backend_out=backends)
    assert _groups(backends[0]) == {(0, 1, 2): 75}
    for out, ref in zip(outs, refs):
        assert torch.allclose(out.double(), ref, atol=TOLERANCE)


def test_shared_prefixes_only_in_decode_batches():
    backends: list[TorchAttention] = []
    outs, refs, _ = _run([80, 90, 0], [1, 1, 12], 8, 4, shared=[([0, 1], 70)], backend_out=backends)
    assert backends[0]._meta.shared is None  # a mixed batch keeps the plain path
    for out, ref in zip(outs, refs):
        assert torch.allclose(out.double(), ref, atol=TOLERANCE)


def test_shared_prefixes_in_bfloat16():
    outs, refs, _ = _run([80, 150, 95], [1, 1, 1], 8, 4, dtype=torch.bfloat16, shared=[([0, 1, 2], 70)])
    for out, ref in zip(outs, refs):
        assert torch.allclose(out.double(), ref, atol=5e-2)


# --- the compiled paged decode kernel -----------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dim", [16, 32, 64, 128])  # 32, 64 and 128 take the unrolled paths
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_reference(kernels, case, heads, kv_heads, dim):
    prefix, extend = CASES[case]
    backends: list[TorchAttention] = []
    outs, refs, _ = _run(prefix, extend, heads, kv_heads, dim=dim, kernels=kernels, backend_out=backends)
    meta = backends[0]._meta
    assert (meta.paged is not None) == all(n == 1 for n in extend) and (meta.extend is not None) == any(n != 1 for n in extend)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out.double(), ref, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("kind", ["decode", "extend", "mixed"])
def test_kernels_random_ragged_batches(kernels, kind):
    rng = random.Random(kind)
    for trial in range(10):
        prefix, extend = _random_batch(rng, rng.choice([1, 3, 17, 40]), kind)
        if kind == "decode" and trial % 2:
            prefix = [rng.choice([rng.randint(1, 40), rng.randint(300, 700)]) for _ in prefix]  # long and short contexts
        outs, refs, _ = _run(prefix, extend, 6, 2, dim=64, seed=trial, kernels=kernels)
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out.double(), ref, atol=TOLERANCE, rtol=0)


def test_extend_kernel_on_a_long_prompt_after_a_prefix(kernels):
    """Tiles of several key blocks, causal skipping and a partial last tile."""
    outs, refs, _ = _run([0, 45], [300, 77], 9, 3, dim=64, kernels=kernels)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out.double(), ref, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_kernels_in_half_precision(kernels, dtype, tolerance):
    for extend in ([1] * 5, [1, 20, 1, 3, 40]):
        outs, refs, _ = _run([1, 5, 60, 300, 33], extend, 9, 3, dim=64, dtype=dtype, kernels=kernels)
        for out, ref in zip(outs, refs):
            assert out.dtype == dtype
            torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (9, 3)])
def test_kernel_with_shared_prefixes(kernels, heads, kv_heads):
    """Each request's own keys through the kernel, the shared prefixes once, merged by lse."""
    prefix = [80, 150, 95, 120, 130, 101, 70, 90, 200]
    groups = [([0, 1, 2, 3], 70), ([4, 5], 100), ([6, 7], 40)]
    backends: list[TorchAttention] = []
    outs, refs, _ = _run(prefix, [1] * len(prefix), heads, kv_heads, dim=64, shared=groups, backend_out=backends, kernels=kernels)
    assert _groups(backends[0]) == {(0, 1, 2, 3): 70, (4, 5): 100}
    assert backends[0]._meta.paged.key_begin.tolist() == [70, 70, 70, 70, 100, 100, 0, 0, 0]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out.double(), ref, atol=TOLERANCE, rtol=0)


def test_kernel_pages_of_several_slots(kernels):
    kernel = kernels.decode_attention
    """A paged pool's layout: each request's slots run in whole pages of 4, pages scattered."""
    gen = torch.Generator().manual_seed(3)
    page, seq_lens, kv_heads, heads, dim = 4, [13, 4, 29, 1], 2, 8, 64
    pages = [-(-n // page) for n in seq_lens]
    order = (torch.randperm(sum(pages) + 4, generator=gen) + 1)[: sum(pages)].split(pages)
    table = torch.zeros((len(seq_lens) + 1, 32), dtype=torch.int32)
    for i, (n, p) in enumerate(zip(seq_lens, order)):
        table[i + 1, :n] = (p[:, None] * page + torch.arange(page)).reshape(-1)[:n].to(torch.int32)
    slots = (sum(pages) + 5) * page
    k_pool = torch.randn((slots, kv_heads, dim), generator=gen)
    v_pool = torch.randn((slots, kv_heads, dim), generator=gen)
    q = torch.randn((len(seq_lens), heads, dim), generator=gen)
    rows = torch.arange(1, len(seq_lens) + 1)
    begin, end = torch.tensor([2, 0, 10, 0]), torch.tensor(seq_lens)
    out, lse = kernel(q, k_pool, v_pool, table, rows, begin, end, 0.125)
    for i in range(len(seq_lens)):
        s = table[i + 1, begin[i] : end[i]].long()
        keys = k_pool[s].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        values = v_pool[s].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        scores = (q[i].double()[:, None, :] @ keys.transpose(1, 2))[:, 0] * 0.125  # [heads, keys]
        torch.testing.assert_close(lse[i].double(), scores.logsumexp(-1), atol=1e-5, rtol=0)
        expected = (scores.softmax(-1)[:, None, :] @ values)[:, 0]
        torch.testing.assert_close(out[i].double(), expected, atol=TOLERANCE, rtol=0)


def _scattered_decode_inputs(gen: torch.Generator, seq_lens: list[int], heads: int, kv_heads: int, dim: int,
                             dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(q, k_pool, v_pool, table, rows): each request's slots scattered over a pool with slot 0 unused."""
    slots = (torch.randperm(sum(seq_lens) + 7, generator=gen) + 1)[: sum(seq_lens)].split(seq_lens)
    table = torch.zeros((len(seq_lens) + 1, max(seq_lens) + 2), dtype=torch.int32)
    for i, s in enumerate(slots):
        table[i + 1, : s.numel()] = s.to(torch.int32)
    k_pool, v_pool = (torch.randn((sum(seq_lens) + 8, kv_heads, dim), generator=gen).to(dtype) for _ in range(2))
    q = torch.randn((len(seq_lens), heads, dim), generator=gen).to(dtype)
    return q, k_pool, v_pool, table, torch.arange(1, len(seq_lens) + 1)


def _decode_reference(q, k_pool, v_pool, table, rows, begin, end, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64, request by request, from the inputs' own values."""
    group = q.shape[1] // k_pool.shape[1]
    outs, lses = [], []
    for i in range(q.shape[0]):
        s = table[rows[i], begin[i] : end[i]].long()
        keys = k_pool[s].double().repeat_interleave(group, 1).transpose(0, 1)  # [heads, keys, dim]
        values = v_pool[s].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = (q[i].double()[:, None, :] @ keys.transpose(1, 2))[:, 0] * scale  # [heads, keys]
        outs.append((scores.softmax(-1)[:, None, :] @ values)[:, 0])
        lses.append(scores.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


# Group sizes 1..9, several not a multiple of 4 (where a CPU with AVX-512 scores four query heads
# per vector, in bfloat16 and in float32); contexts on both sides of the kernel's 32-key blocks,
# odd ones included.
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (8, 4), (9, 3), (12, 3), (5, 1), (8, 1), (9, 1)])
@pytest.mark.parametrize("dim", [32, 64, 128])
# bfloat16: its output, and probabilities that may be rounded to bfloat16 before P.V.
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_decode_kernel_per_group_and_dim(kernels, heads, kv_heads, dim, dtype, atol):
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 10 + dim)
    seq_lens = [1, 2, 3, 31, 32, 33, 63, 64, 65, 100, 257]
    q, k_pool, v_pool, table, rows = _scattered_decode_inputs(gen, seq_lens, heads, kv_heads, dim, dtype)
    begin = torch.tensor([0, 1, 0, 5, 0, 32, 0, 2, 31, 40, 0])
    end = torch.tensor(seq_lens)
    scale = dim**-0.5
    ref_out, ref_lse = _decode_reference(q, k_pool, v_pool, table, rows, begin, end, scale)
    # Every vector width compiled here (512- and 256-bit lanes, 0: the generic kernel); the default
    # op takes the widest.
    widths = torch.ops.actorserve.decode_attention_widths()
    assert widths[-1] == 0
    for width in widths:
        out, lse = torch.ops.actorserve.decode_attention_at(q, k_pool, v_pool, table, rows, begin, end, scale, width)
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0, msg=lambda m: f"width {width}: {m}")
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5, msg=lambda m: f"width {width}: {m}")
        # A task takes one K/V head, a few, or all of a request's: each head's sums are the same.
        for task_heads in sorted({1, 2, kv_heads}):
            split = torch.ops.actorserve.decode_attention_at(q, k_pool, v_pool, table, rows, begin, end, scale, width, task_heads)
            assert torch.equal(split[0], out) and torch.equal(split[1], lse), (width, task_heads)
    widest = kernels.decode_attention(q, k_pool, v_pool, table, rows, begin, end, scale)
    assert torch.equal(widest[0], torch.ops.actorserve.decode_attention_at(q, k_pool, v_pool, table, rows, begin, end, scale, widths[0])[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_take_q_as_a_view_of_a_fused_projection(kernels, dtype):
    """q sliced out of [tokens, (heads + 2 * kv_heads) * dim] gives what a contiguous copy gives."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, seq_lens = 9, 3, 64, [5, 40, 70]
    _, k_pool, v_pool, table, rows = _scattered_decode_inputs(gen, seq_lens, heads, kv_heads, dim, dtype)
    end = torch.tensor(seq_lens)
    fused = torch.randn((len(seq_lens), (heads + 2 * kv_heads) * dim), generator=gen).to(dtype)
    q = fused[:, : heads * dim].view(len(seq_lens), heads, dim)
    assert not q.is_contiguous()
    args = (k_pool, v_pool, table, rows, torch.zeros(3, dtype=torch.int64), end, 0.125)
    out, lse = kernels.decode_attention(q, *args)
    out_c, lse_c = kernels.decode_attention(q.contiguous(), *args)
    assert out.is_contiguous() and torch.equal(out, out_c) and torch.equal(lse, lse_c)
    # Extend: 3 + 5 new tokens after prefixes of 2 and 30.
    fused = torch.randn((8, (heads + 2 * kv_heads) * dim), generator=gen).to(dtype)
    q = fused[:, : heads * dim].view(8, heads, dim)
    args = (k_pool, v_pool, table, rows[:2], torch.tensor([2, 30]), torch.tensor([3, 5]), 0.125)
    out = kernels.extend_attention(q, *args)
    assert out.is_contiguous() and torch.equal(out, kernels.extend_attention(q.contiguous(), *args))


def test_decode_kernel_takes_an_empty_batch(kernels):
    """No request, no task: empty outputs (the parallel region still gets one thread)."""
    pool = torch.randn(10, 3, 64)
    none = torch.zeros(0, dtype=torch.int64)
    out, lse = kernels.decode_attention(torch.randn(0, 9, 64), pool, pool, torch.zeros(3, 8, dtype=torch.int32), none, none, none, 0.125)
    assert out.shape == (0, 9, 64) and lse.shape == (0, 9)


def test_kernel_refuses_bad_input_by_name(kernels):
    kernel = kernels.decode_attention
    q, pool = torch.zeros(2, 4, 16), torch.zeros(10, 2, 16)
    table, rows, ends = torch.zeros(3, 8, dtype=torch.int32), torch.tensor([1, 2]), torch.tensor([3, 3])
    with pytest.raises(RuntimeError, match="q.s dtype or int8 rows"):
        kernel(q, pool.double(), pool.double(), table, rows, torch.zeros(2, dtype=torch.int64), ends, 1.0)
    with pytest.raises(RuntimeError, match="multiple of K/V heads"):
        kernel(torch.zeros(2, 3, 16), pool, pool, table, rows, torch.zeros(2, dtype=torch.int64), ends, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        kernel(q, pool, pool, table.long(), rows, torch.zeros(2, dtype=torch.int64), ends, 1.0)
    with pytest.raises(RuntimeError, match="key range"):
        kernel(q, pool, pool, table, rows, torch.zeros(2, dtype=torch.int64), torch.tensor([3, 9]), 1.0)
    with pytest.raises(RuntimeError, match="key range"):
        kernel(q, pool, pool, table, rows, torch.tensor([3, 0]), ends, 1.0)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        kernel(torch.zeros(4, 2, 16).transpose(0, 1), pool, pool, table, rows, torch.zeros(2, dtype=torch.int64), ends, 1.0)
    with pytest.raises(RuntimeError, match="task_heads must be 0"):
        torch.ops.actorserve.decode_attention_at(q, pool, pool, table, rows, torch.zeros(2, dtype=torch.int64), ends, 1.0, 0, -1)
    extend = kernels.extend_attention
    with pytest.raises(RuntimeError, match="q has 2"):
        extend(q, pool, pool, table, rows, torch.tensor([0, 0]), torch.tensor([1, 2]), 1.0)
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        extend(q, pool, pool, table, rows, torch.tensor([8, 0]), torch.tensor([1, 1]), 1.0)
