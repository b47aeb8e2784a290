"""Reference cases for the prefix caches of cache/ (RadixCache, ChunkCache), per reference/sglang-behaviour.md."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from cache import ChunkCache, MatchResult, PrefixCache, RadixCache, RadixNode, token_array
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator


class RecordingAllocator(TokenSlotAllocator):
    """Remembers every slot handed back, so tests can check what eviction freed."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        super().__init__(size, page_size)
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        super().free(slots)
        self.freed.extend(slots.tolist())


def make(size: int = 64, page_size: int = 1, policy: str = "lru") -> tuple[RadixCache, RecordingAllocator]:
    alloc = RecordingAllocator(size, page_size)
    return RadixCache(alloc, eviction_policy=policy), alloc


def put(cache: RadixCache, alloc: TokenSlotAllocator, tokens: list[int], extra_key: str | None = None) -> torch.Tensor:
    """Insert `tokens` with fresh slots the way a caller must: free what the tree did not take."""
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    present = cache.insert(tokens, slots, extra_key)
    aligned = len(tokens) // cache.page_size * cache.page_size
    alloc.free(torch.cat([slots[:present], slots[aligned:]]))
    return slots


def nodes(cache: RadixCache) -> list[RadixNode]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def assert_accounting(cache: PrefixCache, alloc: TokenSlotAllocator, held: int = 0) -> None:
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() + held == alloc.size


# -- match and insert -------------------------------------------------------------------------


def test_insert_then_full_and_partial_matches():
    cache, alloc = make()
    slots = put(cache, alloc, [1, 2, 3, 4, 5])
    full = cache.match_prefix([1, 2, 3, 4, 5])
    assert full.length == 5 and full.slots.tolist() == slots.tolist()
    assert full.slots.dtype == torch.int64
    part = cache.match_prefix([1, 2, 3, 9, 9])
    assert part.length == 3 and part.slots.tolist() == slots[:3].tolist()
    assert part.last_node.depth == 3
    longer = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert longer.length == 5 and longer.last_node is full.last_node
    miss = cache.match_prefix([9, 1, 2])
    assert miss.length == 0 and miss.last_node is cache.root and miss.slots.numel() == 0
    assert cache.match_prefix([]).length == 0


def test_match_accepts_lists_tuples_arrays_and_tensors():
    cache, alloc = make()
    slots = put(cache, alloc, [7, 8, 9, 10])
    query = [7, 8, 9, 11]
    for form in (query, tuple(query), array("i", query), torch.tensor(query), token_array(query)):
        result = cache.match_prefix(form)
        assert result.length == 3 and result.slots.tolist() == slots[:3].tolist()


def test_array_queries_ignore_the_unaligned_tail():
    """array('i') queries are encoded whole; a node must still not match past the last whole page."""
    cache, alloc = make(size=64, page_size=4)
    slots = put(cache, alloc, list(range(1, 9)))
    result = cache.match_prefix(token_array(range(1, 8)))  # 7 tokens: one whole page
    assert result.length == 4 and result.slots.tolist() == slots[:4].tolist()
    assert cache.match_prefix(array("i", range(1, 9))).length == 8


def test_insert_returns_the_length_already_cached_and_sizes_add_up():
    cache, alloc = make()
    assert cache.insert([1, 2, 3, 4, 5], alloc.alloc(5)) == 0
    assert cache.total_size() == 5 and cache.evictable_size() == 5 and cache.protected_size() == 0
    second = alloc.alloc(4)
    assert cache.insert([1, 2, 7, 8], second) == 2
    alloc.free(second[:2])  # the duplicates of [1, 2]
    assert cache.total_size() == 7 and cache.evictable_size() == 7
    again = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], again) == 5  # all present: every slot is a duplicate
    alloc.free(again)
    assert cache.total_size() == 7
    assert sorted(node.num_tokens for node in nodes(cache)) == [2, 2, 3]  # [1 2] -> {[3 4 5], [7 8]}


def test_insert_of_a_prefix_of_a_node_splits_it_without_adding():
    cache, alloc = make()
    slots = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    extra = alloc.alloc(3)
    assert cache.insert([1, 2, 3], extra) == 3
    alloc.free(extra)
    assert cache.total_size() == 6
    assert [n.num_tokens for n in nodes(cache)] == [3, 3]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()


def test_insert_keeps_its_own_copy_of_the_slots():
    """Callers pass views of request rows, which are rewritten when the row is reused."""
    cache, alloc = make()
    rows = ReqToTokenPool(max_requests=2, context_len=8)
    slots = alloc.alloc(4)
    rows.write(1, 0, slots)
    cache.insert([1, 2, 3, 4], rows.slots(1, 4))  # an int32 view of row 1
    rows.write(1, 0, torch.tensor([0, 0, 0, 0]))
    result = cache.match_prefix([1, 2, 3, 4])
    assert result.slots.tolist() == slots.tolist() and result.slots.dtype == torch.int64


def test_extra_key_namespaces_never_share():
    cache, alloc = make()
    a = put(cache, alloc, [1, 2, 3], extra_key="lora-a")
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], extra_key="lora-b").length == 0
    assert cache.match_prefix([1, 2, 3], extra_key="lora-a").slots.tolist() == a.tolist()
    b = alloc.alloc(3)
    assert cache.insert([1, 2, 3], b, extra_key="lora-b") == 0  # not shared with lora-a
    none = alloc.alloc(3)
    assert cache.insert([1, 2, 3], none) == 0
    assert cache.total_size() == 9 and len(cache.root.children) == 3
    assert cache.match_prefix([1, 2, 3], extra_key="lora-b").slots.tolist() == b.tolist()
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == none.tolist()
    # Evicting one namespace leaves the others whole.
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3], extra_key="lora-a").last_node)
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    assert cache.evict(100) == 3
    assert cache.match_prefix([1, 2, 3], extra_key="lora-b").length == 0
    assert cache.match_prefix([1, 2, 3], extra_key="lora-a").length == 3


@pytest.mark.parametrize(("page", "length"), [(1, 5), (2, 5), (4, 6)])
def test_page_alignment(page: int, length: int):
    cache, alloc = make(size=64, page_size=page)
    tokens = list(range(100, 100 + length))
    slots = put(cache, alloc, tokens)
    aligned = length // page * page
    assert cache.total_size() == aligned
    result = cache.match_prefix(tokens)
    assert result.length == aligned and result.slots.tolist() == slots[:aligned].tolist()
    # A query that diverges inside a page matches only the pages before it.
    diverging = tokens[:]
    diverging[aligned - 1] = 7
    assert cache.match_prefix(diverging).length == aligned - page
    assert all(node.num_tokens % page == 0 for node in nodes(cache))
    assert_accounting(cache, alloc)


def test_pages_are_compared_whole_at_the_first_edge():
    cache, alloc = make(size=64, page_size=4)
    put(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match_prefix([1, 2, 3, 9, 5, 6, 7, 8]).length == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9]).length == 4


def test_split_keeps_total_size_and_slots():
    cache, alloc = make()
    slots = put(cache, alloc, list(range(10, 18)))
    cache.inc_lock_ref(cache.match_prefix(list(range(10, 18))).last_node)
    before = (cache.total_size(), cache.evictable_size(), cache.protected_size())
    mid = cache.match_prefix([10, 11, 12])  # ends inside the only node: split
    assert mid.length == 3 and len(nodes(cache)) == 2
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == before
    assert mid.last_node.lock_ref == 1  # the upper half keeps the holder of the lower half
    assert cache.match_prefix(list(range(10, 18))).slots.tolist() == slots.tolist()


def test_long_keys_across_encoding_chunks():
    """Mismatches around the lazy-encoding chunk boundaries are found exactly."""
    rng = random.Random(1)
    base = [rng.randrange(1, 200_000) for _ in range(9000)]
    cache, alloc = make(size=9000)
    cache.insert(base, alloc.alloc(9000))
    for cut in (1, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8999):
        query = base[:cut] + [0] + base[cut + 1 :]
        assert cache.match_prefix(query).length == cut
    assert cache.match_prefix(base).length == 9000
    assert cache.match_prefix(base + [5]).length == 9000
    assert cache.total_size() == 9000


def test_match_touches_access_times_on_the_path_only():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    shared = cache.match_prefix([1, 2]).last_node
    three = cache.match_prefix([1, 2, 3]).last_node
    four = cache.match_prefix([1, 2, 4]).last_node
    t_three = three.last_access
    cache.match_prefix([1, 2, 4])
    assert three.last_access == t_three and four.last_access > t_three and shared.last_access == four.last_access


# -- locks --------------------------------------------------------------------------------------


def test_lock_and_unlock_move_exactly_the_node_lengths():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5])
    put(cache, alloc, [1, 2, 7, 8])  # tree: [1 2] -> {[3 4 5], [7 8]}
    leaf = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    cache.inc_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (2, 5)
    cache.inc_lock_ref(leaf)  # a second holder changes no size
    assert (cache.evictable_size(), cache.protected_size()) == (2, 5)
    other = cache.match_prefix([1, 2, 7, 8]).last_node
    cache.inc_lock_ref(other)  # only [7 8] is new; [1 2] is already protected
    assert (cache.evictable_size(), cache.protected_size()) == (0, 7)
    cache.dec_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 7)
    cache.dec_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (3, 4)
    cache.dec_lock_ref(other)
    assert (cache.evictable_size(), cache.protected_size()) == (7, 0)
    with pytest.raises(ValueError, match="unlocked"):
        cache.dec_lock_ref(other)
    cache.inc_lock_ref(cache.root)  # the root is always locked: no-ops
    cache.dec_lock_ref(cache.root)
    assert cache.root.lock_ref == 1 and (cache.evictable_size(), cache.protected_size()) == (7, 0)


def test_lock_on_an_evicted_node_is_refused():
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    assert cache.evict(2) == 2
    with pytest.raises(ValueError, match="not in this tree"):
        cache.inc_lock_ref(node)


# -- eviction -----------------------------------------------------------------------------------


def test_evict_frees_what_it_says_and_returns_slots_to_the_allocator():
    cache, alloc = make()
    a = put(cache, alloc, [1, 2, 3])
    b = put(cache, alloc, [4, 5])
    cache.match_prefix([4, 5])  # b is now more recently used than a
    free_before = alloc.available_size()
    freed = cache.evict(1)
    assert freed == 3  # whole leaf [1 2 3], the least recently used
    assert sorted(alloc.freed[-3:]) == sorted(a.tolist())
    assert alloc.available_size() == free_before + 3
    assert cache.match_prefix([1, 2, 3]).length == 0 and cache.match_prefix([4, 5]).slots.tolist() == b.tolist()
    assert_accounting(cache, alloc)


def test_evict_never_touches_locked_paths_and_stops_at_evictable():
    cache, alloc = make()
    first = put(cache, alloc, [1, 2, 3])
    kept = torch.cat([first[:2], put(cache, alloc, [1, 2, 4, 5])[2:]])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 4, 5]).last_node)
    assert cache.evictable_size() == 1
    assert cache.evict(100) == 1
    assert cache.evict(100) == 0
    assert cache.match_prefix([1, 2, 4, 5]).slots.tolist() == kept.tolist()
    assert cache.evict(0) == 0 and cache.evict(-3) == 0


def test_a_parent_left_childless_is_evicted_in_the_same_call():
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    put(cache, alloc, [1, 2, 3, 4])  # chain [1 2] -> [3 4]
    assert len(nodes(cache)) == 2
    assert cache.evict(4) == 4
    assert cache.total_size() == 0 and not cache.root.children
    assert_accounting(cache, alloc)


def _three_leaves(policy: str) -> RadixCache:
    cache, alloc = make(policy=policy)
    for token in (1, 2, 3):  # created in this order
        put(cache, alloc, [token])
    for token in (3, 3, 1, 1, 2):
        cache.match_prefix([token])
    # created: 1 < 2 < 3; last use: [3] oldest; [2] has the fewest matches
    return cache


@pytest.mark.parametrize(("policy", "victim"), [("lru", 3), ("lfu", 3), ("fifo", 1)])
def test_eviction_policies_pick_their_victim(policy: str, victim: int):
    """lfu evicts as lru: SGLang's plain RadixCache never counts hits, so its (hits, last access)
    key is ordered by the access time alone, and [2]'s fewer matches do not matter."""
    cache = _three_leaves(policy)
    assert cache.evict(1) == 1
    gone = [t for t in (1, 2, 3) if cache.match_prefix([t]).length == 0]
    assert gone == [victim]


def test_split_gives_both_halves_the_match_time():
    """SGLang's match stamps the child before splitting it: the lower half is as recent as the
    upper one, so an older leaf elsewhere is evicted first."""
    cache, alloc = make(policy="lru")
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [9])  # newer than [1, 2, 3, 4]
    cache.match_prefix([1, 2])  # splits [1, 2 | 3, 4]
    cache.evict(1)
    assert cache.match_prefix([9]).length == 0
    assert cache.match_prefix([1, 2, 3, 4]).length == 4


def test_unknown_eviction_policy_names_the_allowed_ones():
    with pytest.raises(ValueError, match="lru, lfu, fifo"):
        RadixCache(TokenSlotAllocator(8), eviction_policy="mru")


# -- request lifecycle --------------------------------------------------------------------------


def admit(cache: PrefixCache, alloc: TokenSlotAllocator, tokens: list[int]) -> tuple[MatchResult, torch.Tensor]:
    """What the Adder does: match at most len-1 tokens, lock, allocate the rest."""
    match = cache.match_prefix(tokens[:-1])
    cache.inc_lock_ref(match.last_node)
    own = alloc.alloc(len(tokens) - match.length)
    assert own is not None
    return match, torch.cat([match.slots, own])


def test_cache_finished_req_frees_duplicates_and_tail_exactly_once():
    cache, alloc = make(size=64, page_size=2)
    # Two requests with the same 7-token prompt run concurrently: neither hits the cache.
    m1, s1 = admit(cache, alloc, [1, 2, 3, 4, 5, 6, 7])
    m2, s2 = admit(cache, alloc, [1, 2, 3, 4, 5, 6, 7])
    assert m1.length == m2.length == 0
    assert_accounting(cache, alloc, held=8 + 8)  # 7 tokens each, 4 pages each
    cache.cache_finished_req([1, 2, 3, 4, 5, 6, 7], s1, m1.last_node)
    assert cache.total_size() == 6  # three whole pages; token 7's page went back
    assert_accounting(cache, alloc, held=8)
    cache.cache_finished_req([1, 2, 3, 4, 5, 6, 7], s2, m2.last_node)
    assert cache.total_size() == 6  # s2's pages were duplicates: all freed
    assert_accounting(cache, alloc)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == s1[:6].tolist()


def test_cache_finished_req_keeps_borrowed_slots_and_unlocks():
    cache, alloc = make(size=64)
    put(cache, alloc, [1, 2, 3, 4])
    match, slots = admit(cache, alloc, [1, 2, 3, 4, 5, 6])
    assert match.length == 4 and cache.protected_size() == 4
    assert_accounting(cache, alloc, held=2)
    cache.cache_finished_req([1, 2, 3, 4, 5, 6], slots, match.last_node)
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()
    assert_accounting(cache, alloc)


def test_cache_finished_req_frees_slots_past_the_token_ids():
    cache, alloc = make(size=64)
    match, slots = admit(cache, alloc, [1, 2, 3, 4])
    extra = alloc.alloc(1)  # e.g. a slot taken for a token that was never run
    cache.cache_finished_req([1, 2, 3, 4], torch.cat([slots, extra]), match.last_node)
    assert cache.total_size() == 4
    assert_accounting(cache, alloc)


def test_cache_finished_req_refuses_a_foreign_last_node():
    cache, alloc = make(size=64)
    put(cache, alloc, [1, 2, 3])
    match, slots = admit(cache, alloc, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="cached prefix has 3 tokens"):
        cache.cache_finished_req([1, 2, 3, 4], slots, match.last_node, extra_key="other")


def test_cache_unfinished_req_rewrites_the_row_and_moves_the_lock():
    page = 2
    cache, alloc = make(size=64, page_size=page)
    rows = ReqToTokenPool(max_requests=4, context_len=32)
    prompt = list(range(1, 12))  # 11 tokens, prefilled in chunks
    # Another request already cached the first 4 tokens.
    put(cache, alloc, prompt[:4])
    cached = cache.match_prefix(prompt[:4]).slots
    # Our request was admitted before that insert landed: it matched nothing and owns 11 slots.
    row = rows.alloc()
    assert row is not None
    own = alloc.alloc(11)
    rows.write(row, 0, own)
    last = cache.root
    # Chunk 1 computed 5 tokens: pages [1 2] [3 4] are duplicates, token 5 is an unaligned tail.
    r1 = cache.cache_unfinished_req(prompt[:5], rows, row, last)
    assert r1.length == 4 and r1.last_node.depth == 4 and r1.last_node.lock_ref == 1
    assert rows.slots(row, 4).tolist() == cached.tolist()  # now the tree's slots
    assert rows.slots(row, 11, 4).tolist() == own[4:].tolist()  # the rest is still the request's
    assert sorted(alloc.freed[-4:]) == sorted(own[:4].tolist())  # the duplicates went back
    assert cache.protected_size() == 4
    assert_accounting(cache, alloc, held=8)  # positions 4..10: 4 pages
    # Chunk 2 computed up to 9 tokens: pages [5 6] [7 8] join the tree, token 9 stays with us.
    r2 = cache.cache_unfinished_req(prompt[:9], rows, row, r1.last_node)
    assert r2.length == 8 and r1.last_node.lock_ref == 1 and r2.last_node.lock_ref == 1
    assert rows.slots(row, 8).tolist() == cached.tolist() + own[4:8].tolist()
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    assert_accounting(cache, alloc, held=4)  # positions 8..10: 2 pages
    # A chunk that does not reach a new page changes nothing.
    r3 = cache.cache_unfinished_req(prompt[:9], rows, row, r2.last_node)
    assert r3.last_node is r2.last_node and r3.slots.tolist() == r2.slots.tolist()
    assert_accounting(cache, alloc, held=4)
    # Finish with the whole prompt, slots read from the row.
    cache.cache_finished_req(prompt, rows.slots(row, 11), r3.last_node)
    assert cache.protected_size() == 0 and cache.total_size() == 10
    assert_accounting(cache, alloc)


def test_release_req_frees_only_what_the_request_owns():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    match, slots = admit(cache, alloc, [1, 2, 3, 4, 5])
    cache.release_req(slots, match.last_node)
    assert cache.protected_size() == 0 and cache.total_size() == 3
    assert_accounting(cache, alloc)


# -- ChunkCache ---------------------------------------------------------------------------------


def test_chunk_cache_matches_nothing_and_frees_everything():
    alloc = TokenSlotAllocator(32, page_size=2)
    cache = ChunkCache(alloc)
    m1, s1 = admit(cache, alloc, [1, 2, 3, 4, 5])
    assert m1.length == 0 and m1.slots.numel() == 0
    cache.cache_finished_req([1, 2, 3, 4, 5], s1, m1.last_node)
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.evict(100)) == (0, 0, 0)
    assert_accounting(cache, alloc)
    # Chunked: the request keeps its whole row; nothing moves.
    rows = ReqToTokenPool(2, 16)
    row = rows.alloc()
    assert row is not None
    m2, s2 = admit(cache, alloc, [1, 2, 3, 4, 5])
    rows.write(row, 0, s2)
    r = cache.cache_unfinished_req([1, 2, 3], rows, row, m2.last_node)
    assert r.length == 0 and rows.slots(row, 5).tolist() == s2.tolist()
    assert_accounting(cache, alloc, held=6)
    assert cache.insert([1, 2, 3], s2[:3]) == 3  # takes nothing: the caller keeps its slots
    cache.release_req(s2, r.last_node)
    assert_accounting(cache, alloc)
    assert "disabled" in cache.pretty()


# -- reset, dump -------------------------------------------------------------------------------


def test_reset_returns_every_slot_and_is_refused_while_locked():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 5])
    node = cache.match_prefix([1, 5]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="hold"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size
    assert cache.match_prefix([1, 2, 3]).length == 0


def test_pretty_shows_every_node():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4], extra_key=None)
    put(cache, alloc, [5], extra_key="tenant")
    cache.inc_lock_ref(cache.match_prefix([1, 2, 4]).last_node)
    text = cache.pretty()
    lines = text.splitlines()
    assert lines[0].startswith("RadixCache(page_size=1, policy=lru, evictable=2, protected=3")
    assert len(lines) == 1 + 4
    assert any("<tenant>" in line and "[1] 5" in line for line in lines)
    assert any(line.startswith("    [1] 4") and "lock=1" in line for line in lines)


def test_page_size_must_agree_with_the_allocator():
    with pytest.raises(ValueError, match="page size"):
        RadixCache(TokenSlotAllocator(16, page_size=4), page_size=2)
    assert RadixCache(TokenSlotAllocator(16, page_size=4)).page_size == 4


def test_insert_needs_slots_for_every_cached_token():
    cache, alloc = make()
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2, 3], alloc.alloc(2))
