"""`--quantization int8` (gpu/packed_linear.py's Int8Linear): int8 weights, per-token int8
activations, oneDNN's int8 matmul. The layer against an exact integer reference, its batch
independence, the compiled passes against the torch ones, and the default model's error against
the unquantized model (logits on the parity prompts, greedy agreement over a fixed prompt set)."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from api.cli import _parser
from api.server.cli import engine_kwargs
from bench.quant_accuracy import PARITY_PROMPTS, all_logits
from gpu.int8_smoothing import smooth
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from gpu.packed_linear import (
    ZERO_POINT,
    Int8Kernels,
    Int8Linear,
    dequantize_rows_torch,
    quantize_rows_torch,
    quantize_weight,
)
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams

GREEDY_PROMPTS = [
    *PARITY_PROMPTS,
    "Once upon a time",
    "import numpy as np\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
    "for i in range(10):",
]
GREEDY_TOKENS = 24
# Measured on SmolLM2-135M-Instruct with SmoothQuant scales folded in (BENCHMARKS.md): per prompt,
# max |error| over all logits 2.9-3.3 with bfloat16 activations (2.9-4.1 with float32, what a CPU
# without bf16 instructions runs), mean 0.5-0.71; greedy agreement here 0.94 (float32 0.93). Without
# the smoothing: max 4.9-6.0 (float32 4.3-8.3), mean 0.9-1.6 (0.8-2.2), agreement 0.91 (both).
MAX_LOGIT_ERROR = 5.0
MEAN_LOGIT_ERROR = 1.0
MIN_GREEDY_AGREEMENT = 0.9


def _rows(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(7, 96) * torch.logspace(-2, 2, 7)[:, None]  # rows of very different magnitude
    x[3] = 0.0  # a zero row must not divide by zero
    x[5, 17] = 40.0  # an outlier channel
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_matches_the_torch_ops(int8_ops: Int8Kernels, dtype: torch.dtype) -> None:
    x = _rows(dtype)
    q, scale = int8_ops.quantize_rows(x)
    q_ref, scale_ref = quantize_rows_torch(x)
    assert q.dtype == torch.uint8 and scale.shape == (7, 1)
    assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)
    # Symmetric per row: each row's largest magnitude maps to +-127, zero to the zero point.
    centred = q.int() - ZERO_POINT
    assert centred.abs().amax(dim=1).tolist() == [127, 127, 127, 0, 127, 127, 127]
    product = torch.randn(7, 40)
    bias = torch.randn(40)
    for b in (None, bias):
        assert torch.equal(int8_ops.dequantize_rows(product, scale, b, dtype), dequantize_rows_torch(product, scale, b, dtype))


def _layer(kernels: Int8Kernels | None) -> tuple[Int8Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    weights = [torch.randn(48, 96) * 0.05, torch.randn(16, 96) * 0.2]  # two fused layers, their own scales
    biases = [torch.randn(48), None]
    return Int8Linear(weights, biases, kernels), torch.cat(weights), torch.cat([biases[0], torch.zeros(16)])


@pytest.mark.parametrize("compiled", [True, False], ids=["kernels", "torch-ops"])
def test_int8_linear_is_the_integer_product_scaled_back(int8_ops: Int8Kernels, compiled: bool) -> None:
    layer, weight, bias = _layer(int8_ops if compiled else None)
    x = _rows(torch.float32)
    y = layer(x)
    # Reference in float64 from the same integers: (q_x - 128) . q_w * s_x * s_w + b.
    qx, sx = quantize_rows_torch(x)
    qw, sw = quantize_weight(weight, layer.weight_max)  # 63 on oneDNN's kernel without VNNI (its int16 pairs)
    exact = (qx.double() - ZERO_POINT) @ qw.double().T * sx.double() * sw.double() + bias.double()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    # And close to the float layer: per-row activation scales keep small rows accurate too.
    ref = F.linear(x, weight, bias)
    rel = (y - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max() < 0.05, rel


def test_each_row_is_quantized_on_its_own(int8_ops: Int8Kernels) -> None:
    """A request's output must not depend on what else is in the batch: one row alone gives the
    bits it gives in a batch beside rows a thousand times larger (a per-tensor activation scale
    would crush the small row)."""
    layer, _, _ = _layer(int8_ops)
    x = _rows(torch.bfloat16)
    batched = layer(x)
    for i in range(x.shape[0]):
        assert torch.equal(layer(x[i : i + 1]), batched[i : i + 1]), i


def test_quantization_setting_is_checked_and_reaches_the_runner(tiny_llama) -> None:
    with pytest.raises(ValueError, match="quantization 'int4' is unknown; choose int8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization int8 runs on a CPU only"):
        EngineConfig(quantization="int8", device="cuda")
    args = _parser().parse_args(["serve", "--quantization", "int8"])
    assert isinstance(args, argparse.Namespace) and EngineConfig(**engine_kwargs(args)).quantization == "int8"
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama), dtype="float32", quantization="int8", max_total_tokens=256, max_running_requests=2))
    layer = runner.model.model.layers[0]
    linears = [layer.self_attn.qkv, layer.self_attn.o_proj.packed, layer.mlp.gate_up, layer.mlp.down_proj.packed, runner.model.packed_head]
    assert all(isinstance(m, Int8Linear) for m in linears)


@pytest.mark.parametrize(("model", "dtype"), [("tiny_llama", "float32"), ("tiny_llama", "bfloat16"), ("tiny_qwen2", "bfloat16")])
def test_smoothing_changes_no_unquantized_output(request: pytest.FixtureRequest, model: str, dtype: str) -> None:
    """The fold divides each input channel by a power of two where it is produced (RMSNorm weight,
    up_proj's rows) and multiplies the consuming weight columns by it: every product, hence every
    logit, is the same bits as before (Qwen2: q/k/v biases, which the fold leaves alone)."""
    path = request.getfixturevalue(model)
    runner = ModelRunner(RunnerConfig(model_path=str(path), dtype=dtype, cpu_kernels=False, max_total_tokens=256, max_running_requests=2))
    layer = runner.model.model.layers[0]
    watched = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight]
    before = [t.clone() for t in watched]
    ids = list(range(3, 40))
    reference = all_logits(runner, ids)
    smooth(runner.model)
    assert all(not torch.equal(t, b) for t, b in zip(watched, before))  # the scales were folded in
    assert torch.equal(all_logits(runner, ids), reference)


# --- the default model against itself unquantized -------------------------------------------------------


def _runner(dtype: str, quantization: str | None) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=None, dtype=dtype, quantization=quantization, max_total_tokens=2048, max_running_requests=len(GREEDY_PROMPTS)))


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir) -> tuple[ModelRunner, ModelRunner, AutoTokenizer]:
    # The converted directory's tokenizer.json: the same ids as the GGUF's tokenizer, about 4 s faster to load.
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    # bfloat16 where the CPU computes it natively (the mode int8 is compared with in BENCHMARKS.md).
    dtype = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    return _runner(dtype, None), _runner(dtype, "int8"), tokenizer


def test_int8_logits_stay_near_the_unquantized_model(smollm2_pair) -> None:
    base, quantized, tokenizer = smollm2_pair
    assert isinstance(quantized.model.packed_head, Int8Linear) and not isinstance(base.model.packed_head, Int8Linear)
    for prompt in PARITY_PROMPTS:
        ids = tokenizer.encode(prompt)
        ref, got = all_logits(base, ids), all_logits(quantized, ids)
        error = (got - ref).abs()
        assert error.max() <= MAX_LOGIT_ERROR and error.mean() <= MEAN_LOGIT_ERROR, (prompt, error.max(), error.mean())
        assert error.max() > 0  # really the quantized path


def test_int8_greedy_choices_agree_with_the_unquantized_model(smollm2_pair) -> None:
    """Teacher forcing: at each step of the unquantized model's own greedy continuation, does the
    int8 model pick the same next token? (Free-running outputs part at the first difference and
    would compare different texts after it.)"""
    base, quantized, tokenizer = smollm2_pair
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    params = [SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)] * len(prompts)
    agree = 0
    for prompt, out in zip(prompts, generate(base, prompts, params)):
        ids = prompt + out.output_ids
        steps = slice(len(prompt) - 1, len(ids) - 1)  # the logits that chose each output token
        ref_choice = all_logits(base, ids)[steps].argmax(-1)
        agree += int((all_logits(quantized, ids)[steps].argmax(-1) == ref_choice).sum())
    total = len(prompts) * GREEDY_TOKENS
    assert agree / total >= MIN_GREEDY_AGREEMENT, f"{agree}/{total}"
