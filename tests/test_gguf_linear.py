"""`--quantization gguf`: linear layers on a GGUF file's own Q4_0/Q4_1/Q8_0 blocks
(gpu/gguf_linear.py, gpu/csrc/gguf_matmul.cpp). The oracle is float64 arithmetic on the
dequantized weights and the dequantized activations; on a CPU without AVX512-VNNI the same tests
check the torch fallback."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpu import gguf_linear
from gpu.cpu_decode import CpuDecodeLayers
from gpu.forward_batch import ForwardBatch
from gpu.gguf_linear import GgufLinear, blocks_from_gguf, quantize_blocks_torch
from gpu.model_runner import ModelRunner, RunnerConfig
from api.frontend.engine import Engine
from gpu.offline import generate
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from tests.test_cpu_decode import _decode_batch, _requests
from tests.test_gguf import tiny_tensor_shapes, tiny_tokens, write_tiny_gguf, write_tiny_metadata

TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _quantized(rows: int, cols: int, type_name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF blocks, gguf's own dequantization of them)."""
    values = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_are_the_values_gguf_dequantizes(type_name: str) -> None:
    raw, want = _quantized(70, 96, type_name, seed=1)
    blocks = blocks_from_gguf(raw, type_name, (70, 96))
    assert blocks.bits == (8 if type_name == "Q8_0" else 4)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("types", [("Q4_0",), ("Q4_1",), ("Q8_0",), ("Q4_1", "Q8_0")])
def test_matmul_is_the_dequantized_product(types: tuple[str, ...], dtype: torch.dtype) -> None:
    """Layers fused along their outputs (mixed widths included), 70-130 outputs (a short last
    block of 64), 1-37 rows (512-bit: whole blocks one and two rows a pass, from 32 rows half
    blocks five rows a pass and the last 2 or 4; 256-bit: a row a pass, from 8 rows widened half
    blocks two rows a pass and the last 1), with a bias on one part."""
    sizes = [(70, 96), (130, 96)][: len(types)]
    parts = [_quantized(n, k, t, seed=i) for i, ((n, k), t) in enumerate(zip(sizes, types))]
    biases = [torch.linspace(-1, 1, sizes[0][0]), None][: len(types)]
    layer = GgufLinear([blocks_from_gguf(raw, t, size) for (raw, _), t, size in zip(parts, types, sizes)], biases)
    weight = torch.from_numpy(np.concatenate([w for _, w in parts])).double()
    bias = torch.cat([b if b is not None else torch.zeros(n) for b, (n, _) in zip(biases, sizes)]).double()
    torch.manual_seed(0)
    x = torch.randn(37, 96).to(dtype)
    x[3, :32] = 0  # an all-zero block: scale 0, no division by it
    want = quantize_blocks_torch(x).double() @ weight.T + bias
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    for width in _widths(layer):
        got = _at_width(layer, x, width)
        assert got.dtype == dtype and (got.double() - want).abs().max().item() <= tolerance, width
        for rows in (1, 2, 3, 17, 34):  # a row's result depends neither on the rows beside it nor on the path
            assert torch.equal(_at_width(layer, x[:rows], width), got[:rows]), (width, rows)


def _widths(layer: GgufLinear) -> list[int | None]:
    """The kernel's paths compiled here (AVX512-VNNI 512, AVX2 256), or None: the torch fallback."""
    return torch.ops.actorserve.gguf_matmul_widths() if layer.kernel else [None]


def _at_width(layer: GgufLinear, x: torch.Tensor, width: int | None) -> torch.Tensor:
    if width is None:
        return layer(x)
    return torch.ops.actorserve.gguf_matmul_at(x.contiguous(), layer.weight, layer.scale, layer.minimum, layer.bias, layer.out_features, width)


def test_torch_fallback_computes_what_the_kernel_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPUs without AVX512-VNNI run the same arithmetic as torch ops on the dequantized weights."""
    raw, _ = _quantized(70, 96, "Q4_1", seed=3)
    blocks = blocks_from_gguf(raw, "Q4_1", (70, 96))
    kernel = GgufLinear([blocks], [None])
    monkeypatch.setattr(gguf_linear, "kernel_available", lambda: False)
    fallback = GgufLinear([blocks], [None])
    assert not fallback.kernel and fallback.weight.shape == (70, 96)
    x = torch.randn(5, 96)
    assert torch.allclose(fallback(x), kernel(x), atol=1e-5)


def _write_quantized_gguf(path: Path) -> Path:
    """tests/test_gguf.py's tiny llama (q/k rows permuted as llama.cpp writes them), tied, with every
    matrix block-quantized: attention Q4_0, the MLP Q4_1, the embedding (and so the output layer) Q8_0."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    write_tiny_metadata(writer, "llama", 16, add_bos=False)
    for name, shape in tiny_tensor_shapes("llama", 16, tied=True, vocab=len(tiny_tokens())).items():
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 1:
            writer.add_tensor(name, values)
            continue
        kind = "Q8_0" if "token_embd" in name else "Q4_0" if "attn" in name else "Q4_1"
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_quantized_gguf(tmp_path_factory.mktemp("gguf-blocks") / "tiny-blocks.gguf")


def _runner(path: Path, quantization: str | None) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=str(path), dtype="float32", quantization=quantization, max_total_tokens=512, max_running_requests=4))


def test_model_on_blocks_matches_the_dequantized_model(quantized_gguf: Path) -> None:
    """The whole forward (prefill of every position) against the same file dequantized: the only
    difference is the activations' rounding."""
    runners = [_runner(quantized_gguf, q) for q in (None, "gguf")]
    ids = [5, 60, 100, 7, 200, 3, 261, 42]
    logits = []
    for runner in runners:
        row, slots = runner.req_to_token.alloc(), runner.allocator.alloc(len(ids))
        runner.req_to_token.write(row, 0, slots)
        logits.append(runner.forward(ForwardBatch.build([ids], [row], [0], slots, runner.device, return_all_logits=True)).double())
    base, blocks = logits
    error = (blocks - base).abs()
    assert error.mean().item() < 0.02 * base.abs().mean().item(), (error.mean(), base.abs().mean())
    assert torch.equal(blocks.argmax(-1), base.argmax(-1))


def test_one_call_decode_gives_the_modules_bits(quantized_gguf: Path) -> None:
    runner = _runner(quantized_gguf, "gguf")
    fast = runner.model.cpu_decode
    if not runner.model.packed_head.kernel:
        assert fast is None  # the torch fallback has no one-call path
        return
    assert isinstance(fast, CpuDecodeLayers)
    contexts = [5, 40, 17]
    rows, slots = _requests(runner, contexts, 2)
    for step in range(2):
        batch = _decode_batch(runner, contexts, step, rows, slots)
        runner.model.cpu_decode = fast
        got = runner.forward(batch).clone()
        assert fast.inputs(batch, runner.attn) is not None
        runner.model.cpu_decode = None
        assert torch.equal(got, runner.forward(batch)), step


async def test_engine_serves_on_the_blocks_as_the_runner_decides(quantized_gguf: Path) -> None:
    """`Engine(quantization="gguf")` reaches the runner: its greedy tokens are the blocks' own, which
    part from the dequantized model's at the 8th token on this prompt."""
    prompt, params = [1, 2, 3], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    blocks, dequantized = (generate(_runner(quantized_gguf, q), [prompt], [params])[0].output_ids for q in ("gguf", None))
    assert blocks != dequantized
    async with Engine(model_path=str(quantized_gguf), dtype="float32", quantization="gguf", inline_core=True) as engine:
        out = await engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    assert out.output_ids == blocks


def test_a_tensor_of_another_type_is_refused_by_name(tmp_path: Path) -> None:
    """tests/test_gguf.py's tiny file keeps v, o and the MLP as F32: not blocks to keep."""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "llama")
    with pytest.raises(ValueError, match=r"keeps Q4_0, Q4_1 and Q8_0 blocks; mixed.gguf's blk.0.attn_v.weight is F32"):
        _runner(path, "gguf")


def test_config_names_what_gguf_needs() -> None:
    with pytest.raises(ValueError, match="not a .gguf file"):
        EngineConfig(model_path="/some/checkpoint-dir", quantization="gguf")
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(quantization="gguf", tp_size=2)
