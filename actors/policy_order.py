"""Queue ordering for the Policy actor: SGLang's six scheduling policies plus priority.

`QueueOrderer.order(waiting, running_routing_keys)` returns the waiting requests in the order the
Adder should try them, as a new list holding every request exactly once. It reads requests and,
for the cache-aware policies, matches them against the Adder's prefix cache; it writes nothing on
a `Req` (`prefix_len` and `last_node` belong to the Adder, which matches again when it locks).

Behaviour follows reference/sglang-behaviour.md ("Policies"). Where we differ, on purpose:

- Priority goes first under every policy that sorts by a key: fcfs and lof (as SGLang), and also
  lpm and dfs-weight, which SGLang orders by the cache alone. A request the user marked urgent
  should not wait behind a hot cache branch; within one priority level the cache order is kept.
  `random` and `routing-key` ignore priority, as in SGLang.
- The lpm fallback to fcfs applies our fcfs, priority included (SGLang leaves the queue as is).
- dfs-weight breaks weight ties between sibling branches by the earliest queue position of a
  request under each branch (first come, first served), instead of dict insertion order, so the
  order never depends on the history of the tree's splits.
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from actors.prefill_adder import match_key
from gpu.prefix_cache import MatchResult, PrefixCache, RadixCache, RadixNode
from runtime.config import CACHE_AWARE_POLICIES, EngineConfig
from runtime.req import Req

# In-batch prefix caching (lpm): only requests whose real-cache hit is at most CHECK tokens are
# checked against the other queued requests (-1 disables the check); a shared uncached prefix of
# at least DEPRIORITIZE tokens sends every request after the first to the back for this round.
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32

_SortKey = Callable[[Req], object]


class QueueOrderer:
    """Orders the waiting queue once per scheduling round; owned by the Policy actor."""

    def __init__(
        self,
        config: EngineConfig,
        prefix_cache: PrefixCache | None,
        rng: random.Random,
        *,
        in_batch_check_threshold: int = IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD,
        in_batch_deprioritize_threshold: int = IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD,
    ) -> None:
        # Only a RadixCache shares prefixes; with ChunkCache every match is empty and the in-batch
        # check would hold back requests for a cache hit that never comes.
        self.cache = prefix_cache if isinstance(prefix_cache, RadixCache) and not prefix_cache.is_scratch else None
        policy = config.effective_schedule_policy
        self.policy = "fcfs" if policy in CACHE_AWARE_POLICIES and self.cache is None else policy
        self.rng = rng
        self.priority_on = config.enable_priority_scheduling
        self.priority_sign = 1 if config.schedule_low_priority_values_first else -1
        self.lpm_fallback_queue_len = config.lpm_fallback_queue_len
        self.in_batch_check_threshold = in_batch_check_threshold
        self.in_batch_deprioritize_threshold = in_batch_deprioritize_threshold
        self._scratch = RadixCache.scratch(self.cache.page_size) if self.cache is not None else None

    def active_policy(self, queue_len: int) -> str:
        """The policy this round runs: lpm over a long queue is fcfs (matching it all costs too much)."""
        if self.policy == "lpm" and queue_len > self.lpm_fallback_queue_len:
            return "fcfs"
        return self.policy

    def order(self, waiting: Sequence[Req], running_routing_keys: Counter[str] | None = None) -> list[Req]:
        """The waiting requests in scheduling order (a new list; none dropped or repeated)."""
        policy = self.active_policy(len(waiting))
        if policy == "fcfs":
            return self._fcfs(waiting)
        if policy == "lof":
            return self._by_priority_then(waiting, lambda req: -req.max_new_tokens)
        if policy == "random":
            return self._random(waiting)
        if policy == "routing-key":
            return self._routing_key(waiting, running_routing_keys or Counter())
        if policy == "lpm":
            return self._lpm(waiting)
        if policy == "dfs-weight":
            return self._dfs_weight(waiting)
        raise ValueError(f"unknown schedule policy {policy!r}")

    # -- cache-agnostic ------------------------------------------------------------------------

    def _fcfs(self, waiting: Sequence[Req]) -> list[Req]:
        # The queue is kept in arrival order; priority needs the enqueue time because a requeued
        # (preempted or retracted) request sits at the back but keeps its place in time.
        return self._by_priority_then(waiting, lambda req: req.enqueue_time) if self.priority_on else list(waiting)

    def _by_priority_then(self, waiting: Sequence[Req], key: _SortKey) -> list[Req]:
        """Stable sort by `key`, with the priority level first when priority scheduling is on."""
        if not self.priority_on:
            return sorted(waiting, key=key)
        sign = self.priority_sign
        return sorted(waiting, key=lambda req: (req.priority * sign, key(req)))

    def _random(self, waiting: Sequence[Req]) -> list[Req]:
        out = list(waiting)
        self.rng.shuffle(out)
        return out

    def _routing_key(self, waiting: Sequence[Req], running: Counter[str]) -> list[Req]:
        # Requests that share a key with running ones go first, the most shared key first: the
        # router sent them here because this engine already holds their context.
        counts = {key: n for key, n in running.items() if n > 0}
        if not counts:
            return list(waiting)

        def key(req: Req) -> tuple[int, int, str]:
            n = counts.get(req.routing_key) if req.routing_key is not None else None
            return (0, -n, req.routing_key) if n else (1, 0, req.routing_key or "")  # type: ignore[return-value]

        return sorted(waiting, key=key)

    # -- cache-aware ---------------------------------------------------------------------------

    def _lpm(self, waiting: Sequence[Req]) -> list[Req]:
        keys = self._keys_for(waiting)
        lengths = [match.length for match in self._match_all(waiting, keys)]
        held_back = self._in_batch_held_back(waiting, keys, lengths)
        # Plain ints, not tuples: a queue of a thousand requests is ordered every round, and fewer
        # container objects means fewer garbage-collector passes. Any positive rank sorts after
        # every match (-length <= 0), and the stable sort keeps the held-back in queue order.
        rank = [1 if i in held_back else -n for i, n in enumerate(lengths)]
        if self.priority_on:
            sign = self.priority_sign
            rank = [(req.priority * sign, r) for req, r in zip(waiting, rank)]  # type: ignore[misc]
        return [waiting[i] for i in sorted(range(len(waiting)), key=rank.__getitem__)]

    def _in_batch_held_back(self, waiting: Sequence[Req], keys: list[array], lengths: list[int]) -> set[int]:
        """Queue positions to defer this round: they share an uncached prefix with an earlier request.

        Sending them together would compute that prefix once per request; sent one round apart,
        the later ones find it cached.
        """
        held_back: set[int] = set()
        if self.in_batch_check_threshold < 0:
            return held_back
        scratch = self._scratch
        assert scratch is not None
        scratch.reset()  # only this round's queue counts
        for i, (req, key, cached) in enumerate(zip(waiting, keys, lengths)):
            if cached > self.in_batch_check_threshold:
                continue
            if scratch.match_prefix(key, req.extra_key).length >= self.in_batch_deprioritize_threshold:
                held_back.add(i)
            else:
                scratch.insert(key, None, req.extra_key)
        return held_back

    def _dfs_weight(self, waiting: Sequence[Req]) -> list[Req]:
        groups: dict[RadixNode, list[Req]] = {}
        for req, match in zip(waiting, self._match_all(waiting, self._keys_for(waiting))):
            groups.setdefault(match.last_node, []).append(req)
        out = _dfs_order(self.cache.root, groups)  # type: ignore[union-attr]
        assert len(out) == len(waiting)
        if self.priority_on:
            sign = self.priority_sign
            out.sort(key=lambda req: req.priority * sign)  # stable: the tree order within a level
        return out

    def _match_all(self, waiting: Sequence[Req], keys: list[array]) -> Iterator[MatchResult]:
        """Each request's match, one at a time (callers keep only what they need of it)."""
        cache = self.cache
        assert cache is not None
        # The one sanctioned reach into another actor's state: the prefix cache belongs to the
        # Adder, but ordering needs match lengths. A match only splits nodes and touches access
        # times, never changes what is cached or locked, and both actors run on the loop thread.
        return (cache.match_prefix(key, req.extra_key) for req, key in zip(waiting, keys))

    @staticmethod
    def _keys_for(waiting: Sequence[Req]) -> list[array]:
        """Each request's match key (cheap: the Receiver encoded every prompt on arrival)."""
        return [match_key(req) for req in waiting]


def _dfs_order(root: RadixNode, groups: dict[RadixNode, list[Req]]) -> list[Req]:
    """Post-order walk of the tree part that holds requests, heavier branches first.

    A node's weight is the number of requests whose match ends at it or below it. Only the nodes
    on some request's path are visited, so the cost follows the queue, not the cache size.
    """
    tree = _WeightedPaths(root)
    # `groups` is in queue order, so its index is each node's first arrival: the tie-break.
    for index, (node, reqs) in enumerate(groups.items()):
        tree.add(node, len(reqs), index)
    out: list[Req] = []
    for node in tree.post_order():
        out.extend(groups.get(node, ()))
    return out


class _WeightedPaths:
    """The union of root-to-node paths, with request counts summed up each path."""

    def __init__(self, root: RadixNode) -> None:
        self.root = root
        self.weight: dict[RadixNode, int] = {}
        self.first: dict[RadixNode, int] = {}  # smallest queue-group index at or below the node
        self.kids: dict[RadixNode, list[RadixNode]] = {}

    def add(self, node: RadixNode, count: int, index: int) -> None:
        """Count `count` requests at `node` in its weight and every ancestor's; indexes must grow."""
        weight, first, kids, root = self.weight, self.first, self.kids, self.root
        while True:
            # Paths always run to the root, so a known node's ancestors are linked already.
            known = node in weight
            weight[node] = weight.get(node, 0) + count
            first.setdefault(node, index)
            if node is root:
                return
            parent = node.parent
            assert parent is not None, "a matched node was evicted while the queue was being ordered"
            if not known:
                kids.setdefault(parent, []).append(node)
            node = parent

    def post_order(self) -> list[RadixNode]:
        """Every node after its subtree; siblings by descending weight, then earliest arrival."""
        weight, first = self.weight, self.first
        out: list[RadixNode] = []
        # Iterative (deep trees would hit the recursion limit); children are pushed lightest
        # first so the heaviest pops first.
        stack: list[tuple[RadixNode, bool]] = [(self.root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.append(node)
                continue
            stack.append((node, True))
            children = sorted(self.kids.get(node, ()), key=lambda c: (-weight[c], first[c]), reverse=True)
            stack.extend((child, False) for child in children)
        return out
