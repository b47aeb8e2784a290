"""The 8-bit KV cache (`--kv-cache-dtype int8`): rows of int8 values with their scale
(gpu/kv_quant.py), written and read by the CPU kernels (gpu/csrc/kv_rows.h) and by the torch path.

The generic decode loops and extend attention convert each int8 row to floats and go on as they do
over a float32 pool, so over int8 rows they must give the bits they give over those rows' values;
the vector decode paths (AVX2, AVX512-VNNI) also round the queries to int8 and are held to a
tolerance instead."""

from __future__ import annotations

import pytest
import torch

from gpu.attention import TorchAttention
from gpu.cpu_ops import CpuKernels
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVBuffers
from gpu.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows
from gpu.model_runner import ModelRunner, RunnerConfig
from runtime.config import EngineConfig


def test_rows_round_to_within_half_a_step_of_their_scale() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0  # a zero row: scale at its floor, values 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale[..., 0], x.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127)
    back = dequantize_rows(rows, torch.float32)
    assert torch.all((back - x).abs() <= scale * 0.5 * (1 + 1e-6))
    assert torch.equal(back[7, 1], torch.zeros(64)) and rows[..., :64].abs().max() == 127


def _pools(gen: torch.Generator, slots: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(torch.randn((slots, kv_heads, dim), generator=gen)), quantize_rows(torch.randn((slots, kv_heads, dim), generator=gen))


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("dim", [32, 64, 128, 48])  # 48: the generic loops only
def test_float32_kernels_over_int8_rows_are_the_kernels_over_their_values(kernels: CpuKernels, heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads + dim)
    seq_lens = [1, 31, 33, 64, 100]
    k_pool, v_pool = _pools(gen, 5 * 100 + 8, kv_heads, dim)
    k_values, v_values = dequantize_rows(k_pool, torch.float32), dequantize_rows(v_pool, torch.float32)
    table = torch.randperm(5 * 100 + 8, generator=gen)[: 5 * 100].view(5, 100).to(torch.int32)  # scattered slots
    rows, begin, end = torch.arange(len(seq_lens)), torch.tensor([0, 3, 0, 40, 1]), torch.tensor(seq_lens)
    q = torch.randn((len(seq_lens), heads, dim), generator=gen)
    for width in torch.ops.actorserve.decode_attention_widths():
        got = torch.ops.actorserve.decode_attention_at(q, k_pool, v_pool, table, rows, begin, end, dim**-0.5, width)
        want = torch.ops.actorserve.decode_attention_at(q, k_values, v_values, table, rows, begin, end, dim**-0.5, width)
        if width == 0 or dim not in (32, 64, 128):  # the generic loops: the same bits
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), width
        else:  # the vector paths over int8 rows (AVX2, AVX512-VNNI) round the queries to int8 too
            torch.testing.assert_close(got, want, atol=3e-2, rtol=0)
        for task_heads in (1, kv_heads):  # a task per K/V head or per request: the same sums
            split = torch.ops.actorserve.decode_attention_at(q, k_pool, v_pool, table, rows, begin, end, dim**-0.5, width, task_heads)
            assert torch.equal(split[0], got[0]) and torch.equal(split[1], got[1]), (width, task_heads)
    prefix, extend = torch.tensor([0, 20, 5, 50, 90]), torch.tensor([1, 11, 28, 14, 10])
    qe = torch.randn((int(extend.sum()), heads, dim), generator=gen)
    got = kernels.extend_attention(qe, k_pool, v_pool, table, rows, prefix, extend, dim**-0.5)
    assert torch.equal(got, kernels.extend_attention(qe, k_values, v_values, table, rows, prefix, extend, dim**-0.5))


def test_bfloat16_queries_over_int8_rows(kernels: CpuKernels) -> None:
    """bfloat16 models: every path compiled here (generic, AVX2, AVX512-VNNI) against float64."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, seq_lens = 9, 3, 64, [5, 40, 257]
    k_pool, v_pool = _pools(gen, 3 * 257 + 8, kv_heads, dim)
    table = torch.randperm(3 * 257 + 8, generator=gen)[: 3 * 257].view(3, 257).to(torch.int32)
    q = torch.randn((3, heads, dim), generator=gen).to(torch.bfloat16)
    rows, begin, end = torch.arange(3), torch.zeros(3, dtype=torch.int64), torch.tensor(seq_lens)
    k, v = dequantize_rows(k_pool, torch.float64), dequantize_rows(v_pool, torch.float64)
    for width in torch.ops.actorserve.decode_attention_widths():
        out, lse = torch.ops.actorserve.decode_attention_at(q, k_pool, v_pool, table, rows, begin, end, dim**-0.5, width)
        for i, n in enumerate(seq_lens):
            s = table[i, :n].long()
            scores = (q[i].double().view(kv_heads, 3, dim) @ k[s].permute(1, 2, 0)) * dim**-0.5  # [kv_heads, group, keys]
            want = (scores.softmax(-1) @ v[s].transpose(0, 1)).reshape(heads, dim)
            torch.testing.assert_close(out[i].double(), want, atol=2e-2, rtol=0, msg=lambda m: f"width {width}: {m}")
            torch.testing.assert_close(lse[i].double(), scores.logsumexp(-1).reshape(heads), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_rounds_each_head_as_the_reference(kernels: CpuKernels, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    k_pool, v_pool = torch.zeros((20, 3, 68), dtype=torch.int8), torch.zeros((20, 3, 68), dtype=torch.int8)
    qkv = torch.randn((4, 3 * 3 * 64), generator=gen).to(dtype)  # heads strided, as views of a fused projection
    k, v = qkv[:, : 3 * 64].view(4, 3, 64), qkv[:, 3 * 64 : 6 * 64].view(4, 3, 64)
    slots = torch.tensor([3, 9, 1, 17])
    kernels.write_kv_(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool[slots], quantize_rows(k)) and torch.equal(v_pool[slots], quantize_rows(v))
    assert not k_pool[[0, 2, 4]].any()  # nothing else written
    with pytest.raises(RuntimeError, match="matching the pools"):
        kernels.write_kv_(k_pool, v_pool, slots, k[..., :60], v[..., :60])


def test_torch_path_reads_and_writes_int8_rows() -> None:
    """No compiled kernels: the pools' rows are rounded on write and read back as the model's dtype."""
    gen = torch.Generator().manual_seed(5)
    kv = KVBuffers.allocate(1, 40, 2, 16, torch.float32, "cpu", int8_rows=True)
    assert kv.int8_rows and kv.k[0].shape == (40, 2, 16 + SCALE_BYTES) and kv.bytes() == 2 * 40 * 2 * 20
    with pytest.raises(ValueError, match="needs the model's dtype"):
        TorchAttention(kv, torch.zeros((2, 8), dtype=torch.int32), 0.25)
    table = torch.zeros((2, 8), dtype=torch.int32)
    table[1, :5] = torch.tensor([4, 9, 2, 30, 7], dtype=torch.int32)
    backend = TorchAttention(kv, table, 0.25, dtype=torch.float32)
    k, v = torch.randn((5, 2, 16), generator=gen), torch.randn((5, 2, 16), generator=gen)
    backend.init_forward_metadata(ForwardBatch.build([[1] * 4], [1], [0], table[1, :4].long()))
    backend.forward(torch.randn((4, 4, 16), generator=gen), k[:4], v[:4], 0)
    assert torch.equal(kv.k[0][table[1, :4].long()], quantize_rows(k[:4]))
    backend.init_forward_metadata(ForwardBatch.build([[1]], [1], [4], table[1, 4:5].long()))
    q = torch.randn((1, 4, 16), generator=gen)
    out = backend.forward(q, k[4:], v[4:], 0)
    keys, values = dequantize_rows(quantize_rows(k), torch.float32), dequantize_rows(quantize_rows(v), torch.float32)
    scores = q[0].view(2, 2, 16) @ keys.permute(1, 2, 0) * 0.25
    torch.testing.assert_close(out[0], (scores.softmax(-1) @ values.transpose(0, 1)).reshape(4, 16), atol=1e-5, rtol=1e-5)


def test_engine_with_int8_rows_follows_the_model(tiny_llama) -> None:
    """A float32 model with an int8 KV cache, through the kernels and the torch path, against the
    same model with a float32 cache: logits close, the same greedy tokens (a prompt attends to its
    own K/V as computed on the torch path, as read back from the pool by the kernels); a row takes head_dim + 4
    bytes where float32 takes 4 x head_dim."""
    def run(kv_cache_dtype: str, cpu_kernels: bool = True) -> tuple[torch.Tensor, ModelRunner]:
        runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=256, max_running_requests=2,
                                          kv_cache_dtype=kv_cache_dtype, cpu_kernels=cpu_kernels))
        prompt = [3, 17, 99, 4, 250, 8, 61, 12, 5, 77]
        row, slots = runner.req_to_token.alloc(), runner.allocator.alloc(len(prompt) + 6)
        runner.req_to_token.write(row, 0, slots)
        logits = [runner.forward(ForwardBatch.build([prompt], [row], [0], slots[: len(prompt)]))[-1]]
        for pos in range(len(prompt), len(prompt) + 6):
            token = int(logits[-1].argmax())
            logits.append(runner.forward(ForwardBatch.build([[token]], [row], [pos], slots[pos : pos + 1]))[-1])
        return torch.stack(logits), runner

    want, plain = run("auto")
    got, quantized = run("int8")
    torch_path, _ = run("int8", cpu_kernels=False)
    d = plain.model_config.head_dim
    assert quantized.kv.int8_rows and quantized.kv_bytes_per_token() * 4 * d == plain.kv_bytes_per_token() * (d + SCALE_BYTES)
    for logits in (got, torch_path):
        assert torch.equal(logits.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(logits, want, atol=0.05 * float(want.abs().max()), rtol=0)


def test_int8_kv_is_a_cpu_setting() -> None:
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype int8 runs on a CPU only"):
        EngineConfig(kv_cache_dtype="int8", device="cuda")
