"""Shared-prefix (cascade) decode for CPU batches, beside the reference path in gpu/attention.py.

The radix cache hands one prefix's pool slots to every request that matches it. In a decode batch
the requests behind one such prefix attend to it together: each prefix is gathered once per layer
(all prefixes in one SDPA call, padded to the longest), each request's own keys go through the
reference path's buckets or the compiled kernel, and the two partial results merge exactly
through their log-sum-exps. Without this, every request copies the shared prefix again in every
layer. Everything is batched: on a CPU each extra small op costs tens of microseconds, so a loop
over prefixes would eat the gain.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from gpu.forward_batch import ForwardBatch

# Shorter shared prefixes (a chat template's first tokens) save less copying than the extra SDPA
# call and merge cost.
SHARED_PREFIX_MIN = 64


@dataclass(slots=True)
class SharedPrefixes:
    """Groups of decode requests whose first keys are the same slots, each group's prefix padded
    to the longest and its requests' queries to the largest group, for one SDPA call."""

    members: torch.Tensor  # [M] int64 batch rows, group after group
    pad_index: torch.Tensor  # [M] int64 row of each member in the padded [groups * max_members] layout
    slots: torch.Tensor  # [groups * max_len] int64 prefix slots; padding reads slot 0 (masked out)
    mask: torch.Tensor | None  # additive [groups, 1, 1, max_len]; None when every prefix is max_len
    sizes: list[int]  # members per group
    lengths: list[int]  # prefix length per group
    max_len: int
    skip: list[int]  # per request of the batch: leading keys its prefix covers (0 in none)


def find_shared_prefixes(batch: ForwardBatch, req_to_token: torch.Tensor, dtype: torch.dtype) -> SharedPrefixes | None:
    if batch.input_ids.device.type != "cpu" or any(n != 1 for n in batch.extend_lens):
        return None  # the log-sum-exp kernel is the CPU one; extends keep the plain path
    seq_lens = batch.seq_lens
    long = [i for i, s in enumerate(seq_lens) if s > SHARED_PREFIX_MIN]
    if len(long) < 2:
        return None
    # Cached slots form a tree: two requests with the same slot at one position have the same
    # slots at every position before it. So grouping by one slot finds the shared prefixes.
    by_slot: dict[int, list[int]] = defaultdict(list)
    for i, slot in zip(long, req_to_token[batch.req_rows[long], SHARED_PREFIX_MIN - 1].tolist()):
        by_slot[slot].append(i)
    groups: list[tuple[list[int], torch.Tensor]] = []  # (members, prefix slots)
    skip = [0] * batch.batch_size
    for members in by_slot.values():
        if len(members) < 2:
            continue
        # Each request keeps at least its newest key (its own slot) for the buckets.
        limit = min(seq_lens[i] for i in members) - 1
        slots = req_to_token[batch.req_rows[members], :limit]
        length = int((slots == slots[:1]).all(0).int().cumprod(0).sum())
        if length < SHARED_PREFIX_MIN:  # not a tree-shared prefix after all: keep the plain path
            continue
        groups.append((members, slots[0, :length]))
        for i in members:
            skip[i] = length
    return _pack(groups, skip, dtype) if groups else None


def decode_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [size, heads, dim] against keys/values [size, kv_heads, seq, dim] -> outputs
    [size, heads, dim] and log-sum-exps [size, heads], for merging with a prefix's."""
    size, num_heads, head_dim = q.shape
    queries = q.reshape(size, keys.shape[1], num_heads // keys.shape[1], head_dim)
    out, lse = _flash_cpu(queries, keys, values, mask, scale)
    return out.reshape(size, num_heads, head_dim), lse.reshape(size, num_heads)


def merge_prefixes(
    q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, p: SharedPrefixes, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """`out`/`lse`: each request's attention over its own keys; merged in place with its prefix's
    (keys/values: `p.slots` gathered). Softmax over a union of key sets, exactly."""
    o, l = _prefixes_lse(q, p, keys, values, scale)
    own_o, own_l = out.index_select(0, p.members), lse.index_select(0, p.members)
    top = torch.maximum(l, own_l)
    w, own_w = (l - top).exp(), (own_l - top).exp()
    merged = (o * w[..., None] + own_o * own_w[..., None]) / (w + own_w)[..., None]
    out.index_copy_(0, p.members, merged.to(out.dtype))
    return out


def _prefixes_lse(q: torch.Tensor, p: SharedPrefixes, keys: torch.Tensor, values: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, heads, dim] and [M, heads]: one SDPA call whose query axis holds, per group and K/V
    head, all members' query groups."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = keys.shape[1]
    group, groups = num_heads // kv_heads, len(p.sizes)
    most = max(p.sizes)
    keys = keys.view(groups, p.max_len, kv_heads, head_dim).transpose(1, 2)
    values = values.view(groups, p.max_len, kv_heads, head_dim).transpose(1, 2)
    padded = q.new_zeros((groups * most, num_heads, head_dim)).index_copy_(0, p.pad_index, q.index_select(0, p.members))
    queries = padded.view(groups, most, kv_heads, group, head_dim).transpose(1, 2).reshape(groups, kv_heads, most * group, head_dim)
    out, lse = _flash_cpu(queries, keys, values, p.mask, scale)
    out = out.view(groups, kv_heads, most, group, head_dim).transpose(1, 2).reshape(groups * most, num_heads, head_dim)
    lse = lse.view(groups, kv_heads, most, group).transpose(1, 2).reshape(groups * most, num_heads)
    return out.index_select(0, p.pad_index), lse.index_select(0, p.pad_index)


def _pack(groups: list[tuple[list[int], torch.Tensor]], skip: list[int], dtype: torch.dtype) -> SharedPrefixes:
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
        allowed = (torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return SharedPrefixes(members, pad_index, slots.reshape(-1), mask, sizes, lengths, max_len, skip)


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention, which also returns each query's log-sum-exp."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, lse.float()
