"""Property-based tests of RadixCache against a reference model (hypothesis state machine).

The model is a dict `(extra_key, page-aligned token prefix) -> KV slots of the prefix's last page`:
exactly what the tree must hold. Random sequences of request admissions (match + lock + allocate), finishes,
chunked-prefill steps, aborts, raw inserts, matches, external locks and evictions run against both;
after every step the tree is walked and compared with the model and with the cache's counters, and
the KV accounting identity is checked:

    allocator free + evictable + protected + owned by live requests == pool size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache import RadixCache, RadixNode
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator

POOL = 48  # a multiple of every page size below
MAX_LEN = 12
KEYS = st.sampled_from([None, "a"])
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=MAX_LEN)  # small alphabet: prefixes are shared

Prefix = tuple[str | None, tuple[int, ...]]  # (extra_key, tokens); len(tokens) is a page multiple


class RecordingAllocator(TokenSlotAllocator):
    def __init__(self, size: int, page_size: int) -> None:
        super().__init__(size, page_size)
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        super().free(slots)
        self.freed.extend(slots.tolist())


@dataclass(slots=True)
class LiveReq:
    tokens: list[int]
    extra_key: str | None
    row: int
    last_node: RadixNode
    computed: int  # tokens whose KV exists (prefix + chunks)

    @property
    def prefix(self) -> int:
        return self.last_node.depth


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu", "fifo"]), chunk=st.sampled_from([1, 3, 2048]))
    def setup(self, page: int, policy: str, chunk: int) -> None:
        # A tiny first encoding chunk makes short keys cross the lazy-encoding boundaries too.
        self.page = page
        self.alloc = RecordingAllocator(POOL, page)
        self.cache = RadixCache(self.alloc, eviction_policy=policy, first_chunk=chunk)
        self.rows = ReqToTokenPool(max_requests=5, context_len=MAX_LEN)
        self.model: dict[Prefix, tuple[int, ...]] = {}
        self.live: list[LiveReq] = []
        self.external: list[tuple[RadixNode, str | None, tuple[int, ...]]] = []  # locks held without a request

    # -- the reference model ------------------------------------------------------------------

    def page_ends(self, length: int) -> range:
        return range(self.page, length // self.page * self.page + 1, self.page)

    def expected_match(self, tokens: list[int], extra_key: str | None) -> list[int]:
        """Slots of the longest page-aligned prefix of `tokens` present in the model."""
        slots: list[int] = []
        for end in self.page_ends(len(tokens)):
            page = self.model.get((extra_key, tuple(tokens[:end])))
            if page is None:
                break
            slots.extend(page)
        return slots

    def check_match(self, tokens: list[int], extra_key: str | None):
        result = self.cache.match_prefix(tokens, extra_key)
        expected = self.expected_match(tokens, extra_key)
        assert result.length == len(expected) == result.last_node.depth
        assert result.slots.tolist() == expected
        return result

    def record(self, tokens: list[int], extra_key: str | None, slots: list[int]) -> None:
        """The model after caching the whole pages of `tokens`: existing entries win."""
        for end in self.page_ends(len(tokens)):
            self.model.setdefault((extra_key, tuple(tokens[:end])), tuple(slots[end - self.page : end]))

    def owned(self, req: LiveReq) -> int:
        """Slots a live request owns: whole pages from its cached prefix to the end of its prompt."""
        return -(-(len(req.tokens) - req.prefix) // self.page) * self.page

    def holders(self) -> list[RadixNode]:
        return [req.last_node for req in self.live] + [node for node, _, _ in self.external]

    # -- rules ----------------------------------------------------------------------------------

    @rule(tokens=TOKENS, extra_key=KEYS)
    def admit(self, tokens: list[int], extra_key: str | None) -> None:
        row = self.rows.alloc()
        if row is None:
            return
        match = self.check_match(tokens[:-1], extra_key)  # the caller's len-1 rule
        self.cache.inc_lock_ref(match.last_node)
        need = len(tokens) - match.length
        own = self.alloc.alloc(need)
        if own is None:
            self.evict_and_check(need)
            own = self.alloc.alloc(need)
        if own is None:
            self.cache.dec_lock_ref(match.last_node)
            self.rows.free(row)
            return
        self.rows.write(row, 0, torch.cat([match.slots, own]))
        self.live.append(LiveReq(tokens, extra_key, row, match.last_node, match.length))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def finish(self, i: int) -> None:
        req = self.live.pop(i % len(self.live))
        slots = self.rows.slots(req.row, len(req.tokens)).clone()
        self.record(req.tokens, req.extra_key, slots.tolist())
        self.cache.cache_finished_req(req.tokens, slots, req.last_node, req.extra_key)
        self.rows.free(req.row)

    @precondition(lambda self: any(req.computed < len(req.tokens) for req in self.live))
    @rule(data=st.data())
    def chunk(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from([r for r in self.live if r.computed < len(r.tokens)]))
        cut = data.draw(st.integers(req.computed + 1, len(req.tokens)))
        aligned = cut // self.page * self.page
        before = self.rows.slots(req.row, len(req.tokens)).tolist()
        expected_row: list[int] = []
        for end in self.page_ends(cut):
            expected_row.extend(self.model.get((req.extra_key, tuple(req.tokens[:end])), before[end - self.page : end]))
        self.record(req.tokens[:cut], req.extra_key, before)
        old_node = req.last_node
        result = self.cache.cache_unfinished_req(req.tokens[:cut], self.rows, req.row, old_node, req.extra_key)
        assert result.length == aligned == result.last_node.depth
        assert result.slots.tolist() == expected_row
        after = self.rows.slots(req.row, len(req.tokens)).tolist()
        assert after == expected_row + before[aligned:]  # the unaligned tail stays with the request
        req.last_node, req.computed = result.last_node, cut

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def abort(self, i: int) -> None:
        req = self.live.pop(i % len(self.live))
        self.cache.release_req(self.rows.slots(req.row, len(req.tokens)), req.last_node)
        self.rows.free(req.row)

    @rule(tokens=TOKENS, extra_key=KEYS)
    def insert(self, tokens: list[int], extra_key: str | None) -> None:
        slots = self.alloc.alloc(len(tokens))
        if slots is None:
            return
        expected_present = len(self.expected_match(tokens, extra_key))
        present = self.cache.insert(tokens, slots, extra_key)
        assert present == expected_present
        self.record(tokens, extra_key, slots.tolist())
        aligned = len(tokens) // self.page * self.page
        self.alloc.free(torch.cat([slots[:present], slots[aligned:]]))

    @rule(tokens=TOKENS, extra_key=KEYS)
    def match(self, tokens: list[int], extra_key: str | None) -> None:
        self.check_match(tokens, extra_key)

    @rule(tokens=TOKENS, extra_key=KEYS)
    def lock(self, tokens: list[int], extra_key: str | None) -> None:
        result = self.check_match(tokens, extra_key)
        self.cache.inc_lock_ref(result.last_node)
        self.external.append((result.last_node, extra_key, tuple(tokens[: result.length])))

    @precondition(lambda self: self.external)
    @rule(i=st.integers(0, 10))
    def unlock(self, i: int) -> None:
        node, _, _ = self.external.pop(i % len(self.external))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, POOL))
    def evict(self, n: int) -> None:
        self.evict_and_check(n)

    def evict_and_check(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        locked = {slot for _, key, toks in self.external for end in self.page_ends(len(toks)) for slot in self.model[(key, toks[:end])]}
        for req in self.live:
            locked.update(self.rows.slots(req.row, req.prefix).tolist())
        start = len(self.alloc.freed)
        freed = self.cache.evict(n)
        gone = set(self.alloc.freed[start:])
        assert freed == len(self.alloc.freed) - start == len(gone)
        assert freed >= min(n, evictable)
        assert self.cache.evictable_size() == evictable - freed
        assert not gone & locked
        self.model = {prefix: page for prefix, page in self.model.items() if not gone.intersection(page)}

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def tree_matches_model_and_counters(self) -> None:
        if not hasattr(self, "cache"):
            return
        cache, root = self.cache, self.cache.root
        content: dict[Prefix, tuple[int, ...]] = {}
        evictable = protected = 0
        leaves = set()
        expected_locks = {}
        for holder in self.holders():
            node = holder
            while node is not root:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                node = node.parent
        stack: list[tuple[RadixNode, str | None, tuple[int, ...]]] = [
            (child, edge[0], ()) for edge, child in root.children.items()
        ]
        while stack:
            node, key, before = stack.pop()
            tokens = node.token_ids()
            assert tokens and len(tokens) % self.page == 0
            assert node.value is not None and node.value.tolist() and len(node.value) == len(tokens)
            assert node.depth == len(before) + len(tokens)
            first = tokens[0] if self.page == 1 else tuple(tokens[: self.page])
            assert node.edge == ((key, first) if node.parent is root else first)
            assert node.lock_ref == expected_locks.get(id(node), 0)
            slots = node.value.tolist()
            for end in self.page_ends(len(tokens)):
                content[(key, before + tuple(tokens[:end]))] = tuple(slots[end - self.page : end])
            if node.lock_ref:
                protected += len(tokens)
            else:
                evictable += len(tokens)
                if not node.children:
                    leaves.add(node)
            for child in node.children.values():
                assert child.parent is node
                stack.append((child, key, before + tuple(tokens)))
        assert content == self.model
        assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)
        assert cache._leaves == leaves
        assert root.lock_ref == 1

    @invariant()
    def every_slot_is_accounted_for(self) -> None:
        if not hasattr(self, "cache"):
            return
        held = sum(self.owned(req) for req in self.live)
        total = self.alloc.available_size() + self.cache.evictable_size() + self.cache.protected_size() + held
        assert total == POOL
        cached = [slot for page in self.model.values() for slot in page]
        assert len(set(cached)) == len(cached)  # no slot cached twice


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixCacheStateMachine = RadixCacheMachine.TestCase
