"""`--quantization gguf`: linear layers on a GGUF file's own blocks (gpu/gguf_linear.py,
gpu/csrc/gguf_matmul.cpp). The oracles are gguf's own dequantization of the file's bytes and float64
arithmetic on the dequantized weights and activations; on a CPU without AVX512-VNNI or AVX2 the same
tests check the torch fallback."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpu import gguf_linear, gguf_loader
from gpu.cpu_decode import CpuDecodeLayers
from gpu.forward_batch import ForwardBatch
from gpu.gguf_linear import GgufBlockSource, GgufLinear, blocks_from_gguf, quantize_blocks_torch
from gpu.model_runner import ModelRunner, RunnerConfig
from api.frontend.engine import Engine
from gpu.offline import generate
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from tests.test_cpu_decode import _decode_batch, _requests
from tests.test_gguf import tiny_tensor_shapes, tiny_tokens, write_tiny_gguf, write_tiny_metadata

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants can write these
# Types gguf.quants only reads: random bytes are valid blocks once their float16 scales are set.
# Byte offsets of each block's float16 scales (d, and dmin where there is one).
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,)}


def _quantized(rows: int, cols: int, type_name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF blocks, gguf's own dequantization of them)."""
    quant = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    if type_name in SCALE_OFFSETS:
        elements, block_bytes = gguf.GGML_QUANT_SIZES[quant]
        raw = rng.integers(0, 256, (rows, cols // elements, block_bytes), dtype=np.uint8)
        for at in SCALE_OFFSETS[type_name]:
            raw[:, :, at : at + 2] = (rng.uniform(1e-4, 2e-3, (rows, cols // elements, 1)).astype(np.float16)).view(np.uint8)
        raw = raw.reshape(rows, -1)
    else:
        raw = gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), quant)
    return raw, np.asarray(gguf.quants.dequantize(raw, quant), np.float32).reshape(rows, cols)


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_are_the_values_gguf_dequantizes(type_name: str) -> None:
    raw, want = _quantized(70, 96, type_name, seed=1)
    blocks = blocks_from_gguf(raw, type_name, (70, 96))
    assert blocks.bits == {"Q4": 4, "Q5": 5, "Q8": 8}[type_name[:2]]
    assert torch.equal(blocks.dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quant_blocks_keep_their_weights(type_name: str) -> None:
    """Eight 32-weight sub-blocks per 256 with 6-bit scales and mins: u is each weight's own code
    (gguf's dequantization of the same bytes with every scale 1 and every min 0), and d * sc_j and
    dmin * m_j lose only their rounding to float16."""
    raw, want = _quantized(6, 512, type_name, seed=2)
    blocks = blocks_from_gguf(raw, type_name, (6, 512))
    assert blocks.bits == (4 if type_name == "Q4_K" else 5)
    unit = raw.reshape(6, 2, -1).copy()
    unit[:, :, 0:2], unit[:, :, 2:4] = np.frombuffer(np.float16(1).tobytes(), np.uint8), 0
    unit[:, :, 4:16] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)
    codes = gguf.quants.dequantize(unit.reshape(6, -1), gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(blocks.u, codes.reshape(6, 512).astype(np.uint8))
    error = (blocks.dequantize() - torch.from_numpy(want)).abs()
    assert error.max().item() <= 2**-10 * np.abs(want).max(), (error.max(), np.abs(want).max())


@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K", "Q2_K", "IQ4_NL"])
def test_other_block_types_are_requantized_to_8_bit_blocks(type_name: str) -> None:
    """16-weight sub-blocks (Q6_K, Q3_K, Q2_K) or a non-linear code (IQ4_NL) do not fit one d and m
    per 32 weights: each 32 of gguf's dequantized weights get m = their minimum and a step of a
    255th of their range, both float16. A weight is off by at most about half a step (the step's
    own rounding adds up to an eighth of a step at the top, the minimum's at the bottom)."""
    raw, want = _quantized(6, 512, type_name, seed=3)
    blocks = blocks_from_gguf(raw, type_name, (6, 512))
    assert blocks.bits == 8
    step = np.repeat(blocks.d.astype(np.float32), 32, axis=1)
    low = np.repeat(blocks.m.astype(np.float32), 32, axis=1)
    error = np.abs(blocks.dequantize().numpy() - want)
    assert (error <= 0.63 * step + 2**-11 * np.abs(low) + 1e-9).all(), (error / step).max()
    assert error.mean() < 0.3 * step.mean()


def test_a_float_tensor_has_no_blocks() -> None:
    with pytest.raises(ValueError, match=r"quantized blocks; the tensor is F16, not quantized \(load it without"):
        blocks_from_gguf(np.zeros((2, 64), np.uint8), "F16", (2, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "types", [("Q4_0",), ("Q4_1",), ("Q5_0",), ("Q8_0",), ("Q4_1", "Q8_0"), ("Q4_1", "Q5_1"), ("Q5_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q5_K",)]
)
def test_matmul_is_the_dequantized_product(types: tuple[str, ...], dtype: torch.dtype) -> None:
    """Layers fused along their outputs (mixed widths included), 70-130 outputs (a short last
    block of 64), 1-37 rows (512-bit: whole blocks one and two rows a pass, from 32 rows half
    blocks five rows a pass and the last 2 or 4; 256-bit: a row a pass, from 8 rows widened half
    blocks two rows a pass and the last 1), with a bias on one part; weights of 4, 5 and 8 bits,
    fused ones taking the widest. K-quants come in 256 inputs."""
    cols = 256 if types[0].endswith("K") else 96
    sizes = [(70, cols), (130, cols)][: len(types)]
    parts = [_quantized(n, k, t, seed=i) for i, ((n, k), t) in enumerate(zip(sizes, types))]
    biases = [torch.linspace(-1, 1, sizes[0][0]), None][: len(types)]
    blocks = [blocks_from_gguf(raw, t, size) for (raw, _), t, size in zip(parts, types, sizes)]
    layer = GgufLinear(blocks, biases)
    weight = torch.cat([b.dequantize() for b in blocks]).double()
    bias = torch.cat([b if b is not None else torch.zeros(n) for b, (n, _) in zip(biases, sizes)]).double()
    torch.manual_seed(0)
    x = torch.randn(37, cols).to(dtype)
    x[3, :32] = 0  # an all-zero block: scale 0, no division by it
    want = quantize_blocks_torch(x).double() @ weight.T + bias
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    for width in _widths(layer):
        got = _at_width(layer, x, width)
        assert got.dtype == dtype and (got.double() - want).abs().max().item() <= tolerance, width
        for rows in (1, 2, 3, 17, 34):  # a row's result depends neither on the rows beside it nor on the path
            assert torch.equal(_at_width(layer, x[:rows], width), got[:rows]), (width, rows)


@pytest.mark.parametrize("threads", [3, 5])
def test_matmul_does_not_depend_on_the_thread_count(threads: int) -> None:
    """gpu/csrc/parallel.h cuts the work into pieces the threads take as they come: for odd thread
    counts and a layer of 11 blocks (a short last one), every output is computed once, as one thread
    computes it."""
    raw, _ = _quantized(700, 96, "Q4_1", seed=3)
    layer = GgufLinear([blocks_from_gguf(raw, "Q4_1", (700, 96))], [None])
    x = torch.randn(20, 96)
    before = torch.get_num_threads()
    try:
        for width in _widths(layer):
            torch.set_num_threads(1)
            want = [_at_width(layer, x[:rows], width) for rows in (1, 20)]
            torch.set_num_threads(threads)
            assert all(torch.equal(_at_width(layer, x[:rows], width), w) for rows, w in zip((1, 20), want)), width
    finally:
        torch.set_num_threads(before)


def _widths(layer: GgufLinear) -> list[int | None]:
    """The kernel's paths compiled here (AVX512-VNNI 512, AVX2 256), or None: the torch fallback."""
    return torch.ops.actorserve.gguf_matmul_widths() if layer.kernel else [None]


def _at_width(layer: GgufLinear, x: torch.Tensor, width: int | None) -> torch.Tensor:
    if width is None:
        return layer(x)
    return torch.ops.actorserve.gguf_matmul_at(x.contiguous(), layer.weight, layer.scale, layer.minimum, layer.bias, layer.out_features, layer.bits, width)


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


def test_blocks_are_read_through_the_tensor_index(quantized_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the file is converted, its blocks come from the index written beside the checkpoint,
    with the bytes gguf's reader finds, and the file's metadata is not parsed again."""
    reader = gguf.GGUFReader(quantized_gguf)
    gguf_loader.gguf_to_hf_dir(quantized_gguf)  # what the runner's load does first

    def no_parsing(*args: object) -> None:
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf_loader, "GGUFReader", no_parsing)
    source = GgufBlockSource(quantized_gguf)
    assert sorted(source.names()) == sorted(gguf_loader.hf_tensor_name(t.name) for t in reader.tensors)
    for tensor in reader.tensors:
        if len(tensor.shape) != 2 or ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            continue  # norms have no blocks; q/k rows are un-permuted (the model test covers them)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))
        want = blocks_from_gguf(tensor.data, tensor.tensor_type.name, shape)
        got = source.blocks(gguf_loader.hf_tensor_name(tensor.name))
        assert got.bits == want.bits, tensor.name
        for a, b in ((got.u, want.u), (got.d, want.d), (got.m, want.m)):
            assert np.array_equal(a, b), tensor.name


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


def test_a_float_tensor_is_refused_by_name(tmp_path: Path) -> None:
    """tests/test_gguf.py's tiny file keeps v, o and the MLP as F32: not blocks to keep."""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "llama")
    with pytest.raises(ValueError, match=r"quantized blocks; mixed.gguf's blk.0.attn_v.weight is F32, not quantized \(load it without"):
        _runner(path, "gguf")


def test_config_names_what_gguf_needs() -> None:
    with pytest.raises(ValueError, match="not a .gguf file"):
        EngineConfig(model_path="/some/checkpoint-dir", quantization="gguf")
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(quantization="gguf", tp_size=2)
