"""Attention over the paged KV pool.

`TorchAttention` is the reference backend (CPU and CUDA): it writes the new tokens' K/V into the
pool, gathers each request's whole sequence back through the request-to-token table, and runs
PyTorch SDPA over padded `[requests, heads, new_tokens, seq_len]` problems. EXTEND, DECODE and
MIXED batches all take the same path; a decode batch is simply one with a single new token per
request.

Requests are grouped into length buckets (`plan_buckets`), each padded only to its own longest
sequence: one padding for a whole batch whose contexts range from 33 to 768 tokens makes about half
of the gathered K/V and of the SDPA work padding. The bucket plan, slot indices and masks are
built once per forward in `init_forward_metadata`; every layer reuses them.

On a CPU, decode attention is memory-bound: the gather (one copy of the batch's K/V per layer)
costs about 1.5x the SDPA call that reads it back, so the keys that buckets do not pad are what
counts. The gathers go into reused buffers (see `TorchAttention.__init__`).

Shared prefixes (CPU decode batches): requests whose first keys are the same pool slots (the radix
cache hands one prefix's slots to every request that matches it) attend to that prefix together,
cascade style. Each prefix is gathered once per layer and its requests' queries attend to it
together (all prefixes in one SDPA call, padded to the longest); each request's own suffix goes
through the buckets as usual; the two partial results merge exactly through their log-sum-exps.
Without it, every request copies the shared prefix again in every layer. Everything is batched:
on a CPU each extra small op costs tens of microseconds, so a loop over prefixes would eat the
gain.

With `kernels` (gpu/cpu_ops.py, CPU only) the compiled kernels read K/V where it lies in the pool
instead: decode batches one query per request (still merged with shared prefixes as above), any
other batch causally per new token. No buckets, gathers or masks then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.cpu_ops import CpuKernels
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVBuffers

# A bucket closes when adding the next request would leave less than FILL of its padded
# query-key work useful, unless the waste is under MIN_WASTE pairs: below that an extra bucket
# (one more gather and SDPA call per layer, ~0.1 ms on a CPU) costs more than the padding.
FILL = 0.9
MIN_WASTE = 1024
# Gathered K/V rows per bucket (one request may exceed it alone). Bounds the reused gather
# buffers; splitting there measured no slower than one big bucket.
MAX_KV_ROWS = 32768
# A shared prefix is attended once for all its requests when at least this long: shorter ones
# (a chat template's first tokens) save less copying than the extra SDPA call and merge cost.
SHARED_PREFIX_MIN = 64


class AttentionBackend(ABC):
    """Computes attention for one layer of the batch prepared by `init_forward_metadata`."""

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
class _SharedPrefixes:
    """Groups of decode requests whose first keys are the same slots, each group's prefix padded
    to the longest and its requests' queries to the largest group, for one SDPA call."""

    members: torch.Tensor  # [M] int64 batch rows, group after group
    pad_index: torch.Tensor  # [M] int64 row of each member in the padded [groups * max_members] layout
    slots: torch.Tensor  # [groups * max_len] int64 prefix slots; padding reads slot 0 (masked out)
    mask: torch.Tensor | None  # additive [groups, 1, 1, max_len]; None when every prefix is max_len
    sizes: list[int]  # members per group
    lengths: list[int]  # prefix length per group
    max_len: int


@dataclass(slots=True)
class _PagedDecode:
    """A decode batch for the compiled kernel: request i attends to the slots at positions
    key_begin[i] .. key_end[i] - 1 of its table row (key_begin: the shared prefix it skips)."""

    req_rows: torch.Tensor  # [batch] int64
    key_begin: torch.Tensor  # [batch] int64
    key_end: torch.Tensor  # [batch] int64


@dataclass(slots=True)
class _PagedExtend:
    """Any other batch for the compiled kernel: request i's new tokens are positions
    prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1, each attending causally."""

    req_rows: torch.Tensor  # [batch] int64
    prefix_lens: torch.Tensor  # [batch] int64
    extend_lens: torch.Tensor  # [batch] int64


@dataclass(slots=True)
class _TorchMetadata:
    out_cache_loc: torch.Tensor  # [tokens]
    buckets: list[_Bucket]
    # One bucket holding every request in batch order: its output is the result, no scatter.
    in_order: bool
    # One request with nothing cached: attend to the new k/v directly with SDPA's causal kernel.
    plain_causal: bool
    # Shared prefixes of a decode batch; the buckets then hold only the keys after them.
    shared: _SharedPrefixes | None
    # A batch the compiled kernels attend in place (no buckets then).
    paged: _PagedDecode | None = None
    extend: _PagedExtend | None = None


class TorchAttention(AttentionBackend):
    def __init__(self, kv: KVBuffers, req_to_token: torch.Tensor, scale: float, kernels: CpuKernels | None = None):
        self.kv = kv
        self.req_to_token = req_to_token
        self.scale = scale
        # gpu/cpu_ops.py's paged attention kernels (CPU batches), or None for the torch path.
        self.kernels = kernels
        self._meta: _TorchMetadata | None = None
        # Gathered K and V land in these reused buffers: a fresh allocation of tens of MB per
        # layer is served by mmap and page-faulted on first touch, which costs more than the copy.
        self._k_buf = kv.k[0].new_empty((0, *kv.k[0].shape[1:]))
        self._v_buf = self._k_buf.new_empty(self._k_buf.shape)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        on_cpu = self.kernels is not None and batch.input_ids.device.type == "cpu"
        if on_cpu and any(n != 1 for n in batch.extend_lens):
            extend = _PagedExtend(batch.req_rows, _int64(batch.prefix_lens), _int64(batch.extend_lens))
            self._meta = _TorchMetadata(batch.out_cache_loc, [], in_order=False, plain_causal=False, shared=None, extend=extend)
            return
        if batch.batch_size == 1 and batch.prefix_lens[0] == 0:
            self._meta = _TorchMetadata(batch.out_cache_loc, [], in_order=True, plain_causal=True, shared=None)
            return
        shared, skip = self._shared_prefixes(batch)
        if on_cpu:  # a decode batch
            paged = _PagedDecode(batch.req_rows, _int64(skip), _int64(batch.seq_lens))
            self._grow_buffers(shared.slots.numel() if shared else 0)
            self._meta = _TorchMetadata(batch.out_cache_loc, [], in_order=False, plain_causal=False, shared=shared, paged=paged)
            return
        # Keys each request attends through the buckets: all but its shared prefix.
        key_lens = [s - k for s, k in zip(batch.seq_lens, skip)]
        groups = plan_buckets(batch.extend_lens, key_lens)
        starts = [0]
        for n in batch.extend_lens[:-1]:
            starts.append(starts[-1] + n)
        buckets = [self._bucket(batch, group, starts, key_lens, skip) for group in groups]
        in_order = len(groups) == 1 and groups[0] == list(range(batch.batch_size))
        self._grow_buffers(max([b.size * b.max_seq for b in buckets] + [shared.slots.numel() if shared else 0]))
        self._meta = _TorchMetadata(batch.out_cache_loc, buckets, in_order, plain_causal=False, shared=shared)

    def _grow_buffers(self, kv_rows: int) -> None:
        if self._k_buf.shape[0] < kv_rows:
            self._k_buf = self._k_buf.new_empty((kv_rows, *self._k_buf.shape[1:]))
            self._v_buf = self._k_buf.new_empty(self._k_buf.shape)

    def _shared_prefixes(self, batch: ForwardBatch) -> tuple[_SharedPrefixes | None, list[int]]:
        """The shared prefixes of a CPU decode batch, and how many leading keys of each request
        they cover (0 for a request in none)."""
        skip = [0] * batch.batch_size
        if batch.input_ids.device.type != "cpu" or any(n != 1 for n in batch.extend_lens):
            return None, skip  # the log-sum-exp kernel is the CPU one; extends keep the plain path
        seq_lens = batch.seq_lens
        long = [i for i, s in enumerate(seq_lens) if s > SHARED_PREFIX_MIN]
        if len(long) < 2:
            return None, skip
        rows = batch.req_rows[long]
        # Cached slots form a tree: two requests with the same slot at one position have the same
        # slots at every position before it. So grouping by one slot finds the shared prefixes.
        by_slot: dict[int, list[int]] = defaultdict(list)
        for i, slot in zip(long, self.req_to_token[rows, SHARED_PREFIX_MIN - 1].tolist()):
            by_slot[slot].append(i)
        groups: list[tuple[list[int], torch.Tensor]] = []  # (members, prefix slots)
        for members in by_slot.values():
            if len(members) < 2:
                continue
            # Each request keeps at least its newest key (its own slot) for the buckets.
            limit = min(seq_lens[i] for i in members) - 1
            slots = self.req_to_token[batch.req_rows[members], :limit]
            length = int((slots == slots[:1]).all(0).int().cumprod(0).sum())
            if length < SHARED_PREFIX_MIN:  # not a tree-shared prefix after all: keep the plain path
                continue
            groups.append((members, slots[0, :length]))
            for i in members:
                skip[i] = length
        return (_pack_prefixes(groups, self._k_buf.dtype) if groups else None), skip

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
            mask = _additive(allowed[:, None], self._k_buf.dtype)
        elif max_new == 1 and min(seqs) != max_seq:
            mask = _additive(in_seq[:, None, None, :], self._k_buf.dtype)
        return _Bucket(token_index, pad_index, kv_slots, mask, causal, size, max_new, max_seq)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "init_forward_metadata must run before forward"
        self.kv.write(layer_id, meta.out_cache_loc, k, v)
        if meta.plain_causal:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=self.scale, enable_gqa=True
            )
            return out[0].transpose(0, 1)
        if meta.paged:
            return self._decode_paged(q, meta, layer_id)
        if meta.extend:
            assert self.kernels is not None
            e = meta.extend
            return self.kernels.extend_attention(
                q.contiguous(), self.kv.k[layer_id], self.kv.v[layer_id], self.req_to_token, e.req_rows, e.prefix_lens, e.extend_lens, self.scale
            )
        if meta.shared:
            return self._decode_with_shared_prefixes(q, meta, layer_id)
        if meta.in_order:
            return self._attend(q, meta.buckets[0], layer_id)
        out = torch.empty_like(q)
        for bucket in meta.buckets:
            out.index_copy_(0, bucket.token_index, self._attend(q.index_select(0, bucket.token_index), bucket, layer_id))
        return out

    def _decode_paged(self, q: torch.Tensor, meta: _TorchMetadata, layer_id: int) -> torch.Tensor:
        """The compiled kernel over each request's keys in place (after its shared prefix, if
        any), merged with the shared prefixes' attention as the torch path does."""
        paged = meta.paged
        assert paged is not None and self.kernels is not None
        q = q.contiguous()
        out, lse = self.kernels.decode_attention(
            q, self.kv.k[layer_id], self.kv.v[layer_id], self.req_to_token, paged.req_rows, paged.key_begin, paged.key_end, self.scale
        )
        return out if meta.shared is None else self._merge_shared(q, out, lse, meta.shared, layer_id)

    def _decode_with_shared_prefixes(self, q: torch.Tensor, meta: _TorchMetadata, layer_id: int) -> torch.Tensor:
        """Each request's own keys through the buckets, each shared prefix once for all its
        requests; merged by log-sum-exp (softmax over a union of key sets, exactly)."""
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)  # [requests, heads]; merged in float32
        for bucket in meta.buckets:
            o, l = self._decode_lse(q.index_select(0, bucket.token_index), bucket, layer_id)
            out.index_copy_(0, bucket.token_index, o)
            lse.index_copy_(0, bucket.token_index, l)
        assert meta.shared is not None
        return self._merge_shared(q, out, lse, meta.shared, layer_id)

    def _merge_shared(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, shared: _SharedPrefixes, layer_id: int) -> torch.Tensor:
        """`out`/`lse`: attention over each request's own keys; merged in place with its shared
        prefix's by log-sum-exp (softmax over a union of key sets, exactly)."""
        o, l = self._prefixes_lse(q, shared, layer_id)
        own_o, own_l = out.index_select(0, shared.members), lse.index_select(0, shared.members)
        top = torch.maximum(l, own_l)
        w, own_w = (l - top).exp(), (own_l - top).exp()
        merged = (o * w[..., None] + own_o * own_w[..., None]) / (w + own_w)[..., None]
        out.index_copy_(0, shared.members, merged.to(out.dtype))
        return out

    def _gather(self, slots: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slots.numel()
        keys = torch.index_select(self.kv.k[layer_id], 0, slots, out=self._k_buf[:rows])
        values = torch.index_select(self.kv.v[layer_id], 0, slots, out=self._v_buf[:rows])
        return keys, values

    def _decode_lse(self, q: torch.Tensor, b: _Bucket, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode bucket's outputs [size, heads, dim] and log-sum-exps [size, heads]."""
        keys, values = self._gather(b.kv_slots, layer_id)
        size, num_heads, head_dim = q.shape
        kv_heads = keys.shape[1]
        keys = keys.view(size, b.max_seq, kv_heads, head_dim).transpose(1, 2)
        values = values.view(size, b.max_seq, kv_heads, head_dim).transpose(1, 2)
        queries = q.reshape(size, kv_heads, num_heads // kv_heads, head_dim)
        out, lse = _flash_cpu(queries, keys, values, attn_mask=b.mask, scale=self.scale)
        return out.reshape(size, num_heads, head_dim), lse.reshape(size, num_heads)

    def _prefixes_lse(self, q: torch.Tensor, p: _SharedPrefixes, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every member's attention over its group's prefix, [M, heads, dim] and [M, heads]: one
        SDPA call whose query axis holds, per group and K/V head, all members' query groups."""
        keys, values = self._gather(p.slots, layer_id)
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = keys.shape[1]
        group, groups = num_heads // kv_heads, len(p.sizes)
        most = max(p.sizes)
        keys = keys.view(groups, p.max_len, kv_heads, head_dim).transpose(1, 2)
        values = values.view(groups, p.max_len, kv_heads, head_dim).transpose(1, 2)
        padded = q.new_zeros((groups * most, num_heads, head_dim)).index_copy_(0, p.pad_index, q.index_select(0, p.members))
        queries = padded.view(groups, most, kv_heads, group, head_dim).transpose(1, 2).reshape(groups, kv_heads, most * group, head_dim)
        out, lse = _flash_cpu(queries, keys, values, attn_mask=p.mask, scale=self.scale)
        out = out.view(groups, kv_heads, most, group, head_dim).transpose(1, 2).reshape(groups * most, num_heads, head_dim)
        lse = lse.view(groups, kv_heads, most, group).transpose(1, 2).reshape(groups * most, num_heads)
        return out.index_select(0, p.pad_index), lse.index_select(0, p.pad_index)

    def _attend(self, q: torch.Tensor, b: _Bucket, layer_id: int) -> torch.Tensor:
        """q: the bucket's packed queries [rows, heads, dim] -> their outputs, same shape."""
        rows = b.kv_slots.numel()
        keys = torch.index_select(self.kv.k[layer_id], 0, b.kv_slots, out=self._k_buf[:rows])
        values = torch.index_select(self.kv.v[layer_id], 0, b.kv_slots, out=self._v_buf[:rows])
        kv_heads, head_dim = keys.shape[1], keys.shape[2]
        keys = keys.view(b.size, b.max_seq, kv_heads, head_dim).transpose(1, 2)  # [size, kv_heads, seq, dim]
        values = values.view(b.size, b.max_seq, kv_heads, head_dim).transpose(1, 2)
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


def _pack_prefixes(groups: list[tuple[list[int], torch.Tensor]], dtype: torch.dtype) -> _SharedPrefixes:
    sizes = [len(members) for members, _ in groups]
    lengths = [slots.numel() for _, slots in groups]
    most, max_len = max(sizes), max(lengths)
    members = torch.tensor([i for m, _ in groups for i in m], dtype=torch.int64)
    pad_index = torch.tensor([g * most + j for g, n in enumerate(sizes) for j in range(n)], dtype=torch.int64)
    slots = torch.zeros((len(groups), max_len), dtype=torch.int64)
    for g, (_, prefix) in enumerate(groups):
        slots[g, : prefix.numel()] = prefix
    mask = None
    if min(lengths) != max_len:
        allowed = torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]
        mask = _additive(allowed[:, None, None, :], dtype)
    return _SharedPrefixes(members, pad_index, slots.reshape(-1), mask, sizes, lengths, max_len)


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention, which also returns the log-sum-exp of each query's scores."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=attn_mask, scale=scale)
    return out, lse.float()


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
