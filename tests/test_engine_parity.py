"""End to end: 32 concurrent requests through the actors give transformers' greedy tokens."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from api.frontend.engine import Engine
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks

NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def workload(tiny_model_factory):
    """Prompts with shared prefixes (so the radix cache and lpm matter) and transformers' answers."""
    path = tiny_model_factory("llama", max_position_embeddings=512)
    rng = random.Random(7)
    # 72 tokens: decode batches attend that prefix once for its requests (gpu/shared_prefix.py).
    shared = [[rng.randrange(3, 500) for _ in range(n)] for n in (24, 72)]
    prompts, max_new = [], []
    for i in range(NUM_REQUESTS):
        head = shared[i % 2] if i % 3 else []
        prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))])
        max_new.append(rng.randint(1, 20))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = []
    for prompt, n in zip(prompts, max_new):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())
    return path, prompts, max_new, expected


async def _run_all(engine: Engine, prompts, max_new) -> list[list[int]]:
    async def one(prompt, n):
        out = await engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": n, "temperature": 0})
        return out.output_ids

    return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_new)))


CONFIGS = {
    "fcfs": {},
    "lof": {"schedule_policy": "lof"},
    "random": {"schedule_policy": "random", "random_seed": 1},
    "routing-key": {"schedule_policy": "routing-key"},
    "lpm": {"schedule_policy": "lpm"},
    "dfs-weight": {"schedule_policy": "dfs-weight"},
    "chunked-16": {"chunked_prefill_size": 16, "max_prefill_tokens": 64},
    "mixed-chunk": {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    "page-4": {"page_size": 4, "schedule_policy": "lpm"},
    "no-overlap": {"disable_overlap_schedule": True},
    "no-radix": {"disable_radix_cache": True},
    "few-rows": {"max_running_requests": 3},
}


# Through the core process too: the scheduling-heavy ones (each start costs a process spawn).
THROUGH_CORE_PROCESS = ("fcfs", "lpm", "chunked-16", "page-4", "no-overlap")
PARITY_CASES = [pytest.param(name, True, id=f"{name}-inline") for name in CONFIGS] + [
    pytest.param(name, False, id=f"{name}-core-process") for name in THROUGH_CORE_PROCESS
]


@pytest.mark.parametrize(("name", "inline_core"), PARITY_CASES)
async def test_greedy_parity(workload, name, inline_core):
    path, prompts, max_new, expected = workload
    engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=4096, inline_core=inline_core, **CONFIGS[name])
    async with engine:
        got = await _run_all(engine, prompts, max_new)
        assert got == expected
        await assert_idle_invariants(engine)
        if name in ("lpm", "page-4"):
            assert (await engine.current_stats())["kv_cached"] > 0
        if name in ("fcfs", "lpm") and inline_core:  # the runner is in this process only inline
            assert engine.runner.attn.shared_prefix_batches > 0, "no decode step attended a shared prefix once"
    await close_and_check_tasks(engine)


async def test_retraction_keeps_parity(workload, core_mode):
    path = workload[0]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(4)]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=118, do_sample=False)[0, len(prompt) :].tolist())
    # A new request is charged its whole max_new_tokens, a running one only new_token_ratio
    # (0.07 here) of what it has left: a request that arrives once the first is decoding is
    # admitted beside it (138 < 256 - 23 - 0.07 * 115), and together they need 2 * 138 > 256
    # slots, so decode must retract.
    sampling = {"max_new_tokens": 118, "temperature": 0, "ignore_eos": True}
    engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=256, schedule_conservativeness=0.1, **core_mode)
    async with engine:
        first = engine.stream(input_ids=prompts[0], sampling_params=sampling)
        head = [await anext(first) for _ in range(3)]
        later = asyncio.gather(*(engine.generate(input_ids=p, sampling_params=sampling) for p in prompts[1:]))
        rest = [delta async for delta in first]
        outs = await later
        assert [t for d in head + rest for t in d.output_ids] == expected[0]
        assert [o.output_ids for o in outs] == expected[1:]
        assert (await engine.current_stats())["retractions"] > 0
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)
