"""The compiled CPU kernels (gpu/cpu_ops.py) attending K/V where it lies in the pool: no buckets,
gathers or masks, where the reference path in gpu/attention.py copies every request's keys out in
every layer. Decode batches take one query per request (its shared prefix, if any, is attended
and merged by gpu/shared_prefix.py); any other batch attends causally per new token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.cpu_ops import DecodeAttention, ExtendAttention
from gpu.forward_batch import ForwardBatch


@dataclass(slots=True)
class PagedDecode:
    """Request i attends to the slots at positions key_begin[i] .. key_end[i] - 1 of its table
    row (key_begin: the shared prefix it skips)."""

    kernel: DecodeAttention
    req_rows: torch.Tensor  # [batch] int64
    key_begin: torch.Tensor  # [batch] int64
    key_end: torch.Tensor  # [batch] int64

    @classmethod
    def plan(cls, kernel: DecodeAttention, batch: ForwardBatch, skip: list[int]) -> PagedDecode:
        return cls(kernel, batch.req_rows, _int64(skip), _int64(batch.seq_lens))

    def attend(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs [batch, heads, dim] and their log-sum-exps [batch, heads]."""
        return self.kernel(q.contiguous(), k_pool, v_pool, req_to_token, self.req_rows, self.key_begin, self.key_end, scale)


@dataclass(slots=True)
class PagedExtend:
    """Request i's new tokens are positions prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1,
    each attending causally."""

    kernel: ExtendAttention
    req_rows: torch.Tensor  # [batch] int64
    prefix_lens: torch.Tensor  # [batch] int64
    extend_lens: torch.Tensor  # [batch] int64

    @classmethod
    def plan(cls, kernel: ExtendAttention, batch: ForwardBatch) -> PagedExtend:
        return cls(kernel, batch.req_rows, _int64(batch.prefix_lens), _int64(batch.extend_lens))

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor, scale: float) -> torch.Tensor:
        return self.kernel(q.contiguous(), k_pool, v_pool, req_to_token, self.req_rows, self.prefix_lens, self.extend_lens, scale)


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
