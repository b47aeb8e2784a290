"""Linear layers that keep a GGUF file's quantized blocks (`--quantization gguf`), on a CPU.

The GGUF loader (gpu/gguf_loader.py) dequantizes a file's weights into a checkpoint directory, so
by default a Q4_1 model computes with float weights that are 4-7x the bytes it was shipped as.
With `quantization="gguf"`, `pack_for_cpu` (gpu/packed_linear.py) builds every linear layer from
the file's own blocks instead: 32 weights of one output row, w = d * u + m (`BlockWeights`),
multiplied as they are by gpu/csrc/gguf_matmul.cpp (AVX512-VNNI or AVX2) with the activations
quantized per 32 inputs, as llama.cpp does. Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K and Q8_0 have that
form (`KEPT`); the 4-bit blocks stay 4-bit in memory and a decode step reads them once. Block types
without it (Q6_K, Q3_K and Q2_K scale 16 weights at a time; IQ codes are not linear) are
requantized to 8-bit blocks at load. On a CPU with neither AVX512-VNNI nor AVX2 the same arithmetic
runs as torch ops on the dequantized weights (correct, not fast). BENCHMARKS.md gives its speed and
error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize
from torch import nn

log = logging.getLogger(__name__)

GROUP = 32  # weights per GGUF block
BLOCK_ROWS = 64  # output rows per block of gpu/csrc/gguf_matmul.cpp's layout


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """One weight matrix [N, K] as GGUF blocks: w[n, k] = d[n, k // 32] * u[n, k] + m[n, k // 32]."""

    u: np.ndarray  # uint8 [N, K]: u < 2^bits
    d: np.ndarray  # float16 [N, K / 32]
    m: np.ndarray  # float16 [N, K / 32]
    bits: int  # 4 (held two to a byte), 5 or 8 (a byte each)

    def dequantize(self) -> torch.Tensor:
        u = self.u.astype(np.float32).reshape(self.u.shape[0], -1, GROUP)
        w = u * self.d[:, :, None].astype(np.float32) + self.m[:, :, None].astype(np.float32)
        return torch.from_numpy(w.reshape(self.u.shape))

    def widened(self, bits: int) -> BlockWeights:
        """The same blocks as codes of `bits` >= self.bits: to fuse with wider blocks."""
        return BlockWeights(self.u, self.d, self.m, bits)

    def rows(self, order: np.ndarray) -> BlockWeights:
        return BlockWeights(self.u[order], self.d[order], self.m[order], self.bits)


def blocks_from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int], name: str = "the tensor") -> BlockWeights:
    """A GGUF tensor's raw bytes ([N, bytes per row] uint8, as gguf's reader gives them) as blocks;
    `name` says which tensor in the error for a float one.

    The types in KEPT are kept: the same u, and the same d and m but that a K-quant's d * sc_j and
    dmin * m_j are rounded to float16. Other block types (Q6_K and Q3_K with 16-weight sub-blocks,
    Q2_K, the IQ types, ...) are requantized from gguf's dequantization to 8-bit blocks with their
    own minimum, whose step is a 255th of each 32 weights' range."""
    quant = GGMLQuantizationType[type_name]
    if GGML_QUANT_SIZES[quant][0] == 1:  # F32, F16, BF16 and the integer types: a value per element
        raise ValueError(
            f"--quantization gguf keeps a GGUF file's quantized blocks; {name} is {type_name}, not quantized "
            "(load it without --quantization, or with --quantization int8)"
        )
    rows, cols = shape
    if type_name not in KEPT:
        return requantized(np.asarray(dequantize(data, quant), np.float32).reshape(rows, cols))
    bits, unpack = KEPT[type_name]
    elements, block_bytes = GGML_QUANT_SIZES[quant]
    u, d, m = unpack(np.ascontiguousarray(data).reshape(rows, cols // elements, block_bytes))
    return BlockWeights(u.reshape(rows, cols), d.reshape(rows, -1), m.reshape(rows, -1), bits)


Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]  # u, d, m of [rows, GGUF blocks, ...]


def _float16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at : at + 2].copy().view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """n bytes as 2n values: the low nibbles first, then the high ones (GGUF's order in a block)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of a block's 32-bit qh is weight j's fifth bit."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


# In Q4_0, Q5_0 and Q8_0, m = -offset * d is exact in float16 (d times a power of two).
def _q4_0(raw: np.ndarray) -> Unpacked:
    d = _float16(raw, 0)
    return _nibbles(raw[..., 2:]), d, d * np.float16(-8)


def _q4_1(raw: np.ndarray) -> Unpacked:
    return _nibbles(raw[..., 4:]), _float16(raw, 0), _float16(raw, 2)


def _q5_0(raw: np.ndarray) -> Unpacked:
    d = _float16(raw, 0)
    return _nibbles(raw[..., 6:]) | _fifth_bits(raw[..., 2:6]), d, d * np.float16(-16)


def _q5_1(raw: np.ndarray) -> Unpacked:
    return _nibbles(raw[..., 8:]) | _fifth_bits(raw[..., 4:8]), _float16(raw, 0), _float16(raw, 2)


def _q8_0(raw: np.ndarray) -> Unpacked:
    d = _float16(raw, 0)
    return raw[..., 2:] ^ 0x80, d, d * np.float16(-128)  # an int8 q's bits xor 0x80 are q + 128


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: eight sub-blocks of 32 per 256, w = d sc_j q - dmin m_j with 6-bit sc_j and m_j."""
    rows, blocks = raw.shape[:2]
    sc, mins = (v.reshape(rows, blocks, 8) for v in Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12)))
    d, dmin = (_float16(raw, at).astype(np.float32)[..., None] for at in (0, 2))
    return (d * sc).astype(np.float16), (-dmin * mins).astype(np.float16)


def _q4_k(raw: np.ndarray) -> Unpacked:
    rows, blocks = raw.shape[:2]
    # Each 32 bytes hold sub-block 2c in their low nibbles and 2c + 1 in their high ones.
    return (_nibbles(raw[..., 16:].reshape(rows, blocks, 4, 32)), *_k_scales(raw))


def _q5_k(raw: np.ndarray) -> Unpacked:
    rows, blocks = raw.shape[:2]
    low = _nibbles(raw[..., 48:].reshape(rows, blocks, 4, 32)).reshape(rows, blocks, 8, 32)
    # Bit j of qh's byte i is the fifth bit of weight i in sub-block j.
    fifth = (raw[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return (low | (fifth << 4), *_k_scales(raw))


KEPT: dict[str, tuple[int, Callable[[np.ndarray], Unpacked]]] = {
    "Q4_0": (4, _q4_0),
    "Q4_1": (4, _q4_1),
    "Q4_K": (4, _q4_k),
    "Q5_0": (5, _q5_0),
    "Q5_1": (5, _q5_1),
    "Q5_K": (5, _q5_k),
    "Q8_0": (8, _q8_0),
}


def requantized(weights: np.ndarray) -> BlockWeights:
    """[N, K] float weights as 8-bit blocks: per 32, m = min, d = (max - min) / 255 (both float16)."""
    rows, cols = weights.shape
    w = weights.reshape(rows, cols // GROUP, GROUP)
    low = w.min(axis=2).astype(np.float16)
    low32 = low.astype(np.float32)
    scale = ((w.max(axis=2) - low32) / 255).astype(np.float16)
    step = scale.astype(np.float32)[:, :, None]
    codes = np.divide(w - low32[:, :, None], step, out=np.zeros_like(w), where=step > 0)
    u = np.clip(np.rint(codes), 0, 255).astype(np.uint8)
    return BlockWeights(u.reshape(rows, cols), scale, low, 8)


def concat(parts: list[BlockWeights]) -> BlockWeights:
    """Layers fused along their outputs; mixed widths all take the widest."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    parts = [p.widened(bits) for p in parts]
    return BlockWeights(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("u", "d", "m")), parts[0].bits)


def pack(blocks: BlockWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpu/csrc/gguf_matmul.cpp's layout: u as [N/64][K/8 or K/4][64][4] (4-bit: the low nibble from
    one group of four inputs, the high from the next), d and m as [N/64][K/32][64]."""
    rows, cols = blocks.u.shape
    padded = -(-rows // BLOCK_ROWS) * BLOCK_ROWS
    u = np.zeros((padded, cols), np.uint8)
    u[:rows] = blocks.u
    scale = np.zeros((padded, cols // GROUP), np.float16)
    minimum = np.zeros_like(scale)
    scale[:rows], minimum[:rows] = blocks.d, blocks.m
    tiles = padded // BLOCK_ROWS
    if blocks.bits == 4:
        pairs = u.reshape(tiles, BLOCK_ROWS, cols // 8, 2, 4)
        u = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)
    weight = u.reshape(tiles, BLOCK_ROWS, -1, 4).transpose(0, 2, 1, 3)
    per_tile = (tiles, BLOCK_ROWS, cols // GROUP)
    return (
        torch.from_numpy(np.ascontiguousarray(weight)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(per_tile).transpose(0, 2, 1))),
        torch.from_numpy(np.ascontiguousarray(minimum.reshape(per_tile).transpose(0, 2, 1))),
    )


def quantize_blocks_torch(x: torch.Tensor) -> torch.Tensor:
    """The activations as the kernel quantizes them, dequantized: per 32 inputs, a = max|x| / 127,
    round_half_even(x / a) * a (0 where the block is all zero)."""
    x32 = x.float().reshape(x.shape[0], -1, GROUP)
    a = x32.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(a > 0, x32 / torch.where(a > 0, a, 1), 0).round()
    return (q * a).reshape(x.shape)


@cache
def kernel_available() -> bool:
    from gpu.packed_linear import int8_kernels

    return int8_kernels() is not None and torch.ops.actorserve.gguf_matmul_available()


class GgufLinear(nn.Module):
    """y = x W^T + b with W as GGUF blocks; the concatenation of one or more layers'."""

    def __init__(self, parts: list[BlockWeights], biases: list[torch.Tensor | None]):
        super().__init__()
        blocks = concat(parts)
        self.out_features = blocks.u.shape[0]
        self.bits = blocks.bits
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.float() if b is not None else torch.zeros(p.u.shape[0]) for p, b in zip(parts, biases)])
        self.register_buffer("bias", bias, persistent=False)
        self.kernel = kernel_available()
        if self.kernel:
            weight, scale, minimum = pack(blocks)
            self.register_buffer("weight", weight, persistent=False)
            self.register_buffer("scale", scale, persistent=False)
            self.register_buffer("minimum", minimum, persistent=False)
        else:
            self.register_buffer("weight", blocks.dequantize(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return torch.ops.actorserve.gguf_matmul(x.contiguous(), self.weight, self.scale, self.minimum, self.bias, self.out_features, self.bits)
        y = quantize_blocks_torch(x) @ self.weight.T
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class GgufBlockSource:
    """A GGUF file's linear weights as blocks, by their Hugging Face names (rows in the checkpoint
    directory's order: llama's q/k rows un-permuted as gpu/gguf_loader.py does). Where the blocks
    lie comes from the tensor index that the file's conversion wrote beside its checkpoint."""

    def __init__(self, path: Path):
        from gpu.gguf_loader import ARCHITECTURES, gguf_to_hf_dir, hf_tensor_name, read_tensor_index

        hf_dir = gguf_to_hf_dir(path)
        index = read_tensor_index(hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        self.path = path
        self._file = np.memmap(path, np.uint8, mode="r")
        # llama.cpp's llama converter permutes q/k rows per head; the blocks come back in HF's order.
        self._permuted_heads = (
            {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
            if ARCHITECTURES[index.architecture].permuted_qk
            else {}
        )
        self._tensors = {hf_tensor_name(t.name): t for t in index.tensors}
        self._requantized_types: set[str] = set()

    def names(self) -> list[str]:
        return list(self._tensors)

    def blocks(self, name: str) -> BlockWeights:
        from gpu.gguf_loader import unpermute_rows

        tensor = self._tensors[name]
        cols, rows = tensor.shape  # GGUF lists the fastest dimension first
        data = self._file[tensor.offset : tensor.offset + tensor.nbytes].reshape(rows, -1)
        blocks = blocks_from_gguf(data, tensor.type, (rows, cols), f"{self.path.name}'s {tensor.name}")
        if tensor.type not in KEPT and tensor.type not in self._requantized_types:
            self._requantized_types.add(tensor.type)
            log.info("%s: %s tensors requantized to 8-bit blocks (only %s are kept as stored)", self.path.name, tensor.type, ", ".join(KEPT))
        heads = next((n for leaf, n in self._permuted_heads.items() if f".{leaf}." in tensor.name), None)
        return blocks if heads is None else blocks.rows(unpermute_rows(np.arange(rows), heads))
