"""bench.device_model: the roofline's terms against numbers worked out from the published specs,
and the null device sleeping what the model says."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from bench.device_model import DEVICE_MODELS, DeviceModel
from bench.overhead import NullDevice, Probe, parse_args, run_decode, run_decode_split, start_engine, stop_engine, submit
from bench.workloads import Request
from runtime.forward_mode import ForwardMode
from runtime.messages import Batch
from tests.conftest import TinyModelFactory

QWEN = DEVICE_MODELS["h100-qwen3-8b"]
# Worked out by hand from Qwen3-8B's config.json and the H100 SXM datasheet (not read back from
# the preset): 7.57e9 weights (8.19e9 minus the 0.62e9 input embedding table) in bf16, K/V of
# 2 * 36 layers * 8 heads * 128 dims * 2 bytes per token, at 75% of 3.35 TB/s and 50% of 989 TFLOP/s.
QWEN_WEIGHT_BYTES = 2 * 7.568e9
QWEN_KV_BYTES = 2 * 36 * 8 * 128 * 2
H100_BYTES_S = 0.75 * 3.35e12
H100_FLOPS = 0.5 * 989e12


def decode(model: DeviceModel, running: int, context: int) -> float:
    """A decode step: every row extends by one token on top of context - 1 cached ones."""
    return model.step_s([context - 1] * running, [1] * running)


def test_qwen3_8b_constants_match_the_config() -> None:
    assert QWEN.kv_bytes_per_token == QWEN_KV_BYTES == 147_456
    assert QWEN.weight_params == pytest.approx(7.568e9, rel=1e-3)
    assert DEVICE_MODELS["h100-llama3-70b-tp4"].kv_bytes_per_token == 2 * 80 * 2 * 128 * 2  # 8 KV heads over 4 GPUs
    assert DEVICE_MODELS["a10g-qwen3-0.6b"].weight_params == pytest.approx(0.596e9, rel=1e-2)  # tied: the card's 0.6B


def test_decode_at_batch_one_is_the_weight_read() -> None:
    weight_s = QWEN_WEIGHT_BYTES / H100_BYTES_S  # 6.02 ms
    step = decode(QWEN, 1, 1024)
    assert step == pytest.approx(weight_s + 1024 * QWEN_KV_BYTES / H100_BYTES_S + 0.5e-3, rel=1e-3)
    assert 6.3e-3 < step < 6.9e-3  # ~150 tok/s single stream, as measured on H100s
    assert weight_s / step > 0.9


def test_step_grows_with_context() -> None:
    """1,000 more context tokens per row: their K/V read, nothing else."""
    for running in (1, 64, 256):
        extra = decode(QWEN, running, 2024) - decode(QWEN, running, 1024)
        assert extra == pytest.approx(running * 1000 * QWEN_KV_BYTES / H100_BYTES_S, rel=1e-6)
    assert 23e-3 < decode(QWEN, 256, 1024) < 24.5e-3  # 38.7 GB of K/V on top of 15.1 GB of weights


def test_step_grows_with_prefill_tokens() -> None:
    times = [QWEN.step_s([0], [n]) for n in (1, 256, 1024, 4096, 8192)]
    assert times == sorted(times) and len(set(times)) == len(times)
    # Below the ridge (~200 tokens per weight byte read) a prefill costs what a decode step does.
    ridge = QWEN_WEIGHT_BYTES / H100_BYTES_S * H100_FLOPS / (2 * 7.568e9)
    assert 150 < ridge < 200
    assert QWEN.step_s([0], [128]) - QWEN.step_s([0], [1]) < 0.2e-3  # only K/V and attention


def test_large_prefill_is_compute() -> None:
    n = 8192
    linear_s = 2 * 7.568e9 * n / H100_FLOPS  # 251 ms
    attention_s = 4 * 36 * 32 * 128 * (n * (n + 1) / 2) / H100_FLOPS  # causal: 36 ms
    step = QWEN.step_s([0], [n])
    assert step == pytest.approx(0.5e-3 + linear_s + n * QWEN_KV_BYTES / H100_BYTES_S + attention_s, rel=1e-3)
    assert linear_s / step > 0.8
    assert 0.28 < step < 0.30


def test_cached_prefix_costs_attention_and_reads_not_weights() -> None:
    """The same 512 new tokens over a 4,096-token cached prefix: each query sees 4,096 more keys."""
    extra = QWEN.step_s([4096], [512]) - QWEN.step_s([0], [512])
    attention = 4 * 36 * 32 * 128 * 512 * 4096 / H100_FLOPS
    assert extra == pytest.approx(attention + 4096 * QWEN_KV_BYTES / H100_BYTES_S, rel=1e-6)


def test_mixed_step_adds_decode_rows_to_the_tokens() -> None:
    prefill_only = QWEN.step_s([0], [4096])
    mixed = QWEN.step_s([0] + [511] * 100, [4096] + [1] * 100)  # 100 decode rows ride along
    compute = 2 * 7.568e9 * 100 / H100_FLOPS
    kv = 100 * 512 * QWEN_KV_BYTES / H100_BYTES_S
    assert mixed - prefill_only == pytest.approx(compute + kv, rel=1e-3)


@pytest.mark.parametrize("name", sorted(DEVICE_MODELS))
def test_presets_are_valid(name: str) -> None:
    m = DEVICE_MODELS[name]
    assert m.name == name and m.description
    fields = dataclasses.asdict(m)
    assert all(v > 0 for k, v in fields.items() if k not in ("name", "description"))
    assert 0 < m.mfu <= 1 and 0 < m.bandwidth_eff <= 1
    # Ordered as physics orders them: decode batch 1 is the weight-read floor plus a little.
    floor = m.launch_s + m.weight_read_s
    assert floor < decode(m, 1, 128) < 1.1 * floor
    assert decode(m, 1, 128) < decode(m, 64, 128) < decode(m, 256, 128)
    assert 1e-3 < decode(m, 1, 1024) < 50e-3


def test_invalid_constants_are_refused() -> None:
    with pytest.raises(ValueError, match="fractions"):
        dataclasses.replace(QWEN, mfu=1.5)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(QWEN, bandwidth=0.0)
    with pytest.raises(ValueError, match="divide"):
        dataclasses.replace(QWEN, tp=3)


def test_decode_throughput_is_batch_over_step() -> None:
    for running in (1, 64, 256):
        assert QWEN.decode_tokens_per_s(running, 1024) == pytest.approx(running / decode(QWEN, running, 1024), rel=1e-9)
    assert 10_000 < QWEN.decode_tokens_per_s(256, 1024) < 11_500


def test_request_rate_is_one_prefill_plus_decode_steps() -> None:
    """64 requests of 100 prompt + 50 output tokens: one prefill of 6,400 tokens, then 49 decode
    steps at the mean context 100 + 25."""
    rate = QWEN.requests_per_s(100, 50, 64)
    cycle = QWEN.step_s([0] * 64, [100] * 64) + 49 * decode(QWEN, 64, 125)
    assert rate == pytest.approx(64 / cycle, rel=1e-9)
    prefill_s = 0.5e-3 + 2 * 7.568e9 * 6400 / H100_FLOPS + 6400 * QWEN_KV_BYTES / H100_BYTES_S + 64 * 4 * 36 * 32 * 128 * 5050 / H100_FLOPS
    decode_s = 0.5e-3 + QWEN_WEIGHT_BYTES / H100_BYTES_S + 64 * 125 * QWEN_KV_BYTES / H100_BYTES_S
    assert rate == pytest.approx(64 / (prefill_s + 49 * decode_s), rel=1e-3)
    assert 110 < rate < 125  # 0.20 s of prefill, 49 steps of 7.1 ms
    # Long outputs: the rate tends to decode throughput over the output length.
    long = QWEN.requests_per_s(100, 4000, 64)
    assert long * 4000 == pytest.approx(QWEN.decode_tokens_per_s(64, 100 + 2000), rel=0.02)
    # More running requests raise throughput while the weight read dominates.
    assert QWEN.requests_per_s(100, 50, 8) < rate < QWEN.requests_per_s(100, 50, 256)


def batch(prefix_lens: list[int], extend_lens: list[int]) -> Batch:
    n = len(prefix_lens)
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
    ids = [None if e == 1 else [11] * e for e in extend_lens]
    return Batch(step=0, mode=mode, reqs=[], rows=list(range(n)), prefix_lens=prefix_lens, extend_lens=extend_lens,
                 extend_ids=ids, out_cache_loc=torch.zeros(sum(extend_lens), dtype=torch.int64), produces_token=[True] * n, final_token=[False] * n)


def test_null_device_sleeps_the_models_step(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("bench.overhead.time.sleep", slept.append)
    device = NullDevice(0.010, vocab_size=512, model=QWEN)
    steps = [batch([1023] * 8, [1] * 8), batch([0, 64], [2048, 512])]
    outs = [device.run(b) for b in steps]
    assert slept == [QWEN.step_s(b.prefix_lens, b.extend_lens) for b in steps]
    assert slept[0] == pytest.approx(decode(QWEN, 8, 1024)) and slept[1] > 0.05
    assert [len(o.token_ids) for o in outs] == [8, 2]
    fixed = NullDevice(0.010, vocab_size=512)  # no model: the fixed step, as before
    fixed.run(steps[1])
    assert slept[-1] == 0.010


@pytest.fixture(scope="module")
def micro_model(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("llama", vocab_size=512, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16, intermediate_size=16)


async def test_start_engine_with_a_device_model(micro_model: Path) -> None:
    """The real actors run on the cost model: every step lasts at least the model's floor (the
    weight read), and the prefill step of all four prompts at least its own time."""
    model = DEVICE_MODELS["a10g-qwen3-0.6b"]
    probe = Probe()
    seen: list[Batch] = []
    probe.on_batch = seen.append
    rig = await start_engine(micro_model, probe, None, device_model=model, max_running_requests=8, max_total_tokens=4096)
    try:
        assert rig.device is not None and rig.device.model is model
        reqs = [Request(i, [20 + i + j for j in range(300)], 3) for i in range(4)]
        assert await asyncio.gather(*submit(rig.engine, reqs)) == [3] * 4
    finally:
        await stop_engine(rig, probe)
    spans = [e - s for s, e in rig.device.busy]
    assert len(spans) == len(seen) >= 3  # a prefill, then decode steps
    floor = model.launch_s + model.weight_read_s
    assert min(spans) >= floor
    assert sum(spans) >= sum(model.step_s(b.prefix_lens, b.extend_lens) for b in seen)
    assert sum(e for b in seen for e in b.extend_lens if e > 1) == 4 * 300  # every prompt token was prefilled


def test_overhead_arguments_take_a_device_model() -> None:
    assert parse_args(["--device-model", "h100-qwen3-8b"]).device_model == "h100-qwen3-8b"
    assert parse_args([]).device_model is None  # the fixed --step-ms, as before
    with pytest.raises(SystemExit):
        parse_args(["--device-model", "no-such-gpu"])


async def test_decode_scenarios_run_on_a_device_model(micro_model: Path) -> None:
    """Inline and through a core process (the model travels there by name): decode steps of 8
    requests last the model's decode step (8 rows, 16-token prompts: the weight read dominates)."""
    model = DEVICE_MODELS["a10g-qwen3-0.6b"]
    inline = await run_decode(8, step_ms=100.0, steps=8, warmup=1, prompt_len=16, model_dir=micro_model, device_model=model)
    split = await run_decode_split(8, step_ms=100.0, steps=8, warmup=1, prompt_len=16, device_model=model)
    floor = model.launch_s + model.weight_read_s
    for r in (inline, split):
        assert r.finished == 8
        # Not the 100 ms of --step-ms: the model's ~3.3 ms decode step (the window's edges clip
        # the sleeps a little, the loop's own gaps add a little).
        assert 0.8 * floor * r.steps <= r.busy_s and r.wall_s < 0.05 * r.steps
