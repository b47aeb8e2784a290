"""Linear layers with weights reordered once for oneDNN, on a CPU.

`F.linear` on a CPU reorders the weight into oneDNN's blocked layout inside every call; doing it
once at load time makes decode (a few rows) about 2x faster and batches of 64 rows about 15%
(bench/forward.py's shapes, bfloat16). q/k/v and gate/up are also fused into one matmul each, which
reads the input once and makes one larger call instead of several small ones.

`pack_for_cpu(model)` rewrites a loaded `CausalLM` in place: the fused and packed weights replace
the modules' own (so memory does not double), and the model's forward takes the packed path
wherever a module has one. Only float32 and bfloat16 are packed (oneDNN's CPU formats).

With `quantization="int8"` the same layers become `Int8Linear`s instead: int8 weights (one scale
per output channel) and activations quantized per row (per token) at every call. On a CPU with
AVX512-VNNI or AVX2 gpu/csrc/int8_matmul.cpp multiplies them at every batch size, bit for bit the
result its arithmetic defines (faster than oneDNN's u8 x s8 kernel on SmolLM2's shapes from 1 to
512 rows with VNNI, up to 64 rows with AVX2, where oneDNN's needs 7-bit weights); elsewhere
oneDNN's kernel does. Each token's scale is its own, so a request's output does not depend on what
else is in the batch; SmoothQuant scales folded in first (gpu/int8_smoothing.py) keep a few large
input channels from setting that scale. The output layer is quantized too: it is the largest
matmul of a decode step. See BENCHMARKS.md for its speed and its error against the unquantized
model.

With `quantization="gguf"` they become GgufLinears (gpu/gguf_linear.py), built from the blocks of
the GGUF file the model was loaded from instead of from its dequantized weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu_ops import BUILD_DIR, CSRC, build_extension
from gpu.gguf_linear import GgufBlockSource, GgufLinear
from gpu.int8_smoothing import smooth

log = logging.getLogger(__name__)

PACKABLE = (torch.float32, torch.bfloat16)
ZERO_POINT = 128  # oneDNN's fast int8 kernels take unsigned activations: q + 128


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    # oneDNN refuses to reorder bfloat16 weights on CPUs without its bf16 instructions (AVX2 only).
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """y = x W^T + b with W reordered for oneDNN; the concatenation of one or more layers'."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        super().__init__()
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None), persistent=False)
        self.register_buffer("bias", _concat_biases(weight, weights, biases), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@dataclass(frozen=True, slots=True)
class Int8Matmul:
    """gpu/csrc/int8_matmul.cpp (AVX512-VNNI or AVX2): quantize, multiply and scale back in one
    call. `pack(q)` -> (weight in the kernel's layout, zero-point offsets);
    `multiply(x, packed, offsets, weight_scale, bias, out_features)`."""

    pack: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    multiply: Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class Int8Kernels:
    """gpu/csrc/quantize.cpp: one pass each for what quantize_rows_torch / dequantize_rows_torch do
    (oneDNN's path); and our matmul kernel where the CPU has AVX512-VNNI or AVX2."""

    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dequantize_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.dtype], torch.Tensor]
    matmul: Int8Matmul | None = None


@cache
def int8_kernels() -> Int8Kernels | None:
    """The compiled int8 kernels, or None (the torch ops, reason logged once)."""
    try:
        build_int8_ops()
    except Exception as exc:  # a missing compiler surfaces as any of several error types
        log.warning("int8 quantization kernels unavailable, using torch ops: %s", exc)
        return None
    ops = torch.ops.actorserve
    matmul = Int8Matmul(ops.int8_pack_weight, ops.int8_matmul) if ops.int8_matmul_available() else None
    return Int8Kernels(ops.quantize_rows, ops.dequantize_rows, matmul)


class Int8Linear(nn.Module):
    """y = x W^T + b with W as int8 (a scale per output row) and x quantized per row at each call;
    the concatenation of one or more layers'. The weight is held in one layout: our kernel's where
    `kernels` has it, else oneDNN's. `kernels` quantize and scale back in one pass each; without
    them the same arithmetic runs as torch ops. `weight_max` overrides the weights' range (7 bits
    on oneDNN's path, whose kernel may lack VNNI; 8 with our kernel, exact on either of its paths)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], kernels: Int8Kernels | None,
                 weight_max: int | None = None):
        super().__init__()
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.kernels = kernels
        self.kernel = kernels.matmul if kernels is not None else None
        if weight_max is None:
            weight_max = WEIGHT_MAX if self.kernel is not None else ONEDNN_WEIGHT_MAX
        self.weight_max = weight_max
        q, scale = quantize_weight(weight, self.weight_max)
        self.register_buffer("weight_scale", scale, persistent=False)
        bias = _concat_biases(weight, weights, biases)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self.out_features = q.shape[0]
        if self.kernel is not None:
            packed, offsets = self.kernel.pack(q)
            self.register_buffer("kernel_weight", packed, persistent=False)
            self.register_buffer("kernel_offsets", offsets, persistent=False)
        else:
            self.register_buffer("weight", torch.ops.onednn.qlinear_prepack(q, None), persistent=False)
            self.register_buffer("weight_zero_point", torch.zeros(q.shape[0], dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.multiply(x.contiguous(), self.kernel_weight, self.kernel_offsets, self.weight_scale, self.bias, self.out_features)
        quantize = self.kernels.quantize_rows if self.kernels is not None else quantize_rows_torch
        dequantize = self.kernels.dequantize_rows if self.kernels is not None else dequantize_rows_torch
        q, row_scale = quantize(x.contiguous())
        rows = q.shape[0]
        # oneDNN builds an int8 primitive per row count (~1.7 ms here, more than the matmul of a
        # few hundred rows), and batches change size every step: pad to a few buckets of sizes.
        # Padding rows are zeros; integer dot products are exact, so no row changes.
        padded = row_bucket(rows)
        if padded != rows:
            q = torch.cat([q, q.new_full((padded - rows, q.shape[1]), ZERO_POINT)])
        # Activation scale 1: the float32 result is the integer dot product times the weight's scale.
        product = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, ZERO_POINT, self.weight, self.weight_scale, self.weight_zero_point, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return dequantize(product[:rows], row_scale, self.bias, x.dtype)


CpuLinear = PackedLinear | Int8Linear | GgufLinear
ROW_STEP = 128  # above this many rows, buckets are its multiples; below, powers of two


def row_bucket(rows: int) -> int:
    if rows > ROW_STEP:
        return -(-rows // ROW_STEP) * ROW_STEP
    return 1 << max(rows - 1, 0).bit_length()


def build_int8_ops() -> None:
    """Build (when needed) and load the int8 extension: its own build folder, which nothing else
    loads or rebuilds; gpu/csrc/decode_layers.cpp calls the CPU kernels' extension (gpu/cpu_ops.py)."""
    sources = [CSRC / name for name in ("quantize.cpp", "int8_matmul.cpp", "gguf_matmul.cpp", "decode_layers.cpp")]
    build_extension("actorserve_int8_ops", sources, BUILD_DIR.with_name("int8_ops"))


def can_quantize(device: torch.device, quantization: str = "int8") -> bool:
    if quantization == "gguf":  # gpu/gguf_linear.py: its kernel, or torch ops where it cannot build
        return device.type == "cpu"
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


WEIGHT_MAX = 127
# oneDNN's int8 kernel on a CPU without VNNI (vpmaddubsw) sums two u8 x s8 products into int16 with
# saturation: activations up to 255 against weights up to 127 overflow it (logits off by up to 10
# on SmolLM2, one greedy step in eight changed). Weights of 7 bits keep every pair in range, as
# PyTorch's reduce_range does for the activations; our kernel's AVX2 path moves the weights' sign
# onto the activations instead, and keeps 8 bits.
ONEDNN_WEIGHT_MAX = 63


def quantize_weight(weight: torch.Tensor, max_level: int = WEIGHT_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q in [-max_level, max_level], float32 scale per row)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / max_level
    return (w / scale[:, None]).round().clamp(-max_level, max_level).to(torch.int8), scale


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpu/csrc/quantize.cpp's quantize_rows as torch ops: (round(x / s) + 128 as uint8, s) with
    s = max|row| / 127 per row."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (x32 / scale).round().add(ZERO_POINT).to(torch.uint8), scale


def dequantize_rows_torch(product: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    y = product * scale
    return (y if bias is None else y + bias).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: CpuLinear | None) -> torch.Tensor:
    return packed(x) if packed is not None else F.linear(x, weight, bias)


def pack_for_cpu(model: nn.Module, quantization: str | None = None, gguf: GgufBlockSource | None = None) -> None:
    """Fuse and pack every linear layer of a loaded CausalLM (gpu/models.py); with quantization
    "int8", as Int8Linears, after SmoothQuant's scales are folded in (gpu/int8_smoothing.py: one
    calibration forward of the still unquantized model); with "gguf", as GgufLinears made from the
    blocks of the GGUF file the model was loaded from (`gguf`)."""
    kernels = int8_kernels() if quantization == "int8" else None
    if quantization == "int8":
        smooth(model)
    if quantization == "gguf" and gguf is None:
        raise ValueError("quantization gguf needs the GGUF file the model was loaded from")

    def fused_layers(prefix: str, *layers: tuple[str, nn.Module], tp_bias: bool = True) -> CpuLinear:
        biases = [_bias(layer) if tp_bias else None for _, layer in layers]
        if quantization == "gguf":
            return GgufLinear([gguf.blocks(f"{prefix}{name}.weight") for name, _ in layers], biases)
        weights = [layer.weight.detach() for _, layer in layers]
        return Int8Linear(weights, biases, kernels) if quantization == "int8" else PackedLinear(weights, biases)

    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{i}."
        attn.qkv = fused_layers(prefix, ("self_attn.q_proj", attn.q_proj), ("self_attn.k_proj", attn.k_proj), ("self_attn.v_proj", attn.v_proj))
        mlp.gate_up = fused_layers(prefix, ("mlp.gate_proj", mlp.gate_proj), ("mlp.up_proj", mlp.up_proj))
        # Under tensor parallelism a row-parallel layer's bias is added once, after the all-reduce.
        for name, row_parallel in (("self_attn.o_proj", attn.o_proj), ("mlp.down_proj", mlp.down_proj)):
            row_parallel.packed = fused_layers(prefix, (name, row_parallel), tp_bias=row_parallel.tp.size == 1)
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            _drop_weight(module)
    # The output layer gets its own packed copy when tied: the embedding lookup needs the plain rows.
    if quantization == "gguf":
        head = "model.embed_tokens" if model.config.tie_word_embeddings else "lm_head"
        model.packed_head = GgufLinear([gguf.blocks(f"{head}.weight")], [None])
    else:
        weight = model.output_weight().detach()
        model.packed_head = Int8Linear([weight], [None], kernels) if quantization == "int8" else PackedLinear([weight], [None])
    if not model.config.tie_word_embeddings:
        _drop_weight(model.lm_head)


def _concat_biases(weight: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else weight.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return None if layer.bias is None else layer.bias.detach()


def _drop_weight(module: nn.Module) -> None:
    """Free a module's own weight once a packed copy replaces it (the bias stays: row-parallel
    layers still add theirs)."""
    module.weight = nn.Parameter(module.weight.detach().new_empty(0), requires_grad=False)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    kernels = int8_kernels()  # what `make setup` runs: the build, ahead of the first int8 model
    if kernels is None:
        print("int8 kernels: unavailable (torch ops)")
    elif kernels.matmul is None:
        print("int8 kernels: built, without the int8 matmul kernel (no AVX2): oneDNN's")
    else:
        print(f"int8 kernels: built, the int8 matmul kernel's paths {torch.ops.actorserve.int8_matmul_widths()} bits")
