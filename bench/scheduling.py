"""Scheduling quality at GPU scale: each workload under today's policy and the new one, same run.

    .venv/bin/python -m bench.scheduling [--workload w5|lpm|slo|tenants|all] [--device-model h100-qwen3-8b]

The real actors (Receiver, Policy, Adder, Executor, OutputProcessor) run with a cost-model device
(bench/device_model.py: each step sleeps what the modelled GPU would take for it), so thousands
of requests at GPU rates run on a CPU. An open-loop client sends each request at its arrival time
and reads its stream; per request: queue time (arrival to admission, from the engine), TTFT,
end-to-end latency and when each token came, split by class. Capacity is measured, not assumed:
the same requests sent at once, requests per second to finish them all. `--plot out.png|.svg|.pdf`
draws each workload's TTFT CDFs, a panel per class and a line per setting (bench/serving_plot.py;
with --workload all, one file per workload: out-w5.png, ...).

Workloads:
- w5: W5-priority-overload (shared/bench-workloads.md) at GPU scale (`--w5-requests`, prompts
  32-256, outputs 16-128, 10% priority 10) at 2x capacity: fcfs with priority scheduling, without
  aging and with each `--w5-aging` S. The bound of actors/policy_order.py is checked per request:
  how many requests were admitted before one they arrived more than (D + 1) * S after.
- lpm: 90% of prompts share a hot 1,024-token prefix, 10% are cold (as long, nothing shared),
  at capacity (`--lpm-overload`, x capacity); lpm (no fallback to fcfs, as a deployment that raised
  `--lpm-fallback-queue-len` runs) alone, with aging (`--lpm-aging`), with a cold lane
  (`--lpm-cold-lane`) and with both (`--lpm-cold-lane-aging`): each class's TTFT, the hit rate.
- slo: W5's request sizes (no priorities), each asking TTFT <= 500 ms (its slo_ttft_ms) and
  TPOT <= 50 ms:
  the arrival rate where fcfs meets 90% of them (bisected), then edf with --reject-infeasible at it:
  attainment among the admitted, and goodput (tokens of requests that met both per second).
- tenants: W5's request sizes from two tenants, one sending 4x the other's requests, at 3x
  capacity (so b alone asks for more than half of it and both stay backlogged): lpm, and lpm with
  --fairness vtc. Over each period in which both wait, the largest difference between the service
  each received since it began (prompt tokens when admitted + 2 x tokens as they stream, the VTC
  paper's measure), against the paper's bound; Jain's index over that service; throughput
  against lpm's.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from api.frontend.engine import Engine, Rejected
from bench.device_model import DEVICE_MODELS, DeviceModel
from bench.overhead import Probe, micro_model_dir, start_engine, stop_engine
from bench.serving_plot import class_figure, plot_problem, save
from bench.workloads import W5_HIGH_PRIORITY, W5_REQUESTS, Request, arrival_offsets, make_workload

VOCAB = 512  # the micro model's
NO_FALLBACK = 1 << 20
SLO_TTFT_MS = 500.0
SLO_TPOT_MS = 50.0


@dataclass(frozen=True, slots=True)
class Job:
    request: Request
    klass: str
    options: dict[str, Any] = field(default_factory=dict)  # Engine.stream's keyword arguments


@dataclass(frozen=True, slots=True)
class Outcome:
    job: Job
    sent_s: float  # offsets from the start of the run
    end_s: float
    queue_s: float
    prompt_tokens: int
    cached_tokens: int
    token_times: list[tuple[float, int]]  # (when, tokens) per delta; none: refused

    @property
    def first_token_s(self) -> float | None:
        return self.token_times[0][0] if self.token_times else None

    @property
    def refused(self) -> bool:
        return self.first_token_s is None

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.sent_s

    @property
    def admitted_s(self) -> float:
        return self.sent_s + self.queue_s

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.token_times)


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    config: dict[str, Any]


# --- running jobs ----------------------------------------------------------------------------------


async def run(jobs: Sequence[Job], setting: Setting, device: DeviceModel, pool_tokens: int) -> list[Outcome]:
    probe = Probe()
    rig = await start_engine(micro_model_dir(), probe, None, device_model=device, max_total_tokens=pool_tokens, **setting.config)
    try:
        start = time.perf_counter()
        return list(await asyncio.gather(*(_one(rig.engine, job, start) for job in jobs)))
    finally:
        await stop_engine(rig, probe)


async def _one(engine: Engine, job: Job, start: float) -> Outcome:
    r = job.request
    await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
    sent = time.perf_counter() - start
    times: list[tuple[float, int]] = []
    queue, cached, prompt = 0.0, 0, len(r.input_ids)
    params = {"max_new_tokens": r.max_new_tokens, "temperature": 0, "ignore_eos": True}
    try:
        async for delta in engine.stream(input_ids=r.input_ids, sampling_params=params, priority=r.priority, **job.options):
            if delta.output_ids:
                times.append((time.perf_counter() - start, len(delta.output_ids)))
            queue = delta.queue_time if delta.queue_time is not None else queue
            cached = delta.cached_tokens or cached
    except Rejected:
        return Outcome(job, sent, time.perf_counter() - start, 0.0, prompt, 0, [])
    return Outcome(job, sent, time.perf_counter() - start, queue, prompt, cached, times)


async def capacity(requests: Sequence[Request], setting: Setting, device: DeviceModel, pool_tokens: int) -> float:
    """Requests per second when all arrive at once: the rate the engine sustains."""
    outs = await run([Job(replace(r, arrival_s=0.0), "all") for r in requests], setting, device, pool_tokens)
    return len(outs) / max(o.end_s for o in outs)


def with_arrivals(requests: Sequence[Request], rate: float, seed: int) -> list[Request]:
    offsets = arrival_offsets(np.random.default_rng(seed), len(requests), rate)
    return [replace(r, arrival_s=t) for r, t in zip(requests, offsets)]


# --- figures ---------------------------------------------------------------------------------------


def _p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


HEADER = "| setting | class | requests | TTFT p50 ms | TTFT p99 ms | max queue ms | E2E p99 s |\n| --- | --- | --- | --- | --- | --- | --- |"


def class_rows(name: str, outs: Sequence[Outcome]) -> list[str]:
    rows = []
    for klass in sorted({o.job.klass for o in outs}):
        mine = [o for o in outs if o.job.klass == klass and not o.refused]
        ttft = [o.ttft_s * 1e3 for o in mine]
        rows.append(
            f"| {name} | {klass} | {len(mine)} | {statistics.median(ttft):.0f} | {_p(ttft, 0.99):.0f} | "
            f"{max(o.queue_s for o in mine) * 1e3:.0f} | {_p([o.end_s - o.sent_s for o in mine], 0.99):.2f} |"
        )
    return rows


def hit_rate(outs: Sequence[Outcome]) -> float:
    return 100.0 * sum(o.cached_tokens for o in outs) / max(1, sum(o.prompt_tokens for o in outs))


def tokens_per_s(outs: Sequence[Outcome]) -> float:
    return sum(o.output_tokens for o in outs) / max(o.end_s for o in outs)


def overtaken_from_outside_window(outs: Sequence[Outcome], aging_s: float, best: int) -> int:
    """Pairs (R, Q) where Q was admitted before R but arrived more than (D + 1) * S after it;
    the bound of actors/policy_order.py says none with aging S."""
    admitted = sorted(outs, key=lambda o: o.admitted_s)
    sent_sorted: list[float] = []  # sent times of those admitted so far, sorted
    count = 0
    for o in admitted:
        window = (best - (o.job.request.priority or 0) + 1) * aging_s
        count += len(sent_sorted) - bisect.bisect_right(sent_sorted, o.sent_s + window)
        bisect.insort(sent_sorted, o.sent_s)
    return count


def worst_wait_over_bound(outs: Sequence[Outcome], aging_s: float, best: int, admit_per_s: float) -> float:
    """max over requests of wait / bound, the bound of actors/policy_order.py in seconds: (those
    queued at its arrival + those arriving within its window) / the admission rate."""
    sent = sorted(o.sent_s for o in outs)
    admitted = sorted(o.admitted_s for o in outs)
    worst = 0.0
    for o in outs:
        window = (best - (o.job.request.priority or 0) + 1) * aging_s
        queued = bisect.bisect_left(sent, o.sent_s) - bisect.bisect_right(admitted, o.sent_s)
        arriving = bisect.bisect_right(sent, o.sent_s + window) - bisect.bisect_right(sent, o.sent_s)
        worst = max(worst, o.queue_s / max((queued + arriving) / admit_per_s, 1e-9))
    return worst


# --- w5 ----------------------------------------------------------------------------------------------


def w5_requests(n: int, seed: int) -> list[Request]:
    """W5's requests (its sizes and priority mix), as many as asked: W5 itself is 512, so further
    ones come from the same generator with the next seeds."""
    out: list[Request] = []
    for k in range(-(-n // W5_REQUESTS)):
        out += make_workload("W5-priority-overload", VOCAB, seed=seed + k).requests
    return [replace(r, index=i) for i, r in enumerate(out[:n])]


Results = dict[str, list[Outcome]]  # by setting name (and load, where a workload runs several)


def ttfts_by_class(results: Results) -> dict[str, dict[str, list[float]]]:
    """TTFTs (s) of the served requests, by setting then class: what the plot draws."""
    by: dict[str, dict[str, list[float]]] = {}
    for setting, outs in results.items():
        for o in outs:
            if not o.refused:
                by.setdefault(setting, {}).setdefault(o.job.klass, []).append(o.ttft_s)
    return by


async def w5(args: argparse.Namespace, device: DeviceModel) -> Results:
    base = w5_requests(args.w5_requests, args.seed)
    common = {"enable_priority_scheduling": True, "max_running_requests": args.max_running}
    plain = Setting("fcfs + priority", common)
    cap = await capacity(base, plain, device, args.pool_tokens)
    jobs = [Job(r, f"priority {r.priority}") for r in with_arrivals(base, 2 * cap, args.seed)]
    print(f"\nW5-priority-overload, {len(jobs)} requests on {device.name}: capacity {cap:.1f} req/s, arrivals at {2 * cap:.1f} req/s")
    settings = [plain] + [Setting(f"+ aging {s:g} s", {**common, "priority_aging_s": s}) for s in args.w5_aging]
    results = {s.name: await run(jobs, s, device, args.pool_tokens) for s in settings}
    print(HEADER)
    for name, outs in results.items():
        print("\n".join(class_rows(name, outs)))
    print("\nRequests admitted before one they arrived more than (D + 1) * S after (the bound: 0 with aging S),")
    print(f"and the largest wait / its bound in seconds (admission rate = capacity {cap:.1f} req/s):")
    print("\n| setting | " + " | ".join(f"overtaken, S = {s:g} s" for s in args.w5_aging) + " | largest wait / bound |")
    print("| --- |" + " --- |" * (len(args.w5_aging) + 1))
    for setting in settings:
        outs = results[setting.name]
        counts = [overtaken_from_outside_window(outs, s, W5_HIGH_PRIORITY) for s in args.w5_aging]
        aging_s = setting.config.get("priority_aging_s")
        ratio = f"{worst_wait_over_bound(outs, aging_s, W5_HIGH_PRIORITY, cap):.3f}" if aging_s else "no bound"
        print(f"| {setting.name} | " + " | ".join(str(c) for c in counts) + f" | {ratio} |")
    return results


# --- lpm starvation ----------------------------------------------------------------------------------


def lpm_starvation_requests(n: int, seed: int, prefix_len: int = 1024, suffix_len: int = 32, output_len: int = 32) -> list[Request]:
    rng = np.random.default_rng(seed)
    hot = rng.integers(10, VOCAB - 10, prefix_len).tolist()
    out = []
    for i in range(n):
        cold = rng.random() < 0.1
        head = rng.integers(10, VOCAB - 10, prefix_len).tolist() if cold else hot
        out.append(Request(i, head + rng.integers(10, VOCAB - 10, suffix_len).tolist(), output_len, group=None if cold else 0))
    return out


async def lpm_starvation(args: argparse.Namespace, device: DeviceModel) -> Results:
    base = lpm_starvation_requests(args.lpm_requests, args.seed)
    common = {"schedule_policy": "lpm", "lpm_fallback_queue_len": NO_FALLBACK, "max_running_requests": args.max_running}
    plain = Setting("lpm", common)
    cap = await capacity(base, plain, device, args.pool_tokens)
    rate = args.lpm_overload * cap
    jobs = [Job(r, "hot" if r.group == 0 else "cold") for r in with_arrivals(base, rate, args.seed)]
    print(f"\nlpm starvation, {len(jobs)} requests (10% cold) on {device.name}: capacity {cap:.1f} req/s, arrivals at {rate:.1f} req/s")
    settings = [plain] + [Setting(f"lpm + aging {s:g} s", {**common, "priority_aging_s": s}) for s in args.lpm_aging]
    settings += [Setting(f"lpm + cold lane {f:g}", {**common, "cold_lane_share": f}) for f in args.lpm_cold_lane]
    settings += [
        Setting(f"lpm + cold lane {f:g} + aging {s:g} s", {**common, "cold_lane_share": f, "priority_aging_s": s})
        for f in args.lpm_cold_lane for s in args.lpm_cold_lane_aging
    ]
    print(HEADER)
    results = {}
    for setting in settings:
        results[setting.name] = outs = await run(jobs, setting, device, args.pool_tokens)
        print("\n".join(class_rows(setting.name, outs)))
    base_cold, base_hit = _p(_ttfts(results[plain.name], "cold"), 0.99), hit_rate(results[plain.name])
    print("\n| setting | hit rate % | vs lpm, points | cold TTFT p99 ms | lpm's / this | hot TTFT p50 / p99 ms | output tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, outs in results.items():
        cold, hot, hit = _p(_ttfts(outs, "cold"), 0.99), _ttfts(outs, "hot"), hit_rate(outs)
        print(f"| {name} | {hit:.1f} | {hit - base_hit:+.1f} | {cold:.0f} | {base_cold / cold:.1f}x | "
              f"{statistics.median(hot):.0f} / {_p(hot, 0.99):.0f} | {tokens_per_s(outs):.0f} |")
    return results


def _ttfts(outs: Sequence[Outcome], klass: str) -> list[float]:
    return [o.ttft_s * 1e3 for o in outs if o.job.klass == klass and not o.refused]


# --- slo goodput -------------------------------------------------------------------------------------


def slo_jobs(requests: Sequence[Request], rate: float, seed: int) -> list[Job]:
    return [Job(r, "ttft<=500ms", {"slo_ttft_ms": SLO_TTFT_MS}) for r in with_arrivals(requests, rate, seed)]


def meets_slo(o: Outcome) -> bool:
    tokens = o.output_tokens
    tpot_ms = (o.end_s - o.ttft_s - o.sent_s) / (tokens - 1) * 1e3 if tokens > 1 else 0.0
    return o.ttft_s * 1e3 <= SLO_TTFT_MS and tpot_ms <= SLO_TPOT_MS


def attainment(outs: Sequence[Outcome]) -> tuple[float, float, float]:
    """(share of admitted requests meeting the SLO, of all requests, goodput tok/s)."""
    admitted = [o for o in outs if not o.refused]
    met = [o for o in admitted if meets_slo(o)]
    wall = max(o.end_s for o in outs)
    return len(met) / max(1, len(admitted)), len(met) / len(outs), sum(o.output_tokens for o in met) / wall


async def slo(args: argparse.Namespace, device: DeviceModel) -> Results:
    base = [replace(r, priority=None) for r in w5_requests(args.slo_requests, args.seed)]
    fcfs = Setting("fcfs", {"max_running_requests": args.max_running})
    edf = Setting("edf + reject-infeasible", {"max_running_requests": args.max_running, "schedule_policy": "edf", "reject_infeasible": True})
    cap = await capacity(base, fcfs, device, args.pool_tokens)
    print(f"\nSLO goodput (TTFT <= {SLO_TTFT_MS:g} ms, TPOT <= {SLO_TPOT_MS:g} ms), {len(base)} W5-sized requests on {device.name}: capacity {cap:.1f} req/s")
    print("| load x capacity | setting | admitted meeting SLO % | all meeting SLO % | refused | goodput tok/s |\n| --- | --- | --- | --- | --- | --- |")

    results: Results = {}

    async def fcfs_at(load: float) -> float:
        results[f"fcfs @ {load:.3f}x"] = outs = await run(slo_jobs(base, load * cap, args.seed), fcfs, device, args.pool_tokens)
        admitted_share, share, goodput = attainment(outs)
        print(f"| {load:.3f} | fcfs | {100 * admitted_share:.1f} | {100 * share:.1f} | 0 | {goodput:.0f} |")
        return share

    # Bisect the load between one where fcfs meets >= 90% and one where it meets less.
    met, missed = args.slo_loads
    assert await fcfs_at(met) >= 0.9 and await fcfs_at(missed) < 0.9, "widen --slo-loads"
    for _ in range(args.slo_search_steps):
        load = (met + missed) / 2
        met, missed = (load, missed) if await fcfs_at(load) >= 0.9 else (met, load)
    # fcfs meets 90% between these two loads: edf must meet >= 99% of what it admits at both.
    for load in (met, missed):
        results[f"{edf.name} @ {load:.3f}x"] = outs = await run(slo_jobs(base, load * cap, args.seed), edf, device, args.pool_tokens)
        admitted_share, share, goodput = attainment(outs)
        refused = sum(o.refused for o in outs)
        print(f"| {load:.3f} | {edf.name} | {100 * admitted_share:.1f} | {100 * share:.1f} | {refused} | {goodput:.0f} |")
    return results


# --- tenants -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fairness:
    gap: float  # the largest service difference within one common backlog
    jain: float  # Jain's index over the service each tenant received while both waited


def fairness(outs: Sequence[Outcome], step_s: float = 0.05) -> Fairness:
    """VTC's measure: over each period in which both tenants had a request waiting for admission,
    the largest difference between the service each received since the period began (prompt
    tokens when admitted + 2 x generated tokens as they arrived), sampled every `step_s`; and
    Jain's index (1 when equal, 1/2 when one tenant got it all) over the service received in all
    those periods."""
    tenants = sorted({o.job.klass for o in outs})
    assert len(tenants) == 2
    served = {t: _cumulative(o for o in outs if o.job.klass == t) for t in tenants}
    end = max(o.end_s for o in outs)
    gap, start, last = 0.0, None, None  # start / last: each one's service when the backlog began / at the last sample
    totals = [0.0, 0.0]
    for now in np.arange(0.0, end, step_s):
        if not all(any(o.sent_s <= now < o.admitted_s for o in outs if o.job.klass == t) for t in tenants):
            start = last = None
            continue
        current = [_at(served[t], now) for t in tenants]
        if start is None:
            start = last = current
        gap = max(gap, abs((current[0] - start[0]) - (current[1] - start[1])))
        totals = [total + c - p for total, c, p in zip(totals, current, last)]
        last = current
    jain = sum(totals) ** 2 / (2 * sum(x * x for x in totals)) if any(totals) else 1.0
    return Fairness(gap, jain)


def _cumulative(outs: Any) -> tuple[list[float], np.ndarray]:
    events = []
    for o in outs:
        events.append((o.admitted_s, float(o.prompt_tokens)))
        events.extend((when, 2.0 * n) for when, n in o.token_times)
    events.sort()
    return [w for w, _ in events], np.cumsum([v for _, v in events])


def _at(series: tuple[list[float], np.ndarray], now: float) -> float:
    i = bisect.bisect_right(series[0], now)
    return float(series[1][i - 1]) if i else 0.0


async def tenants(args: argparse.Namespace, device: DeviceModel) -> Results:
    base = [replace(r, priority=None) for r in w5_requests(args.tenant_requests, args.seed)]
    lpm = Setting("lpm", {"schedule_policy": "lpm", "max_running_requests": args.max_running})
    vtc = Setting("lpm + vtc", {**lpm.config, "fairness": "vtc"})
    cap = await capacity(base, lpm, device, args.pool_tokens)
    rate = args.tenant_load * cap
    arrivals = with_arrivals(base, rate, args.seed)
    jobs = [Job(r, "a (4x)" if i % 5 else "b", {"tenant": "a" if i % 5 else "b"}) for i, r in enumerate(arrivals)]
    held = min(args.pool_tokens, args.max_running * max(len(r.input_ids) + r.max_new_tokens for r in base))
    bound = 2 * max(max(len(r.input_ids) for r in base), 2 * held)  # the paper's 2 max(w_p L, w_q M)
    print(f"\nTwo tenants, {len(jobs)} requests (a sends 4x b's) on {device.name}: capacity {cap:.1f} req/s, arrivals at {rate:.1f} req/s")
    print(f"VTC's bound on the gap: 2 max(L, 2 M) = {bound} (L the longest prompt, M = {held} tokens the running batch can hold)")
    print("| setting | largest service gap while both wait | Jain's index while both wait | output tok/s |\n| --- | --- | --- | --- |")
    results: Results = {}
    for setting in (lpm, vtc):
        results[setting.name] = outs = await run(jobs, setting, device, args.pool_tokens)
        measured = fairness(outs)
        print(f"| {setting.name} | {measured.gap:.0f} | {measured.jain:.3f} | {tokens_per_s(outs):.0f} |")
    return results


# --- the command -------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("w5", "lpm", "slo", "tenants", "all"), default="all")
    p.add_argument("--device-model", choices=sorted(DEVICE_MODELS), default="h100-qwen3-8b")
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--pool-tokens", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--w5-requests", type=int, default=4000)
    p.add_argument("--w5-aging", type=_floats, default=[2.0, 1.0, 0.5])
    p.add_argument("--lpm-requests", type=int, default=3000)
    p.add_argument("--lpm-overload", type=float, default=1.0)
    p.add_argument("--lpm-aging", type=_floats, default=[0.5, 0.1])
    p.add_argument("--lpm-cold-lane", type=_floats, default=[0.2, 0.5], help="cold-lane shares (--cold-lane-share) to run")
    p.add_argument("--lpm-cold-lane-aging", type=_floats, default=[0.1], help="each share also runs with these --priority-aging-s")
    p.add_argument("--slo-requests", type=int, default=2000)
    p.add_argument("--slo-loads", type=_floats, default=[1.0, 1.2], help="loads (x capacity) where fcfs meets >= 90%% and < 90%%")
    p.add_argument("--slo-search-steps", type=int, default=4)
    p.add_argument("--tenant-requests", type=int, default=3000)
    p.add_argument("--tenant-load", type=float, default=3.0, help="x capacity: b alone then sends more than half of it")
    p.add_argument("--plot", type=Path, default=None, help="TTFT CDFs per class and setting to this .png, .svg or .pdf (needs matplotlib)")
    p.add_argument("--plot-log-x", action="store_true", help="the CDFs on a log-scaled x axis")
    args = p.parse_args(argv)
    if args.plot is not None and (problem := plot_problem(args.plot)):
        p.error(problem)
    device = DEVICE_MODELS[args.device_model]
    workloads: dict[str, Callable[[argparse.Namespace, DeviceModel], Awaitable[Results]]] = {
        "w5": w5, "lpm": lpm_starvation, "slo": slo, "tenants": tenants,
    }

    async def go() -> None:
        for name, workload in workloads.items():
            if args.workload in (name, "all"):
                results = await workload(args, device)
                if args.plot is not None:
                    out = args.plot if args.workload == name else args.plot.with_stem(f"{args.plot.stem}-{name}")
                    save(class_figure(f"{name}: TTFT by class", ttfts_by_class(results), args.plot_log_x), out)
                    print(f"plot: {out}")

    asyncio.run(go())


if __name__ == "__main__":
    main()
