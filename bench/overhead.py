"""The runtime's own cost: the actors measured at scale with a simulated device.

    python -m bench.overhead [--scenario all|decode|split|busy|prefill|real|profile] [--repeats 3] [--profile]
                             [--device-model h100-qwen3-8b]

A `NullDevice` stands in for the model: every step sleeps `--step-ms` (a sleep releases the GIL,
as a device computing would) and returns deterministic token ids (never EOS) without computing
anything. With `--device-model NAME` the sleep is instead what that GPU would take for the step
(bench/device_model.py: a roofline of the step's prefill tokens, decode rows and context). It is
the Executor's step runner (handed to the core by a `CoreSetup`), so everything else is the
real runtime: Receiver, Policy, Adder (KV allocation, prefix cache), Executor launch and reporter,
OutputProcessor (detokenizing and streaming every token to an `Engine.generate` caller). The
model loaded underneath is a one-layer micro model, so a KV pool of a million tokens stays small.

The actors are timed from outside: the harness observes each actor's `handle` (`Actor.observer`)
and adds up the loop thread's CPU time (`time.thread_time`) spent inside it, so other processes on a shared
machine do not inflate the numbers. Columns, per decode step:
- `sched`: the sum over the actors (what SGLang's scheduler process does per step: schedule,
  process the results, stream the outputs), split into `policy`, `adder`, `executor` (launch),
  `output` (appending, finish checks, detokenizing, pushing deltas);
- `loop`: all CPU time of the event-loop thread: adds the callers reading their streams and the
  asyncio machinery;
- `gc`: collector pauses on the loop thread (startup objects are frozen first, as `actorserve
  serve` does; the embedded Engine does not);
- `busy`: the null device's sleep time (real model: the worker's time in the steps) over wall.

Scenarios:
- decode: N requests (128-token prompts) decode together, at N = 64 / 256 / 1024.
- split: the same decode with the engine core in its own process (the default way to run), the
  null device installed there by a `CoreSetup`. The core reports its own counters: `sched` is its
  actors' CPU (`Actor.cpu_s`), `loop` all CPU of its loop thread, `busy` the device's share of the
  wall time; `frontend` is this process's loop thread (validating, detokenizing, streaming to
  the callers), per `running` tokens its callers received, so a frontend that falls behind the
  core is measured by its work. The window opens on monotone counts (every caller has its first
  token, none has finished); a run whose window could not open says why instead of a row.
  `--split-cores process` leaves out the inline rows, `--stream-interval N` sets the engine's.
  Each row is against the inline `decode` row of the same run.
- busy: 256 running, overlap on and off.
- prefill: 1,024 requests in 16 groups sharing 512-token system prompts (+64-token questions)
  are queued at once behind a hot cache (one request per group ran before); per prefill round
  under each policy: the ordering, the Policy's and the Adder's CPU. `order@1024` orders a queue
  of 1,024 such requests directly (`QueueOrderer.order`): the first call, then later ones.
- real: bench.forward's tiny Qwen3 with the real model runner: decode steps per second and the
  actors' CPU per step (time outside the forward), at 16 / 64 / 256 running.
Every number is the median over --repeats runs, each with a fresh Engine.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from actors.executor import ModelStepRunner, PendingStep, StepRunner
from actors.policy_order import QueueOrderer
from api.core.engine_core import CoreSetup
from api.frontend.engine import Engine
from bench.device_model import DEVICE_MODELS, DeviceModel
from bench.offline import tiny_qwen3_dir
from bench.workloads import Request, shared_prefix_requests
from cache import PrefixMatcher, token_array
from gpu.model_runner import ModelRunner
from runtime.actor import Actor
from runtime.config import EngineConfig
from runtime.forward_mode import ForwardMode
from runtime.messages import Batch, StepOut
from runtime.req import CallerRequest, Req, SchedState
from runtime.sampling_params import SamplingParams

TOKEN_MARGIN = 10  # generated ids stay in [10, vocab - 10): no special token, so never EOS
POLICIES = ("fcfs", "lof", "random", "routing-key", "lpm", "dfs-weight")
NO_LPM_FALLBACK = 1 << 20


# --- the simulated device ------------------------------------------------------------------------


class NullDevice:
    """A StepRunner in place of the model: token ids without computing, after a fixed `step_s`
    or, with a `model`, the time that model gives the step's rows."""

    def __init__(self, step_s: float, vocab_size: int, model: DeviceModel | None = None):
        self.step_s = step_s
        self.model = model
        self.span = vocab_size - 2 * TOKEN_MARGIN
        self.busy: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def run(self, batch: Batch) -> StepOut:
        # Varied ids so that detokenizing does real work; a pure function of row and position.
        tokens = [TOKEN_MARGIN + (row * 31 + p + e) % self.span for row, p, e in zip(batch.rows, batch.prefix_lens, batch.extend_lens)]
        start = time.perf_counter()
        time.sleep(self.sleep_s(batch))
        end = time.perf_counter()
        with self.lock:
            self.busy.append((start, end))
        return StepOut(batch=batch, token_ids=tokens, logprobs=None, top_logprobs=None, forward_s=end - start)

    def sleep_s(self, batch: Batch) -> float:
        return self.step_s if self.model is None else self.model.step_s(batch.prefix_lens, batch.extend_lens)

    def busy_between(self, t0: float, t1: float) -> float:
        with self.lock:
            return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.busy)

    def close(self) -> None:
        pass


class Gated:
    """A StepRunner whose steps wait while `gate` is cleared (lets the whole queue build up first)."""

    def __init__(self, inner: StepRunner):
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()

    def run(self, batch: Batch) -> StepOut | PendingStep:
        self.gate.wait()
        return self.inner.run(batch)

    def close(self) -> None:
        self.gate.set()
        self.inner.close()


def bench_device(runner: ModelRunner, step_s: float | None = None, device_model: str | None = None) -> Gated:
    """`CoreSetup` step runner: a NullDevice sleeping `step_s` or the cost model named
    `device_model` (it travels to a core process by name); with neither, the model itself."""
    if step_s is None and device_model is None:
        return Gated(ModelStepRunner(runner))
    return Gated(NullDevice(step_s or 0.0, runner.vocab_size, DEVICE_MODELS[device_model] if device_model else None))


def device_setup(step_s: float | None, device_model: DeviceModel | None) -> CoreSetup:
    kwargs = {"step_s": step_s, "device_model": device_model.name if device_model else None}
    return CoreSetup(step_runner="bench.overhead:bench_device", step_runner_kwargs=kwargs)


# --- timing the actors from outside ----------------------------------------------------------------


@dataclass
class Probe:
    """CPU seconds of the loop thread inside each actor's `handle`, while `active` (a
    `HandleObserver`)."""

    active: bool = False
    cpu: Counter[str] = field(default_factory=Counter)  # "actor.Message" -> seconds
    count: Counter[str] = field(default_factory=Counter)  # messages handled, always counted
    on_batch: Callable[[Batch], None] | None = None  # sees every batch as it is launched
    # (key, cpu seconds, requests in the message) in the order the handles end, while active.
    log: list[tuple[str, float, int]] = field(default_factory=list)
    gc_pauses: list[tuple[int, float]] = field(default_factory=list)  # (generation, seconds), while active
    _gc_start: float = 0.0
    profiler: cProfile.Profile | None = None  # runs inside the handles named in profile_keys, while active
    profile_keys: frozenset[str] = frozenset()
    _profiling: set[int] = field(default_factory=set)  # ids of the messages whose handle is profiled

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self.active:
            self.gc_pauses.append((info["generation"], time.perf_counter() - self._gc_start))

    def actor_cpu(self, actor: str) -> float:
        return sum(v for k, v in self.cpu.items() if k.startswith(actor + "."))

    def before(self, actor: Actor, msg: object) -> None:
        key = f"{actor.name}.{type(msg).__name__}"
        self.count[key] += 1
        if isinstance(msg, Batch) and self.on_batch is not None:
            self.on_batch(msg)
        if self.profiler is not None and self._profiled(key, msg):
            self._profiling.add(id(msg))
            self.profiler.enable()

    def after(self, actor: Actor, msg: object, cpu_s: float, wall_s: float) -> None:
        key = f"{actor.name}.{type(msg).__name__}"
        # Decided in `before`: `active` may change while the handle awaits.
        if self.profiler is not None and id(msg) in self._profiling:
            self._profiling.discard(id(msg))
            self.profiler.disable()
        if self.active:
            self.cpu[key] += cpu_s
            self.log.append((key, cpu_s, len(getattr(msg, "reqs", ()))))

    def _profiled(self, key: str, msg: object) -> bool:
        # Only messages that carry requests: a Ranked without candidates is a decode round.
        return self.active and key in self.profile_keys and bool(getattr(msg, "reqs", None))


def instrument(engine: Engine, probe: Probe) -> None:
    """Time every actor's `handle`."""
    for actor in engine._actors:
        actor.observer = probe


class Window:
    """Opens after `warmup` decode batches of exactly `size` requests, closes `steps` later."""

    def __init__(self, size: int, warmup: int, steps: int, probe: Probe, profile: bool):
        self.size, self.warmup, self.steps, self.probe = size, warmup, steps, probe
        self.seen = 0
        self.t0 = self.t1 = self.cpu0 = self.cpu1 = 0.0
        self.forward_s: Callable[[], float] = lambda: 0.0  # the Executor's worker time so far
        self.fwd0 = self.fwd1 = 0.0
        self.profiler = cProfile.Profile() if profile else None
        self.closed = asyncio.Event()

    def on_batch(self, batch: Batch) -> None:
        if batch.mode != ForwardMode.DECODE or len(batch.reqs) != self.size:
            return
        self.seen += 1
        if self.seen == self.warmup + 1:
            self.probe.active = True
            self.t0, self.cpu0, self.fwd0 = time.perf_counter(), time.thread_time(), self.forward_s()
            if self.profiler:
                self.profiler.enable()
        elif self.seen == self.warmup + self.steps + 1:
            if self.profiler:
                self.profiler.disable()
            self.probe.active = False
            self.t1, self.cpu1, self.fwd1 = time.perf_counter(), time.thread_time(), self.forward_s()
            self.closed.set()


# --- engines and requests -----------------------------------------------------------------------------


def micro_model_dir() -> Path:
    """The smallest model the runner loads: its KV buffers stay small at a million tokens."""
    from gpu.tiny_model import make_tiny_model

    out = Path(tempfile.gettempdir()) / "actorserve-bench-micro-llama"
    if not (out / "model.safetensors").exists():
        make_tiny_model(out, "llama", seed=0, vocab_size=512, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16, intermediate_size=16, max_position_embeddings=4096)
    return out


@dataclass
class Rig:
    engine: Engine
    device: NullDevice | None  # None: the real model runs
    gate: threading.Event  # cleared: launched steps wait (lets the whole queue build up first)


async def start_engine(model_dir: Path, probe: Probe, step_s: float | None, device_model: DeviceModel | None = None, **config: Any) -> Rig:
    """A started, instrumented Engine; with `step_s` or `device_model` its model is replaced by a
    NullDevice (that sleeps the cost model's step time when one is given, else `step_s`)."""
    # Before any request: the Adder launches nothing until the first one is queued.
    engine = Engine(model_path=str(model_dir), random_seed=0, inline_core=True, core_setup=device_setup(step_s, device_model), **config)
    await engine.start()
    # As `actorserve serve` does: startup objects (torch, the tokenizer) leave the collector's
    # view, else every full collection walks them and stalls the loop for ~0.2 s.
    gc.collect()
    gc.freeze()
    gc.callbacks.append(probe.on_gc)
    gated = engine.core.executor.step_runner
    assert isinstance(gated, Gated)
    instrument(engine, probe)
    return Rig(engine, gated.inner if isinstance(gated.inner, NullDevice) else None, gated.gate)


async def stop_engine(rig: Rig, probe: Probe) -> None:
    rig.gate.set()
    await rig.engine.close()
    gc.callbacks.remove(probe.on_gc)
    gc.unfreeze()  # the next run's engine starts from a clean collector


async def flood(rig: Rig, probe: Probe, reqs: list[Request], routing: bool = False) -> list[asyncio.Task]:
    """Submit `reqs` with the device held, and release it once the Policy has queued them all:
    the first rounds then see the whole queue, as when requests arrive faster than steps."""
    rig.gate.clear()
    expected = probe.count["policy.Enqueue"] + len(reqs)
    tasks = submit(rig.engine, reqs, routing)
    while probe.count["policy.Enqueue"] < expected:
        await asyncio.sleep(0.001)
    return tasks


def submit(engine: Engine, reqs: Iterable[Request], routing: bool = False) -> list[asyncio.Task]:
    async def one(r: Request) -> int:
        params = {"max_new_tokens": r.max_new_tokens, "temperature": 0, "ignore_eos": True}
        key = f"group-{r.group}" if routing and r.group is not None else None
        out = await engine.generate(input_ids=r.input_ids, sampling_params=params, routing_key=key)
        assert out.finish_reason == "length", out.finish_reason
        return out.completion_tokens

    return [asyncio.create_task(one(r)) for r in reqs]


def decode_requests(n: int, prompt_len: int, max_new: int, vocab_size: int) -> list[Request]:
    span = vocab_size - 2 * TOKEN_MARGIN
    return [Request(i, [TOKEN_MARGIN + (i * 7 + j) % span for j in range(prompt_len)], max_new) for i in range(n)]


# --- decode: CPU per step, device busy ------------------------------------------------------------------


@dataclass
class DecodeResult:
    running: int
    steps: int
    wall_s: float
    loop_cpu_s: float
    actor_cpu_s: dict[str, float]
    busy_s: float
    finished: int
    generated: int
    gc_pauses: list[tuple[int, float]]
    profile: str = ""
    frontend_cpu_s: float | None = None  # core process: this process's loop thread; inline: None
    frontend_tokens: int = 0  # core process: the tokens its callers received over the same time

    def frontend_ms(self) -> float | None:
        """The frontend's CPU per step of `running` tokens: per token delivered, so a frontend
        that lags behind the core (saturated) is measured by its work, not by the core's steps."""
        if self.frontend_cpu_s is None or not self.frontend_tokens:
            return None
        return self.frontend_cpu_s / (self.frontend_tokens / self.running) * 1e3

    def per_step_ms(self, what: str) -> float:
        if what == "loop":
            return self.loop_cpu_s / self.steps * 1e3
        if what == "sched":
            return sum(self.actor_cpu_s.values()) / self.steps * 1e3
        return self.actor_cpu_s.get(what, 0.0) / self.steps * 1e3

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.wall_s

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s


async def run_decode(
    running: int,
    *,
    step_ms: float,
    steps: int,
    warmup: int,
    overlap: bool = True,
    prompt_len: int = 128,
    real_model: bool = False,
    profile: bool = False,
    model_dir: Path | None = None,
    device_model: DeviceModel | None = None,
) -> DecodeResult:
    """`running` requests decode together; measures `steps` full decode steps after `warmup`."""
    model = model_dir or (tiny_qwen3_dir() if real_model else micro_model_dir())
    max_new = warmup + steps + 4  # everyone finishes together, after the window
    probe = Probe()
    window = Window(running, warmup, steps, probe, profile)
    probe.on_batch = window.on_batch
    rig = await start_engine(
        model, probe, None if real_model else step_ms / 1e3, None if real_model else device_model,
        max_running_requests=running, max_total_tokens=running * (prompt_len + max_new + 8) + 4096,
        disable_overlap_schedule=not overlap,
    )
    engine, device = rig.engine, rig.device
    # Steps are counted as they report, a step or two behind the launches: fine over the window.
    window.forward_s = lambda: engine.core.executor.forward_s
    try:
        tasks = await flood(rig, probe, decode_requests(running, prompt_len, max_new, engine.runner.vocab_size))
        rig.gate.set()
        outs = await asyncio.gather(*tasks)
    finally:
        await stop_engine(rig, probe)
    assert window.closed.is_set(), f"only {window.seen} full decode steps of {running} requests were seen"
    return DecodeResult(
        running=running,
        steps=steps,
        wall_s=window.t1 - window.t0,
        loop_cpu_s=window.cpu1 - window.cpu0,
        actor_cpu_s={name: probe.actor_cpu(name) for name in ("receiver", "policy", "adder", "executor", "output")},
        # The null device's sleeps, clipped to the window; the real model's worker time.
        busy_s=device.busy_between(window.t0, window.t1) if device else window.fwd1 - window.fwd0,
        finished=len(outs),
        generated=sum(outs),
        gc_pauses=probe.gc_pauses,
        profile=_profile_text(window.profiler) if profile else "",
    )


@dataclass(frozen=True, slots=True)
class Unopened:
    """A run whose measuring window could not be opened, and why."""

    running: int
    why: str


@dataclass(slots=True)
class Progress:
    """The frontend's monotone counts of its requests: decoding (a first token came) and finished.
    The window waits on these, never on a state it might not observe (`num_running == N` can pass
    between two polls, or never hold if some finish before the last is admitted)."""

    decoding: int = 0
    finished: int = 0
    tokens: int = 0  # received by the callers
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def count(self, *, decoding: int = 0, finished: int = 0) -> None:
        self.decoding += decoding
        self.finished += finished
        self.changed.set()

    async def until(self, done: Callable[[Progress], bool], timeout: float = 120.0) -> None:
        async with asyncio.timeout(timeout):
            while not done(self):
                self.changed.clear()
                await self.changed.wait()


def split_max_new(running: int, prompt_len: int, warmup: int, steps: int) -> int:
    """Output length of each request of a split run: admitting them all takes about one prefill
    round per 8k prompt tokens; the frontend sees the last first token some steps after the core
    made it (more when it is saturated); then the window, and everyone still decodes after it."""
    return warmup + steps + 64 + running // 2 + running * prompt_len // 1024


def stream_counted(engine: Engine, reqs: Iterable[Request], progress: Progress) -> list[asyncio.Task[int]]:
    """`submit`'s requests, streamed, each counted in `progress` at its first token and its end."""
    async def one(r: Request) -> int:
        params = {"max_new_tokens": r.max_new_tokens, "temperature": 0, "ignore_eos": True}
        tokens = 0
        async for delta in engine.stream(input_ids=r.input_ids, sampling_params=params):
            if tokens == 0 and delta.output_ids:
                progress.count(decoding=1)
            tokens += len(delta.output_ids)
            progress.tokens += len(delta.output_ids)
            finish = delta.finish_reason
        progress.count(finished=1)
        assert finish == "length", finish
        return tokens

    return [asyncio.create_task(one(r)) for r in reqs]


async def run_decode_split(
    running: int, *, step_ms: float, steps: int, warmup: int, prompt_len: int = 128, device_model: DeviceModel | None = None,
    max_new: int | None = None, stream_interval: int = 1,
) -> DecodeResult | Unopened:
    """`running` requests decode together through a core process; the window opens once all of
    them decode (the callers have each request's first token, none has finished) and `warmup`
    more steps have run, and closes `steps` steps later. Unopened if a request finished first, in
    the frontend or in the core (its `num_running` at either end of the window, read off
    snapshots: all were admitted before it opens, so the count can only fall). `max_new`: each
    request's output length, default `split_max_new`."""
    max_new = max_new or split_max_new(running, prompt_len, warmup, steps)
    engine = Engine(
        model_path=str(micro_model_dir()), random_seed=0, inline_core=False, core_setup=device_setup(step_ms / 1e3, device_model),
        stream_interval=stream_interval,
        max_running_requests=running, max_total_tokens=running * (prompt_len + max_new + 8) + 4096,
    )
    await engine.start()
    gc.collect()
    gc.freeze()
    pauses: list[tuple[int, float]] = []
    probe = Probe(active=True, gc_pauses=pauses)
    gc.callbacks.append(probe.on_gc)
    progress = Progress()
    try:
        tasks = stream_counted(engine, decode_requests(running, prompt_len, max_new, engine.vocab_size), progress)
        await progress.until(lambda p: p.decoding == running or p.finished > 0)
        # Forward steps only grow; a finished request breaks the window, so the waits stop there too.
        start = (await engine.current_stats())["forward_steps"]
        s0 = await _stats_when(engine, lambda s: progress.finished > 0 or s["forward_steps"] >= start + warmup)
        cpu0, tokens0 = time.thread_time(), progress.tokens
        s1 = await _stats_when(engine, lambda s: progress.finished > 0 or s["forward_steps"] >= s0["forward_steps"] + steps)
        cpu1, tokens1 = time.thread_time(), progress.tokens
        finished_in_window = progress.finished or running - min(s0["num_running"], s1["num_running"])
        outs = await asyncio.gather(*tasks)
    finally:
        gc.callbacks.remove(probe.on_gc)
        await engine.close()
        gc.unfreeze()
    if finished_in_window:
        return Unopened(running, f"{finished_in_window} of {running} requests finished ({max_new} tokens) before "
                                 f"{'the last was admitted' if progress.decoding < running else 'the window closed'}")
    core_cpu = {name: s1["actor_cpu_s"][name] - s0["actor_cpu_s"][name] for name in s1["actor_cpu_s"]}
    return DecodeResult(
        running=running,
        steps=s1["forward_steps"] - s0["forward_steps"],
        wall_s=s1["time"] - s0["time"],  # the core's clock, between the two readings of its counters
        loop_cpu_s=s1["loop_cpu_s"] - s0["loop_cpu_s"],
        actor_cpu_s=core_cpu,
        busy_s=s1["forward_s"] - s0["forward_s"],  # the null device's sleeps, as the core timed them
        finished=len(outs),
        generated=sum(outs),
        gc_pauses=pauses,
        frontend_cpu_s=cpu1 - cpu0,
        frontend_tokens=tokens1 - tokens0,
    )


async def _stats_when(engine: Engine, ready: Callable[[dict[str, Any]], bool], timeout: float = 120.0) -> dict[str, Any]:
    """The core's counters once `ready` holds (polled; the window is read off the core's own
    counters, so a late poll only lengthens it)."""
    deadline = time.monotonic() + timeout
    while not ready(stats := await engine.current_stats()):
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)  # rarely: each answer costs the core a little CPU
    return stats


# --- prefill rounds under each policy ---------------------------------------------------------------------


@dataclass
class Round:
    queue_len: int
    order_s: float
    policy_s: float  # the Pull that was answered plus the Requeue of what was not admitted
    adder_s: float
    admitted: int


@dataclass
class PrefillResult:
    policy: str
    rounds: list[Round]
    finished: int
    cached_tokens: int
    gc_pauses: list[tuple[int, float]]
    order_cold_s: float = 0.0
    order_warm_s: float = 0.0
    profile: str = ""

    @property
    def first(self) -> Round:
        return max(self.rounds, key=lambda r: r.queue_len)


class TimedOrderer(QueueOrderer):
    """The Policy's queue ordering, each call logged as ("order", cpu seconds, queue length)."""

    def __init__(self, probe: Probe, config: EngineConfig, prefix_cache: PrefixMatcher | None):
        super().__init__(config, prefix_cache, random.Random(config.random_seed))
        self.probe = probe

    def order(self, waiting: Sequence[Req], running_routing_keys: Counter[str] | None = None, now: float | None = None) -> list[Req]:
        probe = self.probe
        profiler = probe.profiler if probe.active else None
        if profiler is not None:
            profiler.enable()
        start = time.thread_time()
        out = super().order(waiting, running_routing_keys, now)
        spent = time.thread_time() - start
        if profiler is not None:
            profiler.disable()
        if probe.active:
            probe.log.append(("order", spent, len(waiting)))
        return out


def time_ordering(engine: Engine, probe: Probe) -> None:
    """The Policy of a fresh engine orders with a TimedOrderer (built as the Policy builds its own)."""
    engine.core.policy.orderer = TimedOrderer(probe, engine.config, engine.core.prefix_cache)


def rounds_from_log(log: list[tuple[str, float, int]]) -> list[Round]:
    """Split the log at each ordering: the Policy handle that ordered (logged right after it, as
    that handle ends), the Adder's round on the candidates, and the Requeue of those it did not
    admit. Only rounds that admitted something are prefill rounds."""
    rounds: list[Round] = []
    cur: Round | None = None
    enclosing = False
    candidates = 0
    for key, spent, n in log:
        if key == "order":
            if cur is not None and cur.admitted > 0:
                rounds.append(cur)
            cur, enclosing, candidates = Round(n, spent, 0.0, 0.0, 0), True, 0
        elif cur is None:
            continue
        elif key.startswith("policy.") and enclosing:
            cur.policy_s += spent
            enclosing = False
        elif key == "adder.Ranked" and not candidates:
            cur.adder_s, candidates, cur.admitted = spent, n, n
        elif key == "policy.Requeue" and candidates:
            cur.policy_s += spent
            cur.admitted = candidates - n
    if cur is not None and cur.admitted > 0:
        rounds.append(cur)
    return rounds


async def run_prefill(
    policy: str,
    *,
    step_ms: float,
    num_requests: int = 1024,
    groups: int = 16,
    order_repeats: int = 20,
    profile: bool = False,
    model_dir: Path | None = None,
    device_model: DeviceModel | None = None,
) -> PrefillResult:
    """`num_requests` requests sharing 16 hot 512-token prefixes, queued at once."""
    model = model_dir or micro_model_dir()
    probe = Probe()
    rig = await start_engine(
        model, probe, step_ms / 1e3, device_model,
        schedule_policy=policy, lpm_fallback_queue_len=NO_LPM_FALLBACK,
        max_running_requests=num_requests + groups, max_total_tokens=(num_requests + groups) * 600 + 4096,
    )
    engine = rig.engine
    # One draw: the same system prompts for all; `fresh` (new questions) is ordered directly at the end.
    reqs = shared_prefix_requests(engine.runner.vocab_size, seed=0, num_groups=groups, num_requests=groups + 2 * num_requests, output_len=4)
    warm, queued, fresh = reqs[:groups], reqs[groups : groups + num_requests], reqs[groups + num_requests :]
    time_ordering(engine, probe)
    if profile:
        # The rounds only: the orderings and the Adder's handling of their candidates.
        probe.profiler, probe.profile_keys = cProfile.Profile(), frozenset({"adder.Ranked"})
    try:
        await asyncio.gather(*submit(engine, warm, routing=True))  # one request per group: the prefixes are hot
        # Rounds are recorded from the first request on: the Adder's first two rounds may run
        # while the queue fills (the device holds their steps); the first full one comes next.
        probe.active = True
        tasks = await flood(rig, probe, queued, routing=True)
        rig.gate.set()
        outs = await asyncio.gather(*tasks)
        probe.active = False
        cached = engine.stats()
        cold, warm_s = order_directly(engine, fresh, order_repeats)
    finally:
        await stop_engine(rig, probe)
    return PrefillResult(
        policy=policy,
        rounds=rounds_from_log(probe.log),
        finished=len(outs),
        cached_tokens=cached["kv_cached"],
        gc_pauses=probe.gc_pauses,
        order_cold_s=cold,
        order_warm_s=warm_s,
        profile=_profile_text(probe.profiler),
    )


def order_directly(engine: Engine, queued: list[Request], repeats: int) -> tuple[float, float]:
    """Order a queue of requests never seen before (their system prompts are cached, their
    questions are not) with the Policy's orderer: the first call and the median of `repeats`
    later ones. Prompts come encoded, as the Receiver leaves them. Runs on the loop thread with
    the engine idle."""
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    now = time.monotonic()
    waiting = [
        Req(CallerRequest(rid=f"order-{r.index}", input_ids=list(r.input_ids), sampling=params, routing_key=f"group-{r.group}", arrival_time=now + r.index * 1e-6), prompt_key=token_array(r.input_ids), sched=SchedState(enqueue_time=now + r.index * 1e-6))
        for r in queued
    ]
    orderer = engine.core.policy.orderer
    running = Counter({f"group-{g}": 1 for g in range(4)})
    gc.collect()  # a full collection due now would land in the first call: time the ordering only
    start = time.thread_time()
    orderer.order(waiting, running)
    cold = time.thread_time() - start
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        orderer.order(waiting, running)
        times.append(time.thread_time() - start)
    return cold, statistics.median(times)


# --- reports --------------------------------------------------------------------------------------------


def _profile_text(profiler: cProfile.Profile | None, top: int = 25) -> str:
    if profiler is None:
        return ""
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def _print(line: str = "") -> None:
    print(line, flush=True)


def _decode_row(runs: list[DecodeResult]) -> dict[str, Any]:
    """Medians over the runs of one case; times are per decode step."""
    return {
        "running": runs[0].running,
        "steps_per_s": _median(r.steps_per_s for r in runs),
        "wall_ms": _median(r.wall_s / r.steps * 1e3 for r in runs),
        **{f"{k}_ms": _median(r.per_step_ms(k) for r in runs) for k in ("sched", "policy", "adder", "executor", "output", "loop")},
        "busy": _median(r.busy_fraction for r in runs),
        "gc_ms": _median(sum(t for _, t in r.gc_pauses) / r.steps * 1e3 for r in runs),
        "gc_max_ms": max(max((t for _, t in r.gc_pauses), default=0.0) for r in runs) * 1e3,
        "frontend_ms": None if runs[0].frontend_cpu_s is None else _median(r.frontend_ms() for r in runs),
        "finished": runs[0].finished,
        "generated": runs[0].generated,
    }


DECODE_COLS = ("running", "steps/s", "wall ms", "sched ms", "policy ms", "adder ms", "executor ms", "output ms", "loop ms", "gc ms", "gc max ms", "busy %")


def _decode_line(row: dict[str, Any]) -> str:
    values = [row["running"], f"{row['steps_per_s']:.1f}", f"{row['wall_ms']:.2f}"]
    values += [f"{row[k + '_ms']:.3f}" for k in ("sched", "policy", "adder", "executor", "output", "loop")]
    values += [f"{row['gc_ms']:.3f}", f"{row['gc_max_ms']:.1f}", f"{100 * row['busy']:.1f}"]
    return "| " + " | ".join(str(v) for v in values) + " |"


def _header(cols: Iterable[str]) -> str:
    cols = list(cols)
    return "| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols)


def _device_model(args: argparse.Namespace) -> DeviceModel | None:
    return DEVICE_MODELS[args.device_model] if args.device_model else None


def _null_label(args: argparse.Namespace) -> str:
    return f"null device, {args.device_model} cost model" if args.device_model else f"null device, step {args.step_ms} ms"


async def scenario_decode(args: argparse.Namespace, real: bool) -> list[dict[str, Any]]:
    label = "real tiny-qwen3 (bench.forward's)" if real else _null_label(args)
    _print(f"\n### decode, {label}, overlap on, streaming every token; per decode step, median of {args.repeats}\n")
    _print(_header(DECODE_COLS))
    rows = []
    for n in args.real_running if real else args.running:
        runs = [await run_decode(n, step_ms=args.step_ms, steps=args.steps, warmup=args.warmup, real_model=real, device_model=_device_model(args)) for _ in range(args.repeats)]
        rows.append({"scenario": "real" if real else "decode", **_decode_row(runs)})
        _print(_decode_line(rows[-1]))
    return rows


SPLIT_COLS = ("running", "core", "steps/s", "wall ms", "sched ms", "policy ms", "adder ms", "executor ms", "output ms", "loop ms", "frontend ms", "busy %")


def _split_line(row: dict[str, Any]) -> str:
    frontend = "(same loop)" if row["frontend_ms"] is None else f"{row['frontend_ms']:.3f}"
    values = [row["running"], row["core"], f"{row['steps_per_s']:.1f}", f"{row['wall_ms']:.2f}"]
    values += [f"{row[k + '_ms']:.3f}" for k in ("sched", "policy", "adder", "executor", "output", "loop")]
    values += [frontend, f"{100 * row['busy']:.1f}"]
    return "| " + " | ".join(str(v) for v in values) + " |"


async def scenario_split(args: argparse.Namespace) -> list[dict[str, Any]]:
    _print(f"\n### decode, {_null_label(args)}, overlap on, streaming every token: inline core vs core process; "
           f"per decode step, median of {args.repeats}\n")
    _print(_header(SPLIT_COLS))
    rows = []
    for n in args.running:
        for core in args.split_cores:
            if core == "inline":
                runs = [await run_decode(n, step_ms=args.step_ms, steps=args.steps, warmup=args.warmup, device_model=_device_model(args)) for _ in range(args.repeats)]
            else:
                tries = [
                    await run_decode_split(n, step_ms=args.step_ms, steps=args.steps, warmup=args.warmup, device_model=_device_model(args),
                                           stream_interval=args.stream_interval)
                    for _ in range(args.repeats)
                ]
                runs = [r for r in tries if isinstance(r, DecodeResult)]
                for r in tries:
                    if isinstance(r, Unopened):
                        _print(f"| {n} | process | window not opened: {r.why} |")
                if not runs:
                    continue
            rows.append({"scenario": "split", "core": core, "runs": len(runs), **_decode_row(runs)})
            _print(_split_line(rows[-1]))
    return rows


async def scenario_busy(args: argparse.Namespace) -> list[dict[str, Any]]:
    n = args.busy_running
    _print(f"\n### device busy, {_null_label(args)}, {n} running; median of {args.repeats}\n")
    _print(_header(("overlap", *DECODE_COLS)))
    rows = []
    for overlap in (True, False):
        runs = [await run_decode(n, step_ms=args.step_ms, steps=args.steps, warmup=args.warmup, overlap=overlap, device_model=_device_model(args)) for _ in range(args.repeats)]
        rows.append({"scenario": "busy", "overlap": overlap, **_decode_row(runs)})
        _print(f"| {'on' if overlap else 'off'} " + _decode_line(rows[-1]))
    return rows


async def scenario_prefill(args: argparse.Namespace) -> list[dict[str, Any]]:
    n = args.queued
    _print(f"\n### prefill rounds, {_null_label(args)}, {n} queued requests, 16 hot 512-token prefixes (median of {args.repeats})\n")
    _print("The first columns are the round that ordered the longest queue; mean = over all prefill rounds of the run.\n")
    _print(_header(("policy", "queue", "order ms", "policy ms", "adder ms", "round ms", "admitted", "rounds", "mean round ms", f"order@{n} cold ms", f"order@{n} warm ms", "gc max ms")))
    rows = []
    for policy in args.policies:
        runs = [await run_prefill(policy, step_ms=args.step_ms, num_requests=n, device_model=_device_model(args)) for _ in range(args.repeats)]
        first = [r.first for r in runs]
        row = {
            "scenario": "prefill", "policy": policy, "queue": first[0].queue_len,
            "order_ms": _median(f.order_s * 1e3 for f in first), "policy_ms": _median(f.policy_s * 1e3 for f in first),
            "adder_ms": _median(f.adder_s * 1e3 for f in first),
            "round_ms": _median((f.policy_s + f.adder_s) * 1e3 for f in first),
            "admitted": first[0].admitted, "rounds": _median(len(r.rounds) for r in runs),
            "mean_round_ms": _median(statistics.mean(x.policy_s + x.adder_s for x in r.rounds) * 1e3 for r in runs),
            "order_cold_ms": _median(r.order_cold_s * 1e3 for r in runs), "order_warm_ms": _median(r.order_warm_s * 1e3 for r in runs),
            "gc_max_ms": max(max((t for _, t in r.gc_pauses), default=0.0) for r in runs) * 1e3,
            "finished": runs[0].finished,
        }
        rows.append(row)
        _print(f"| {policy} | {row['queue']} | {row['order_ms']:.2f} | {row['policy_ms']:.2f} | {row['adder_ms']:.2f} | {row['round_ms']:.2f} | "
               f"{row['admitted']} | {row['rounds']:.0f} | {row['mean_round_ms']:.2f} | {row['order_cold_ms']:.2f} | {row['order_warm_ms']:.2f} | {row['gc_max_ms']:.1f} |")
    return rows


async def scenario_profiles(args: argparse.Namespace) -> None:
    """cProfile of the loop thread (profiling slows it: use the tables above for the numbers)."""
    r = await run_decode(args.busy_running, step_ms=args.step_ms, steps=args.steps, warmup=args.warmup, profile=True, device_model=_device_model(args))
    _print(f"\n### profile: decode at {args.busy_running} running, {args.steps} steps, loop thread, by tottime\n```\n{r.profile}```")
    for policy in ("lpm", "dfs-weight"):
        p = await run_prefill(policy, step_ms=args.step_ms, num_requests=args.queued, profile=True, device_model=_device_model(args))
        _print(f"\n### profile: prefill rounds (ordering + the Adder's round), {policy}, {args.queued} queued, by tottime\n```\n{p.profile}```")


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    chosen = set(args.scenario)
    if chosen & {"all", "decode"}:
        rows += await scenario_decode(args, real=False)
    if chosen & {"all", "split"}:
        rows += await scenario_split(args)
    if chosen & {"all", "busy"}:
        rows += await scenario_busy(args)
    if chosen & {"all", "prefill"}:
        rows += await scenario_prefill(args)
    if chosen & {"all", "real"}:
        rows += await scenario_decode(args, real=True)
    if args.profile or "profile" in chosen:
        await scenario_profiles(args)
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", type=lambda s: s.split(","), default=["all"], help="comma list of all, decode, split, busy, prefill, real, profile")
    p.add_argument("--running", type=_ints, default=[64, 256, 1024], help="decode batch sizes (null device)")
    p.add_argument("--real-running", type=_ints, default=[16, 64, 256], help="decode batch sizes (real tiny model)")
    p.add_argument("--busy-running", type=int, default=256)
    p.add_argument("--queued", type=int, default=1024)
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--device-model", choices=sorted(DEVICE_MODELS), default=None,
                   help="null device steps sleep this cost model's step time instead of --step-ms")
    p.add_argument("--steps", type=int, default=50, help="decode steps measured per run")
    p.add_argument("--warmup", type=int, default=10, help="full decode steps before the window opens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--split-cores", type=lambda s: s.split(","), default=["inline", "process"], help="split: inline, process or both")
    p.add_argument("--stream-interval", type=int, default=1, help="split: the engine's stream_interval (tokens per streamed delta)")
    p.add_argument("--profile", action="store_true", help="also print cProfile top functions of decode and lpm / dfs-weight rounds")
    p.add_argument("--json", type=Path, default=None, help="append the rows as JSON lines here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import os

    import torch

    _print(f"cpus={os.cpu_count()} torch_threads={torch.get_num_threads()} step_ms={args.step_ms} device_model={args.device_model} steps={args.steps} warmup={args.warmup} repeats={args.repeats} load={os.getloadavg()[0]:.2f}")
    rows = uvloop.run(main_async(args))
    _print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        with args.json.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    # Run as the module bench.overhead, not __main__: the core builds its step runner from
    # "bench.overhead:bench_device", and start_engine checks for that module's classes.
    from bench.overhead import main as module_main

    module_main()
