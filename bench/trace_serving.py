"""TTFT on a Mooncake-format trace served by the real actors over the cost-model device, with the
radix cache alone, with a host tier under it, and with a storage tier under that (issue 32).

    python -m bench.trace_serving --requests 300 --time-scale 0.3 --sim-speed 3 --host-ratio 2 4 --storage 2

The first `--requests` requests of the trace are sent at their timestamps (divided by
`--time-scale`: below 1 the trace is slowed down, e.g. to what one GPU sustains) to an Engine whose Receiver, Policy, Adder (KV ledger, radix cache, host tier),
Executor and OutputProcessor are the real ones; the model is a `HostLinkDevice`, a cost-model
device (bench/device_model.py, an 8B model on one H100 by default) that sleeps each step's modelled
GPU time plus the step's host-to-device loads at the model's PCIe rate (charged in full before the
step: SGLang overlaps them with the forward layer by layer, so this is the costlier bound). Copies
to the host are not charged (a side stream, the other direction of the link). Each request asks
for its `output_length` tokens with ignore_eos.

With `--storage`, the engine's own storage tier (file backend, no capacity bound, in a temporary
directory) runs under the host tier: the device writes each block the host tier persists, the
Policy prefetches (`wait_complete`), the Adder adopts what was read into the host tier and loads
it. The tier's reader thread takes each block at the model's disk rate (one PCIe Gen4 x4 NVMe SSD,
bench/device_model.py; one block after another, every request's prefetch in one queue) while the
request waits in the Policy's prefetch queue, as SGLang reads storage beside the GPU; the step that
adopts the blocks pays only their load to the device at PCIe rate. Writes to storage are not
charged (a thread of their own, the disk's other direction).

Prompts: block id h is 512 token ids of a one-layer micro model's 512-token vocabulary, its first
three the digits of h (so two blocks are equal only when their ids are), the rest a function of h;
the last block is cut to `input_length`. The device pool is the model's KV in an H100's memory
(80 GB x mem_fraction_static 0.9, less 16 GB of weights).

`--sim-speed k` runs the whole simulation k times faster than the modelled time: arrivals and
every modelled step and load are k times shorter, and TTFTs and load times are reported multiplied
back by k. The actors' own CPU time is not shortened, so k > 1 weighs it k times.

`--real-model S` runs the real engine instead, the micro model's forward on this CPU (its KV
really copied to the host tier, written to storage and loaded back), with every length scaled by
S: a hash id is 512 x S tokens, prompts and outputs S times their trace lengths, the pool S times
the device's, pages and host blocks 64 x S tokens. TTFTs and times are then this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from api.core.engine_core import CoreSetup
from api.frontend.engine import Engine, EngineError, Rejected
from bench.device_model import DEVICE_MODELS, DeviceModel
from bench.overhead import TOKEN_MARGIN, NullDevice
from bench.serving_plot import OverTime, plot_problem, save, trace_figure
from bench.trace_replay import BLOCK, TraceRequest, read_trace
from cache.storage_tier import StorageTier
from gpu.model_runner import ModelRunner
from runtime.forward_mode import ForwardMode
from runtime.messages import Batch, StepOut

VOCAB = 512
DIGITS = 3  # base-(VOCAB - 2 * TOKEN_MARGIN) digits of a block id at the start of its block
FAILED = "engine_error"  # an Outcome's code when the engine failed under the request
H100_MEMORY_BYTES = 80e9
MEM_FRACTION_STATIC = 0.9
WEIGHT_BYTES_8B = 16e9


class HostLinkDevice(NullDevice):
    """A NullDevice that also charges each batch's host -> device KV loads at the model's PCIe rate,
    and counts them and the blocks the batch brings from the storage tier.

    With a storage tier it writes the tier's blocks as the model's step runner does, each block
    stored to the host with `persist`, so the real tier (its files, checksums, prefetch,
    adoption into the host tier) runs underneath; the files hold zeros of the engine's own (micro)
    KV layout, as this device computes no KV. The tier's prefetch reads at the model's disk rate
    (`StorageTier.pace_reads`) while the request waits in the queue, as SGLang's does: a step
    never waits for the disk, and `storage_s` is the disk time of the blocks the steps adopted."""

    def __init__(self, vocab_size: int, model: DeviceModel, storage: StorageTier | None = None):
        super().__init__(0.0, vocab_size, model)
        self.storage = storage
        self.loaded_tokens = 0
        self.load_s = 0.0
        self.storage_tokens = 0
        self.storage_s = 0.0
        self._zero_block = None if storage is None else torch.zeros(storage.layout.block_shape(storage.block_tokens), dtype=storage.layout.dtype)
        if storage is not None:
            storage.pace_reads(model.storage_read_s(storage.block_tokens))

    def run(self, batch: Batch) -> StepOut:
        self._write_storage(batch)
        if batch.mode is ForwardMode.IDLE:  # copies alone: to the host, not charged
            return StepOut(batch=batch, token_ids=[], logprobs=None, top_logprobs=None, forward_s=0.0)
        return super().run(batch)

    def sleep_s(self, batch: Batch) -> float:
        assert self.model is not None
        tokens, from_storage = loaded_tokens(batch), storage_tokens(batch)
        load_s = self.model.host_load_s(tokens)
        self.loaded_tokens += tokens
        self.load_s += load_s
        self.storage_tokens += from_storage
        self.storage_s += self.model.storage_read_s(from_storage)  # paid in the queue, by the prefetch
        return self.model.step_s(batch.prefix_lens, batch.extend_lens) + load_s

    def _write_storage(self, batch: Batch) -> None:
        if self.storage is None:
            return
        assert self._zero_block is not None
        for copy in batch.kv_copies:
            if copy.persist is not None:  # never written to, so one tensor serves every block
                self.storage.write(copy.persist.key, copy.persist.tokens, self._zero_block)

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()


def loaded_tokens(batch: Batch) -> int:
    """Tokens the batch's KV copies bring from the host tier to the device."""
    return sum(c.device_slots.numel() for c in batch.kv_copies if not c.to_host and c.staged is None)


def storage_tokens(batch: Batch) -> int:
    """Tokens the batch's KV copies bring from the storage tier to the host (each block the Adder
    adopted from a prefetch: a host hit of the same batch then loads it to the device)."""
    return sum(c.host_slots.numel() for c in batch.kv_copies if c.staged is not None)


def host_link_device(runner: ModelRunner, device_model: str, sim_speed: float = 1.0, storage: StorageTier | None = None) -> HostLinkDevice:
    """`CoreSetup` step runner: the named cost model, `sim_speed` times faster."""
    return HostLinkDevice(runner.vocab_size, scaled(DEVICE_MODELS[device_model], sim_speed), storage)


def scaled(model: DeviceModel, s: float) -> DeviceModel:
    """The model with every step and load s times shorter."""
    if s == 1.0:
        return model
    return replace(model, peak_flops=model.peak_flops * s, bandwidth=model.bandwidth * s, launch_s=model.launch_s / s,
                   host_link_bytes_per_s=model.host_link_bytes_per_s * s, storage_read_bytes_per_s=model.storage_read_bytes_per_s * s)


def pool_tokens(model: DeviceModel) -> int:
    """KV tokens of one H100 after SGLang's static fraction and the weights."""
    return int((H100_MEMORY_BYTES * MEM_FRACTION_STATIC - WEIGHT_BYTES_8B) // model.kv_bytes_per_token)


def block_ids(h: int) -> list[int]:
    base = VOCAB - 2 * TOKEN_MARGIN
    head = [TOKEN_MARGIN + h // base**k % base for k in range(DIGITS)]
    return head + [TOKEN_MARGIN + (h * 7919 + i * 104729) % base for i in range(DIGITS, BLOCK)]


def prompt_ids(req: TraceRequest, block: int = BLOCK) -> list[int]:
    """`req`'s prompt, each hash id `block` tokens (the first `block` of its 512)."""
    ids: list[int] = []
    for h in req.hash_ids:
        ids.extend(block_ids(h)[:block])
    return ids[: req.input_length]


def scaled_request(req: TraceRequest, scale: float) -> TraceRequest:
    """`req` with its prompt and output lengths `scale` times as long (at least one token)."""
    return TraceRequest(req.timestamp, max(1, round(req.input_length * scale)), max(1, round(req.output_length * scale)), req.hash_ids)


def trace_model_dir() -> Path:
    """The micro model with a context as long as the trace's longest prompts."""
    from gpu.tiny_model import make_tiny_model

    out = Path(tempfile.gettempdir()) / "actorserve-bench-trace-llama"
    if not (out / "model.safetensors").exists():
        make_tiny_model(out, "llama", seed=0, vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=16, intermediate_size=16, max_position_embeddings=131072)
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None  # None: refused or failed (`code` says why)
    arrival_s: float = 0.0  # its arrival in trace seconds after the first request's
    code: str | None = None
    error: str | None = None  # the engine's failure, when code is FAILED


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    outcomes: list[Outcome]
    loaded_tokens: int  # host -> device, each block from storage included
    load_s: float
    host_hit_tokens: int  # the host tier's hits, by the engine's stats (blocks from storage included)
    seconds: float
    storage_tokens: int = 0  # storage -> host, as the steps adopted them
    storage_s: float = 0.0  # their modelled disk time, paid while their requests waited
    storage_hit_tokens: int = 0  # by the engine's stats
    storage_written_blocks: int = 0
    storage_dropped_writes: int = 0
    # Where the wall time went: the modelled device busy (a fraction of the run), and the CPU of
    # the loop thread (the actors and the requests; sim_speed weighs it against modelled time).
    device_busy: float = 0.0
    loop_cpu_s: float = 0.0
    actor_cpu_s: dict[str, float] = field(default_factory=dict)

    def ttfts_ms(self) -> list[float]:
        return sorted(o.ttft_s * 1e3 for o in self.outcomes if o.ttft_s is not None)

    def over_time(self, window_s: float, sim_speed: float) -> OverTime:
        """Hit rate and modelled TTFT p50/p99 per `window_s` seconds of trace time (by arrival)."""
        windows: dict[int, list[Outcome]] = {}
        for o in self.outcomes:
            windows.setdefault(int(o.arrival_s // window_s), []).append(o)
        keys = sorted(windows)
        hit = [sum(o.cached_tokens for o in windows[k]) / max(1, sum(o.prompt_tokens for o in windows[k])) for k in keys]
        ttfts = [sorted(o.ttft_s * 1e3 * sim_speed for o in windows[k] if o.ttft_s is not None) for k in keys]
        return OverTime(
            [k * window_s / 60 for k in keys], hit,
            [statistics.median(t) if t else None for t in ttfts], [percentile(t, 0.99) if t else None for t in ttfts],
        )

    def row(self, sim_speed: float) -> dict[str, Any]:
        ttft = [t * sim_speed for t in self.ttfts_ms()]
        prompt = sum(o.prompt_tokens for o in self.outcomes)
        saved = sum(o.cached_tokens for o in self.outcomes)
        return {
            "cache": self.name, "requests": len(self.outcomes), "refused": sum(o.ttft_s is None and o.code != FAILED for o in self.outcomes),
            "failed": sum(o.code == FAILED for o in self.outcomes),
            "hit_rate": round(saved / max(prompt, 1), 4),
            "host_hit_rate": round((self.host_hit_tokens - self.storage_hit_tokens) / max(prompt, 1), 4),
            "storage_hit_rate": round(self.storage_hit_tokens / max(prompt, 1), 4),
            "prefill_tokens_saved": saved, "prompt_tokens": prompt,
            "ttft_p50_ms": round(statistics.median(ttft), 1) if ttft else None, "ttft_p99_ms": round(percentile(ttft, 0.99), 1) if ttft else None,
            "host_load_tokens": self.loaded_tokens, "host_load_s": round(self.load_s * sim_speed, 2),
            "storage_read_tokens": self.storage_tokens, "storage_read_s": round(self.storage_s * sim_speed, 2),
            "storage_written_blocks": self.storage_written_blocks, "storage_dropped_writes": self.storage_dropped_writes,
            "wall_s": round(self.seconds, 1), "device_busy": round(self.device_busy, 3), "loop_cpu_s": round(self.loop_cpu_s, 1),
            "actor_cpu_s": {name: round(s, 1) for name, s in self.actor_cpu_s.items()},
        }


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def serve(
    trace: list[TraceRequest], name: str, device: DeviceModel, config: dict[str, Any],
    time_scale: float = 1.0, sim_speed: float = 1.0, model_dir: Path | None = None, real_scale: float | None = None,
) -> Result:
    """The trace through an Engine over the cost-model device, or with `real_scale` through the
    real model at lengths that many times the trace's; `config`: EngineConfig fields over the
    defaults here (the device's pool, pages of 64, both scaled in a real run); a storage tier's
    files go to a temporary directory of this run's, removed after it."""
    with tempfile.TemporaryDirectory(prefix="actorserve-trace-storage-") as storage_dir:
        config = {"hicache_storage_dir": storage_dir, **config}
        if real_scale is None:
            return await _serve(trace, name, device, config, time_scale, sim_speed, model_dir)
        return await _serve_real(trace, name, device, config, time_scale, real_scale, model_dir)


async def _serve(
    trace: list[TraceRequest], name: str, device: DeviceModel, config: dict[str, Any], time_scale: float, sim_speed: float, model_dir: Path | None,
) -> Result:
    setup = CoreSetup(step_runner="bench.trace_serving:host_link_device", step_runner_kwargs={"device_model": device.name, "sim_speed": sim_speed},
                      step_runner_storage=True)
    config = {"max_total_tokens": pool_tokens(device), "page_size": 64, **config}
    engine = Engine(model_path=str(model_dir or trace_model_dir()), random_seed=0, inline_core=True, core_setup=setup, **config)
    await engine.start()
    try:
        outcomes, start, end, cpu_s = await _send_all(engine, trace, time_scale * sim_speed, BLOCK)
        seconds = end - start
        stats = {} if any(o.code == FAILED for o in outcomes) else await engine.current_stats()
        # A HostLinkDevice of the module CoreSetup imports (this one may be __main__, another copy).
        runner: Any = engine.core.executor.step_runner
        return Result(
            name, outcomes, runner.loaded_tokens, runner.load_s, int(stats.get("hicache_host_hit_tokens", 0)), seconds,
            runner.storage_tokens, runner.storage_s, int(stats.get("hicache_storage_hit_tokens", 0)),
            int(stats.get("hicache_storage_written_blocks", 0)), int(stats.get("hicache_storage_dropped_writes", 0)),
            runner.busy_between(start, end) / seconds, cpu_s, dict(stats.get("actor_cpu_s", {})),
        )
    finally:
        await engine.close()


async def _serve_real(
    trace: list[TraceRequest], name: str, device: DeviceModel, config: dict[str, Any], time_scale: float, scale: float, model_dir: Path | None,
) -> Result:
    """The real model runner (the engine's own forward, KV copies and storage writes); loads are
    counted by the engine's stats, their time is inside the steps."""
    page = max(1, round(64 * scale))
    config = {"max_total_tokens": int(pool_tokens(device) * scale), "page_size": page, "hicache_block_tokens": page, **config}
    engine = Engine(model_path=str(model_dir or trace_model_dir()), random_seed=0, inline_core=True, **config)
    await engine.start()
    try:
        requests = [scaled_request(r, scale) for r in trace]
        outcomes, start, end, cpu_s = await _send_all(engine, requests, time_scale, max(1, round(BLOCK * scale)))
        stats = {} if any(o.code == FAILED for o in outcomes) else await engine.current_stats()
        host_hits, storage_hits = int(stats.get("hicache_host_hit_tokens", 0)), int(stats.get("hicache_storage_hit_tokens", 0))
        return Result(
            name, outcomes, host_hits, 0.0, host_hits, end - start, storage_hits, 0.0, storage_hits,
            int(stats.get("hicache_storage_written_blocks", 0)), int(stats.get("hicache_storage_dropped_writes", 0)),
            float(stats.get("forward_s", 0.0)) / (end - start), cpu_s, dict(stats.get("actor_cpu_s", {})),
        )
    finally:
        await engine.close()


async def _send_all(engine: Engine, trace: list[TraceRequest], speed: float, block: int) -> tuple[list[Outcome], float, float, float]:
    """Every request at its time, `speed` times faster: (outcomes, start, end, the loop's CPU s)."""
    start, cpu0 = time.perf_counter(), time.thread_time()
    t0 = trace[0].timestamp
    outcomes = await asyncio.gather(*(_one(engine, r, start, (r.timestamp - t0) / 1000, speed, block) for r in trace))
    end = time.perf_counter()
    failures = [o.error for o in outcomes if o.code == FAILED]
    if failures:
        print(f"{len(failures)} requests failed; the first: {failures[0]}", flush=True)
    return list(outcomes), start, end, time.thread_time() - cpu0


async def _one(engine: Engine, req: TraceRequest, start: float, arrival_s: float, speed: float, block: int) -> Outcome:
    """`req` sent at `arrival_s` trace seconds after `start`, `speed` times faster; `block` tokens a hash id."""
    ids = prompt_ids(req, block)
    await asyncio.sleep(max(0.0, start + arrival_s / speed - time.perf_counter()))
    sent, first, cached = time.perf_counter(), None, 0
    params = {"max_new_tokens": max(req.output_length, 1), "temperature": 0, "ignore_eos": True}
    try:
        async for delta in engine.stream(input_ids=ids, sampling_params=params):
            if delta.output_ids and first is None:
                first = time.perf_counter()
            cached = delta.cached_tokens or cached
    except Rejected as refused:
        return Outcome(len(ids), 0, None, arrival_s, refused.code)
    except EngineError as failure:  # the engine crashed (a 500): counted and shown, never hidden
        return Outcome(len(ids), 0, None, arrival_s, FAILED, str(failure))
    return Outcome(len(ids), cached, None if first is None else first - sent, arrival_s)


# The storage setting's prefetch holds a request until its read is done, which the modelled disk
# paces (HostLinkDevice): the request waits for the disk, the running batch does not.
STORAGE_CONFIG = {"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete"}


def settings(host_ratios: list[float], radix: bool = True, storage_ratios: list[float] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Radix only, each host tier size, and each of `storage_ratios` with a storage tier (of no
    bound) under a host tier of that size."""
    out: list[tuple[str, dict[str, Any]]] = [("radix only", {})] if radix else []
    out += [(f"+ host {r:g}x", {"enable_hierarchical_cache": True, "hicache_ratio": r}) for r in host_ratios]
    out += [(f"+ host {r:g}x + storage", {"enable_hierarchical_cache": True, "hicache_ratio": r, **STORAGE_CONFIG}) for r in storage_ratios or []]
    return out


HEADER = ("| cache | requests | hit rate | from host | from storage | prefill tokens saved | TTFT p50 ms | TTFT p99 ms | p50 vs radix | p99 vs radix | host loads s | storage reads s | device busy | loop CPU s |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table_row(row: dict[str, Any], base: dict[str, Any]) -> str:
    def change(key: str) -> str:
        return f"{(row[key] / base[key] - 1) * 100:+.0f}%" if row[key] and base[key] else "-"
    served = row["requests"] - row["refused"] - row["failed"]
    if row["failed"]:
        return f"| {row['cache']} | {served} | the engine failed: {row['failed']} requests ended with an error |"
    return (f"| {row['cache']} | {served} | {row['hit_rate']:.1%} | {row['host_hit_rate']:.1%} | {row['storage_hit_rate']:.1%} | {row['prefill_tokens_saved']:,} | "
            f"{row['ttft_p50_ms']:,.0f} | {row['ttft_p99_ms']:,.0f} | {change('ttft_p50_ms')} | {change('ttft_p99_ms')} | {row['host_load_s']} | {row['storage_read_s']} | "
            f"{row['device_busy']:.0%} | {row['loop_cpu_s']} |")


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = DEVICE_MODELS[args.device_model]
    trace = read_trace(args.trace, args.requests)
    span_s = (trace[-1].timestamp - trace[0].timestamp) / 1000
    if args.real_model is None:
        print(f"{len(trace)} requests over {span_s:.0f} s of trace ({span_s / args.time_scale:.0f} s modelled, {span_s / args.time_scale / args.sim_speed:.0f} s here), "
              f"{sum(r.input_length for r in trace):,} prompt tokens; {device.name}, pool {pool_tokens(device):,} tokens, "
              f"host link {device.host_link_bytes_per_s / 1e9:g} GB/s, storage reads {device.storage_read_bytes_per_s / 1e9:g} GB/s")
    else:
        s = args.real_model
        print(f"{len(trace)} requests over {span_s / args.time_scale:.0f} s, the real micro model with lengths x {s:g}: "
              f"{sum(scaled_request(r, s).input_length for r in trace):,} prompt tokens, pool {int(pool_tokens(device) * s):,} tokens")
    rows = []
    series: dict[str, OverTime] = {}
    for name, config in settings(args.host_ratio, not args.no_radix, args.storage):
        result = await serve(trace, name, device, config, args.time_scale, args.sim_speed, real_scale=args.real_model)
        rows.append(result.row(args.sim_speed))
        series[name] = result.over_time(args.plot_window_s, args.sim_speed)
        print(json.dumps(rows[-1]), flush=True)
        if args.output:
            with open(args.output, "a") as f:
                f.write(json.dumps({**rows[-1], "time_scale": args.time_scale, "sim_speed": args.sim_speed, "device_model": device.name}) + "\n")
    print(HEADER)
    for row in rows:
        print(table_row(row, rows[0]))
    if args.plot is not None:
        title = f"{Path(args.trace).name}, first {len(trace)} requests, {device.name}, {args.plot_window_s:g} s windows"
        print(f"plot: {save(trace_figure(series, title), args.plot)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", default="../shared/traces/mooncake_conversation_trace.jsonl")
    p.add_argument("--requests", type=int, default=300, help="the first N requests of the trace")
    p.add_argument("--time-scale", type=float, default=0.3, help="arrivals this many times faster than the trace's (below 1: slower)")
    p.add_argument("--sim-speed", type=float, default=None, help="run the modelled time this many times faster (arrivals, steps, loads); default 3, and 1 (the only one) with --real-model")
    p.add_argument("--device-model", default="h100-qwen3-8b", choices=sorted(DEVICE_MODELS))
    p.add_argument("--host-ratio", type=float, nargs="*", default=[2.0, 4.0], help="host tier sizes, times the device pool")
    p.add_argument("--storage", type=float, nargs="*", default=[], metavar="HOST_RATIO",
                   help="also these host tier sizes with a storage tier (L3, file backend, no bound) under them")
    p.add_argument("--no-radix", action="store_true", help="leave out the radix-only run (the table's changes are then against the first host tier)")
    p.add_argument("--real-model", type=float, default=None, metavar="SCALE",
                   help="the real engine and micro model on this CPU, every length (and the pool) times SCALE, instead of the cost-model device")
    p.add_argument("--output", default=None, help="append one JSON line per setting")
    p.add_argument("--plot", type=Path, default=None, help="hit rate and TTFT p50/p99 over the trace's time, a line per setting, to this .png, .svg or .pdf")
    p.add_argument("--plot-window-s", type=float, default=60.0, help="the plot's windows, in trace seconds")
    args = p.parse_args(argv)
    if args.plot is not None and (problem := plot_problem(args.plot)):
        p.error(problem)
    if args.real_model is not None:
        if not 0 < args.real_model <= 1:
            p.error("--real-model takes a scale in (0, 1]")
        if args.sim_speed not in (None, 1):
            p.error("--sim-speed applies to the cost-model device; a --real-model run takes the wall clock")
    if args.sim_speed is None:
        args.sim_speed = 1.0 if args.real_model is not None else 3.0
    if args.time_scale <= 0 or args.sim_speed <= 0 or args.requests < 1:
        p.error("--time-scale, --sim-speed and --requests must be positive")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
