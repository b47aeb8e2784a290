"""Decode batches on a CPU: our int8 matmul (gpu/csrc/int8_matmul.cpp, each path compiled:
AVX512-VNNI and AVX2) against the arithmetic it defines and against oneDNN's int8 path, and every
decoder layer in one call (gpu/cpu_decode.py, gpu/csrc/decode_layers.cpp) against the modules,
with int8 and with oneDNN's packed float32 / bfloat16 linear layers. Each is meant to give the same
bits as the path it shortcuts, so the tests compare with torch.equal. On a CPU with neither
AVX512-VNNI nor AVX2 there is no int8 kernel and the tests that need it skip."""

from __future__ import annotations

import pytest
import torch

from gpu.cpu_decode import CpuDecodeLayers
from gpu.forward_batch import ForwardBatch
from gpu.kv_quant import SCALE_BYTES, quantize_rows
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu import packed_linear
from gpu.packed_linear import WEIGHT_MAX, ZERO_POINT, Int8Kernels, Int8Linear, can_pack, dequantize_rows_torch, quantize_rows_torch, quantize_weight

LARGE_BATCH = 18  # requests: many rows per pass of the int8 kernel, and a batch past oneDNN's 16-row bucket


@pytest.fixture(scope="module")
def int8_kernel(int8_ops: Int8Kernels) -> Int8Kernels:
    if int8_ops.matmul is None:
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2: int8 layers take oneDNN's path at every batch size")
    return int8_ops


def _int8_linear_arithmetic(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What Int8Linear computes, exactly, in torch: activations quantized per row, the integer dot
    product with the 8-bit weights in int64, times the weight's scale in float32 (as oneDNN's
    output), then times the row's scale and plus the bias, each rounded."""
    qx, sx = quantize_rows_torch(x)
    qw, sw = quantize_weight(weight, WEIGHT_MAX)
    dot = (qx.long() - ZERO_POINT) @ qw.long().T
    return dequantize_rows_torch(dot.float() * sw, sx, bias, x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(100, 70), (192, 96), (64, 576)])
def test_each_int8_kernel_path_gives_int8_linears_bits(int8_kernel: Int8Kernels, dtype: torch.dtype, out_features: int, in_features: int) -> None:
    """Every path compiled here (an AVX-512 machine runs the AVX2 one too), on shapes that are not
    whole 64-row blocks or 4-feature groups; with and without bias; whole blocks (few rows) and
    half blocks with every tail of a pass. Weights at full range, so the AVX2 path's int16 pairs
    are at their largest."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.05
    weight[:, 0] = 0.5  # every row's largest weight: 127 after quantization, against activations up to 127
    layer = Int8Linear([weight], [None], int8_kernel)
    for b in (None, torch.randn(out_features)):
        for rows in (1, 2, 3, 4, 6, 7, 8, 9, 16, 64):
            x = (torch.randn(rows, in_features) * torch.logspace(-2, 1, rows)[:, None]).to(dtype)
            x[:, 0] = x.float().abs().amax(dim=1).neg().to(dtype)  # q = -127 at the largest weight
            want = _int8_linear_arithmetic(x, weight, b)
            for width in torch.ops.actorserve.int8_matmul_widths():
                got = torch.ops.actorserve.int8_matmul_at(x, layer.kernel_weight, layer.kernel_offsets, layer.weight_scale, b, out_features, width)
                assert got.dtype == dtype and torch.equal(got, want), (width, rows, b is None, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_gives_onednns_bits(int8_kernel: Int8Kernels, dtype: torch.dtype) -> None:
    """Where oneDNN's kernel sums in int32 (with VNNI), it takes the same 8-bit weights and gives
    the same bits as ours; without VNNI it needs 7-bit weights (gpu/packed_linear.py)."""
    if 512 not in torch.ops.actorserve.int8_matmul_widths():
        pytest.skip("no AVX512-VNNI: oneDNN's kernel saturates int16 sums of 8-bit weights here")
    torch.manual_seed(0)
    weight, bias = torch.randn(192, 96) * 0.05, torch.randn(192)
    onednn = Int8Kernels(int8_kernel.quantize_rows, int8_kernel.dequantize_rows, matmul=None)
    kernel, reference = Int8Linear([weight], [bias], int8_kernel), Int8Linear([weight], [bias], onednn, weight_max=WEIGHT_MAX)
    assert kernel.kernel is not None and reference.kernel is None
    for rows in (1, 3, 4, 9, 64):
        x = torch.randn(rows, 96).to(dtype)
        assert torch.equal(kernel(x), reference(x)), rows


def test_a_row_gets_the_same_bits_alone_as_in_a_large_batch(int8_kernel: Int8Kernels) -> None:
    """Alone a row takes whole weight blocks, in a batch half blocks several rows at a time: a
    request's output must not depend on which, on any path."""
    torch.manual_seed(1)
    layer = Int8Linear([torch.randn(160, 96) * 0.05], [torch.randn(160)], int8_kernel)
    x = torch.randn(LARGE_BATCH + 4, 96).to(torch.bfloat16)
    for width in torch.ops.actorserve.int8_matmul_widths():

        def run(rows: torch.Tensor, width: int = width) -> torch.Tensor:
            return torch.ops.actorserve.int8_matmul_at(rows, layer.kernel_weight, layer.kernel_offsets, layer.weight_scale, layer.bias, 160, width)

        batched = run(x)
        for i in range(x.shape[0]):
            assert torch.equal(run(x[i : i + 1]), batched[i : i + 1]), (width, i)


def _runner(path, dtype: str, quantization: str | None = "int8", kv_cache_dtype: str = "auto") -> ModelRunner:
    config = RunnerConfig(model_path=str(path), dtype=dtype, quantization=quantization, max_total_tokens=1024, max_running_requests=LARGE_BATCH,
                          kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(config)


def _decode_batch(runner: ModelRunner, contexts: list[int], step: int, rows: list[int], slots: list[torch.Tensor]) -> ForwardBatch:
    tokens = [[(7 * i + 3 * step) % runner.vocab_size] for i in range(len(contexts))]
    # A column of a table, as bench/gpu_check.py passes it: a strided view, not a contiguous tensor.
    out_loc = torch.stack([s[ctx + step : ctx + step + 2] for s, ctx in zip(slots, contexts)])[:, 0]
    return ForwardBatch.build(tokens, rows, [ctx + step for ctx in contexts], out_loc, runner.device)


def _requests(runner: ModelRunner, contexts: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Table rows and slots for requests with `contexts` tokens cached (random K/V) and room for `steps` more."""
    rows = [runner.req_to_token.alloc() for _ in contexts]
    slots = [runner.allocator.alloc(ctx + steps + 1) for ctx in contexts]
    for row, s in zip(rows, slots):
        runner.req_to_token.write(row, 0, s)
    torch.manual_seed(2)
    for pool in runner.kv.k + runner.kv.v:
        if runner.kv.int8_rows:
            pool.copy_(quantize_rows(torch.randn((*pool.shape[:2], pool.shape[2] - SCALE_BYTES))))
        else:
            pool.copy_(torch.randn(pool.shape))
    return rows, slots


ONE_CALL_CASES = [("tiny_llama", "bfloat16", "int8", "auto"), ("tiny_llama", "float32", "int8", "auto"), ("tiny_qwen2", "bfloat16", "int8", "auto"),
                  ("tiny_llama", "bfloat16", None, "auto"), ("tiny_llama", "float32", None, "auto"), ("tiny_qwen2", "bfloat16", None, "auto"),
                  ("tiny_llama", "float32", "int8", "int8"), ("tiny_llama", "bfloat16", None, "int8")]


@pytest.mark.parametrize(("model", "dtype", "quantization", "kv_cache_dtype"), ONE_CALL_CASES)
def test_one_call_for_all_layers_gives_the_modules_bits(
    int8_ops: Int8Kernels, request: pytest.FixtureRequest, model: str, dtype: str, quantization: str | None, kv_cache_dtype: str
) -> None:
    """Each decode step twice, on the same pool: in one call, then through the modules. The
    logits and the K/V written for the new tokens must be the same bits (Qwen2: q/k/v biases);
    at 3 requests and at LARGE_BATCH; with the model's dtype in the KV pool and with int8 rows."""
    if quantization is None and not can_pack(getattr(torch, dtype), torch.device("cpu")):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU: its layers stay torch's, which the one call does not take")
    _check_one_call(_runner(request.getfixturevalue(model), dtype, quantization, kv_cache_dtype))


def test_one_call_with_onednns_int8_kernel(int8_ops: Int8Kernels, tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has neither AVX512-VNNI nor AVX2, int8 layers take oneDNN's kernel on rows padded to a bucket."""
    monkeypatch.setattr(packed_linear, "int8_kernels", lambda: Int8Kernels(int8_ops.quantize_rows, int8_ops.dequantize_rows, matmul=None))
    runner = _runner(tiny_llama, "bfloat16")
    assert runner.model.model.layers[0].mlp.gate_up.kernel is None
    _check_one_call(runner)


def _check_one_call(runner: ModelRunner) -> None:
    fast = runner.model.cpu_decode
    assert isinstance(fast, CpuDecodeLayers)
    contexts, steps = [5, 40, 17] + [9] * (LARGE_BATCH - 3), 4
    rows, slots = _requests(runner, contexts, steps)
    for step in range(steps):
        n = 3 if step < 2 else len(contexts)
        batch = _decode_batch(runner, contexts[:n], step, rows[:n], slots[:n])
        runner.model.cpu_decode = fast
        got = runner.forward(batch).clone()
        assert fast.inputs(batch, runner.attn) is not None  # the step really took the one-call path
        written = [(k[batch.out_cache_loc].clone(), v[batch.out_cache_loc].clone()) for k, v in zip(runner.kv.k, runner.kv.v)]
        runner.model.cpu_decode = None
        want = runner.forward(batch)
        assert torch.equal(got, want), step
        for (k, v), layer_k, layer_v in zip(written, runner.kv.k, runner.kv.v):
            assert torch.equal(k, layer_k[batch.out_cache_loc]) and torch.equal(v, layer_v[batch.out_cache_loc])


def test_batches_it_does_not_cover_take_the_modules(int8_ops: Int8Kernels, tiny_llama, tiny_qwen3) -> None:
    runner = _runner(tiny_llama, "bfloat16")
    fast = runner.model.cpu_decode
    assert fast is not None
    contexts = [9] * (LARGE_BATCH - 1)
    rows, slots = _requests(runner, contexts, 1)
    large = _decode_batch(runner, contexts, 0, rows, slots)
    runner.attn.init_forward_metadata(large)
    assert fast.inputs(large, runner.attn) is not None
    prefill = ForwardBatch.build([[1, 2, 3]], rows[:1], [0], slots[0][:3], runner.device)
    runner.attn.init_forward_metadata(prefill)
    assert fast.inputs(prefill, runner.attn) is None
    # Qwen3's per-head q/k norm, and the torch path (no CPU kernels), have none.
    assert _runner(tiny_qwen3, "bfloat16").model.cpu_decode is None
    assert _runner(tiny_qwen3, "bfloat16", quantization=None).model.cpu_decode is None
    torch_path = ModelRunner(RunnerConfig(model_path=str(tiny_llama), dtype="bfloat16", max_total_tokens=256, max_running_requests=2, cpu_kernels=False))
    assert torch_path.model.cpu_decode is None
