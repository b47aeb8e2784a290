"""Attention over the paged KV pool.

`TorchAttention` is the reference backend (CPU and CUDA): it writes the new tokens' K/V into the
pool, gathers each request's whole sequence back through the request-to-token table, and runs
PyTorch SDPA over a padded `[batch, heads, new_tokens, seq_len]` problem. EXTEND, DECODE and MIXED
batches all take the same path; a decode batch is simply one with a single new token per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVBuffers
from runtime.forward_mode import ForwardMode


class AttentionBackend(ABC):
    """Computes attention for one layer of the batch prepared by `init_forward_metadata`."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute what every layer of this forward pass shares (indices, masks)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [tokens, heads, dim], k/v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""


@dataclass(slots=True)
class _TorchMetadata:
    out_cache_loc: torch.Tensor  # [tokens]
    kv_slots: torch.Tensor | None  # [batch, max_seq] slots of each request's sequence (padded with 0)
    mask: torch.Tensor | None  # [batch, 1, max_new, max_seq] True where a query may attend
    # Where packed token t sits in the padded [batch * max_new] layout; None for pure decode.
    pad_index: torch.Tensor | None
    batch_size: int
    max_new: int
    # One request with nothing cached: attend to the new k/v directly with SDPA's causal kernel.
    plain_causal: bool


class TorchAttention(AttentionBackend):
    def __init__(self, kv: KVBuffers, req_to_token: torch.Tensor, scale: float):
        self.kv = kv
        self.req_to_token = req_to_token
        self.scale = scale
        self._meta: _TorchMetadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        if batch.batch_size == 1 and batch.prefix_lens[0] == 0:
            self._meta = _TorchMetadata(batch.out_cache_loc, None, None, None, 1, batch.extend_lens[0], True)
            return
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
        prefix_lens = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
        max_seq = int(max(batch.seq_lens))
        max_new = int(max(batch.extend_lens))
        kv_slots = self.req_to_token[batch.req_rows, :max_seq].to(torch.int64)
        key_pos = torch.arange(max_seq, device=device)
        query_pos = prefix_lens[:, None] + torch.arange(max_new, device=device)[None, :]  # [b, new]
        # Causal within the request and never past its own length. Padded query rows still see
        # key 0, so no row is fully masked (which would make SDPA return NaN).
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
        kv_slots = torch.where(key_pos[None, :] < seq_lens[:, None], kv_slots, torch.zeros_like(kv_slots))
        pad_index = None
        if batch.mode != ForwardMode.DECODE:
            starts = torch.arange(batch.batch_size, device=device) * max_new
            pad_index = torch.cat([starts[i] + torch.arange(n, device=device) for i, n in enumerate(batch.extend_lens)])
        self._meta = _TorchMetadata(
            out_cache_loc=batch.out_cache_loc,
            kv_slots=kv_slots,
            mask=mask[:, None, :, :],
            pad_index=pad_index,
            batch_size=batch.batch_size,
            max_new=max_new,
            plain_causal=False,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "init_forward_metadata must run before forward"
        self.kv.write(layer_id, meta.out_cache_loc, k, v)
        if meta.plain_causal:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=self.scale, enable_gqa=True
            )
            return out[0].transpose(0, 1)
        keys = self.kv.k[layer_id][meta.kv_slots].transpose(1, 2)  # [b, kv_heads, seq, dim]
        values = self.kv.v[layer_id][meta.kv_slots].transpose(1, 2)
        num_heads, head_dim = q.shape[1], q.shape[2]
        queries = self._pad(q, meta).view(meta.batch_size, meta.max_new, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.mask, scale=self.scale, enable_gqa=True
        )  # [b, heads, new, dim]
        out = out.transpose(1, 2).reshape(meta.batch_size * meta.max_new, num_heads, head_dim)
        return out if meta.pad_index is None else out[meta.pad_index]

    @staticmethod
    def _pad(q: torch.Tensor, meta: _TorchMetadata) -> torch.Tensor:
        if meta.pad_index is None:
            return q
        padded = q.new_zeros((meta.batch_size * meta.max_new, q.shape[1], q.shape[2]))
        padded[meta.pad_index] = q
        return padded
