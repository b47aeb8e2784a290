"""Constrained decoding: what masking costs per step, and what a JSON schema costs a workload.

    python -m bench.grammar [--model smollm2|tiny-qwen3|PATH] [--dtype bfloat16] [--rows 16,64,256]
                            [--steps 32] [--repeats 3] [--skip-w1]

1. Masking, on the model's own tokenizer: N matchers of SCHEMA; per step each row's bitmask is
   filled, applied to [N, vocab] logits, a token is picked (greedy) and accepted: the work the
   Executor's forward thread adds to a step with N constrained rows. Median ms per step.
2. W1-mixed-64 through `actorserve.Engine` (greedy), every request with SCHEMA against none, in the same
   run after a warm-up, alternating free / constrained --repeats times: output tokens per second,
   medians, and their ratio (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from actors.grammar import GrammarCompiler, accept_tokens, mask_logits
from bench.offline import engine_vocab_size, model_path
from bench.workloads import make_workload

# At least 1,000 integers: no request can finish its JSON before its max_new_tokens, so the
# constrained run decodes exactly the tokens the free one does.
SCHEMA = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 1000})


def main() -> None:
    args = _args()
    path = model_path(args.model)
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()}")
    _masking(path, args.rows, args.steps)
    if not args.skip_w1:
        asyncio.run(_w1(path, args.dtype, args.repeats))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-qwen3, or a checkpoint path")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="W1 runs of each kind (medians)")
    p.add_argument("--skip-w1", action="store_true")
    return p.parse_args()


def _masking(path: str | None, rows: list[int], steps: int) -> None:
    from gpu.loader import load_tokenizer, resolve_model_dir
    from gpu.model_config import ModelConfig

    model_dir = resolve_model_dir(path)
    config = ModelConfig.from_dir(model_dir)
    compiler = GrammarCompiler(load_tokenizer(model_dir), config.vocab_size, config.eos_token_ids)
    start = time.perf_counter()
    compiled = compiler.compile_now("json_schema", SCHEMA)
    print(f"compile (tokenizer info included) {1e3 * (time.perf_counter() - start):.0f} ms, vocab {config.vocab_size}")
    print("| constrained rows | mask + accept ms per step | per row us |")
    print("| --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for n in rows:
        constraints = [compiler.constraint(compiled) for _ in range(n)]
        times = []
        for step in range(steps + 4):
            logits = torch.randn(n, config.vocab_size, generator=gen)
            t = time.perf_counter()
            mask_logits(logits, list(range(n)), constraints)
            accept_tokens(constraints, logits.argmax(-1).tolist())
            if step >= 4:  # warm-up steps excluded
                times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        print(f"| {n} | {ms:.2f} | {ms * 1e3 / n:.0f} |")


async def _w1(path: str | None, dtype: str, repeats: int) -> None:
    from api.frontend.engine import Engine

    config = {"model_path": path, "dtype": dtype}
    requests = make_workload("W1-mixed-64", engine_vocab_size(config)).requests

    async def run(engine: Engine, extra: dict) -> tuple[int, float]:
        start = time.perf_counter()
        outs = await asyncio.gather(*[
            engine.generate(input_ids=r.input_ids, sampling_params={"max_new_tokens": r.max_new_tokens, "temperature": 0, "ignore_eos": True, **extra})
            for r in requests
        ])
        assert all(o.finish_reason == "length" for o in outs)
        return sum(o.completion_tokens for o in outs), time.perf_counter() - start

    print("\n| W1-mixed-64 | output tokens | s (median) | tok/s (median) |")
    print("| --- | --- | --- | --- |")
    async with Engine(**config) as engine:
        warm = {"max_new_tokens": 8, "temperature": 0, "json_schema": SCHEMA}
        await asyncio.gather(*[engine.generate(input_ids=r.input_ids, sampling_params=warm) for r in requests[:8]])
        times: dict[str, list[float]] = {"free": [], "json_schema": []}
        tokens: dict[str, int] = {}
        for _ in range(repeats):
            for label, extra in (("free", {}), ("json_schema", {"json_schema": SCHEMA})):
                tokens[label], elapsed = await run(engine, extra)
                times[label].append(elapsed)
    rates = {}
    for label, elapsed in times.items():
        median = statistics.median(elapsed)
        rates[label] = tokens[label] / median
        print(f"| {label} | {tokens[label]} | {median:.1f} | {rates[label]:.1f} |")
    print(f"\nthroughput ratio json_schema / free: {rates['json_schema'] / rates['free']:.3f}")


if __name__ == "__main__":
    main()
