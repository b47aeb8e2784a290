"""Prefix-cache hit rates on a Mooncake-format trace, replayed through the real radix cache, host
tier and KV ledger (issue 32).

    python -m bench.trace_replay --trace ../shared/traces/mooncake_conversation_trace.jsonl

Each request's prompt is built from its `hash_ids` (block id h gives the 512 token ids
h * 512 + 1 .. h * 512 + 512, the last block cut to `input_length`) and goes through what the
Adder does for it: match (device, then the host tier, loaded back), a row, KV for the rest,
cached when it closes. Requests run one after another in trace order, so nothing running pins a
prefix: the pool holds only cache, and the figures are the cache's, not a serving run's. Outputs
are not cached (their tokens are not in the trace).

The device pool defaults to an 8B model (Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, so
128 KiB of KV a token) on one 80 GB H100 with SGLang's mem_fraction_static 0.9: about 450,000
tokens. "unbounded" gives the pool every token of the trace.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from actors.kv_ledger import KVLedger
from bench.serving_plot import hit_rate_figure, plot_problem, save
from cache import RadixCache
from cache.host_tier import HostTier, chain_digests
from cache.storage_tier import Prefetch
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator

BLOCK = 512  # tokens per hash id in Mooncake's traces
KV_BYTES_PER_TOKEN_8B = 2 * 32 * 8 * 128 * 2
H100_POOL_TOKENS = int((80e9 * 0.9 - 16e9) // KV_BYTES_PER_TOKEN_8B)


class TraceRequest(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class Replay:
    name: str
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    seconds: float = 0.0
    # Per request, in trace order: arrival (ms), prompt tokens, tokens found in any tier (the plot's).
    arrivals_ms: list[float] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    def row(self) -> dict[str, object]:
        total = max(self.prompt_tokens, 1)
        return {
            "cache": self.name,
            "hit_rate": round(self.hit_rate, 4),
            "device_hit_rate": round(self.device_hit_tokens / total, 4),
            "host_hit_rate": round(self.host_hit_tokens / total, 4),
            "storage_hit_rate": round(self.storage_hit_tokens / total, 4),
            "prefill_tokens_saved": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "replay_s": round(self.seconds, 1),
        }


def read_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    decoder = msgspec.json.Decoder(TraceRequest)
    with open(path, "rb") as f:
        reqs = [decoder.decode(line) for line in f if line.strip()]
    reqs.sort(key=lambda r: r.timestamp)  # stable: equal times keep the file's order
    return reqs[:limit] if limit else reqs


def prompt_tokens(req: TraceRequest) -> list[int]:
    tokens: list[int] = []
    for h in req.hash_ids:
        tokens.extend(range(h * BLOCK + 1, h * BLOCK + BLOCK + 1))
    return tokens[: req.input_length]


def replay(
    trace: list[TraceRequest], name: str, device_tokens: int, host_tokens: int = 0,
    page_size: int = 64, block_tokens: int = BLOCK, write_policy: str = "write_through", storage: bool = False,
) -> Replay:
    """`storage`: a storage tier (L3) of unbounded size under the host tier, read completely
    before each request is admitted (`wait_complete`)."""
    allocator = TokenSlotAllocator(device_tokens, page_size)
    host = HostTier(host_tokens, block_tokens, page_size, write_policy) if host_tokens else None
    stored: dict[bytes, bytes] | None = {} if storage and host is not None else None  # every block written, by chain key
    if stored is not None:
        host.persist = True  # type: ignore[union-attr]
    longest = max(r.input_length for r in trace)
    ledger = KVLedger(allocator, ReqToTokenPool(1, longest + page_size), RadixCache(allocator, host_tier=host))
    out = Replay(name)
    start = time.perf_counter()
    for req in trace:
        tokens = prompt_tokens(req)
        if len(tokens) + page_size > device_tokens:
            continue  # cannot run on this pool at all
        key = tokens[:-1]  # the last token is always computed
        on_device = ledger.cache.match_prefix(key).length
        on_host, prefetch = None, None  # on_host: how far device and host reach without storage
        if stored is not None:
            assert host is not None
            on_host = host.find(key, None, on_device, len(key) // page_size * page_size)
            prefetch = _stored_blocks(stored, key, host.block_tokens, on_host)
        match = ledger.match(key, None, prefetch)
        for copy in ledger.take_kv_copies():  # no KV data here: the Executor would do these copies
            if stored is not None and copy.persist is not None:
                stored[copy.persist.key] = copy.persist.tokens
        ledger.cache.inc_lock_ref(match.last_node)
        row = ledger.open_row(match)
        ledger.make_room(len(tokens) - match.length + page_size)
        if ledger.extend(row, len(tokens) - match.length) is None:
            raise RuntimeError(f"the pool of {device_tokens} tokens cannot hold a {len(tokens)}-token prompt")
        ledger.close_row(row, tokens, None)
        out.prompt_tokens += len(tokens)
        out.device_hit_tokens += on_device
        from_host = match.length if on_host is None else min(on_host, match.length)
        out.host_hit_tokens += from_host - on_device
        out.storage_hit_tokens += match.length - from_host
        out.arrivals_ms.append(req.timestamp)
        out.prompts.append(len(tokens))
        out.hits.append(match.length)
    ledger.check()
    out.seconds = time.perf_counter() - start
    return out


def _stored_blocks(stored: dict[bytes, bytes], key: list[int], block_tokens: int, on_host: int) -> Prefetch | None:
    """What a completed storage prefetch holds: the stored blocks that continue the match from
    the block holding token `on_host` (no KV data: empty tensors stand for it)."""
    first, last = on_host // block_tokens, len(key) // block_tokens
    if last <= first:
        return None
    keys = chain_digests(key, None, block_tokens, last)[first:]
    found = list(itertools.takewhile(lambda k: k in stored, keys))
    return Prefetch(found, [stored[k] for k in found], deadline=0.0, blocks=[torch.empty(0)] * len(found))


def configurations(
    device_tokens: int, host_ratios: list[float], total_tokens: int, storage: bool = False,
) -> Iterator[tuple[str, int, int, bool]]:
    yield "unbounded", total_tokens + BLOCK, 0, False
    yield f"radix, device {device_tokens:,}", device_tokens, 0, False
    for ratio in host_ratios:
        yield f"+ host {ratio:g}x", device_tokens, int(device_tokens * ratio), False
        if storage:
            yield f"+ host {ratio:g}x + storage", device_tokens, int(device_tokens * ratio), True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", default="../shared/traces/mooncake_conversation_trace.jsonl")
    p.add_argument("--limit", type=int, default=None, help="the first N requests only")
    p.add_argument("--device-tokens", type=int, default=H100_POOL_TOKENS, help="device KV pool, tokens")
    p.add_argument("--host-ratio", type=float, nargs="*", default=[2.0, 4.0], help="host tier sizes, times the device pool")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--write-policy", default="write_through", choices=("write_through", "write_back"))
    p.add_argument("--storage", action="store_true", help="also each host tier size with an unbounded storage tier (L3) under it")
    p.add_argument("--output", default=None, help="append one JSON line per configuration")
    p.add_argument("--plot", type=Path, default=None, help="hit rate over the trace's time, a line per cache, to this .png, .svg or .pdf")
    p.add_argument("--plot-window-s", type=float, default=120.0, help="the plot's hit rate is over windows of this many trace seconds")
    args = p.parse_args(argv)
    if args.plot is not None and (problem := plot_problem(args.plot)):
        p.error(problem)
    trace = read_trace(args.trace, args.limit)
    total = sum(r.input_length for r in trace)
    print(f"{len(trace)} requests, {total:,} prompt tokens")
    print(f"{'cache':<28} {'hit rate':>9} {'device':>8} {'host':>8} {'storage':>8} {'saved tokens':>14} {'s':>6}")
    replays = []
    for name, device, host, storage in configurations(args.device_tokens, args.host_ratio, total, args.storage):
        replays.append(replay(trace, name, device, host, args.page_size, write_policy=args.write_policy, storage=storage))
        result = replays[-1].row()
        print(f"{name:<28} {result['hit_rate']:>9.1%} {result['device_hit_rate']:>8.1%} {result['host_hit_rate']:>8.1%} "
              f"{result['storage_hit_rate']:>8.1%} {result['prefill_tokens_saved']:>14,} {result['replay_s']:>6}")
        if args.output:
            with open(args.output, "a") as f:
                f.write(json.dumps({**result, "requests": len(trace), "page_size": args.page_size}) + "\n")
    if args.plot is not None:
        series = {r.name: hit_rate_over_time(r, args.plot_window_s) for r in replays}
        save(hit_rate_figure(series, f"{Path(args.trace).name}, {args.plot_window_s:g} s windows"), args.plot)
        print(f"plot: {args.plot}")
    return 0


def hit_rate_over_time(r: Replay, window_s: float) -> tuple[list[float], list[float]]:
    """(window start in minutes, share of that window's prompt tokens found in any tier)."""
    by_window: dict[int, list[int]] = {}
    for at_ms, prompt, hit in zip(r.arrivals_ms, r.prompts, r.hits):
        tally = by_window.setdefault(int(at_ms / 1000 // window_s), [0, 0])
        tally[0] += hit
        tally[1] += prompt
    windows = sorted(by_window)
    return [w * window_s / 60 for w in windows], [by_window[w][0] / by_window[w][1] for w in windows]


if __name__ == "__main__":
    raise SystemExit(main())
