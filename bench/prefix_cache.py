"""Prefix-cache speed: match_prefix / insert / evict of cache.RadixCache.

    python -m bench.prefix_cache [--rounds 15] [--trees 1000,10000]

Trees hold 1k or 10k cached requests with realistic sharing: 16 system prompts (64, 256, 1024 or
4096 tokens) and a distinct user part of 32..512 tokens per request. Token ids are numpy
default_rng(0) draws from [10, 151000), turned into fresh Python ints as a tokenizer returns them.
Queries:
- `sys+new`: one of the system prompts followed by new tokens (hit = the system prompt);
- `turn`: a cached conversation followed by a new 256-token turn (hit = the whole conversation);
- `2 nodes`, `33-node chain`, `512 hit`: the reference cases (SGLang 0.5.7 on this machine class:
  49 us, 100 us, 15 us, independent of tree size).
Columns: `list` is match_prefix on a list of ints (what a Req holds); `array` is the same query as
an `array('i')` built once per request (`token_array`), which skips the encoding; `+slots` also
materializes the matched slot tensor (the Adder's use); `naive` is a token-by-token Python compare
of the same tree shape, measured in the same run (the way SGLang compares), and `x` = naive / list.
Times are medians (over rounds) of the mean per call within a round, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from cache import RadixCache, token_array
from gpu.kv_pool import TokenSlotAllocator

VOCAB = 151_000
SYSTEM_LENGTHS = (64, 256, 1024, 4096)
GROUPS = 16
QUERIES = 20  # distinct queries per case, each matched once per round


class Tokens:
    """Token ids from one seeded generator, as fresh Python ints."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def draw(self, n: int) -> list[int]:
        return self.rng.integers(10, VOCAB - 10, size=n).tolist()

    def length(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))


# -- a naive radix tree: the reference's token-by-token compare, for a same-machine baseline ------


class NaiveNode:
    __slots__ = ("key", "value", "children")

    def __init__(self, key: list[int], value: torch.Tensor) -> None:
        self.key, self.value, self.children = key, value, {}


class NaiveRadix:
    """Children by first token, keys as lists, one Python comparison per token."""

    def __init__(self) -> None:
        self.root = NaiveNode([], torch.empty(0, dtype=torch.int64))

    def insert(self, tokens: list[int], slots: torch.Tensor) -> None:
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                node.children[tokens[pos]] = NaiveNode(tokens[pos:], slots[pos:].clone())
                return
            n = self._common(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(node, child, n)
            node, pos = child, pos + n

    def match(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        node, pos, parts = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = self._common(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(node, child, n)
            parts.append(child.value)
            node, pos = child, pos + n
            if n < len(child.key):
                break
        return pos, torch.cat(parts) if parts else self.root.value

    @staticmethod
    def _common(key: list[int], tokens: list[int], pos: int) -> int:
        n = 0
        for a, b in zip(key, tokens[pos:]):
            if a != b:
                break
            n += 1
        return n

    @staticmethod
    def _split(parent: NaiveNode, child: NaiveNode, n: int) -> NaiveNode:
        upper = NaiveNode(child.key[:n], child.value[:n])
        child.key, child.value = child.key[n:], child.value[n:]
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper


# -- workload -------------------------------------------------------------------------------------


class Workload:
    """A tree of cached requests, mirrored in the naive baseline, plus the slots to fill it."""

    def __init__(self, num_requests: int, tokens: Tokens) -> None:
        self.tokens = tokens
        self.systems = [tokens.draw(SYSTEM_LENGTHS[g % len(SYSTEM_LENGTHS)]) for g in range(GROUPS)]
        requests = [self.systems[i % GROUPS] + tokens.draw(tokens.length(32, 512)) for i in range(num_requests)]
        size = sum(len(r) for r in requests) + 1_000_000  # room for the reference cases and inserts
        self.alloc = TokenSlotAllocator(size, page_size=1)
        self.cache = RadixCache(self.alloc)
        self.naive = NaiveRadix()
        for request in requests:
            self.add(request)

    def add(self, request: list[int]) -> None:
        slots = self.alloc.alloc(len(request))
        assert slots is not None
        present = self.cache.insert(request, slots)
        self.alloc.free(slots[:present])
        self.naive.insert(request, slots)

    def conversation(self, length: int) -> list[int]:
        """A system prompt (one that fits) and earlier turns: `length` tokens."""
        fitting = [s for s in self.systems if len(s) < length]
        system = max(fitting, key=len) if fitting else []
        return system + self.tokens.draw(length - len(system))

    def system_for(self, prompt_len: int) -> list[int]:
        """The longest system prompt that leaves room for a new part."""
        fitting = [s for s in self.systems if len(s) < prompt_len]
        return max(fitting, key=len)


def fresh(tokens: list[int]) -> list[int]:
    """The same ids as new int objects, as a second tokenizer call would return them."""
    return np.array(tokens, dtype=np.int64).tolist()


def timed(fn: Callable[[], object], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# -- cases ----------------------------------------------------------------------------------------


def match_cases(w: Workload, t: Tokens) -> list[tuple[str, list[list[int]]]]:
    """(name, queries) for every case; inserts the paths the special cases need."""
    cases = []
    for length in (128, 2048, 8192):
        system = w.system_for(length)
        cases.append((f"sys+new {length}", [fresh(system + t.draw(length - len(system))) for _ in range(QUERIES)]))
        history = w.conversation(length - min(256, length // 2))
        w.add(history)
        cases.append((f"turn {length}", [fresh(history + t.draw(length - len(history))) for _ in range(QUERIES)]))
    # 2048 prompt hitting 1984 tokens over 2 nodes: a cached 1024 + 960 path.
    first, second = t.draw(1024), t.draw(960)
    w.add(first + t.draw(64))
    w.add(first + second + t.draw(64))
    cases.append(("2 nodes 1984/2048", [fresh(first + second + t.draw(64)) for _ in range(QUERIES)]))
    # 33-node chain: 33 cached requests, each one 60 tokens longer than the last.
    chain = t.draw(33 * 60)
    for i in range(1, 34):
        w.add(chain[: 60 * i] + t.draw(8))
    cases.append(("33-node chain 1980/2048", [fresh(chain + t.draw(68)) for _ in range(QUERIES)]))
    # 512-token hit on one node, for a 513-token and a 2048-token prompt.
    block = t.draw(512)
    w.add(block + t.draw(64))
    cases.append(("512 hit/513", [fresh(block + t.draw(1)) for _ in range(QUERIES)]))
    cases.append(("512 hit/2048", [fresh(block + t.draw(1536)) for _ in range(QUERIES)]))
    return cases


def bench_matches(w: Workload, t: Tokens, rounds: int, tree: str) -> list[str]:
    rows = []
    for name, queries in match_cases(w, t):
        queries = [q[:-1] for q in queries]  # the Adder's len-1 rule
        arrays = [token_array(q) for q in queries]
        first = w.cache.match_prefix(queries[0])  # splits happen here, before timing
        naive_len = w.naive.match(queries[0])[0]
        assert naive_len == first.length, (name, naive_len, first.length)
        for q in queries:
            w.naive.match(q)
            w.cache.match_prefix(q)
        n = len(queries)
        ours = timed(lambda: [w.cache.match_prefix(q) for q in queries], rounds) / n
        fast = timed(lambda: [w.cache.match_prefix(a) for a in arrays], rounds) / n
        slots = timed(lambda: [w.cache.match_prefix(q).slots for q in queries], rounds) / n
        naive = timed(lambda: [w.naive.match(q) for q in queries], rounds) / n
        nodes = _path_nodes(first.last_node)
        rows.append(
            f"| {name} | {tree} | {first.length} | {nodes} | {ours * 1e6:.1f} | {fast * 1e6:.1f} | "
            f"{slots * 1e6:.1f} | {naive * 1e6:.1f} | {naive / ours:.1f}x |"
        )
    return rows


def bench_inserts(w: Workload, t: Tokens, tree: str) -> list[str]:
    """Each insert adds one new request (a system prompt + a new part); median over requests."""
    rows = []
    for length in (128, 2048, 8192):
        system = w.system_for(length)
        requests = [fresh(system + t.draw(length - len(system))) for _ in range(3 * QUERIES)]
        slots = [w.alloc.alloc(length) for _ in requests]
        samples = []
        for request, s in zip(requests, slots):
            start = time.perf_counter()
            w.cache.insert(request, s)
            samples.append(time.perf_counter() - start)
        rows.append(f"| insert {length} | {tree} | {len(system)} | {statistics.median(samples) * 1e6:.1f} |")
    return rows


def bench_evict(num_requests: int, t: Tokens, repeats: int = 3) -> str:
    """Evict 10% of a pool that the cache fills, `repeats` times in a row (each from a fuller tree)."""
    w = Workload(num_requests, t)
    pool = w.cache.evictable_size()
    target = pool // 10
    in_free: list[float] = []
    free = w.alloc.free

    def timed_free(slots: torch.Tensor) -> None:
        start = time.perf_counter()
        free(slots)
        in_free.append(time.perf_counter() - start)

    w.alloc.free = timed_free  # type: ignore[method-assign]
    samples, freed = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        freed.append(w.cache.evict(target))
        samples.append(time.perf_counter() - start)
    total = statistics.median(samples)
    per_token = total / statistics.median(freed) * 1e9
    return (
        f"| {num_requests // 1000}k | {pool} | {target} | {total * 1e3:.1f} | "
        f"{statistics.median(in_free) * 1e3:.1f} | {per_token:.0f} |"
    )


def _path_nodes(node) -> int:
    count = 0
    while node.parent is not None:
        count, node = count + 1, node.parent
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--trees", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 10000])
    args = p.parse_args()
    torch.set_num_threads(1)
    t = Tokens(0)
    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cpus, rounds={args.rounds}\n")
    print("| case (hit/prompt) | tree | hit | nodes | list us | array us | +slots us | naive us | naive/list |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    inserts = []
    for size in args.trees:
        w = Workload(size, t)
        for row in bench_matches(w, t, args.rounds, f"{size // 1000}k"):
            print(row, flush=True)
        inserts += bench_inserts(w, t, f"{size // 1000}k")
    print("\n| insert (new request) | tree | already cached | us |")
    print("| --- | --- | --- | --- |")
    print("\n".join(inserts))
    print("\n| evict 10%: tree | cached tokens (= pool) | tokens to evict | ms | of which allocator.free ms | ns/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in args.trees:
        print(bench_evict(size, t), flush=True)


if __name__ == "__main__":
    main()
