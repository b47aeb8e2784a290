"""Smoke tests of bench.overhead at a tiny scale: structure only, never timings."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.overhead import DecodeResult, Round, Unopened, parse_args, rounds_from_log, run_decode, run_decode_split, run_prefill, split_max_new
from tests.conftest import TinyModelFactory


@pytest.fixture(scope="module")
def micro_model(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("llama", vocab_size=512, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16, intermediate_size=16)


@pytest.mark.parametrize("overlap", [True, False])
async def test_decode_with_null_device(micro_model: Path, overlap: bool) -> None:
    r = await run_decode(8, step_ms=1.0, steps=3, warmup=1, overlap=overlap, prompt_len=16, model_dir=micro_model)
    assert r.finished == 8
    assert r.generated == 8 * (1 + 3 + 4)  # warmup + steps + the margin after the window
    assert r.steps == 3 and r.wall_s > 0 and r.loop_cpu_s > 0
    assert r.actor_cpu_s["adder"] > 0 and r.actor_cpu_s["output"] > 0
    assert r.per_step_ms("sched") > 0
    assert 0 < r.busy_fraction <= 1.0


async def test_decode_through_a_core_process_with_null_device() -> None:
    """The core's own counters measure it: its actors, its loop, the simulated device; the
    frontend's loop is measured here."""
    r = await run_decode_split(8, step_ms=1.0, steps=3, warmup=1, prompt_len=16)
    assert isinstance(r, DecodeResult), r
    assert r.finished == 8 and r.generated == 8 * split_max_new(8, 16, warmup=1, steps=3)
    assert r.steps >= 3 and r.wall_s > 0 and r.loop_cpu_s > 0 and r.frontend_cpu_s > 0 and r.frontend_tokens > 0
    assert set(r.actor_cpu_s) == {"policy", "adder", "executor", "output"} and r.actor_cpu_s["adder"] > 0
    assert r.busy_fraction > 0  # steps are counted as they report: over 3 steps it can pass 1


async def test_a_split_window_that_cannot_open_is_reported_not_waited_for() -> None:
    """Requests that finish before the last is admitted (here: at their first token): the state
    'all decoding' never exists, and the run says so at once instead of timing out waiting."""
    r = await asyncio.wait_for(run_decode_split(8, step_ms=1.0, steps=3, warmup=1, prompt_len=16, max_new=1), 60)
    assert isinstance(r, Unopened) and r.running == 8
    assert "of 8 requests finished (1 tokens) before" in r.why


async def test_decode_with_the_real_model(tiny_qwen3: Path) -> None:
    r = await run_decode(4, step_ms=0.0, steps=2, warmup=1, prompt_len=8, real_model=True, model_dir=tiny_qwen3)
    assert r.finished == 4 and r.generated == 4 * (1 + 2 + 4)
    assert r.steps_per_s > 0 and r.busy_s > 0  # the worker ran the model


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "routing-key"])
async def test_prefill_rounds(micro_model: Path, policy: str) -> None:
    r = await run_prefill(policy, step_ms=1.0, num_requests=24, groups=4, order_repeats=2, model_dir=micro_model)
    assert r.finished == 24
    assert r.rounds, "no prefill round was recorded"
    assert 0 < sum(x.admitted for x in r.rounds) <= 24
    assert r.first.queue_len <= 24 + 4 and r.first.order_s >= 0 and r.first.adder_s > 0
    assert r.order_cold_s > 0 and r.order_warm_s > 0
    assert r.cached_tokens > 0  # the hot system prompts stayed cached


def test_rounds_from_log_pairs_orderings_with_admissions() -> None:
    log = [
        ("policy.Enqueue", 1.0, 0),  # before any ordering: ignored
        ("order", 0.5, 10),
        ("policy.Pull", 0.6, 0),  # the handle that ordered
        ("adder.Ranked", 2.0, 10),
        ("policy.Requeue", 0.1, 4),  # 6 admitted
        ("adder.StepDone", 0.3, 0),
        ("order", 0.2, 4),
        ("policy.Requeue", 0.3, 0),  # ordering inside another message's handle
        ("adder.Ranked", 1.0, 4),  # all admitted: no requeue
        ("order", 0.1, 0),
        ("policy.Pull", 0.1, 0),
        ("adder.Ranked", 0.1, 0),  # nothing admitted: not a prefill round
    ]
    assert rounds_from_log(log) == [Round(10, 0.5, 0.7, 2.0, 6), Round(4, 0.2, 0.3, 1.0, 4)]


def test_arguments() -> None:
    args = parse_args(["--scenario", "decode,busy", "--running", "8,16", "--policies", "lpm"])
    assert args.scenario == ["decode", "busy"] and args.running == [8, 16] and args.policies == ["lpm"]


async def test_profiles_are_collected(micro_model: Path) -> None:
    d = await run_decode(4, step_ms=1.0, steps=2, warmup=1, prompt_len=8, profile=True, model_dir=micro_model)
    p = await run_prefill("lpm", step_ms=1.0, num_requests=8, groups=2, order_repeats=1, profile=True, model_dir=micro_model)
    assert "function calls" in d.profile and "function calls" in p.profile
