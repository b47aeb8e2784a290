"""Attention over the paged KV pool.

`TorchAttention` is the reference backend (CPU and CUDA): it writes the new tokens' K/V into the
pool, gathers each request's whole sequence back through the request-to-token table, and runs
PyTorch SDPA over padded `[requests, heads, new_tokens, seq_len]` problems. EXTEND, DECODE and
MIXED batches all take the same path; a decode batch is simply one with a single new token per
request.

Requests are grouped into length buckets (`plan_buckets`), each padded only to its own longest
sequence: one padding for a whole batch whose contexts range from 33 to 768 tokens makes about half
of the gathered K/V and of the SDPA work padding.

On a CPU, decode attention is memory-bound: the gather (one copy of the batch's K/V per layer)
costs about 1.5x the SDPA call that reads it back, so the keys that buckets do not pad are what
counts. The gathers go into reused buffers (see `TorchAttention.__init__`). Two CPU optimisations
sit beside this path, each in its own module: decode requests behind one cached prefix attend to
it once (gpu/shared_prefix.py), and with `kernels` the compiled kernels read K/V where it lies
instead of gathering it (gpu/paged_attention.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

from gpu.cpu_ops import CpuKernels
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVBuffers
from gpu.paged_attention import PagedDecode, PagedExtend
from gpu.shared_prefix import SharedPrefixes, decode_lse, find_shared_prefixes, merge_prefixes

# A bucket closes when adding the next request would leave less than FILL of its padded
# query-key work useful, unless the waste is under MIN_WASTE pairs: below that an extra bucket
# (one more gather and SDPA call per layer, ~0.1 ms on a CPU) costs more than the padding.
FILL = 0.9
MIN_WASTE = 1024
# Gathered K/V rows per bucket (one request may exceed it alone). Bounds the reused gather
# buffers; splitting there measured no slower than one big bucket.
MAX_KV_ROWS = 32768


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute what every layer of this forward pass shares (indices, masks)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [tokens, heads, dim], k/v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""


def plan_buckets(
    extend_lens: Sequence[int], seq_lens: Sequence[int], fill: float = FILL, min_waste: int = MIN_WASTE, max_rows: int = MAX_KV_ROWS
) -> list[list[int]]:
    """Group request indices into buckets of similar (new tokens, sequence length).

    Greedy over the requests sorted longest first: a bucket's padded work is
    `size * max_new * max_seq` query-key pairs, its useful work the sum of `new * seq`; it also
    closes before it gathers more than `max_rows` K/V rows.
    """
    order = sorted(range(len(seq_lens)), key=lambda i: (-extend_lens[i], -seq_lens[i], i))
    buckets: list[list[int]] = []
    max_new = max_seq = useful = 0
    for i in order:
        new, seq = extend_lens[i], seq_lens[i]
        if buckets:
            grown_new, grown_seq = max(max_new, new), max(max_seq, seq)
            padded = (len(buckets[-1]) + 1) * grown_new * grown_seq
            grown_useful = useful + new * seq
            fits = (len(buckets[-1]) + 1) * grown_seq <= max_rows
            if fits and (padded - grown_useful <= min_waste or grown_useful >= fill * padded):
                buckets[-1].append(i)
                max_new, max_seq, useful = grown_new, grown_seq, grown_useful
                continue
        buckets.append([i])
        max_new, max_seq, useful = new, seq, new * seq
    return buckets


@dataclass(slots=True)
class _Bucket:
    """Requests attended by one SDPA call, padded to the bucket's own longest sequence."""

    token_index: torch.Tensor  # [rows] packed positions of the bucket's new tokens, request by request
    # Row of each of those in the padded [size * max_new] query layout; None when no request of
    # the bucket is shorter than max_new (always so for decode).
    pad_index: torch.Tensor | None
    kv_slots: torch.Tensor  # [size * max_seq] int64 pool slots; padding reads slot 0 (masked out)
    # Additive float mask [size, 1, max_new, max_seq] (0 or -inf), built once instead of SDPA
    # converting a boolean one in every layer; None when no key needs masking.
    mask: torch.Tensor | None
    causal: bool  # no cached prefix: SDPA's own causal mask is exact (see `_bucket`)
    size: int
    max_new: int
    max_seq: int


@dataclass(slots=True)
class _TorchMetadata:
    out_cache_loc: torch.Tensor  # [tokens]
    buckets: list[_Bucket] = field(default_factory=list)
    # One bucket holding every request in batch order: its output is the result, no scatter.
    in_order: bool = False
    # One request with nothing cached: SDPA's causal kernel over the new k/v, no gather.
    plain_causal: bool = False
    # A decode batch's shared prefixes; the buckets or `paged` then cover only the keys after them.
    shared: SharedPrefixes | None = None
    # A batch the compiled kernels attend in place (no buckets then).
    paged: PagedDecode | None = None
    extend: PagedExtend | None = None


class TorchAttention(AttentionBackend):
    def __init__(
        self, kv: KVBuffers, req_to_token: torch.Tensor, scale: float, kernels: CpuKernels | None = None, dtype: torch.dtype | None = None
    ):
        self.kv = kv
        self.req_to_token = req_to_token
        self.scale = scale
        self.kernels = kernels  # attend CPU batches in place with these (gpu/paged_attention.py)
        if dtype is None and kv.int8_rows:
            raise ValueError("TorchAttention over int8 KV rows needs the model's dtype")
        self.dtype = dtype or kv.k[0].dtype  # the model's: what gathered int8 rows are read as
        self._meta: _TorchMetadata | None = None
        self.shared_prefix_batches = 0  # decode batches that attended a shared prefix once
        # Gathered K and V land in these reused buffers: a fresh allocation of tens of MB per
        # layer is served by mmap and page-faulted on first touch, which costs more than the copy.
        self._k_buf = kv.k[0].new_empty((0, *kv.k[0].shape[1:]))
        self._v_buf = self._k_buf.new_empty(self._k_buf.shape)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._meta = self._plan(batch)

    def _plan(self, batch: ForwardBatch) -> _TorchMetadata:
        loc = batch.out_cache_loc.to(torch.int64).contiguous()  # the CPU kernels' slot index (a copy only if not)
        kernels = self.kernels if batch.input_ids.device.type == "cpu" else None
        if kernels is not None and any(n != 1 for n in batch.extend_lens):
            return _TorchMetadata(loc, extend=PagedExtend.plan(kernels.extend_attention, batch))
        if batch.batch_size == 1 and batch.prefix_lens[0] == 0:
            return _TorchMetadata(loc, in_order=True, plain_causal=True)
        shared = find_shared_prefixes(batch, self.req_to_token, self.dtype)
        self.shared_prefix_batches += shared is not None
        skip = shared.skip if shared else [0] * batch.batch_size
        prefix_rows = shared.slots.numel() if shared else 0
        if kernels is not None:  # a decode batch
            self._grow_buffers(prefix_rows)
            return _TorchMetadata(loc, shared=shared, paged=PagedDecode.plan(kernels.decode_attention, batch, skip))
        key_lens = [s - k for s, k in zip(batch.seq_lens, skip)]
        groups = plan_buckets(batch.extend_lens, key_lens)
        starts = list(accumulate(batch.extend_lens[:-1], initial=0))
        buckets = [self._bucket(batch, group, starts, key_lens, skip) for group in groups]
        self._grow_buffers(max([b.size * b.max_seq for b in buckets] + [prefix_rows]))
        in_order = len(groups) == 1 and groups[0] == list(range(batch.batch_size))
        return _TorchMetadata(loc, buckets, in_order, shared=shared)

    def _grow_buffers(self, kv_rows: int) -> None:
        if self._k_buf.shape[0] < kv_rows:
            self._k_buf = self._k_buf.new_empty((kv_rows, *self._k_buf.shape[1:]))
            self._v_buf = self._k_buf.new_empty(self._k_buf.shape)

    def _bucket(self, batch: ForwardBatch, group: list[int], starts: list[int], key_lens: list[int], skip: list[int]) -> _Bucket:
        """`key_lens[i]` keys of request i from position `skip[i]` on (skip: a shared prefix
        attended separately; only ever nonzero for decode requests)."""
        device = batch.input_ids.device
        new = [batch.extend_lens[i] for i in group]
        prefix = [batch.prefix_lens[i] for i in group]
        seqs = [key_lens[i] for i in group]
        size, max_new, max_seq = len(group), max(new), max(seqs)
        token_index = torch.tensor([starts[i] + j for i, n in zip(group, new) for j in range(n)], dtype=torch.int64, device=device)
        pad_index = None
        if min(new) != max_new:
            pad_index = torch.tensor([r * max_new + j for r, n in enumerate(new) for j in range(n)], dtype=torch.int64, device=device)
        rows = batch.req_rows[torch.tensor(group, device=device)]
        seq_t = torch.tensor(seqs, dtype=torch.int64, device=device)
        key_pos = torch.arange(max_seq, device=device)
        in_seq = key_pos[None, :] < seq_t[:, None]  # [size, max_seq]
        offsets = [skip[i] for i in group]
        if any(offsets):
            columns = (torch.tensor(offsets, device=device)[:, None] + key_pos[None, :]).clamp_max(self.req_to_token.shape[1] - 1)
            table = self.req_to_token[rows[:, None], columns]
        else:
            table = self.req_to_token[rows, :max_seq]
        kv_slots = torch.where(in_seq, table.to(torch.int64), 0).reshape(-1)
        # Nothing cached: query j of every request attends to keys 0..j, which is SDPA's own
        # (top-left) causal mask; the padded keys lie past every real query of their request.
        causal = max_new > 1 and max(prefix) == 0
        mask = None
        if max_new > 1 and not causal:
            # Causal within the request and never past its own length. Padded query rows still
            # see key 0, so no row is fully masked (which would make SDPA return NaN).
            query_pos = torch.tensor(prefix, device=device)[:, None] + torch.arange(max_new, device=device)[None, :]
            allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_seq[:, None, :]
            mask = _additive(allowed[:, None], self.dtype)
        elif max_new == 1 and min(seqs) != max_seq:
            mask = _additive(in_seq[:, None, None, :], self.dtype)
        return _Bucket(token_index, pad_index, kv_slots, mask, causal, size, max_new, max_seq)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "init_forward_metadata must run before forward"
        if self.kernels is not None and q.device.type == "cpu":
            self.kernels.write_kv_(self.kv.k[layer_id], self.kv.v[layer_id], meta.out_cache_loc, k, v)
        else:
            self.kv.write(layer_id, meta.out_cache_loc, k, v)
        if meta.plain_causal:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=self.scale, enable_gqa=True
            )
            return out[0].transpose(0, 1)
        if meta.extend:
            return meta.extend.attend(q, self.kv.k[layer_id], self.kv.v[layer_id], self.req_to_token, self.scale)
        if meta.paged or meta.shared:
            return self._decode_merged(q, meta, layer_id)
        if meta.in_order:
            return self._attend(q, meta.buckets[0], layer_id)
        out = torch.empty_like(q)
        for bucket in meta.buckets:
            out.index_copy_(0, bucket.token_index, self._attend(q.index_select(0, bucket.token_index), bucket, layer_id))
        return out

    def plain_paged_decode(self) -> tuple[PagedDecode, torch.Tensor] | None:
        """The current batch's plan and its new tokens' slots (int64, contiguous) when it is a
        decode batch the compiled kernel attends in place with nothing to merge
        (gpu/cpu_decode.py runs such batches' layers in one call)."""
        meta = self._meta
        if meta is None or meta.paged is None or meta.shared is not None:
            return None
        return meta.paged, meta.out_cache_loc

    def _decode_merged(self, q: torch.Tensor, meta: _TorchMetadata, layer_id: int) -> torch.Tensor:
        if meta.paged:
            out, lse = meta.paged.attend(q, self.kv.k[layer_id], self.kv.v[layer_id], self.req_to_token, self.scale)
        else:
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:2], dtype=torch.float32)  # [requests, heads]; merged in float32
            for bucket in meta.buckets:
                o, l = decode_lse(q.index_select(0, bucket.token_index), *self._bucket_kv(bucket, layer_id), bucket.mask, self.scale)
                out.index_copy_(0, bucket.token_index, o)
                lse.index_copy_(0, bucket.token_index, l)
        return out if meta.shared is None else self._merge_shared(q, out, lse, meta.shared, layer_id)

    def _merge_shared(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, shared: SharedPrefixes, layer_id: int) -> torch.Tensor:
        keys, values = self._gather(shared.slots, layer_id)
        return merge_prefixes(q, out, lse, shared, keys, values, self.scale)

    def _gather(self, slots: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slots.numel()
        keys = torch.index_select(self.kv.k[layer_id], 0, slots, out=self._k_buf[:rows])
        values = torch.index_select(self.kv.v[layer_id], 0, slots, out=self._v_buf[:rows])
        return self.kv.read(keys, self.dtype), self.kv.read(values, self.dtype)

    def _bucket_kv(self, b: _Bucket, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's keys and values, [size, kv_heads, max_seq, dim]."""
        keys, values = self._gather(b.kv_slots, layer_id)
        kv_heads, head_dim = keys.shape[1], keys.shape[2]
        keys = keys.view(b.size, b.max_seq, kv_heads, head_dim).transpose(1, 2)
        values = values.view(b.size, b.max_seq, kv_heads, head_dim).transpose(1, 2)
        return keys, values

    def _attend(self, q: torch.Tensor, b: _Bucket, layer_id: int) -> torch.Tensor:
        """q: the bucket's packed queries [rows, heads, dim] -> their outputs, same shape."""
        keys, values = self._bucket_kv(b, layer_id)
        kv_heads, head_dim = keys.shape[1], keys.shape[3]
        num_heads = q.shape[1]
        if b.max_new == 1:
            # Decode: fold each K/V head's query group into the query-length axis, so SDPA reads
            # every K/V head once rather than once per query head (enable_gqa is ~1.4x slower).
            queries = q.reshape(b.size, kv_heads, num_heads // kv_heads, head_dim)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=b.mask, scale=self.scale)
            return out.reshape(b.size, num_heads, head_dim)
        if b.pad_index is not None:
            q = q.new_zeros((b.size * b.max_new, num_heads, head_dim)).index_copy_(0, b.pad_index, q)
        queries = q.reshape(b.size, b.max_new, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=b.mask, is_causal=b.causal, scale=self.scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b.size * b.max_new, num_heads, head_dim)
        return out if b.pad_index is None else out.index_select(0, b.pad_index)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
