"""Which replica serves a request: the router's policies, shared by `--dp-size` (one frontend, N
engine core processes) and `actorserve router` (one proxy, N servers over HTTP).

Policies (`--router-policy`):
- `round_robin`: the next healthy replica in turn.
- `shortest_queue`: the fewest outstanding tokens (of the requests this router sent there and
  that have not finished: prompt and output in the frontend, prompt bytes only in the HTTP
  router; its own accounting, so it is never stale).
- `cache_aware` (SGLang's router): an approximate radix tree holds the prompts sent to each
  replica. When the load is imbalanced (the busiest replica has more than `balance_abs_threshold`
  requests more than the idlest, and more than `balance_rel_threshold` times as many) the request
  goes to the idlest. Otherwise it goes to the replica whose cached prompts match it longest, if
  the match covers more than `cache_threshold` of it, else to the replica with the smallest tree
  (the most room left in its cache). Either way its prompt is added to that replica's tree.
- `routing_key`: a request's `routing_key` picks the replica by rendezvous hashing, so a key
  stays on one replica while that replica is healthy and only the keys of a replica that goes
  down move; requests without a key go to the fewest outstanding tokens.

A prompt is a list of token ids in the frontend and bytes in the HTTP router (the JSON text of
the prompt: it does not tokenize). One tree holds one of the two kinds: its edges are slices of
the prompts inserted, compared with slices of the same type.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.config import ROUTER_POLICIES, RouterConfig


class NoHealthyReplica(RuntimeError):
    """Every replica is down."""


@dataclass(slots=True)
class ReplicaLoad:
    requests: int = 0
    tokens: int = 0


class Router:
    """Picks a healthy replica per request and keeps the load it has sent to each."""

    def __init__(self, config: RouterConfig, num_replicas: int):
        if num_replicas < 1:
            raise ValueError(f"the router needs at least one replica, got {num_replicas}")
        self.config = config
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.healthy = [True] * num_replicas
        self.tree = PrefixTree(num_replicas, config.max_tree_tokens)
        self._turn = itertools.count()
        self._live = list(range(num_replicas))  # the healthy replicas, kept with `healthy`

    def choose(self, prompt: Sequence[int], routing_key: str | None = None) -> int:
        """The replica for a request; raises NoHealthyReplica when every replica is down."""
        live = self._live
        if not live:
            raise NoHealthyReplica("every replica is down")
        policy = self.config.policy
        if policy == "round_robin":
            return live[next(self._turn) % len(live)]
        if policy == "routing_key" and routing_key is not None:
            keyed = _key_hash(routing_key)
            return max(live, key=lambda i: _replica_weight(keyed, i))
        if policy == "cache_aware":
            walk = self.tree.walk(prompt)  # matched once, inserted along the same path
            replica = self._cache_aware(prompt, live, walk.matched)
            self.tree.insert(prompt, replica, walk)
            return replica
        return min(live, key=lambda i: (self.loads[i].tokens, i))

    def _cache_aware(self, prompt: Sequence[int], live: list[int], matched: list[int]) -> int:
        cfg = self.config
        loads = self.loads
        counts = [loads[i].requests for i in live]
        busiest, idlest = max(counts), min(counts)
        if busiest - idlest > cfg.balance_abs_threshold and busiest > idlest * cfg.balance_rel_threshold:
            return live[counts.index(idlest)]
        best = max(live, key=lambda i: (matched[i], -loads[i].requests, -i))
        if prompt and matched[best] / len(prompt) > cfg.cache_threshold:
            return best
        return min(live, key=lambda i: (self.tree.size[i], loads[i].requests, i))

    def started(self, replica: int, tokens: int) -> None:
        load = self.loads[replica]
        load.requests += 1
        load.tokens += tokens

    def progressed(self, replica: int, tokens: int) -> None:
        self.loads[replica].tokens += tokens

    def finished(self, replica: int, tokens: int) -> None:
        load = self.loads[replica]
        load.requests -= 1
        load.tokens -= tokens

    def set_healthy(self, replica: int, healthy: bool) -> None:
        self.healthy[replica] = healthy
        self._live = [i for i, ok in enumerate(self.healthy) if ok]
        if not healthy:  # what it cached is gone with it, or will be stale when it returns
            self.tree.drop_replica(replica)


# Rendezvous weights: 64-bit FNV-1a over the UTF-8 of f"{key}\0{replica}", then splitmix64's
# finalizer (FNV-1a leaves its last bytes, the replica's digits, poorly mixed into the high bits).
# Short enough for api/router/csrc/route.c to compute the same; the key comes first so that both hash it
# once per request and only the replica's digits per replica.
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def _key_hash(key: str) -> int:
    """FNV-1a of the key and its separator. A lone surrogate (JSON allows "\\ud800") is encoded
    as its three bytes instead of raising."""
    return _fnv1a(_FNV_OFFSET, key.encode("utf-8", "surrogatepass") + b"\0")


def _replica_weight(keyed: int, replica: int) -> int:
    z = _fnv1a(keyed, str(replica).encode())
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _fnv1a(h: int, data: bytes) -> int:
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h


@dataclass(eq=False, slots=True)
class _Node:
    key: Sequence[int]  # the edge from the parent: a slice of the prompt that made it
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    # Replicas whose tree holds this node, with when they last used it. A replica that holds a
    # node holds all its ancestors (insert marks whole paths; eviction takes leaves first).
    last_used: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class Walk:
    """A prompt's way down the tree: per replica how many of its leading tokens the replica's tree
    holds (`matched`), and where it left the tree, so that inserting it does not walk again."""

    matched: list[int]
    path: list[_Node]  # the nodes it went through, root's child first; the last maybe only in part
    depth: int  # tokens matched along `path`


class PrefixTree:
    """An approximate radix tree of the prompts routed to each replica, at most `max_tokens`
    tokens per replica (least recently used leaves are dropped first). Approximate: it does not
    know what a replica's own cache evicted, only what was sent there."""

    def __init__(self, num_replicas: int, max_tokens: int):
        self.root = _Node(b"", None)
        self.max_tokens = max_tokens
        self.size = [0] * num_replicas  # tokens held per replica
        self._nodes = [0] * num_replicas  # nodes held per replica
        self._clock = itertools.count(1)
        self._ids = itertools.count()
        # Per replica: (last used, tiebreak, node) candidates for eviction, checked when popped.
        # An insert pushes only the deepest node of its path: the nodes above it are not leaves,
        # and each is pushed when its last child of that replica is evicted.
        self._lru: list[list[tuple[int, int, _Node]]] = [[] for _ in range(num_replicas)]

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Per replica, how many leading tokens of `tokens` its tree holds."""
        return self.walk(tokens).matched

    def walk(self, tokens: Sequence[int]) -> Walk:
        matched = [0] * len(self.size)
        path: list[_Node] = []
        node, pos, end = self.root, 0, len(tokens)
        while pos < end:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            key = child.key
            whole = tokens[pos : pos + len(key)] == key
            pos += len(key) if whole else _common_prefix(key, tokens, pos)
            path.append(child)
            for replica in child.last_used:
                matched[replica] = pos
            if not whole:
                break
            node = child
        return Walk(matched, path, pos)

    def insert(self, tokens: Sequence[int], replica: int, walk: Walk | None = None) -> None:
        """Add `tokens` to `replica`'s tree; `walk` is this tree's walk of them, if taken since its
        last change."""
        if walk is None:
            walk = self.walk(tokens)
        now = next(self._clock)
        node, edge_end = self.root, 0
        for child in walk.path:
            edge_end += len(child.key)
            if edge_end > walk.depth:  # the prompt leaves this edge part way: cut it there
                child = self._split(child, len(child.key) - (edge_end - walk.depth))
            self._hold(child, replica, now)
            node = child
        if walk.depth < len(tokens):
            leaf = _Node(tokens[walk.depth :], node)
            node.children[tokens[walk.depth]] = leaf
            self._hold(leaf, replica, now)
            node = leaf
        if node is not self.root:
            heapq.heappush(self._lru[replica], (now, next(self._ids), node))
        self._evict(replica)

    def drop_replica(self, replica: int) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.last_used.pop(replica, None)
            stack.extend(node.children.values())
        self._prune(self.root)
        self.size[replica] = 0
        self._nodes[replica] = 0
        self._lru[replica] = []

    def _hold(self, node: _Node, replica: int, now: int) -> None:
        if replica not in node.last_used:
            self.size[replica] += len(node.key)
            self._nodes[replica] += 1
        node.last_used[replica] = now

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; the new upper half holds what the child held."""
        assert child.parent is not None
        upper = _Node(child.key[:at], child.parent, last_used=dict(child.last_used))
        for replica in upper.last_used:
            self._nodes[replica] += 1
        child.parent.children[child.key[0]] = upper
        child.key, child.parent = child.key[at:], upper
        upper.children[child.key[0]] = child
        return upper

    def _evict(self, replica: int) -> None:
        heap = self._lru[replica]
        while self.size[replica] > self.max_tokens and heap:
            used, _, node = heapq.heappop(heap)
            if node.last_used.get(replica) != used or any(replica in c.last_used for c in node.children.values()):
                continue  # used again since, or not a leaf of this replica's tree
            del node.last_used[replica]
            self.size[replica] -= len(node.key)
            self._nodes[replica] -= 1
            parent = node.parent
            if not node.last_used and not node.children and parent is not None:
                del parent.children[node.key[0]]
            if parent is not None and parent is not self.root and replica in parent.last_used:
                heapq.heappush(heap, (parent.last_used[replica], next(self._ids), parent))
        if len(heap) > 2 * self._nodes[replica] + 1024:  # stale entries pile up: rebuild
            self._rebuild_lru(replica)

    def _rebuild_lru(self, replica: int) -> None:
        """The replica's leaves only: the nodes above them are pushed as they become leaves."""
        entries = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if replica in node.last_used:
                held_children = [c for c in node.children.values() if replica in c.last_used]
                if not held_children:
                    entries.append((node.last_used[replica], next(self._ids), node))
                stack.extend(held_children)
        heapq.heapify(entries)
        self._lru[replica] = entries

    def _prune(self, node: _Node) -> None:
        for first, child in list(node.children.items()):
            self._prune(child)
            if not child.last_used and not child.children:
                del node.children[first]


def _common_prefix(key: Sequence[int], tokens: Sequence[int], pos: int) -> int:
    """How many leading elements of `key` equal those of tokens[pos:]: slices compared in C, a
    binary search when they differ."""
    n = min(len(key), len(tokens) - pos)
    if tokens[pos : pos + n] == key[:n]:
        return n
    same, differs = 0, n  # key[:same] matches; key[:differs] does not
    while differs - same > 1:
        mid = (same + differs) // 2
        if tokens[pos + same : pos + mid] == key[same:mid]:
            same = mid
        else:
            differs = mid
    return same
