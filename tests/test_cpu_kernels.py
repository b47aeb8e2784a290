"""The compiled CPU kernels (gpu/cpu_ops.py) and packed linears against the torch code they replace.

The elementwise kernels round where the torch code rounds, so in bfloat16 they agree with it
except where float32 math itself differs in its last bit (the exp inside SiLU, a sum's order);
a whole model with the kernels must give the torch path's logits and greedy tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import gpu.cpu_ops as cpu_ops
from gpu.forward_batch import ForwardBatch
from gpu.model_config import RopeConfig
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.models import RMSNorm, RotaryEmbedding
from gpu.packed_linear import can_pack
from gpu.sampler import Sampler, SamplingInfo
from runtime.sampling_params import SamplingParams


def _torch_norm(dim: int, weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = weight
    return norm


def _mostly_equal(got: torch.Tensor, want: torch.Tensor, ulp_share: float = 0.01) -> None:
    """Equal but for a few elements one float32 rounding apart (at most ulp_share of them)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    differ = got != want
    assert differ.float().mean() <= ulp_share, f"{int(differ.sum())} of {got.numel()} elements differ"
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)  # one bfloat16 step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual_add(kernels, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(37, 576, generator=gen).to(dtype)
    norm = _torch_norm(576, (torch.rand(576, generator=gen) + 0.5).to(dtype))
    want = norm(x)
    got = kernels.rms_norm(x, norm.weight.data, norm.eps)
    residual = x.clone()
    fused = kernels.add_rms_norm_(residual, delta, norm.weight.data, norm.eps)
    assert torch.equal(residual, x + delta)  # the residual add rounds exactly as `hidden + delta`
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(fused, norm(x + delta), atol=1e-6, rtol=1e-6)
    else:
        _mostly_equal(got, want)
        _mostly_equal(fused, norm(x + delta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(29, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp's range ends
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:
        _mostly_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_strided_views(kernels, dtype):
    """q and k as the fused qkv matmul leaves them: views with a row stride wider than theirs."""
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim = 11, 4, 2, 64
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), dim, 4096)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    want_q, want_k = rotary(positions, q, k)
    kernels.rope_(q, positions, rotary.cos, rotary.sin)
    kernels.rope_(k, positions, rotary.cos, rotary.sin)
    tolerance = 1e-6 if dtype == torch.float32 else 0  # float32: fused multiply-adds round once
    torch.testing.assert_close(q, want_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k, want_k, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_the_indexed_assignment(kernels, dtype):
    """k and v as views into a fused qkv (heads back to back) and with the heads apart (a stride
    between them), into slots in any order: the pools end as `pool[slots] = k` leaves them."""
    gen = torch.Generator().manual_seed(3)
    tokens, kv_heads, dim, slots = 6, 3, 16, 40
    k_pool, v_pool = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype), torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    where = torch.tensor([7, 0, 39, 12, 13, 5])
    qkv = torch.randn(tokens, 5 * kv_heads * dim, generator=gen).to(dtype)
    fused_k, fused_v = (t.view(tokens, kv_heads, dim) for t in qkv.split([kv_heads * dim, kv_heads * dim, 3 * kv_heads * dim], dim=-1)[:2])
    apart = torch.randn(tokens, kv_heads, 2 * dim, generator=gen).to(dtype)[:, :, :dim]  # head stride 2 * dim
    for k, v in ((fused_k, fused_v), (apart, fused_k)):
        want_k, want_v = k_pool.clone(), v_pool.clone()
        want_k[where], want_v[where] = k, v
        kernels.write_kv_(k_pool, v_pool, where, k, v)
        assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    with pytest.raises(RuntimeError, match="is not a slot of the pool"):
        kernels.write_kv_(k_pool, v_pool, torch.tensor([0, 1, 2, 3, 4, slots]), fused_k, fused_v)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.write_kv_(k_pool, v_pool, where, fused_k.double(), fused_v.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_max_indices(kernels, dtype):
    """The first of equal maxima, the first NaN in a row that has one, rows of -inf: each row's
    index as `max(dim=-1).indices` gives it (greedy sampling's choice)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 1000 + 7, generator=gen).to(dtype)  # not a whole number of 16-lane vectors
    logits[1, 5] = logits[1, 900] = 50.0  # tie: the first wins, in different lanes
    logits[2, 17] = logits[2, 33] = 50.0  # tie in the same lane
    logits[3, 1003] = 50.0  # in the scalar tail
    logits[4, 40] = logits[4, 600] = float("nan")
    logits[5] = float("-inf")
    logits[6, 2] = float("inf")
    logits[7, ::3] = 50.0
    got = kernels.argmax_rows(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.max(dim=-1).indices), (got, logits.max(dim=-1).indices)
    assert got[:5].tolist() == [int(logits[0].float().argmax()), 5, 17, 1003, 40]
    short = torch.randn(3, 5, generator=gen).to(dtype)  # shorter than a vector
    assert torch.equal(kernels.argmax_rows(short), short.max(dim=-1).indices)


def test_the_runners_sampler_takes_the_kernel_for_greedy_rows(kernels):
    """Greedy rows (alone, and beside sampled ones) get the kernel's argmax; a sampler without
    the kernel gives the same tokens."""
    calls: list[torch.Size] = []

    def counted(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape)
        return kernels.argmax_rows(logits)

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    greedy = SamplingInfo.from_params([SamplingParams(temperature=0.0)] * 4, "cpu")
    assert torch.equal(Sampler(counted).sample(logits, greedy).token_ids, Sampler().sample(logits, greedy).token_ids)
    assert calls == [logits.shape]
    mixed = SamplingInfo.from_params([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2, "cpu")
    tokens = Sampler(counted).sample(logits, mixed).token_ids
    assert len(calls) == 2 and torch.equal(tokens[::2], logits[::2].max(dim=-1).indices)


def test_kernels_refuse_bad_input_by_name(kernels):
    x = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="even last dimension"):
        kernels.silu_mul(torch.zeros(4, 7))
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.rope_(torch.zeros(2, 1, 8), torch.tensor([0, 99]), torch.zeros(10, 8), torch.zeros(10, 8))
    with pytest.raises(RuntimeError, match="positions must be int64"):
        kernels.rope_(torch.zeros(2, 1, 8), torch.tensor([0, 1], dtype=torch.int32), torch.zeros(10, 8), torch.zeros(10, 8))


def test_a_failed_build_leaves_the_torch_path(monkeypatch, caplog):
    def no_compiler() -> None:
        raise OSError("no C++ compiler")

    monkeypatch.setattr(cpu_ops, "_load", no_compiler)
    cpu_ops.cpu_kernels.cache_clear()
    try:
        assert cpu_ops.cpu_kernels() is None
        assert "using the torch path: no C++ compiler" in caplog.text
    finally:
        cpu_ops.cpu_kernels.cache_clear()  # the next caller loads the real kernels again


def test_each_instruction_set_target_builds_into_its_own_folder(tmp_path):
    """ACTORSERVE_MARCH=x86-64-v3 (AVX2, no AVX-512) next to this CPU's own build, and the
    emulated AVX512-BF16 build beside either."""
    base = tmp_path / "cpu_ops"
    assert cpu_ops.build_target(base, "native", False) == (["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"], base)
    flags, folder = cpu_ops.build_target(base, "x86-64-v3", False)
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags and folder == tmp_path / "cpu_ops_x86-64-v3"
    flags, folder = cpu_ops.build_target(base, "x86-64-v3", True)
    assert "-DACTORSERVE_BF16_DOT" in flags and folder == tmp_path / "cpu_ops_x86-64-v3_emulated_bf16"


@pytest.fixture(scope="module", params=[("qwen3", "bfloat16"), ("qwen3", "float32"), ("qwen2", "float32"), ("llama", "bfloat16")])
def runners(request, tiny_model_factory, kernels) -> tuple[ModelRunner, ModelRunner, ModelRunner]:
    """(with kernels, torch path, torch path in float32) on one tiny model."""
    arch, dtype = request.param
    config = RunnerConfig(model_path=str(tiny_model_factory(arch)), dtype=dtype, max_running_requests=8, max_total_tokens=2048)
    plain = dataclasses.replace(config, cpu_kernels=False)
    return ModelRunner(config), ModelRunner(plain), ModelRunner(dataclasses.replace(plain, dtype="float32"))


def _uses_kernels(runner: ModelRunner, kernels: cpu_ops.CpuKernels | None) -> bool:
    """Whether every place that can run a compiled kernel holds `kernels` (None: the torch path)."""
    model = runner.model
    holders = [runner.attn, model.rotary, model.model.norm, *model.model.layers]
    return runner.cpu_kernels is kernels and all(h.kernels is kernels for h in holders)


def _logits(runner: ModelRunner, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Prefill every prompt as one batch, then decode the given continuations a token per step
    (teacher forcing, so every runner sees the same inputs): float32 logits of each step."""
    steps = len(continuations[0])
    rows = [runner.req_to_token.alloc() for _ in prompts]
    lens = [len(p) for p in prompts]
    slots = [runner.allocator.alloc(n + steps) for n in lens]
    for row, s in zip(rows, slots):
        runner.req_to_token.write(row, 0, s)
    out_loc = torch.cat([s[:n] for s, n in zip(slots, lens)])
    logits = [runner.forward(ForwardBatch.build(prompts, rows, [0] * len(prompts), out_loc)).float()]
    for step in range(steps):
        out_loc = torch.stack([s[n + step] for s, n in zip(slots, lens)])
        tokens = [[c[step]] for c in continuations]
        logits.append(runner.forward(ForwardBatch.build(tokens, rows, [n + step for n in lens], out_loc)).float())
    for row, s in zip(rows, slots):
        runner.allocator.free(s)
        runner.req_to_token.free(row)
    return logits


def test_model_with_kernels_matches_the_torch_path(runners):
    """float32: the same logits. bfloat16: as close to the float32 logits as the torch path's
    bfloat16 are (greedy tokens of two bfloat16 paths may differ where the top two nearly tie)."""
    fast, plain, reference = runners
    # Else this compares the torch path with itself.
    assert _uses_kernels(fast, cpu_ops.cpu_kernels()) and _uses_kernels(plain, None)
    assert plain.model.packed_head is None
    assert (fast.model.packed_head is not None) == can_pack(fast.dtype, fast.device)  # bf16 needs oneDNN's bf16
    prompts = [[5, 17, 99, 3, 42, 7] * 5, [8, 1, 2], list(range(40, 90))]
    continuations = [[11, 300, 7, 64, 2, 90], [400, 3, 3, 18, 250, 1], [77, 78, 79, 5, 6, 500]]
    want = _logits(reference, prompts, continuations)
    got = _logits(fast, prompts, continuations)
    if fast.dtype == torch.float32:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
        return
    baseline = _logits(plain, prompts, continuations)
    checked = 0
    for step, (g, b, w) in enumerate(zip(got, baseline, want)):
        kernel_error, torch_error = (g - w).abs().max().item(), (b - w).abs().max().item()
        assert kernel_error <= 1.5 * torch_error + 1e-3, f"step {step}: kernels {kernel_error:.4f} vs torch path {torch_error:.4f}"
        top2 = w.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * kernel_error  # rows where the error cannot flip the choice
        assert torch.equal(g.argmax(-1)[clear], w.argmax(-1)[clear])
        checked += int(clear.sum())
    assert checked >= len(got) * len(prompts) // 3, f"only {checked} rows had a clear top token"


def test_a_build_from_another_cpu_is_not_reused(monkeypatch):
    """-march=native code is tied to the CPU it was built on: its flags are part of the build key."""
    monkeypatch.setattr(cpu_ops, "_cpu_features", lambda: "flags : fpu avx2")
    avx2 = cpu_ops._csrc_digest()
    monkeypatch.setattr(cpu_ops, "_cpu_features", lambda: "flags : fpu avx2 avx512f avx512_bf16")
    assert cpu_ops._csrc_digest() != avx2
