"""Queue ordering for the Policy actor: SGLang's six scheduling policies, shortest-first, earliest
deadline first, priority and aging (reference/sglang-behaviour.md, "Policies").

A round orders by the policy's key, then stably by each request's level: its priority when
priority scheduling is on, less one per `priority_aging_s` waited. A level outranks any cache score.

Aging bound: with D = |best arriving priority - R's|, a request arriving more than (D + 1) * S
after R is always at least a level below R, so R waits at most for what was queued at its arrival
plus (D + 1) * S of arrivals: (B + L * (D + 1) * S) / A at admission rate A, B queued ahead,
arrival rate L. Without aging there is no bound. Waits count from `enqueue_time` (reset on
requeue). Aging changes ordering only: preemption and queue eviction compare the original
priorities. tests/test_aging.py checks the bound on a simulated clock.

The cold lane (lpm and dfs-weight) passes aging levels but never a better priority; with both on
R waits at most (B + L * (D + 1) * S + 1) / (1 - F) + 1 admissions (actors/cold_lane.py).
`sjf` always ages (SJF_DEFAULT_AGING_S by default) so long prompts still run.

Where we differ from SGLang, on purpose:

- Priority goes first under lpm and dfs-weight too (SGLang orders those by the cache alone): an
  urgent request should not wait behind a hot cache branch. `random` and `routing-key` ignore
  priority, as in SGLang.
- The lpm fallback to fcfs applies our fcfs, priority included (SGLang leaves the queue as is).
- dfs-weight breaks ties between sibling branches by earliest queue position, not dict insertion
  order, so the order never depends on the history of the tree's splits.
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
import time
from collections.abc import Iterator, Sequence

from actors.cold_lane import ColdLane
from actors.priority import PriorityRule
from cache import MatchResult, PrefixMatcher, PrefixSet, RadixNode, token_array
from runtime.config import CACHE_AWARE_POLICIES, CoreConfig
from runtime.req import Req

# In-batch prefix caching (lpm): only requests whose real-cache hit is at most CHECK tokens are
# checked against the other queued requests (-1 disables the check); a shared uncached prefix of
# at least DEPRIORITIZE tokens sends every request after the first to the back for this round.
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32

class QueueOrderer:
    """Orders the waiting queue once per scheduling round; owned by the Policy actor."""

    def __init__(
        self,
        config: CoreConfig,
        prefix_cache: PrefixMatcher | None,
        rng: random.Random,
        *,
        in_batch_check_threshold: int = IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD,
        in_batch_deprioritize_threshold: int = IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD,
    ) -> None:
        # Only a RadixCache shares prefixes; with ChunkCache every match is empty and the in-batch
        # check would hold back requests for a cache hit that never comes.
        self.cache = prefix_cache if prefix_cache is not None and prefix_cache.shares_prefixes else None
        policy = config.effective_schedule_policy
        self.policy = "fcfs" if policy in CACHE_AWARE_POLICIES and self.cache is None else policy
        self.rng = rng
        self.priority_on = config.enable_priority_scheduling
        self.priority_rule = PriorityRule.of(config)
        self.aging_s = config.effective_aging_s
        self.default_slo_ttft_ms = config.default_slo_ttft_ms
        self.lpm_fallback_queue_len = config.lpm_fallback_queue_len
        self.in_batch_check_threshold = in_batch_check_threshold
        self.in_batch_deprioritize_threshold = in_batch_deprioritize_threshold
        # SGLang's in-batch check uses a page-1 tree whatever the cache's page size.
        self._in_batch = PrefixSet(1) if self.cache is not None else None
        # Only the cache-aware policies starve cold prompts; fcfs (their fallback) serves the oldest.
        share = config.cold_lane_share
        self.cold_lane = ColdLane(share) if share is not None and self.policy in CACHE_AWARE_POLICIES else None
        self.cold_lane_threshold = config.cold_lane_threshold

    def active_policy(self, queue_len: int) -> str:
        """The policy this round runs: lpm over a long queue is fcfs (matching it all costs too much)."""
        if self.policy == "lpm" and queue_len > self.lpm_fallback_queue_len:
            return "fcfs"
        return self.policy

    def order(self, waiting: Sequence[Req], running_routing_keys: Counter[str] | None = None, now: float | None = None) -> list[Req]:
        """The waiting requests in scheduling order (a new list; none dropped or repeated).
        `now` (time.monotonic's clock) is what the waits are measured to."""
        policy = self.active_policy(len(waiting))
        by_priority = self.priority_on and policy not in ("random", "routing-key")
        lane = self.cold_lane if policy in CACHE_AWARE_POLICIES else None
        cold: set[int] = set()
        if lane is not None:
            out, cold = self._cache_aware_with_cold(policy, waiting)
        else:
            out = self._policy_order(policy, waiting, running_routing_keys, by_priority)
        if by_priority or self.aging_s is not None:
            levels = self._levels(out, by_priority, time.monotonic() if now is None else now)
            out = [out[i] for i in sorted(range(len(out)), key=levels.__getitem__)]
        if lane is not None:
            # The lane passes aging levels (its share bounds what that costs) but no priority.
            return lane.interleave(out, cold, [self.priority_rule.level(req.asked.priority) for req in out] if by_priority else None)
        if self.cold_lane is not None:
            self.cold_lane.pause()
        return out

    def _policy_order(self, policy: str, waiting: Sequence[Req], running: Counter[str] | None, by_priority: bool) -> list[Req]:
        if policy == "fcfs":
            # Requeued requests break the list's arrival order; enqueue times restore it.
            return sorted(waiting, key=_enqueue_time) if by_priority or self.aging_s is not None else list(waiting)
        if policy == "lof":
            return sorted(waiting, key=lambda req: -req.max_new_tokens)
        if policy == "random":
            return self._random(waiting)
        if policy == "routing-key":
            return self._routing_key(waiting, running or Counter())
        if policy == "lpm":
            return self._lpm(waiting)
        if policy == "dfs-weight":
            return self._dfs_weight(waiting)
        if policy == "sjf":
            return self._sjf(waiting)
        if policy == "edf":
            default = self.default_slo_ttft_ms
            return sorted(waiting, key=lambda req: (req.asked.service.first_token_due(req.asked.arrival_time, default), req.sched.enqueue_time))
        raise ValueError(f"unknown schedule policy {policy!r}")

    def _levels(self, reqs: Sequence[Req], by_priority: bool, now: float) -> list[int]:
        """Lower first: `PriorityRule.level`, less one per `aging_s` waited (see the module docstring)."""
        level_of, aging_s = self.priority_rule.level, self.aging_s
        levels = [level_of(req.asked.priority) for req in reqs] if by_priority else [0] * len(reqs)
        if aging_s is not None:
            levels = [level - int((now - req.sched.enqueue_time) // aging_s) for level, req in zip(levels, reqs)]
        return levels

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
            n = counts.get(req.asked.routing_key) if req.asked.routing_key is not None else None
            return (0, -n, req.asked.routing_key) if n else (1, 0, req.asked.routing_key or "")  # type: ignore[return-value]

        return sorted(waiting, key=key)

    def _cache_aware_with_cold(self, policy: str, waiting: Sequence[Req]) -> tuple[list[Req], set[int]]:
        """The lpm or dfs-weight order, and the id() of each request the cold lane serves: those
        whose cached prefix covers less than `cold_lane_threshold` of the prompt (one match per
        request serves both)."""
        keys = self._keys_for(waiting)
        threshold = self.cold_lane_threshold
        if policy == "lpm":
            lengths = [match.length for match in self._match_all(waiting, keys)]
            out = self._lpm_order(waiting, keys, lengths)
        else:
            lengths, nodes = [], []
            for match in self._match_all(waiting, keys):
                lengths.append(match.length)
                nodes.append(match.last_node)
            out = self._dfs_order(waiting, nodes)
        cold = {id(req) for req, key, n in zip(waiting, keys, lengths) if n < threshold * len(key)}
        return out, cold

    def _lpm(self, waiting: Sequence[Req]) -> list[Req]:
        keys = self._keys_for(waiting)
        return self._lpm_order(waiting, keys, [match.length for match in self._match_all(waiting, keys)])

    def _lpm_order(self, waiting: Sequence[Req], keys: list[array], lengths: list[int]) -> list[Req]:
        held_back = self._in_batch_held_back(waiting, keys, lengths)
        # Plain ints, not tuples: a queue of a thousand requests is ordered every round, and fewer
        # container objects means fewer garbage-collector passes. Any positive rank sorts after
        # every match (-length <= 0), and the stable sort keeps the held-back in queue order.
        rank = [1 if i in held_back else -n for i, n in enumerate(lengths)]
        return [waiting[i] for i in sorted(range(len(waiting)), key=rank.__getitem__)]

    def _in_batch_held_back(self, waiting: Sequence[Req], keys: list[array], lengths: list[int]) -> set[int]:
        """Queue positions to defer this round: they share an uncached prefix with an earlier request.

        Sending them together would compute that prefix once per request; sent one round apart,
        the later ones find it cached.
        """
        held_back: set[int] = set()
        if self.in_batch_check_threshold < 0:
            return held_back
        in_batch = self._in_batch
        assert in_batch is not None
        in_batch.reset()  # only this round's queue counts
        for i, (req, key, cached) in enumerate(zip(waiting, keys, lengths)):
            if cached > self.in_batch_check_threshold:
                continue
            if in_batch.shares_prefix(key, req.asked.extra_key, self.in_batch_deprioritize_threshold):
                held_back.add(i)
            else:
                in_batch.insert(key, req.asked.extra_key)
        return held_back

    def _dfs_weight(self, waiting: Sequence[Req]) -> list[Req]:
        return self._dfs_order(waiting, [match.last_node for match in self._match_all(waiting, self._keys_for(waiting))])

    def _dfs_order(self, waiting: Sequence[Req], nodes: list[RadixNode]) -> list[Req]:
        groups: dict[RadixNode, list[Req]] = {}
        for req, node in zip(waiting, nodes):
            groups.setdefault(node, []).append(req)
        out = _dfs_order(self.cache.root, groups)  # type: ignore[union-attr]
        assert len(out) == len(waiting)
        return out

    def _sjf(self, waiting: Sequence[Req]) -> list[Req]:
        keys = self._keys_for(waiting)
        if self.cache is None or len(waiting) > self.lpm_fallback_queue_len:
            left = [len(key) for key in keys]
        else:
            left = [len(key) - match.length for key, match in zip(keys, self._match_all(waiting, keys))]
        return [waiting[i] for i in sorted(range(len(waiting)), key=left.__getitem__)]

    def _match_all(self, waiting: Sequence[Req], keys: list[array]) -> Iterator[MatchResult]:
        cache = self.cache
        assert cache is not None
        # The one sanctioned reach into another actor's state: the prefix cache belongs to the
        # Adder, but ordering needs match lengths. A match only splits nodes and touches access
        # times, never changes what is cached or locked, and both actors run on the loop thread.
        return (cache.match_prefix(key, req.asked.extra_key) for req, key in zip(waiting, keys))

    @staticmethod
    def _keys_for(waiting: Sequence[Req]) -> list[array]:
        """Each request's whole prompt and output so far: SGLang's ordering match takes all of it,
        unlike admission, which leaves the last token to compute (cheap: the Receiver encoded
        every prompt on arrival)."""
        return [ordering_key(req) for req in waiting]


def ordering_key(req: Req) -> array:
    if req.out.output_ids or req.prompt_key is None:
        return token_array(req.fill_ids)
    return req.prompt_key


def _enqueue_time(req: Req) -> float:
    return req.sched.enqueue_time


def _dfs_order(root: RadixNode, groups: dict[RadixNode, list[Req]]) -> list[Req]:
    """Post-order walk of the tree part that holds requests, heavier branches first (weight =
    requests matched at or below a node); the cost follows the queue, not the cache size."""
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
        # Iterative: deep trees would hit the recursion limit.
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
