"""KVLedger: who holds every KV slot and request row of the core. The Adder owns the only one.

Every slot of the pool is in exactly one place:

- free in the allocator;
- in the prefix cache (a request that locked a node *borrows* the cache's slots for positions
  before the node's depth; the cache frees them, never the request);
- owned by one live request row: its positions from its locked node's depth on, in whole pages.

so, at every moment (`check`): free + cached + owned by live rows == pool size. Every request row
is free or held by one live request, and every live row holds one lock on one cache node.

The ledger keeps, per row, how many positions have slots recorded (`held`) and the node it
locked; the row of the request-to-token table holds the slots themselves. The Adder says when:
it opens a row at admission, extends it before launching a step (the step writes those slots),
caches its computed prefix while it runs, and closes it once the request's last launched step is
done (caching its tokens, or not when it was aborted or retracted). The ledger never decides
which request gets memory; it only keeps the books and says what is free or could be freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator

from runtime.messages import KVCopy

if TYPE_CHECKING:
    from cache import MatchResult, PrefixCache, RadixNode
    from cache.host_tier import HostTier
    from cache.storage_tier import Prefetch


class KVLedger:
    def __init__(self, allocator: TokenSlotAllocator, req_to_token: ReqToTokenPool, cache: PrefixCache) -> None:
        if allocator.page_size != cache.page_size:
            raise ValueError(f"the allocator's page size {allocator.page_size} differs from the cache's {cache.page_size}")
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.cache = cache
        self.page_size = allocator.page_size
        self.host_tier: HostTier | None = getattr(cache, "host_tier", None)
        rows = req_to_token.max_requests + 1  # row 0 is the dummy
        self._held = np.zeros(rows, dtype=np.int64)  # positions with slots recorded in the row
        self._node: list[RadixNode | None] = [None] * rows  # the locked node; None: row not open

    def rows_free(self) -> int:
        return self.req_to_token.available()

    def free_slots(self) -> int:
        return self.allocator.available_size()

    def make_room(self, need: int) -> int:
        """Evict cached prefixes when fewer than `need` slots are free; returns the free slots.
        As SGLang's evict_from_tree_cache, a shortfall evicts `need` tokens, not the difference."""
        available = self.allocator.available_size()
        if available < need:
            self.cache.evict(need)
            available = self.allocator.available_size()
        return available

    def match(self, token_ids: Sequence[int], extra_key: str | None, prefetch: Prefetch | None = None) -> MatchResult:
        """The cached prefix of `token_ids`, extended from the host tier where it continues there:
        those pages get device slots now (their copies go with the next batch) and join the tree.
        `prefetch`: the request's storage read, ended here; the blocks it read join the host tier
        after room was made, so the host copies of evicted pages cannot push them out first."""
        match = self.cache.match_prefix(token_ids, extra_key)
        host = self.host_tier
        if host is None:
            return match
        end = len(token_ids) // self.page_size * self.page_size
        staged = prefetch.take() if prefetch is not None else []
        if not staged and host.find(token_ids, extra_key, match.length, end) <= match.length:
            return match
        self.cache.inc_lock_ref(match.last_node)  # making room must not evict the match itself
        self.make_room(end - match.length)
        self.cache.dec_lock_ref(match.last_node)
        if staged:
            assert prefetch is not None
            host.adopt(prefetch.keys, prefetch.tokens, staged)
        reach = host.find(token_ids, extra_key, match.length, end)  # making room may have dropped blocks
        slots = self.allocator.alloc(reach - match.length) if reach > match.length else None
        if slots is None:
            return match
        host.load(token_ids, extra_key, match.length, slots)
        self.cache.insert(token_ids[:reach], torch.cat([match.slots, slots]), extra_key)
        return self.cache.match_prefix(token_ids, extra_key)

    def has_kv_copies(self) -> bool:
        return self.host_tier is not None and bool(self.host_tier.pending)

    def take_kv_copies(self) -> list[KVCopy]:
        return self.host_tier.take_pending() if self.host_tier is not None else []

    def decode_slots_needed(self, positions: np.ndarray) -> int:
        """Fresh slots for one more token at each of `positions`: only a token that starts a page takes one."""
        if self.page_size == 1:
            return len(positions)
        return self.page_size * int((positions % self.page_size == 0).sum())

    def inc_lock_ref(self, node: RadixNode) -> None:
        """Lock a prefix for an admission (the PrefillAdder's budget check needs it locked before
        the row opens); `open_row` keeps the lock for the row and `close_row` releases it."""
        self.cache.inc_lock_ref(node)

    def dec_lock_ref(self, node: RadixNode) -> None:
        """Give back a lock `inc_lock_ref` took for an admission that was then refused."""
        self.cache.dec_lock_ref(node)

    def open_row(self, match: MatchResult) -> int:
        """A row holding the matched prefix (borrowed from the cache), keeping the lock on
        `match.last_node` that this ledger took for the admission."""
        row = self.req_to_token.alloc()
        assert row is not None, "rows were counted before admission"
        if match.length:
            self.req_to_token.write(row, 0, match.slots)
        self._held[row] = match.length
        self._node[row] = match.last_node
        return row

    def extend(self, row: int, num_tokens: int) -> torch.Tensor | None:
        """Slots for the row's next `num_tokens` positions, recorded in the row; None if the pool
        is short (nothing changed then)."""
        held = int(self._held[row])
        last = int(self.req_to_token.table[row, held - 1]) if held and self.page_size > 1 else None
        slots = self.allocator.alloc_extend(held, last, num_tokens)
        if slots is None:
            return None
        self.req_to_token.write(row, held, slots)
        self._held[row] = held + num_tokens
        return slots

    def extend_decode(self, rows: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        """One slot for each row's next token (at `positions`, each row's held length): one
        allocation and one indexed write for the whole set. With pages of several slots a row
        whose last page has room takes the slot after its last one; the others start a page."""
        page = self.page_size
        torch_positions = torch.from_numpy(positions)
        if page == 1:
            slots = self.allocator.alloc(len(rows))
            assert slots is not None, "the caller made room first"
        else:
            fresh = torch_positions % page == 0
            pages = self.allocator.alloc(int(fresh.sum()) * page)
            assert pages is not None, "the caller made room first"
            # positions are never 0 in a decode, so every row has a last slot
            slots = self.req_to_token.table[rows, torch_positions - 1].to(torch.int64) + 1
            slots[fresh] = pages.view(-1, page)[:, 0]
        self.req_to_token.write_at(rows, torch_positions, slots)
        self._held[rows.numpy()] = positions + 1
        return slots

    def cache_prefix(self, row: int, tokens: Sequence[int], extra_key: str | None) -> int:
        """Put the row's first len(tokens) positions into the cache while its request runs (the
        row then borrows the cache's slots for them, moving its lock); returns the cached length.
        Safe before the step that computes them has run: steps run in launch order, so a step that
        reads these slots through another request runs after the one that writes them."""
        result = self.cache.cache_unfinished_req(tokens, self.req_to_token, row, self._locked(row), extra_key)
        self._node[row] = result.last_node
        return result.length

    def close_row(self, row: int, tokens: Sequence[int] | None, extra_key: str | None) -> None:
        """Give the row back: with `tokens` (the request's tokens, at least its held length) its
        computed pages go into the cache, else its owned slots are freed; its lock is released."""
        held = int(self._held[row])
        slots = self.req_to_token.slots(row, held).to(torch.int64)
        if tokens is not None:
            self.cache.cache_finished_req(tokens[:held], slots, self._locked(row), extra_key)
        else:
            self.cache.release_req(slots, self._locked(row))
        self.req_to_token.free(row)
        self._held[row] = 0
        self._node[row] = None

    def held(self, row: int) -> int:
        return int(self._held[row])

    def _locked(self, row: int) -> RadixNode:
        node = self._node[row]
        assert node is not None, f"request row {row} is not open"
        return node

    def flush_cache(self) -> None:
        """Drop every cached prefix; only while no row is open (a row may borrow cached slots)."""
        assert not self.open_rows(), "flushing the cache under live requests"
        self.cache.reset()
        if self.host_tier is not None:
            self.host_tier.reset()

    def open_rows(self) -> list[int]:
        return [row for row, node in enumerate(self._node) if node is not None]

    def owned_slots(self) -> int:
        """Slots the live rows own: whole pages from each row's locked depth to its held length."""
        page = self.page_size
        return sum(-(-int(self._held[row]) // page) * page - self._locked(row).depth for row in self.open_rows())

    def check(self) -> None:
        """The accounting rule (module docstring); raises AssertionError naming the numbers."""
        free, cached, owned = self.allocator.available_size(), self.cache.total_size(), self.owned_slots()
        assert free + cached + owned == self.allocator.size, f"free {free} + cached {cached} + owned {owned} != pool {self.allocator.size}"
        rows_open, rows_free = len(self.open_rows()), self.req_to_token.available()
        assert rows_open + rows_free == self.req_to_token.max_requests, f"{rows_open} rows open + {rows_free} free != {self.req_to_token.max_requests}"
        if self.host_tier is not None:
            self.host_tier.check()
