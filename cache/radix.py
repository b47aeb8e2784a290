"""`RadixCache`: the radix tree of cached prefixes over the paged KV pool (the slot ownership rule
is in cache/base.py).

Keys are page-aligned token ids in the int32 encoding of cache/keys.py. A query is encoded lazily,
as far as the walk needs it, so a short hit on a long prompt stays cheap; an `array('i')` query is
taken whole with one memcpy.
"""

from __future__ import annotations

import heapq
import struct
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from cache.base import MatchResult, PrefixCache, RadixNode, new_root
from cache.host_tier import HostTier
from cache.keys import TOKEN_BYTES, as_token_list, first_diff, pack_tokens
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator

FIRST_CHUNK = 256  # tokens encoded at least, on a query's first need


class _Query:
    """Token ids of one call and their int32 encoding, grown on demand."""

    __slots__ = ("tokens", "n", "buf", "enc", "first_chunk")

    def __init__(self, token_ids: Sequence[int], page_size: int, first_chunk: int) -> None:
        self.first_chunk = first_chunk
        self.buf = b""
        self.enc = 0  # tokens encoded so far
        if type(token_ids) is array and token_ids.typecode == "i":
            self.buf = token_ids.tobytes()  # a memcpy; `enc` is set to the whole pages below
            tokens: Sequence[int] = token_ids
        else:
            tokens = as_token_list(token_ids)
        self.tokens = tokens
        self.n = len(tokens) // page_size * page_size  # only whole pages are ever cached
        if self.buf:
            self.enc = self.n

    def grow(self, need: int) -> None:
        """Encode the query up to at least `need` tokens (capped at n). Doubling batches many short
        nodes into few calls; what a divergence inside a node wastes does not repeat, as the match
        splits the node there."""
        end = max(need, 2 * self.enc, self.first_chunk)
        if 2 * end >= self.n:
            end = self.n  # past half the query: finish it in one call (at most doubling the work)
        tokens = self.tokens
        # Packing the caller's list itself saves a slice: the whole query of a short prompt.
        self.buf += pack_tokens(tokens if self.enc == 0 and end == len(tokens) else tokens[self.enc : end])
        self.enc = end

    def encoded(self, start: int, end: int) -> bytes:
        if self.enc < end:
            self.grow(end)
        return self.buf[start * TOKEN_BYTES : end * TOKEN_BYTES]


_PRIORITIES: dict[str, Callable[[RadixNode], Any]] = {
    "lru": lambda node: node.last_access,
    # SGLang's plain RadixCache never counts hits (only HiRadixCache does, on insert): its LFU
    # key (hits, last access) orders exactly as LRU, and so does ours.
    "lfu": lambda node: node.last_access,
    "fifo": lambda node: node.created,
}


class RadixCache(PrefixCache):
    """Radix tree of cached prefixes with locks, O(1) size counters and leaf eviction."""

    shares_prefixes = True

    def __init__(
        self,
        allocator: TokenSlotAllocator,
        page_size: int | None = None,
        eviction_policy: str = "lru",
        *,
        first_chunk: int = FIRST_CHUNK,
        host_tier: HostTier | None = None,
    ) -> None:
        """`page_size`, where given, must be the allocator's; `first_chunk` is how many tokens of a
        query are encoded at least (tests shrink it so short keys cross the chunk boundaries)."""
        if eviction_policy not in _PRIORITIES:
            raise ValueError(f"unknown eviction policy {eviction_policy!r}; allowed: {', '.join(_PRIORITIES)}")
        if page_size not in (None, allocator.page_size):
            raise ValueError(f"page_size {page_size} differs from the allocator's page size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.eviction_policy = eviction_policy
        self._priority = _PRIORITIES[eviction_policy]
        self._device = allocator.device
        self._first_chunk = first_chunk
        # L2: evicted pages go there (and, write_through, cached pages as they are cached).
        self.host_tier = host_tier
        self._page_struct = struct.Struct(f"={self.page_size}i")
        self._clock = 0
        self._uid = 0
        self._reset_tree()

    def _reset_tree(self) -> None:
        self.root = new_root()
        self._evictable = 0
        self._protected = 0
        self._leaves: set[RadixNode] = set()  # unlocked leaves: the eviction candidates

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset while requests hold {self._protected} cached tokens")
        self._free([node.value for node in self._nodes()])  # type: ignore[misc]
        self._reset_tree()


    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected


    def match_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Splits the node the match ends inside, so `last_node` ends exactly at the match; touches
        the access time of the path."""
        parts: list[torch.Tensor] = []
        node, length = self._walk(self._query(token_ids), extra_key, parts)
        return MatchResult(length, node, parts, self.allocator.device)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, extra_key: str | None = None) -> int:
        """Cache the whole pages of `token_ids`; `slots[i]` holds the KV of token i.

        Returns how many leading tokens were already cached. The tree takes `slots[result:aligned]`
        (aligned = len rounded down to pages); the caller still owns `slots[:result]` (duplicates,
        apart from any it borrowed from the tree) and `slots[aligned:]`.
        """
        q = self._query(token_ids)
        self._check_slots(q, slots)
        return self._insert(q, slots, extra_key)[1]


    def inc_lock_ref(self, node: RadixNode) -> None:
        self._check_live(node)
        self._leaves.discard(node)  # only the lowest node of a path can be a leaf
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                size = node.num_tokens
                self._evictable -= size
                self._protected += size
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: RadixNode) -> None:
        self._check_live(node)
        root = self.root
        if node is root:
            return
        # Locks only grow towards the root, so checking the lowest node covers the whole path.
        if node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on an unlocked node {node!r}")
        lowest = node
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = node.num_tokens
                self._evictable += size
                self._protected -= size
            node = node.parent  # type: ignore[assignment]
        if lowest.lock_ref == 0 and not lowest.children:
            self._leaves.add(lowest)


    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, lowest priority first (a parent left a leaf joins the same call);
        whole nodes are freed, so the result may exceed `num_tokens`."""
        if num_tokens <= 0 or not self._leaves:
            return 0
        priority = self._priority
        heap = [(priority(node), node.uid, node) for node in self._leaves]
        heapq.heapify(heap)
        freed, values = 0, []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            if self.host_tier is not None:
                self._store_in_host(node)
            freed += self._remove_leaf(node, values)
            if parent is not self.root and parent.lock_ref == 0 and not parent.children:  # type: ignore[union-attr]
                self._leaves.add(parent)  # type: ignore[arg-type]
                heapq.heappush(heap, (priority(parent), parent.uid, parent))  # type: ignore[union-attr]
        self._free(values)
        return freed


    def cache_finished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, last_node: RadixNode, extra_key: str | None = None
    ) -> None:
        """Cache the whole pages of a finished request, free its duplicates of cached pages and
        everything past the last whole page, unlock `last_node`: the request then holds no slot.
        `slots` may run past `token_ids` (a slot taken for a token that was never run)."""
        q = self._query(token_ids)
        self._check_slots(q, slots)
        prefix = last_node.depth
        node, present = self._insert(q, slots, extra_key, min_present=prefix)
        if self.host_tier is not None and self.host_tier.write_policy == "write_through" and node is not self.root:
            # The whole path, not only what this call added: the pages cached while the request
            # ran (cache_unfinished_req, before the step computing them) are stored only now.
            # Blocks the host tier holds already are skipped.
            self._store_in_host(node, start=0)
        self._free([slots[prefix:present], slots[q.n :]])
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(
        self,
        token_ids: Sequence[int],
        req_to_token: ReqToTokenPool,
        row: int,
        last_node: RadixNode,
        extra_key: str | None = None,
    ) -> MatchResult:
        """Cache the computed whole pages of a chunked request and move its lock down.

        Duplicated pages are freed and the row rewritten with the tree's slots. The request then
        borrows positions `0 .. result.length - 1` (locked through `result.last_node`) and owns
        its row from `result.length` on, the unaligned tail included.
        """
        q = self._query(token_ids)
        prefix = last_node.depth
        own = req_to_token.slots(row, q.n).to(torch.int64)  # read before the row is rewritten
        node, present = self._insert(q, own, extra_key, min_present=prefix)
        result = MatchResult(q.n, node, self._path_values(node), self.allocator.device)
        if present > prefix:
            self._free([own[prefix:present]])
            req_to_token.write(row, prefix, result.slots[prefix:present])
        self.inc_lock_ref(node)
        self.dec_lock_ref(last_node)
        return result

    def release_req(self, slots: torch.Tensor, last_node: RadixNode) -> None:
        self._free([slots[last_node.depth :]])
        self.dec_lock_ref(last_node)


    def pretty(self, max_tokens: int = 8) -> str:
        lines = [
            f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy}, "
            f"evictable={self._evictable}, protected={self._protected})"
        ]
        stack = [(child, 1) for child in self._sorted_children(self.root)]
        while stack:
            node, level = stack.pop()
            lines.append("  " * level + self._describe(node, max_tokens))
            stack.extend((child, level + 1) for child in self._sorted_children(node))
        return "\n".join(lines)

    def _describe(self, node: RadixNode, max_tokens: int) -> str:
        tokens = node.token_ids()
        shown = " ".join(map(str, tokens[:max_tokens])) + (" ..." if len(tokens) > max_tokens else "")
        text = f"[{len(tokens)}] {shown}  lock={node.lock_ref} t={node.last_access}"
        if node.parent is self.root and node.edge[0] is not None:  # type: ignore[index]
            text = f"<{node.edge[0]}> " + text  # type: ignore[index]
        if node.value is not None and node.value.numel():
            text += f" slots={int(node.value[0])}..{int(node.value[-1])}"
        return text

    @staticmethod
    def _sorted_children(node: RadixNode) -> list[RadixNode]:
        return sorted(node.children.values(), key=lambda child: child.uid, reverse=True)


    def _walk(
        self, q: _Query, extra_key: str | None, parts: list[torch.Tensor] | None
    ) -> tuple[RadixNode, int]:
        """The deepest node the query reaches (split to end exactly there) and its depth."""
        self._clock += 1
        tick, p, tokens, n = self._clock, self.page_size, q.tokens, q.n
        node, pos = self.root, 0
        if n == 0:
            return node, 0
        edge: Hashable = (extra_key, tokens[0] if p == 1 else tuple(tokens[0:p]))
        while True:
            child = node.children.get(edge)
            if child is None:
                return node, pos
            size = len(child.key) // TOKEN_BYTES
            # The common case: the whole node in one memcmp. It fails (safely) where the encoded
            # query is too short, and the query never holds a partial page past q.n.
            if q.buf.startswith(child.key, pos * TOKEN_BYTES):
                matched = size
            else:
                matched = self._common(q, child.key, pos, min(size, n - pos)) // p * p
                if matched < size:
                    child.last_access = tick  # both halves of a split carry the match's time
                    child = self._split(child, matched)
            child.last_access = tick
            if parts is not None:
                parts.append(child.value)  # type: ignore[arg-type]
            node, pos = child, pos + matched
            if matched < size or pos >= n:
                return node, pos
            edge = tokens[pos] if p == 1 else tuple(tokens[pos : pos + p])

    @staticmethod
    def _common(q: _Query, key: bytes, pos: int, limit: int) -> int:
        """How many of the first `limit` tokens of `key` equal the query from `pos` on."""
        if q.enc < pos + limit:
            q.grow(pos + limit)
        segment = key[: limit * TOKEN_BYTES]
        start = pos * TOKEN_BYTES
        if q.buf.startswith(segment, start):
            return limit
        return first_diff(segment, q.buf[start : start + len(segment)])

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child` after `at` tokens; the new upper node takes its place under the parent."""
        assert 0 < at < child.num_tokens and at % self.page_size == 0, (at, child.num_tokens)
        parent = child.parent
        assert parent is not None
        cut = at * TOKEN_BYTES
        upper = RadixNode(
            key=child.key[:cut],
            value=child.value[:at],  # type: ignore[index]
            parent=parent,
            edge=child.edge,
            depth=child.depth - (child.num_tokens - at),
            uid=self._next_uid(),
            created=self._clock,  # a new node, as in SGLang's split (FIFO sees it as new)
            last_access=self._clock,
            lock_ref=child.lock_ref,  # every holder of child holds the path through upper
        )
        parent.children[child.edge] = upper
        child.key = child.key[cut:]
        child.value = child.value[at:]  # type: ignore[index]
        child.parent = upper
        child.edge = self._edge_of(child.key)
        upper.children[child.edge] = child
        return upper

    def _insert(
        self, q: _Query, slots: torch.Tensor, extra_key: str | None, min_present: int = 0
    ) -> tuple[RadixNode, int]:
        """Insert the query's whole pages; returns the node ending at them and the length already present."""
        node, present = self._walk(q, extra_key, None)
        if present < min_present:
            raise ValueError(
                f"the request's cached prefix has {min_present} tokens but only {present} of its token ids "
                "match the tree: wrong last_node, token_ids or extra_key"
            )
        if present < q.n:
            node = self._add_leaf(node, q, present, slots, extra_key)
        return node, present

    def _add_leaf(
        self, parent: RadixNode, q: _Query, start: int, slots: torch.Tensor, extra_key: str | None
    ) -> RadixNode:
        key = q.encoded(start, q.n)
        # A copy: callers pass views of rows that get rewritten.
        value = slots[start : q.n].to(device=self._device, dtype=torch.int64, copy=True)
        first = self._edge_of(key)
        leaf = RadixNode(
            key=key,
            value=value,
            parent=parent,
            edge=(extra_key, first) if parent is self.root else first,
            depth=q.n,
            uid=self._next_uid(),
            created=self._clock,
            last_access=self._clock,
        )
        parent.children[leaf.edge] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._evictable += q.n - start
        return leaf

    def _remove_leaf(self, node: RadixNode, values: list[torch.Tensor]) -> int:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.edge]
        node.parent = None  # marks it evicted: a later lock on it is refused
        self._leaves.discard(node)
        self._evictable -= node.num_tokens
        values.append(node.value)  # type: ignore[arg-type]
        return node.num_tokens

    def _store_in_host(self, node: RadixNode, start: int | None = None) -> None:
        """Hand the host tier the path's tokens and slots; the blocks from `start` (default: the
        node's own first token) on are new there."""
        assert self.host_tier is not None
        keys, values, extra_key, walk = [], [], None, node
        while walk is not self.root:
            keys.append(walk.key)
            values.append(walk.value)
            if walk.parent is self.root:
                extra_key = walk.edge[0]  # type: ignore[index]
            walk = walk.parent  # type: ignore[assignment]
        tokens = array("i")  # the keys' own encoding: the host tier hashes and compares it as is
        tokens.frombytes(b"".join(reversed(keys)))
        first = node.depth - node.num_tokens if start is None else start
        self.host_tier.store(tokens, torch.cat(values[::-1]), extra_key, start=first)  # type: ignore[arg-type]

    def _edge_of(self, key: bytes) -> Hashable:
        page = self._page_struct.unpack_from(key)
        return page[0] if self.page_size == 1 else page

    def _path_values(self, node: RadixNode) -> list[torch.Tensor]:
        values = []
        while node is not self.root:
            values.append(node.value)
            node = node.parent  # type: ignore[assignment]
        values.reverse()
        return values  # type: ignore[return-value]

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _free(self, values: list[torch.Tensor]) -> None:
        values = [v for v in values if v.numel()]
        if values:
            self.allocator.free(torch.cat(values))

    def _next_uid(self) -> int:
        self._uid += 1
        return self._uid

    def _check_live(self, node: RadixNode) -> None:
        if node.parent is None and node is not self.root:
            raise ValueError(f"{node!r} is not in this tree (evicted, or from another cache)")

    def _check_slots(self, q: _Query, slots: torch.Tensor) -> None:
        if slots.numel() < q.n:
            raise ValueError(f"{slots.numel()} slots for {q.n} tokens to cache")

    def _query(self, token_ids: Sequence[int]) -> _Query:
        return _Query(token_ids, self.page_size, self._first_chunk)
