"""Data-parallel replicas behind the router: prompt-token cache hit rate and throughput per
router policy, and the router's own cost per request.

    .venv/bin/python -m bench.dp                      # W2 and W4 through dp=2, every policy, and dp=1
    .venv/bin/python -m bench.dp --router-only        # Router.choose per request, no engine

Each run starts fresh engines on bench.offline's tiny Qwen3 (one torch thread per replica, a
small KV pool per replica so the cache cannot hold every prefix) and sends the whole workload at
once: W2-shared-prefix's 256 requests, or W4-multi-turn's 32 conversations, each turn sent when
the previous answer is in. Hit rate = cached prompt tokens / prompt tokens over all requests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

from api import Engine
from api.router.routing import Router, RouterConfig
from bench.offline import tiny_qwen3_dir
from bench.workloads import Workload, make_workload
from runtime.config import ROUTER_POLICIES


@dataclass(frozen=True, slots=True)
class RunResult:
    workload: str
    dp: int
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


async def run_workload(workload: Workload, dp: int, policy: str, max_total_tokens: int, max_running: int) -> RunResult:
    engine = Engine(
        model_path=str(tiny_qwen3_dir()), dtype="float32", core_threads=1, random_seed=0, dp_size=dp, router_policy=policy,
        max_total_tokens=max_total_tokens, max_running_requests=max_running,
    )
    params = {"temperature": 0, "ignore_eos": True}
    totals = [0, 0, 0, 0]  # requests, prompt tokens, cached tokens, output tokens

    async def one(input_ids: list[int], max_new: int) -> list[int]:
        out = await engine.generate(input_ids=input_ids, sampling_params={**params, "max_new_tokens": max_new})
        for i, v in enumerate((1, out.prompt_tokens, out.cached_tokens, out.completion_tokens)):
            totals[i] += v
        return out.output_ids

    async def conversation(conv) -> None:
        history: list[int] = []
        for turn in range(len(conv.user_turns)):
            prompt = conv.prompt(turn, history)
            history = prompt + await one(prompt, conv.max_new_tokens)

    async with engine:
        start = time.perf_counter()
        if workload.conversations:
            await asyncio.gather(*(conversation(c) for c in workload.conversations))
        else:
            await asyncio.gather(*(one(r.input_ids, r.max_new_tokens) for r in workload.requests))
        wall = time.perf_counter() - start
    return RunResult(workload.name, dp, policy, *totals, wall)


def router_cost(workload: Workload, policy: str, replicas: int, repeats: int) -> float:
    """Microseconds per request for choose + started + finished, the tree warm with the workload."""
    prompts = [r.input_ids for r in workload.requests]
    router = Router(RouterConfig(policy=policy), replicas)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            replica = router.choose(prompt, routing_key=f"k{i % 16}")
            router.started(replica, len(prompt))
            router.finished(replica, len(prompt))
        samples.append((time.perf_counter() - start) / len(prompts) * 1e6)
    return statistics.median(samples)


def _shuffled(workload: Workload, seed: int) -> Workload:
    requests = list(workload.requests)
    random.Random(seed).shuffle(requests)
    return dataclasses.replace(workload, requests=requests)


def _table(results: list[RunResult]) -> str:
    lines = [
        "| workload | dp | policy | requests | hit rate % | output tok/s | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r.workload} | {r.dp} | {r.policy} | {r.requests} | {100 * r.hit_rate:.1f} | {r.tokens_per_s:.0f} | {r.wall_s:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W2-shared-prefix,W4-multi-turn")
    parser.add_argument("--policies", default="cache_aware,round_robin,shortest_queue")
    parser.add_argument("--max-total-tokens", type=int, default=12288, help="KV pool per replica, in tokens")
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--router-only", action="store_true")
    parser.add_argument(
        "--shuffle-seed", type=int, default=None,
        help="send the requests in a shuffled order (W2's own order, group i %% 16, lets round_robin partition the groups by chance)",
    )
    args = parser.parse_args()
    vocab = 4096
    workloads = [make_workload(name, vocab_size=vocab) for name in args.workloads.split(",")]
    if args.shuffle_seed is not None:
        workloads = [_shuffled(wl, args.shuffle_seed) for wl in workloads]
    if args.router_only:
        print("| workload | policy | replicas | us per request |\n| --- | --- | --- | --- |")
        for wl in workloads:
            for policy in ROUTER_POLICIES:
                for n in (2, 8):
                    print(f"| {wl.name} | {policy} | {n} | {router_cost(wl, policy, n, repeats=5):.1f} |")
        return
    results = []
    for wl in workloads:
        runs = [(1, "cache_aware")] + [(2, p) for p in args.policies.split(",")]
        for dp, policy in runs:
            result = asyncio.run(run_workload(wl, dp, policy, args.max_total_tokens, args.max_running_requests))
            print(f"{wl.name} dp={dp} {policy}: hit {100 * result.hit_rate:.1f}% {result.tokens_per_s:.0f} tok/s", flush=True)
            results.append(result)
    print(_table(results))


if __name__ == "__main__":
    main()
