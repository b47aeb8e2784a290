"""Prefill time the storage tier saves after a restart (issue 32, SGLang's HiCache L3).

    python -m bench.storage_restart [--model-path PATH] [--prompt-tokens 2048] [--repeats 3]

One engine serves a prompt with `--hicache-storage-backend file` on a directory and closes; then,
each repeat, two fresh engines serve the same prompt once more: one on an empty directory (cold:
the whole prompt is prefilled) and one on the filled directory (restart: its prefix is read from
storage, `wait_complete`, into the host tier and the pool). Reported: time to the first token
(max_new_tokens 1) of each, medians over the repeats, and the cached tokens the restart served.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from typing import Any

from api.frontend.engine import Engine


def _engine(model_path: str | None, storage_dir: str, pool: int) -> Engine:
    return Engine(
        model_path=model_path, inline_core=True, max_total_tokens=pool, enable_hierarchical_cache=True,
        hicache_storage_backend="file", hicache_storage_dir=storage_dir, hicache_storage_prefetch_policy="wait_complete",
    )


async def _first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first (only) token and the prompt tokens served from the cache."""
    start = time.perf_counter()
    out = await engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    return time.perf_counter() - start, out.cached_tokens


async def run(model_path: str | None, prompt_tokens: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(0)
    prompt = [rng.randrange(100, 10_000) for _ in range(prompt_tokens)]
    pool = prompt_tokens + 256
    with tempfile.TemporaryDirectory(prefix="actorserve-storage-") as filled:
        async with _engine(model_path, filled, pool) as engine:
            await _first_token(engine, prompt)
        cold, warm, cached = [], [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="actorserve-storage-") as empty:
                async with _engine(model_path, empty, pool) as engine:
                    cold.append((await _first_token(engine, prompt))[0])
            async with _engine(model_path, filled, pool) as engine:
                seconds, hit = await _first_token(engine, prompt)
                warm.append(seconds)
                cached.append(hit)
    return {
        "prompt_tokens": prompt_tokens, "repeats": repeats,
        "cold_ttft_s_median": statistics.median(cold), "restart_ttft_s_median": statistics.median(warm),
        "restart_cached_tokens": min(cached), "cold_ttft_s": cold, "restart_ttft_s": warm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="none: the default SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(run(args.model_path, args.prompt_tokens, args.repeats))
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
