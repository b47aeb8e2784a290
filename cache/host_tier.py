"""`HostTier`: KV that left the device pool, kept in host memory and found again by its tokens
(SGLang's HiCache L2, `--enable-hierarchical-cache`).

The host pool is cut into blocks of `block_tokens` tokens, each block aligned on a multiple of
`block_tokens` from the start of its sequence. A block is keyed by a digest chain: the digest of
its tokens and of every block before it (and the cache namespace, `extra_key`), so one key names a
whole prefix, as a radix path does, without a second tree. The tokens are kept beside the data
and compared on a hit: a digest collision is a miss, never wrong KV.

The tier decides and books; it never touches KV data. Each store or load is a `KVCopy` in
`pending`, which the Adder hands to the Executor with the next batch; the Executor performs
them in order before that batch's forward, so a store reads device slots before a later step
reuses them, and a load lands before any step reads it.

Every host slot is free or holds one stored block: `check()`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache.keys import encode_tokens
from gpu.kv_pool import TokenSlotAllocator
from runtime.messages import KVCopy, StorageBlock

WritePolicy = str  # "write_through" | "write_back"
WRITE_POLICIES = ("write_through", "write_back")


@dataclass(slots=True)
class _Block:
    tokens: bytes  # the block's token ids, int32 (checked on every hit)
    host_slots: torch.Tensor


@dataclass(slots=True)
class HostTierStats:
    stored_tokens: int = 0  # device -> host
    loaded_tokens: int = 0  # host -> device: the tier's hits
    evicted_tokens: int = 0  # dropped from the host pool
    adopted_tokens: int = 0  # storage -> host (cache/storage_tier.py): the storage tier's hits


def chain_digests(token_ids: Sequence[int], extra_key: str | None, block_tokens: int, num_blocks: int) -> list[bytes]:
    """The chain keys of the first `num_blocks` blocks of `token_ids` (the storage tier names its
    files by the same keys)."""
    encoded = encode_tokens(token_ids[: num_blocks * block_tokens])
    step = block_tokens * 4
    key = hashlib.blake2b((extra_key or "").encode("utf-8", "surrogatepass"), digest_size=16).digest()
    out = []
    for i in range(num_blocks):
        key = hashlib.blake2b(key + encoded[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(key)
    return out


class HostTier:
    def __init__(self, num_tokens: int, block_tokens: int, page_size: int, write_policy: WritePolicy = "write_through") -> None:
        if block_tokens < 1 or block_tokens % page_size:
            raise ValueError(f"hicache_block_tokens ({block_tokens}) must be a positive multiple of page_size ({page_size})")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy {write_policy!r} is unknown; choose one of {', '.join(WRITE_POLICIES)}")
        num_blocks = num_tokens // block_tokens
        if num_blocks < 1:
            raise ValueError(f"a host tier of {num_tokens} tokens holds no block of {block_tokens} tokens")
        self.block_tokens = block_tokens
        self.write_policy = write_policy
        self.allocator = TokenSlotAllocator(num_blocks * block_tokens, block_tokens)
        self.size = self.allocator.size
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.pending: list[KVCopy] = []
        self.stats = HostTierStats()
        self.persist = False  # with a storage tier: every block stored here is also written there

    def stored_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def digests(self, token_ids: Sequence[int], extra_key: str | None, num_blocks: int) -> list[bytes]:
        """The chain keys of the first `num_blocks` blocks of `token_ids`."""
        return chain_digests(token_ids, extra_key, self.block_tokens, num_blocks)

    def store(self, token_ids: Sequence[int], device_slots: torch.Tensor, extra_key: str | None, start: int = 0) -> None:
        """Keep the whole blocks of a cached sequence that end past `start` (the tokens `start` on
        are leaving the device or were just cached; earlier ones are already here or still on the
        device). `device_slots[i]` holds token i."""
        whole = min(len(token_ids), device_slots.numel()) // self.block_tokens
        first = start // self.block_tokens
        if whole <= first:
            return
        keys = self.digests(token_ids, extra_key, whole)
        encoded = encode_tokens(token_ids[: whole * self.block_tokens])
        b = self.block_tokens
        for i in range(first, whole):
            key = keys[i]
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            host_slots = self._alloc()
            if host_slots is None:
                return  # every block is newer than what would go: keep them
            block_tokens = encoded[i * b * 4 : (i + 1) * b * 4]
            self._blocks[key] = _Block(block_tokens, host_slots)
            persist = StorageBlock(key, block_tokens) if self.persist else None
            self.pending.append(KVCopy(to_host=True, device_slots=device_slots[i * b : (i + 1) * b].clone(), host_slots=host_slots, persist=persist))
            self.stats.stored_tokens += b

    def find(self, token_ids: Sequence[int], extra_key: str | None, start: int, end: int) -> int:
        """How far past `start` (a device match) the tier continues `token_ids` without a gap,
        up to `end`; refreshes the blocks found."""
        b = self.block_tokens
        last = end // b
        first = start // b
        if last <= first:
            return start
        keys = self.digests(token_ids, extra_key, last)
        encoded = encode_tokens(token_ids[: last * b])
        reached = start
        for i in range(first, last):
            block = self._blocks.get(keys[i])
            if block is None or block.tokens != encoded[i * b * 4 : (i + 1) * b * 4]:
                break
            self._blocks.move_to_end(keys[i])
            reached = (i + 1) * b
        return reached

    def load(self, token_ids: Sequence[int], extra_key: str | None, start: int, device_slots: torch.Tensor) -> None:
        """Copy tokens `start .. start + len(device_slots)` (found by `find`) into `device_slots`."""
        b = self.block_tokens
        end = start + device_slots.numel()
        keys = self.digests(token_ids, extra_key, -(-end // b))
        for i in range(start // b, -(-end // b)):
            lo, hi = max(i * b, start), min((i + 1) * b, end)
            block = self._blocks[keys[i]]
            self.pending.append(KVCopy(
                to_host=False, device_slots=device_slots[lo - start : hi - start].clone(), host_slots=block.host_slots[lo - i * b : hi - i * b],
            ))
        self.stats.loaded_tokens += device_slots.numel()

    def adopt(self, keys: Sequence[bytes], tokens: Sequence[bytes], staged: Sequence[torch.Tensor]) -> int:
        """Blocks read from the storage tier (consecutive, keyed and encoded as `store` does):
        each one not held yet takes host slots, its data going there with the next batch. At
        most a tier's worth, so none pushes out another of the same chain; returns the tokens
        taken in."""
        taken = 0
        for key, block_tokens, data in list(zip(keys, tokens, staged))[: self.size // self.block_tokens]:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            host_slots = self._alloc()
            if host_slots is None:
                break
            self._blocks[key] = _Block(block_tokens, host_slots)
            self.pending.append(KVCopy(to_host=True, device_slots=host_slots[:0], host_slots=host_slots, staged=data))
            taken += self.block_tokens
        self.stats.adopted_tokens += taken
        return taken

    def reset(self) -> None:
        for block in self._blocks.values():
            self.allocator.free(block.host_slots)
        self._blocks.clear()
        self.pending.clear()  # copies into freed host slots (or from pages the cache dropped)

    def take_pending(self) -> list[KVCopy]:
        pending, self.pending = self.pending, []
        return pending

    def _alloc(self) -> torch.Tensor | None:
        slots = self.allocator.alloc(self.block_tokens)
        if slots is None and self._blocks:
            # The oldest block's slots go to the new one as they are: freeing and allocating them
            # again would hand back the same page. Copies already queued for them run first.
            _, oldest = self._blocks.popitem(last=False)
            self.stats.evicted_tokens += self.block_tokens
            slots = oldest.host_slots
        return slots

    def check(self) -> None:
        free, stored = self.allocator.available_size(), self.stored_tokens()
        assert free + stored == self.size, f"host tier: free {free} + stored {stored} != {self.size}"
