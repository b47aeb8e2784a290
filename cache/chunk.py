"""`ChunkCache`: prefix caching disabled (`--disable-radix-cache`); every request owns all its slots."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache.base import MatchResult, PrefixCache, RadixNode, new_root
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator


class ChunkCache(PrefixCache):
    """Prefix caching disabled: the same calls, nothing is matched, kept or shared."""

    shares_prefixes = False

    def __init__(self, allocator: TokenSlotAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = new_root()

    def match_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(0, self.root, [], self.allocator.device)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, extra_key: str | None = None) -> int:
        """Takes nothing: reports every token as present, so the caller keeps (and frees) all its slots."""
        return len(token_ids)

    def inc_lock_ref(self, node: RadixNode) -> None:
        pass

    def dec_lock_ref(self, node: RadixNode) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def cache_finished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, last_node: RadixNode, extra_key: str | None = None
    ) -> None:
        self.allocator.free(slots)

    def cache_unfinished_req(
        self,
        token_ids: Sequence[int],
        req_to_token: ReqToTokenPool,
        row: int,
        last_node: RadixNode,
        extra_key: str | None = None,
    ) -> MatchResult:
        """Nothing is cached: the request keeps owning its whole row."""
        return MatchResult(0, self.root, [], self.allocator.device)

    def release_req(self, slots: torch.Tensor, last_node: RadixNode) -> None:
        self.allocator.free(slots)

    def reset(self) -> None:
        pass

    def pretty(self) -> str:
        return "ChunkCache (prefix caching disabled: nothing cached)"
