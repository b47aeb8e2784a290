"""8-bit KV cache rows (`--kv-cache-dtype int8`), in torch: the reference for the CPU kernels
(gpu/csrc/kv_rows.h) and the torch path's reads and writes.

Each head's row of `dim` values is rounded to int8 against its own scale, max(|x|) / 127, and
the scale follows the values as the row's last four bytes (a float32): a pool of
`[slots, kv_heads, dim + 4]` int8. Rows that carry their scale keep every copy of pool rows (the
host tier, the torch path's gathers) a copy of bytes. llama.cpp's q8_0 cache rounds the same way,
per 32 values; one scale per head row costs 4 bytes in 68 at head size 64.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
_TINY = torch.finfo(torch.float32).tiny  # the least scale: a zero row divides safely


def row_width(head_dim: int) -> int:
    """Bytes of one head's row in an int8 pool."""
    return head_dim + SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., dim] floats -> [..., dim + 4] int8 rows with their scales."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / 127
    rows = torch.empty((*x.shape[:-1], row_width(x.shape[-1])), dtype=torch.int8, device=x.device)
    rows[..., : x.shape[-1]] = torch.round(x / scale).to(torch.int8)
    rows[..., x.shape[-1] :] = scale.view(torch.int8)
    return rows


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., dim + 4] int8 rows -> [..., dim] in `dtype` (through float32)."""
    dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., dim:].contiguous().view(torch.float32)
    return (rows[..., :dim].float() * scale).to(dtype)
