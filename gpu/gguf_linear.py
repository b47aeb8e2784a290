"""Linear layers that keep a GGUF file's quantized blocks (`--quantization gguf`), on a CPU.

The GGUF loader (gpu/gguf_loader.py) dequantizes a file's weights into a checkpoint directory, so
by default a Q4_1 model computes with float weights that are 4-7x the bytes it was shipped as.
With `quantization="gguf"`, `pack_for_cpu` (gpu/packed_linear.py) builds every linear layer from
the file's own blocks instead, Q4_0, Q4_1 or Q8_0: 32 weights of one output row, w = d * u + m
(`BlockWeights`), multiplied as they are by gpu/csrc/gguf_matmul.cpp (AVX512-VNNI or AVX2) with
the activations quantized per 32 inputs, as llama.cpp does. The 4-bit blocks stay 4-bit in memory;
a decode step reads them once. On a CPU with neither, the same arithmetic runs as torch ops on the
dequantized weights (correct, not fast). BENCHMARKS.md gives its speed and error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

GROUP = 32  # weights per GGUF block
BLOCK_ROWS = 64  # output rows per block of gpu/csrc/gguf_matmul.cpp's layout
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """One weight matrix [N, K] as GGUF blocks: w[n, k] = d[n, k // 32] * u[n, k] + m[n, k // 32]."""

    u: np.ndarray  # uint8 [N, K]: 0..15 when bits is 4
    d: np.ndarray  # float16 [N, K / 32]
    m: np.ndarray  # float16 [N, K / 32]
    bits: int  # 4 or 8

    def dequantize(self) -> torch.Tensor:
        u = self.u.astype(np.float32).reshape(self.u.shape[0], -1, GROUP)
        w = u * self.d[:, :, None].astype(np.float32) + self.m[:, :, None].astype(np.float32)
        return torch.from_numpy(w.reshape(self.u.shape))

    def widened(self) -> BlockWeights:
        """The same blocks held one u per byte: to fuse with 8-bit blocks."""
        return BlockWeights(self.u, self.d, self.m, 8)

    def rows(self, order: np.ndarray) -> BlockWeights:
        return BlockWeights(self.u[order], self.d[order], self.m[order], self.bits)


def blocks_from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockWeights:
    """A GGUF tensor's raw bytes ([N, bytes per row] uint8, as gguf's reader gives them) as blocks."""
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF {type_name} blocks cannot be kept (supported: {', '.join(SUPPORTED_TYPES)})")
    rows, cols = shape
    raw = np.ascontiguousarray(data).reshape(rows, cols // GROUP, -1)
    d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    # m = -128 d and -8 d are exact in float16 (a power of two times d).
    if type_name == "Q8_0":
        q = raw[:, :, 2:].copy().view(np.int8).astype(np.int16)
        return BlockWeights((q + 128).astype(np.uint8).reshape(rows, cols), d, d * np.float16(-128), 8)
    if type_name == "Q4_1":
        m, nibbles = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0], raw[:, :, 4:]
    else:  # Q4_0: w = d * (q - 8)
        m, nibbles = d * np.float16(-8), raw[:, :, 2:]
    # Elements 0..15 of a block are the low nibbles of its 16 bytes, 16..31 the high ones.
    u = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)
    return BlockWeights(u.reshape(rows, cols), d, m, 4)


def concat(parts: list[BlockWeights]) -> BlockWeights:
    """Layers fused along their outputs; mixed widths all become 8-bit."""
    if len(parts) == 1:
        return parts[0]
    if len({p.bits for p in parts}) > 1:
        parts = [p.widened() for p in parts]
    return BlockWeights(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("u", "d", "m")), parts[0].bits)


def pack(blocks: BlockWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpu/csrc/gguf_matmul.cpp's layout: u as [N/64][K*bits/32][64][4] (4-bit: the low nibble from
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
            return torch.ops.actorserve.gguf_matmul(x.contiguous(), self.weight, self.scale, self.minimum, self.bias, self.out_features)
        y = quantize_blocks_torch(x) @ self.weight.T
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class GgufBlockSource:
    """A GGUF file's linear weights as blocks, by their Hugging Face names (rows in the checkpoint
    directory's order: llama's q/k rows un-permuted as gpu/gguf_loader.py does)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        from gpu.gguf_loader import ARCHITECTURES, hf_tensor_name, read_metadata, uniform

        reader = GGUFReader(path)
        meta = read_metadata(reader)
        self.path = path
        arch = meta["general.architecture"]
        heads = meta[f"{arch}.attention.head_count"]
        # llama.cpp's llama converter permutes q/k rows per head; the blocks come back in HF's order.
        self._permuted_heads = (
            {"attn_q": heads, "attn_k": uniform(meta.get(f"{arch}.attention.head_count_kv", heads), "attention.head_count_kv")}
            if ARCHITECTURES[arch].permuted_qk
            else {}
        )
        self._tensors = {hf_tensor_name(t.name): t for t in reader.tensors}

    def names(self) -> list[str]:
        return list(self._tensors)

    def blocks(self, name: str) -> BlockWeights:
        from gpu.gguf_loader import unpermute_rows

        tensor = self._tensors[name]
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists the fastest dimension first
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise ValueError(
                f"--quantization gguf keeps Q4_0, Q4_1 and Q8_0 blocks; {self.path.name}'s {tensor.name} is {type_name} "
                "(load it without --quantization, or with --quantization int8)"
            )
        blocks = blocks_from_gguf(tensor.data, type_name, (rows, cols))
        heads = next((n for leaf, n in self._permuted_heads.items() if f".{leaf}." in tensor.name), None)
        return blocks if heads is None else blocks.rows(unpermute_rows(np.arange(rows), heads))
