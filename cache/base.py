"""What a prefix cache is to its users: `PrefixCache` (the Adder's calls), `PrefixMatcher` (the
Policy's read-only view), and the tree node and match result both hand out.

Who owns a KV slot, at any moment, is exactly one of: the allocator (free), the cache (a tree
node), or one live request. A request that locked `last_node` at admission *borrows* the tree's
slots for positions `0 .. last_node.depth - 1` and owns the slots of every later position. The
calls that end or advance a request (`cache_finished_req`, `cache_unfinished_req`, `release_req`)
use `last_node.depth` to tell borrowed slots from owned ones, so each slot is freed exactly once:

    allocator free + evictable_size() + protected_size() + owned by live requests == pool size
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cache.keys import TOKEN_BYTES, decode_tokens
from gpu.kv_pool import ReqToTokenPool


@dataclass(slots=True, eq=False, repr=False)
class RadixNode:
    """One edge of the radix tree: a page-aligned run of token ids and the KV slots holding them."""

    key: bytes  # the token ids, int32 native order
    value: torch.Tensor | None  # int64 KV slots, one per token; None for the root
    parent: RadixNode | None  # None for the root and for evicted nodes
    edge: Hashable  # this node's key in parent.children: first token (page 1) or first page
    depth: int  # tokens from the root to the end of this node
    uid: int  # unique: breaks ties in the eviction heap
    created: int = 0  # logical time of creation (FIFO); a split keeps it
    last_access: int = 0  # logical time of the last match or insert through this node (LRU)
    lock_ref: int = 0  # requests whose locked prefix runs through this node
    children: dict[Hashable, RadixNode] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    def token_ids(self) -> list[int]:
        return decode_tokens(self.key)

    def __repr__(self) -> str:
        return f"RadixNode(tokens={self.num_tokens}, depth={self.depth}, lock_ref={self.lock_ref}, children={len(self.children)})"


def new_root() -> RadixNode:
    # The root's lock is never released: it is never evicted and lock walks stop there.
    return RadixNode(key=b"", value=None, parent=None, edge=None, depth=0, uid=0, lock_ref=1)


class MatchResult:
    """The cached prefix of a query: its length, the node it ends at and its KV slots
    (concatenated on first use: the Policy only needs the length and the node)."""

    __slots__ = ("length", "last_node", "_parts", "_device", "_slots")

    def __init__(self, length: int, last_node: RadixNode, parts: list[torch.Tensor], device: torch.device | str) -> None:
        self.length = length
        self.last_node = last_node
        self._parts = parts
        self._device = device  # the pool's, where an empty match's slots live too
        self._slots: torch.Tensor | None = None

    @property
    def slots(self) -> torch.Tensor:
        """int64 KV slot of every matched token (a fresh tensor, safe to modify)."""
        if self._slots is None:
            parts = self._parts
            self._slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=self._device)
        return self._slots

    def __repr__(self) -> str:
        return f"MatchResult(length={self.length}, last_node={self.last_node!r})"


class PrefixMatcher(Protocol):
    """The Policy's view of the Adder's cache: a match may split a node and touch access times,
    never changes what is cached or locked."""

    @property
    def shares_prefixes(self) -> bool:
        """False where every match is empty (prefix caching disabled)."""

    @property
    def page_size(self) -> int: ...

    @property
    def root(self) -> RadixNode: ...

    def match_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> MatchResult: ...


class PrefixCache(ABC):
    """What the Adder needs from a prefix cache (the Policy reads it as a `PrefixMatcher`)."""

    shares_prefixes: bool
    page_size: int
    root: RadixNode

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids`; the caller passes at most len-1 tokens of a new request."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, extra_key: str | None = None) -> int:
        """Cache the page-aligned prefix of `token_ids` with `slots`; returns the length that was already cached."""

    @abstractmethod
    def inc_lock_ref(self, node: RadixNode) -> None:
        """Protect the path root..node from eviction (one more holder)."""

    @abstractmethod
    def dec_lock_ref(self, node: RadixNode) -> None:
        """Drop one holder of the path root..node."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens that no request holds (O(1))."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens that some request holds (O(1))."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least min(num_tokens, evictable_size()) cached tokens; returns the number freed."""

    @abstractmethod
    def cache_finished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, last_node: RadixNode, extra_key: str | None = None
    ) -> None:
        """Take a finished request's KV: cache its pages, free the rest, unlock `last_node`."""

    @abstractmethod
    def cache_unfinished_req(
        self,
        token_ids: Sequence[int],
        req_to_token: ReqToTokenPool,
        row: int,
        last_node: RadixNode,
        extra_key: str | None = None,
    ) -> MatchResult:
        """Cache a running request's computed pages (after a chunk or a prefill) and move its lock; returns its new cached prefix."""

    @abstractmethod
    def release_req(self, slots: torch.Tensor, last_node: RadixNode) -> None:
        """Drop a request without caching it (abort, retract): free the slots it owns, unlock `last_node`."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached prefix, returning its slots to the allocator."""

    @abstractmethod
    def pretty(self) -> str:
        """A readable multi-line dump of the cache, for debugging."""

    def total_size(self) -> int:
        """Cached tokens, held or not."""
        return self.evictable_size() + self.protected_size()
