"""KVLedger under random sequences of what the Adder does with it (hypothesis state machine).

Admissions (match, lock, open a row, extend it), prefill chunks, decode steps over every live row,
caching a running request's prefix, finishes (cached), aborts (not cached), evictions and
flushes. After every step: the ledger's own accounting rule (`check`) and, independently of the
ledger's books, the pages themselves: every page a live row or the cache points at is allocated,
no page is pointed at by two owners, and no allocated page is pointed at by nobody.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.kv_ledger import KVLedger
from cache import ChunkCache, RadixCache, RadixNode
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator

POOL = 48
MAX_LEN = 24
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)  # small alphabet: prefixes are shared
KEYS = st.sampled_from([None, "a"])


@dataclass(slots=True)
class LiveRow:
    row: int
    tokens: list[int]  # every position of the row has its slot: len(tokens) == the ledger's held
    extra_key: str | None


class LedgerMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2, 4]))
    def setup(self, page: int) -> None:
        self.page = page
        self.alloc = TokenSlotAllocator(POOL, page)
        self.cache = RadixCache(self.alloc)
        self.rows = ReqToTokenPool(max_requests=4, context_len=MAX_LEN)
        self.ledger = KVLedger(self.alloc, self.rows, self.cache)
        self.live: list[LiveRow] = []

    # -- what the Adder does -------------------------------------------------------------------
    @rule(tokens=TOKENS, extra_key=KEYS)
    def admit(self, tokens: list[int], extra_key: str | None) -> None:
        if self.ledger.rows_free() == 0:
            return
        match = self.cache.match_prefix(tokens[:-1], extra_key)
        self.cache.inc_lock_ref(match.last_node)  # the PrefillAdder's lock, which the row keeps
        row = self.ledger.open_row(match)
        extend = len(tokens) - match.length
        self.ledger.make_room(extend + self.page)
        if self.ledger.extend(row, extend) is None:
            self.ledger.close_row(row, None, extra_key)  # refused: the row and its lock go back
            return
        assert self.ledger.held(row) == len(tokens)
        self.live.append(LiveRow(row, list(tokens), extra_key))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 9), more=TOKENS)
    def chunk(self, i: int, more: list[int]) -> None:
        req = self.live[i % len(self.live)]
        if len(req.tokens) + len(more) > MAX_LEN:
            return
        self.ledger.make_room(len(more) + self.page)
        if self.ledger.extend(req.row, len(more)) is not None:
            req.tokens += more

    @precondition(lambda self: self.live)
    @rule(token=st.integers(0, 2))
    def decode(self, token: int) -> None:
        if any(len(r.tokens) >= MAX_LEN for r in self.live):
            return
        positions = np.array([len(r.tokens) for r in self.live], dtype=np.int64)
        need = self.ledger.decode_slots_needed(positions)
        if self.ledger.make_room(need) < need:
            return
        free_before = self.alloc.available_size()
        slots = self.ledger.extend_decode(torch.tensor([r.row for r in self.live]), positions)
        assert free_before - self.alloc.available_size() == need
        for req, slot in zip(self.live, slots.tolist()):
            assert self.rows.table[req.row, len(req.tokens)] == slot
            req.tokens.append(token)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 9))
    def cache_prefix(self, i: int) -> None:
        req = self.live[i % len(self.live)]
        cached = self.ledger.cache_prefix(req.row, req.tokens, req.extra_key)
        assert cached == len(req.tokens) // self.page * self.page
        # The row reads the same tokens' slots from the cache now.
        assert self.cache.match_prefix(req.tokens, req.extra_key).slots.tolist() == self.rows.slots(req.row, cached).tolist()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 9), cache_it=st.booleans())
    def close(self, i: int, cache_it: bool) -> None:
        req = self.live.pop(i % len(self.live))
        self.ledger.close_row(req.row, req.tokens if cache_it else None, req.extra_key)
        if cache_it:
            whole_pages = len(req.tokens) // self.page * self.page
            assert self.cache.match_prefix(req.tokens, req.extra_key).length == whole_pages

    @rule(n=st.integers(1, POOL))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @precondition(lambda self: not self.live)
    @rule()
    def flush(self) -> None:
        self.ledger.flush_cache()
        assert self.alloc.available_size() == self.alloc.size

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def accounting_rule(self) -> None:
        self.ledger.check()
        assert self.ledger.rows_free() == self.rows.max_requests - len(self.live)
        for req in self.live:
            assert self.ledger.held(req.row) == len(req.tokens)

    @invariant()
    def every_allocated_page_has_one_owner(self) -> None:
        # Pages from what the rows and the cache point at, not from the ledger's books. A row
        # borrows its cached prefix from the tree, so only the part past it counts as the row's.
        owners: dict[int, str] = {}
        for node in _nodes(self.cache.root):
            for page in _pages(node.value, self.page):
                assert page not in owners, f"page {page} in two cache nodes"
                owners[page] = "cache"
        for req in self.live:
            row_pages = _pages(self.rows.slots(req.row, len(req.tokens)), self.page)
            borrowed = {p for p in row_pages if owners.get(p) == "cache"}
            for page in row_pages - borrowed:
                assert page not in owners, f"page {page} owned by row {req.row} and {owners[page]}"
                owners[page] = f"row {req.row}"
        allocated = {p for p in range(1, self.alloc.num_pages + 1) if not self.alloc._page_is_free[p]}
        assert allocated == set(owners), (sorted(allocated - set(owners)), sorted(set(owners) - allocated))


def _nodes(root: RadixNode) -> list[RadixNode]:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _pages(slots: torch.Tensor | None, page: int) -> set[int]:
    return set() if slots is None else {s // page for s in slots.tolist()}


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_ledger_accounting = LedgerMachine.TestCase


def test_rejects_an_allocator_and_cache_of_different_page_sizes() -> None:
    alloc = TokenSlotAllocator(POOL, 2)
    with pytest.raises(ValueError, match="page size 2 differs from the cache's 4"):
        KVLedger(alloc, ReqToTokenPool(max_requests=2, context_len=8), RadixCache(TokenSlotAllocator(POOL, 4)))


def test_check_names_the_numbers_when_a_slot_leaks() -> None:
    alloc = TokenSlotAllocator(POOL, 1)
    ledger = KVLedger(alloc, ReqToTokenPool(max_requests=2, context_len=8), ChunkCache(alloc))
    ledger.check()
    alloc.alloc(3)  # taken behind the ledger's back
    with pytest.raises(AssertionError, match=f"free {POOL - 3} \\+ cached 0 \\+ owned 0 != pool {POOL}"):
        ledger.check()


@pytest.mark.parametrize("cache_type", [RadixCache, ChunkCache])
def test_an_empty_match_has_its_slots_on_the_pool_device(cache_type: type) -> None:
    """A match of nothing yields slots on the pool's device, as every other match does, so a caller
    may join them to freshly allocated slots (on CUDA a CPU empty tensor made that join fail)."""
    cache = cache_type(TokenSlotAllocator(POOL, 1, device="meta"))
    assert cache.match_prefix([1, 2, 3]).slots.device.type == "meta"
