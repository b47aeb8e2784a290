"""Tensor parallelism: the rank's process group and which slice of each weight a rank holds.

Megatron's layout, over `torch.distributed` (gloo on a CPU, NCCL on CUDA):
- attention heads are split across ranks; K/V heads too when there are at least as many as ranks,
  otherwise each rank holds the one K/V head its query heads read (replicated, as SGLang does);
- q/k/v and gate/up projections are column-parallel (a rank computes its own heads and its own
  share of the MLP); o_proj and down_proj are row-parallel (each rank's partial sum is
  all-reduced, then the bias is added once);
- the embedding and the LM head are split by vocabulary (padded to a multiple of the size): a rank
  looks up only its ids and the partial embeddings are all-reduced; the logits of every rank's
  slice are gathered.

`TPGroup` is the rank's view (size 1: no collective at all). `TPLayout` is pure arithmetic over a
`ModelConfig`, so how a checkpoint is sliced is testable without a process group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

from gpu.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's rank in a tensor-parallel group of `size` (`group` None when size is 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup
    # The same ranks, for the header that starts each piece of work: the other ranks wait on it as
    # long as the engine idles, which the group's collective timeout must not end (`make_idle_group`).
    idle_group: Any = None
    # How long rank 0 waits for the others to take a header (dist_timeout_s): a rank stopped before
    # it was back waiting for one would otherwise hold rank 0 for the idle group's timeout.
    header_timeout: datetime.timedelta | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype on every rank)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_header(self, x: torch.Tensor) -> torch.Tensor:
        """`broadcast` over the idle group: what the other ranks wait on between steps."""
        if self.size == 1:
            return x
        if self.idle_group is None:
            return self.broadcast(x)
        if self.rank == 0 and self.header_timeout is not None:
            # gloo sends only to a posted receive: rank 0 waits for every rank to take it.
            torch.distributed.broadcast(x, src=0, group=self.idle_group, async_op=True).wait(timeout=self.header_timeout)
        else:
            torch.distributed.broadcast(x, src=0, group=self.idle_group)
        return x


# How long a rank waits for the next step's header: an idle engine is not a failed one. A rank
# that stops answering mid-step still fails the engine after dist_timeout_s (the step group's), and
# one that does not take a header after as long (rank 0's wait, `TPGroup.header_timeout`).
IDLE_TIMEOUT = datetime.timedelta(days=365)


def make_idle_group(backend: str) -> Any:
    """The idle group over every rank of the initialized default group (each rank calls this once, in the same order)."""
    return torch.distributed.new_group(backend=backend, timeout=IDLE_TIMEOUT)


@dataclass(frozen=True, slots=True)
class TPLayout:
    """The shapes and slices rank `rank` of `size` holds for one model."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    @staticmethod
    def check(config: ModelConfig, size: int) -> str | None:
        """Why `config` cannot be split `size` ways, or None when it can."""
        if size < 1:
            return f"tp_size must be >= 1, got {size}"
        heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
        if heads % size:
            return f"tp_size {size} does not divide the model's {heads} attention heads; choose a tp_size that divides {heads}"
        if kv >= size and kv % size:
            return f"tp_size {size} does not divide the model's {kv} key/value heads; choose a tp_size that divides {kv}"
        if kv < size and size % kv:
            return f"the model's {kv} key/value heads cannot be replicated over tp_size {size}: tp_size must be a multiple of {kv}"
        if inter % size:
            return f"tp_size {size} does not divide the model's intermediate_size {inter}"
        return None

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        kv = self.config.num_kv_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # ranks that share one replicated K/V head

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_shard(self) -> int:
        """Rows of the embedding and LM head per rank (the vocabulary padded to a multiple of size)."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def shard(self, name: str, read: SliceReader) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name`, read through `read` (only its slice)."""
        hd = self.config.head_dim
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ("q_proj", "weight")
        module, kind = leaf[0], leaf[1]
        if self.size == 1:
            return read.rows(0, None)
        if module in ("embed_tokens", "lm_head"):
            start = self.vocab_start
            part = read.rows(start, min(start + self.vocab_shard, self.config.vocab_size))
            return _pad_rows(part, self.vocab_shard)
        if module == "q_proj":
            n = self.num_heads * hd
            return read.rows(self.rank * n, (self.rank + 1) * n)
        if module in ("k_proj", "v_proj"):
            n = self.num_kv_heads * hd
            start = self.first_kv_head * hd
            return read.rows(start, start + n)
        if module in ("gate_proj", "up_proj"):
            n = self.intermediate_size
            return read.rows(self.rank * n, (self.rank + 1) * n)
        if module in ("o_proj", "down_proj") and kind == "weight":
            n = self.num_heads * hd if module == "o_proj" else self.intermediate_size
            return read.columns(self.rank * n, (self.rank + 1) * n)
        return read.rows(0, None)  # norms and row-parallel biases: whole on every rank


class SliceReader:
    """Reads rows or columns of one checkpoint tensor without reading the rest (safetensors slices)."""

    def __init__(self, tensor_slice: Any):
        self._slice = tensor_slice  # safetensors PySafeSlice, or a torch.Tensor

    def rows(self, start: int, end: int | None) -> torch.Tensor:
        return self._slice[start:end]

    def columns(self, start: int, end: int) -> torch.Tensor:
        return self._slice[:, start:end]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])
