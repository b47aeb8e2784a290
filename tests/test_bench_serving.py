"""bench.serving: the metric arithmetic on synthetic timings (exact numbers), the arrival process,
the datasets, the tenant and SLO-class draws and where the request builders put them (read back
with the server's own schema code), and short end-to-end runs against a tiny-model server (each
backend) and an in-process Engine. Never timings."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from api.server import openai_schema
from api.frontend.engine import Engine
from api.server.app import ServerSettings
from bench import serving, serving_backends
from bench.serving_backends import Backend, Call, EngineBackend, HttpBackend
from bench.serving_datasets import (
    Mix,
    Service,
    gsp_dataset,
    multi_turn_dataset,
    parse_slo_classes,
    parse_tenants,
    random_ids_dataset,
    sharegpt_dataset,
    with_services,
    workload_dataset,
)
from bench.serving_metrics import RequestOutput, compute_metrics, distserve_goodput, metrics_by_class, summarize, throughput_over_time
from bench.serving_plot import SERVING_TITLES
from bench.workloads import make_workload
from runtime.service import ServiceClass, service_error
from runtime.stream import Delta
from tests.test_bench_plot import check_png, svg_panels
from tests.test_server import ServerThread

API_KEY = "sk-bench"
VOCAB = 512  # the tiny llama's

# --- metric arithmetic ---------------------------------------------------------------------------


def _out(ttft: float, e2e: float, output_len: int, itl: list[float], prompt: int = 100, cached: int = 0, ok: bool = True) -> RequestOutput:
    return RequestOutput(success=ok, prompt_len=prompt, output_len=output_len, requested_output_len=output_len,
                         cached_tokens=cached, ttft=ttft, e2e=e2e, itl=itl)


@pytest.fixture
def outputs() -> list[RequestOutput]:
    return [
        _out(0.1, 1.0, 10, [0.1] * 9, prompt=100, cached=50),  # TPOT (1.0 - 0.1) / 9 = 0.1
        _out(0.2, 0.2, 1, [], prompt=50, cached=0),  # one token: no TPOT
        _out(0.3, 2.3, 5, [0.5] * 4, prompt=50, cached=25),  # TPOT (2.3 - 0.3) / 4 = 0.5
        _out(0.0, 0.0, 0, [], prompt=77, ok=False),  # failed: counts nowhere else
    ]


def test_metrics_exact(outputs: list[RequestOutput]) -> None:
    m = compute_metrics(outputs, 4.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 200 and m["total_output_tokens"] == 16
    assert m["requested_output_tokens"] == 16  # failed requests asked for nothing here
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["input_throughput"] == pytest.approx(50.0)
    assert m["total_token_throughput"] == pytest.approx(54.0)
    assert m["concurrency"] == pytest.approx((1.0 + 0.2 + 2.3) / 4.0)
    assert m["cache_hit_rate"] == pytest.approx(75 / 200)
    # TTFT over [100, 200, 300] ms: linear interpolation between order statistics.
    assert (m["mean_ttft_ms"], m["median_ttft_ms"]) == (pytest.approx(200.0), pytest.approx(200.0))
    assert m["p90_ttft_ms"] == pytest.approx(280.0) and m["p95_ttft_ms"] == pytest.approx(290.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT only for output_len > 1: [100, 500] ms.
    assert m["mean_tpot_ms"] == pytest.approx(300.0) and m["median_tpot_ms"] == pytest.approx(300.0)
    assert m["p90_tpot_ms"] == pytest.approx(460.0) and m["p99_tpot_ms"] == pytest.approx(496.0)
    # ITL pooled over requests: nine gaps of 100 ms and four of 500 ms.
    assert m["mean_itl_ms"] == pytest.approx(2900 / 13)
    assert m["median_itl_ms"] == pytest.approx(100.0) and m["p90_itl_ms"] == pytest.approx(500.0)
    assert m["p99_e2e_ms"] == pytest.approx(1000 + 0.98 * 1300)
    assert "goodput" not in m


def test_tpot_of_one_token_is_undefined() -> None:
    assert _out(0.2, 0.2, 1, []).tpot is None
    assert _out(0.2, 0.5, 0, []).tpot is None
    assert _out(0.1, 0.4, 4, []).tpot == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("ttft", "tpot", "good"),
    [
        (250.0, 200.0, 2),  # A (100 ms, 100 ms) and B (200 ms, one token: TPOT 0) meet both
        (None, 200.0, 2),  # C's TPOT is 500 ms
        (150.0, None, 1),  # only A's TTFT
        (None, 99.0, 1),  # B only: its TPOT counts as 0
        (1000.0, 1000.0, 3),  # the failed request never counts
    ],
)
def test_goodput(outputs: list[RequestOutput], ttft: float | None, tpot: float | None, good: int) -> None:
    m = compute_metrics(outputs, 4.0, slo_ttft_ms=ttft, slo_tpot_ms=tpot)
    assert m["goodput"] == pytest.approx(good / 4.0)
    assert m["slo_attained"] == pytest.approx(good / 4)  # of all requests sent


def test_distserve_goodput() -> None:
    assert distserve_goodput([(1, 1.0), (2, 0.95), (4, 0.9), (8, 0.5), (math.inf, 0.1)]) == 4
    assert distserve_goodput([(1, 0.5)]) is None


def test_metrics_split_by_class() -> None:
    def out(priority: str, ttft: float) -> RequestOutput:
        return RequestOutput(success=True, prompt_len=10, output_len=3, ttft=ttft, e2e=ttft + 0.2, classes={"priority": priority})

    outputs = [out("0", 0.5), out("0", 0.7), out("10", 0.1)]
    by_class = metrics_by_class(outputs, 2.0, slo_ttft_ms=300)
    assert sorted(by_class) == ["priority 0", "priority 10"]
    assert by_class["priority 0"]["completed"] == 2 and by_class["priority 0"]["median_ttft_ms"] == pytest.approx(600.0)
    assert by_class["priority 0"]["slo_attained"] == 0.0 and by_class["priority 10"]["slo_attained"] == 1.0
    assert metrics_by_class(outputs[:2], 2.0) == {}  # one class: nothing to split
    table = serving.format_table({**compute_metrics(outputs, 2.0), "by_class": by_class}, {})
    assert "By class" in table and "priority 10" in table


def _classed(tenant: str, slo: float | None, ttft: float, e2e: float, output_len: int, queue: float | None, ok: bool = True) -> RequestOutput:
    label = ServiceClass(slo_ttft_ms=slo).slo_class()
    return RequestOutput(success=ok, prompt_len=10, output_len=output_len, requested_output_len=output_len, ttft=ttft, e2e=e2e,
                         classes={"priority": "0", "tenant": tenant, "slo": label}, slo_ttft_ms=slo, queue_time=queue)


@pytest.fixture
def classed() -> list[RequestOutput]:
    return [
        _classed("a", 200.0, 0.1, 0.5, 5, 0.05),  # TPOT 100 ms; meets its 200 ms target
        _classed("a", 200.0, 0.3, 0.7, 5, 0.25),  # TPOT 100 ms; misses its 200 ms target
        _classed("b", 1000.0, 0.3, 1.1, 3, 0.2),  # TPOT 400 ms; meets its 1000 ms target
        _classed("b", None, 2.0, 2.5, 2, 1.5),  # TPOT 500 ms; no target: meets the TTFT SLO
        _classed("b", 1000.0, 0.0, 0.0, 0, None, ok=False),  # failed: never meets
    ]


def test_metrics_split_by_tenant_and_slo_class(classed: list[RequestOutput]) -> None:
    by_class = metrics_by_class(classed, 2.0)
    # Priority has one value (left out); SLO classes in natural order, "none" first.
    assert list(by_class) == ["tenant a", "tenant b", "slo none", "slo ttft<=200ms", "slo ttft<=1000ms"]
    a, b = by_class["tenant a"], by_class["tenant b"]
    assert (a["completed"], a["failed"], b["completed"], b["failed"]) == (2, 0, 2, 1)
    assert a["median_ttft_ms"] == pytest.approx(200.0) and a["p99_ttft_ms"] == pytest.approx(298.0)
    assert a["mean_tpot_ms"] == pytest.approx(100.0) and a["p99_e2e_ms"] == pytest.approx(500 + 0.99 * 200)
    assert a["median_queue_ms"] == pytest.approx(150.0) and a["p99_queue_ms"] == pytest.approx(50 + 0.99 * 200)
    assert b["median_ttft_ms"] == pytest.approx(1150.0) and b["mean_tpot_ms"] == pytest.approx(450.0)
    assert b["mean_queue_ms"] == pytest.approx(850.0)  # the failed request reported none
    # Each request against its own target; goodput over the whole run's 2 s.
    assert (a["slo_attained"], a["goodput"]) == (pytest.approx(0.5), pytest.approx(0.5))
    assert (b["slo_attained"], b["goodput"]) == (pytest.approx(2 / 3), pytest.approx(1.0))
    assert by_class["slo ttft<=200ms"]["slo_attained"] == pytest.approx(0.5)
    assert by_class["slo ttft<=1000ms"]["slo_attained"] == pytest.approx(0.5)  # one met, one failed
    assert by_class["slo ttft<=1000ms"]["median_ttft_ms"] == pytest.approx(300.0)
    none = by_class["slo none"]
    assert (none["completed"], none["slo_attained"], none["goodput"]) == (1, 1.0, pytest.approx(0.5))
    assert "slo_ttft_ms_per_request" not in none  # its requests asked for nothing
    # The classes of a dimension add up to the run.
    total = compute_metrics(classed, 2.0)
    assert total["slo_ttft_ms_per_request"] == [200.0, 1000.0] and total["slo_ttft_ms"] is None
    assert total["goodput"] == pytest.approx(1.5) == a["goodput"] + b["goodput"]
    assert total["slo_attained"] == pytest.approx(3 / 5)


def test_tpot_slo_applies_to_every_class_and_own_targets_beat_the_flag(classed: list[RequestOutput]) -> None:
    by_class = metrics_by_class(classed, 2.0, slo_tpot_ms=450.0)  # the no-target request's 500 ms TPOT misses
    assert by_class["tenant b"]["slo_attained"] == pytest.approx(1 / 3) and by_class["slo none"]["slo_attained"] == 0.0
    assert by_class["tenant a"]["slo_attained"] == pytest.approx(0.5)
    # --slo-ttft-ms 250 holds only the request without a target of its own (2 s: a miss); the
    # 300 ms answer with its own 1000 ms target still meets it.
    m = compute_metrics(classed, 2.0, slo_ttft_ms=250.0)
    assert m["goodput"] == pytest.approx(1.0) and m["slo_attained"] == pytest.approx(2 / 5)
    assert "p99_queue_ms" not in compute_metrics([_classed("a", None, 0.1, 0.2, 2, None)], 1.0)  # none reported


def test_class_table_lists_every_split(classed: list[RequestOutput]) -> None:
    m = {**compute_metrics(classed, 2.0), "by_class": metrics_by_class(classed, 2.0)}
    table = serving.format_table(m, {})
    lines = table.splitlines()
    header = next(line for line in lines if "TTFT p50" in line)
    assert header.split() == ["requests", "TTFT", "p50", "TTFT", "p99", "TPOT", "p99", "E2E", "p99", "Queue", "p99", "SLO", "goodput"]
    row = next(line for line in lines if line.startswith("tenant a "))
    assert row.split() == ["tenant", "a", "2", "200.0", "298.0", "100.0", "698.0", "248.0", "50%", "0.50"]
    assert next(line for line in lines if line.startswith("slo ttft<=1000ms")).split()[-2:] == ["50%", "0.50"]
    assert "TTFT<=own (200, 1000 ms), TPOT<=None ms" in table
    assert next(line for line in lines if line.startswith("Queue ")).split()[1:3] == ["500.00", "225.00"]  # mean, median


def test_empty_run_and_summary() -> None:
    m = compute_metrics([], 1.0)
    assert m["completed"] == 0 and m["p99_itl_ms"] == 0.0 and m["cache_hit_rate"] == 0.0
    assert summarize([0.001, 0.003]) == pytest.approx({"mean": 2.0, "median": 2.0, "std": 1.0, "p90": 2.8, "p95": 2.9, "p99": 2.98})


def test_throughput_over_time_spreads_tokens_over_chunks() -> None:
    a = RequestOutput(success=True, output_len=4, start=0.0, e2e=2.0, chunk_times=[0.5, 1.5])
    b = RequestOutput(success=True, output_len=2, start=1.0, e2e=1.0, chunk_times=[1.9])
    t, tok_s, in_flight = throughput_over_time([a, b], bins=2)
    assert t.tolist() == [0.5, 1.5]
    assert tok_s.tolist() == [2.0, 4.0]  # 2 tokens in [0, 1); 2 + 2 in [1, 2)
    assert in_flight.tolist() == [1.0, 2.0]


class FakeBackend(Backend):
    """Chunks at scripted times on a fake clock: (time, carries output)."""

    name = "fake"

    def __init__(self, clock: list[float], chunks: list[tuple[float, bool]], end: float, output_len: int):
        self.clock, self.chunks, self.end, self.n = clock, chunks, end, output_len

    async def _stream(self, call: Call, out: RequestOutput) -> AsyncIterator[tuple[float, bool]]:
        for t, carries in self.chunks:
            self.clock[0] = t
            yield t, carries
        out.output_len = self.n
        self.clock[0] = self.end


async def test_send_times_first_non_empty_chunk_and_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10.0]
    monkeypatch.setattr(serving_backends, "clock", lambda: clock[0])
    # A role chunk with no text at 10.05, tokens at 10.5, 10.7 and 11.0, usage chunk at 11.05.
    backend = FakeBackend(clock, [(10.05, False), (10.5, True), (10.7, True), (11.0, True), (11.05, False)], end=11.1, output_len=3)
    out = await backend.send(Call(3, input_ids=[1, 2]), t0=9.0)
    assert out.success and out.error == ""
    assert out.start == pytest.approx(1.0)
    assert out.ttft == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.2, 0.3])
    assert out.e2e == pytest.approx(1.1)
    assert out.tpot == pytest.approx((1.1 - 0.5) / 2)
    assert out.chunk_times == pytest.approx([1.5, 1.7, 2.0])
    assert out.prompt_len == 2  # the local count, as the fake server reports none


async def test_send_turns_exceptions_into_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(Backend):
        name = "broken"

        async def _stream(self, call: Call, out: RequestOutput) -> AsyncIterator[tuple[float, bool]]:
            yield 0.0, True
            raise ConnectionResetError("gone")

    out = await Broken().send(Call(4, input_ids=[1]), t0=0.0)
    assert not out.success and "ConnectionResetError: gone" in out.error


# --- arrivals and datasets -----------------------------------------------------------------------


def test_poisson_arrivals_mean_rate_and_seed() -> None:
    from bench.serving_datasets import _arrivals

    a = _arrivals(7, 20_000, 4.0, 1.0)
    assert a == _arrivals(7, 20_000, 4.0, 1.0) and a != _arrivals(8, 20_000, 4.0, 1.0)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(_arrivals(7, 20_000, 4.0, 0.25))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)  # same mean rate ...
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # ... CV 1 / sqrt(shape)
    assert _arrivals(7, 5, math.inf, 1.0) == [0.0] * 5


def test_w3_rates_send_the_same_prompts() -> None:
    slow = workload_dataset("W3-online", VOCAB, 0, 50, 2.0, 1.0)
    fast = workload_dataset("W3-online", VOCAB, 0, 50, 8.0, 1.0)
    assert [r.input_ids for r in slow.requests] == [r.input_ids for r in fast.requests]
    assert np.allclose(np.array([r.arrival_s for r in slow.requests]) / 4, [r.arrival_s for r in fast.requests])
    wl = make_workload("W3-online", VOCAB, 0, num_requests=50, rate=2.0)
    assert [(r.input_ids, r.max_new_tokens, r.arrival_s) for r in wl.requests] == [(r.input_ids, r.output_len, r.arrival_s) for r in slow.requests]
    burst = workload_dataset("W1-mixed", VOCAB, 0, 10, math.inf, 1.0)
    assert all(r.arrival_s == 0.0 for r in burst.requests)


def test_random_ids_lengths() -> None:
    exact = random_ids_dataset(VOCAB, 20, 30, 7, 1.0, seed=3)
    assert [(r.prompt_len, r.output_len) for r in exact.requests] == [(30, 7)] * 20
    ids = [t for r in exact.requests for t in r.input_ids or []]
    assert min(ids) >= 10 and max(ids) < VOCAB - 10
    ranged = random_ids_dataset(VOCAB, 200, 40, 20, 0.5, seed=3)
    assert {r.prompt_len for r in ranged.requests} == set(range(20, 41))
    assert {r.output_len for r in ranged.requests} == set(range(10, 21))
    assert ranged == random_ids_dataset(VOCAB, 200, 40, 20, 0.5, seed=3)


def test_gsp_and_multi_turn_defaults_are_the_standard_workloads() -> None:
    w2 = make_workload("W2-shared-prefix", VOCAB)
    gsp = gsp_dataset(VOCAB, 16, 16, 512, 64, 64, seed=0)
    assert [(r.input_ids, r.output_len, r.group) for r in gsp.requests] == [(r.input_ids, r.max_new_tokens, r.group) for r in w2.requests]
    small = gsp_dataset(VOCAB, 3, 2, 20, 5, 4, seed=1)
    assert len(small.requests) == 6 and {r.prompt_len for r in small.requests} == {25}
    assert small.requests[0].input_ids[:20] == small.requests[3].input_ids[:20] != small.requests[1].input_ids[:20]
    w4 = make_workload("W4-multi-turn", VOCAB)
    mt = multi_turn_dataset(VOCAB, 32, 4, 256, 64, 64, seed=0)
    assert [c.turns for c in mt.conversations] == [c.user_turns for c in w4.conversations]
    assert mt.num_requests == 128


def test_sharegpt(tiny_llama: Path, tmp_path: Path) -> None:
    from gpu.loader import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    data = [
        {"conversations": [{"from": "human", "value": f"question number {i} about lighthouses"}, {"from": "gpt", "value": "an answer " * (i + 1)}]}
        for i in range(6)
    ] + [{"conversations": [{"from": "human", "value": "alone"}]}, {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    ds = sharegpt_dataset(path, tok, 10, seed=0)
    assert len(ds.requests) == 6  # single-turn and one-token pairs are skipped
    texts = {r.text for r in ds.requests}
    assert texts == {f"question number {i} about lighthouses" for i in range(6)}
    for r in ds.requests:
        i = int((r.text or "").split()[2])
        assert r.output_len == len(tok.encode("an answer " * (i + 1), add_special_tokens=False))
    assert [r.text for r in sharegpt_dataset(path, tok, 10, seed=0).requests] == [r.text for r in ds.requests]
    assert all(r.output_len == 5 for r in sharegpt_dataset(path, tok, 3, seed=0, fixed_output_len=5).requests)


# --- tenants and SLO classes --------------------------------------------------------------------


def test_class_flags_parse() -> None:
    args = serving.parse_args(["--tenants", "a=3,b", "--slo-classes", "200,1000=3,none=0.5"])
    assert args.tenants == Mix(("a", "b"), (3.0, 1.0))
    assert args.slo_classes == Mix((200.0, 1000.0, None), (1.0, 3.0, 0.5))
    assert args.slo_classes.as_dict() == {"200": 1.0, "1000": 3.0, "none": 0.5}
    defaults = serving.parse_args([])
    assert defaults.tenants is None and defaults.slo_classes is None


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--tenants", "a=0", "entry 'a=0': the weight must be a positive number"),
        ("--tenants", "a=x", "entry 'a=x': the weight must be a positive number"),
        ("--tenants", "a=inf", "the weight must be a positive number"),
        ("--tenants", "a,b,a", "entry 'a': a is given twice"),
        ("--tenants", "", "a tenant is 1 to 256 characters"),
        ("--tenants", "a,,b", "a tenant is 1 to 256 characters"),
        ("--tenants", "t" * 257, "a tenant is 1 to 256 characters"),
        ("--slo-classes", "0", "entry '0': an SLO class is a TTFT target in ms"),
        ("--slo-classes", "fast", "an SLO class is a TTFT target in ms (a positive number) or none"),
        ("--slo-classes", "nan", "an SLO class is a TTFT target in ms"),
        ("--slo-classes", "500=-1", "entry '500=-1': the weight must be a positive number"),
        ("--slo-classes", "500,500.0", "500.0 is given twice"),
    ],
)
def test_bad_class_flags_name_the_flag(flag: str, value: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serving.parse_args([flag, value])
    assert exc.value.code == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line.split("error: ", 1)[1].startswith(f"argument {flag}: entry ") and why in line


def test_services_are_drawn_with_the_weights_apart_from_prompts_and_arrivals() -> None:
    tenants, slos = parse_tenants("a=3,b=1"), parse_slo_classes("200,1000,none=2")
    plain = random_ids_dataset(VOCAB, 4000, 8, 2, 1.0, seed=5, rate=10.0)
    drawn = with_services(random_ids_dataset(VOCAB, 4000, 8, 2, 1.0, seed=5, rate=10.0), 5, tenants, slos)
    assert [(r.input_ids, r.arrival_s) for r in drawn.requests] == [(r.input_ids, r.arrival_s) for r in plain.requests]
    who = [r.service.tenant for r in drawn.requests]
    assert who.count("a") / len(who) == pytest.approx(0.75, abs=0.03)
    targets = [r.service.slo_ttft_ms for r in drawn.requests]
    assert targets.count(None) / len(targets) == pytest.approx(0.5, abs=0.03)
    assert targets.count(200.0) / len(targets) == pytest.approx(0.25, abs=0.03)
    # The label is the one /metrics uses for the same request.
    assert all(r.service.slo_class == ServiceClass(slo_ttft_ms=r.service.slo_ttft_ms).slo_class() for r in drawn.requests)
    assert {r.service.slo_class for r in drawn.requests} == {"ttft<=200ms", "ttft<=1000ms", "none"}
    # Adding SLO classes leaves the tenants as they were; the same seed draws the same services.
    only_tenants = with_services(random_ids_dataset(VOCAB, 4000, 8, 2, 1.0, seed=5), 5, tenants, None)
    assert [r.service.tenant for r in only_tenants.requests] == who
    assert {r.service.slo_class for r in only_tenants.requests} == {None}  # not split by SLO class
    again = with_services(random_ids_dataset(VOCAB, 4000, 8, 2, 1.0, seed=5), 5, tenants, slos)
    assert [r.service for r in again.requests] == [r.service for r in drawn.requests]
    untouched = random_ids_dataset(VOCAB, 3, 8, 2, 1.0, seed=5)
    assert {r.service for r in with_services(untouched, 5, None, None).requests} == {Service()}


async def test_a_conversation_keeps_one_service_across_its_turns() -> None:
    ds = with_services(multi_turn_dataset(VOCAB, 6, 3, 10, 4, 2, seed=0), 0, parse_tenants("x,y"), parse_slo_classes("300"))
    assert {c.service.slo_ttft_ms for c in ds.conversations} == {300.0}

    class Recorder(Backend):
        name = "recorder"

        def __init__(self) -> None:
            self.calls: list[Call] = []

        async def _stream(self, call: Call, out: RequestOutput) -> AsyncIterator[tuple[float, bool]]:
            self.calls.append(call)
            out.output_len = call.output_len
            out.output_ids = [7] * call.output_len
            yield 0.0, True

    backend = Recorder()
    outputs, _ = await serving.run_dataset(backend, ds)
    assert len(outputs) == 18 and len(backend.calls) == 18
    for c, turns in zip(ds.conversations, [outputs[i : i + 3] for i in range(0, 18, 3)]):
        assert [o.classes for o in turns] == [{"tenant": c.service.tenant, "slo": "ttft<=300ms"}] * 3
        assert all(o.slo_ttft_ms == 300.0 for o in turns)
    assert {(call.tenant, call.slo_ttft_ms) for call in backend.calls} == {(c.service.tenant, 300.0) for c in ds.conversations}


SCHEDULED = Call(4, input_ids=[11, 12, 13], text="a prompt", priority=3, tenant="acme", slo_ttft_ms=250.0)


def _engine_calls(kind: str, body: dict[str, Any]) -> list[openai_schema.EngineCall]:
    """The body as the server reads it: its schema, then its conversion to Engine.stream calls."""
    raw = orjson.dumps(body)
    if kind == "native":
        return openai_schema.generate_calls(openai_schema.decode(raw, openai_schema.GenerateRequest))[0]
    if kind == "openai-completions":
        return openai_schema.completion_calls(openai_schema.decode(raw, openai_schema.CompletionRequest))[1]
    return openai_schema.chat_calls(openai_schema.decode(raw, openai_schema.ChatCompletionRequest), [11, 12])[1]


@pytest.mark.parametrize("kind", ["native", "openai-completions", "openai-chat"])
async def test_http_bodies_carry_tenant_and_slo_where_the_server_reads_them(kind: str) -> None:
    backend = HttpBackend(kind, "http://127.0.0.1:1", None, "tiny", {})
    try:
        _, body = backend._payload(SCHEDULED)
        [call] = _engine_calls(kind, body)
        assert (call.options["tenant"], call.options["slo_ttft_ms"], call.options["priority"]) == ("acme", 250.0, 3)
        service = ServiceClass(tenant=call.options["tenant"], slo_ttft_ms=call.options["slo_ttft_ms"])
        assert service_error(service) is None and service.slo_class() == "ttft<=250ms"
        # Without classes the body names none of them: a server without these fields accepts it.
        _, plain = backend._payload(Call(4, input_ids=[11, 12], text="a prompt"))
        assert not {"tenant", "slo_ttft_ms", "priority"} & plain.keys()
        [call] = _engine_calls(kind, plain)
        assert (call.options["tenant"], call.options["slo_ttft_ms"]) == (None, None)
    finally:
        await backend.close()


async def test_engine_backend_passes_tenant_and_slo_as_stream_arguments() -> None:
    import inspect

    class FakeEngine:
        def __init__(self) -> None:
            self.kwargs: dict[str, Any] = {}

        async def stream(self, prompt: str | None, **kwargs: Any) -> AsyncIterator[Delta]:
            inspect.signature(Engine.stream).bind(None, prompt, **kwargs)  # a real Engine.stream call
            self.kwargs = kwargs
            yield Delta(rid="r", output_ids=[5, 6], completion_tokens=2, queue_time=0.125)
            yield Delta(rid="r", output_ids=[7], completion_tokens=3, finish_reason="length", prompt_tokens=3)

    engine = FakeEngine()
    out = await EngineBackend(engine, {}).send(SCHEDULED, serving_backends.clock())
    assert out.success and out.output_len == 3 and out.queue_time == 0.125
    assert (engine.kwargs["tenant"], engine.kwargs["slo_ttft_ms"], engine.kwargs["priority"]) == ("acme", 250.0, 3)


# --- end to end ----------------------------------------------------------------------------------

RECORD_KEYS = {
    "timestamp", "backend", "model", "dataset", "num_prompts", "request_rate", "burstiness", "max_concurrency", "seed",
    "completed", "failed", "duration_s", "request_throughput", "input_throughput", "output_throughput",
    "total_token_throughput", "total_input_tokens", "total_output_tokens", "requested_output_tokens", "concurrency",
    "cache_hit_rate", "cached_tokens", "errors", "engine_config", "server_stats",
    *(f"{s}_{n}_ms" for n in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "median", "std", "p90", "p95", "p99")),
}


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerThread]:
    engine = {"model_path": str(tiny_llama), "max_running_requests": 16}
    with ServerThread(engine, ServerSettings(api_key=API_KEY, served_model_names=("tiny",))) as s:
        yield s


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("backend", ["native", "openai-completions", "openai-chat"])
def test_http_backends_end_to_end(server: ServerThread, backend: str, tmp_path: Path) -> None:
    out_file = tmp_path / "runs.jsonl"
    argv = ["--base-url", server.url, "--api-key", API_KEY, "--backend", backend, "--dataset", "random-ids",
            "--num-prompts", "5", "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "1",
            "--max-concurrency", "3", "--output-file", str(out_file), "--disable-tqdm", "--slo-ttft-ms", "60000",
            "--slo-tpot-ms", "60000"]
    if backend == "native":
        argv += ["--plot", str(tmp_path / "run.png"), "--plot-log-x"]
    [result] = serving.main(argv)
    [record] = _records(out_file)
    assert RECORD_KEYS <= record.keys() and {"goodput", "slo_attained"} <= record.keys()
    assert record["completed"] == 5 and record["failed"] == 0 and record["errors"] == []
    assert record["total_output_tokens"] == record["requested_output_tokens"] == 30
    assert record["backend"] == backend and record["dataset"] == "random-ids" and record["request_rate"] == "inf"
    assert record["goodput"] == pytest.approx(5 / record["duration_s"])
    assert record["engine_config"]["max_running_requests"] == 16 and "kv_pool_size" in record["server_stats"]
    if backend != "openai-chat":  # chat renders a template around decoded text: its own count
        assert record["total_input_tokens"] == 5 * 24
    assert all(o.ttft > 0 and len(o.itl) >= 1 and o.e2e >= o.ttft for o in result.outputs)
    assert 0 < record["concurrency"] <= 3.0 + 1e-6
    if backend == "native":
        check_png(tmp_path / "run.png")


def test_http_run_splits_by_tenant_and_slo_class(server: ServerThread, tmp_path: Path) -> None:
    out_file = tmp_path / "runs.jsonl"
    [result] = serving.main(["--base-url", server.url, "--api-key", API_KEY, "--dataset", "random-ids", "--num-prompts", "5",
                             "--random-input-len", "12", "--random-output-len", "3", "--random-range-ratio", "1",
                             "--tenants", "bench-a,bench-b", "--slo-classes", "60000,none", "--output-file", str(out_file),
                             "--disable-tqdm"])
    [record] = _records(out_file)
    assert record["completed"] == 5 and record["tenants"] == {"bench-a": 1.0, "bench-b": 1.0}
    assert record["slo_classes"] == {"60000": 1.0, "none": 1.0}
    # Seed 0 draws a, a, a for three requests and b, b for two; 60000 ms three times, none twice.
    by_class = record["by_class"]
    assert list(by_class) == ["tenant bench-a", "tenant bench-b", "slo none", "slo ttft<=60000ms"]
    assert [by_class[k]["completed"] for k in by_class] == [3, 2, 2, 3]
    assert all(c["slo_attained"] == 1.0 for c in by_class.values())  # a minute is always met
    assert record["goodput"] == pytest.approx(5 / record["duration_s"])
    assert sorted(o.classes["tenant"] for o in result.outputs) == ["bench-a"] * 3 + ["bench-b"] * 2
    # The server read them: its own per-class counters name the same tenants and targets.
    text = server.run(_scrape(server.url))
    for tenant, met in (("bench-a", 2), ("bench-b", 1)):
        assert f'actorserve:slo_met_requests_total{{priority="none",slo_class="ttft<=60000ms",tenant="{tenant}"}} {met}.0' in text
    assert 'actorserve:e2e_request_latency_seconds_count{priority="none",slo_class="none",tenant="bench-b"} 1.0' in text


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        return await resp.text()


def test_http_multi_turn_carries_history(server: ServerThread, tmp_path: Path) -> None:
    out_file = tmp_path / "runs.jsonl"
    [result] = serving.main(["--base-url", server.url, "--api-key", API_KEY, "--dataset", "multi-turn", "--num-prompts", "2",
                             "--mt-turns", "2", "--mt-first-turn-len", "30", "--mt-turn-len", "5", "--mt-output-len", "4",
                             "--output-file", str(out_file), "--disable-tqdm"])
    [record] = _records(out_file)
    assert record["completed"] == 4 and record["failed"] == 0
    # Turn 2's prompt is turn 1's prompt, its answer, and the new turn; turn 1 was cached.
    assert [o.prompt_len for o in result.outputs] == [30, 30 + 4 + 5] * 2
    assert record["cache_hit_rate"] > 0.4


def test_http_failures_are_counted(server: ServerThread, tmp_path: Path) -> None:
    out_file = tmp_path / "runs.jsonl"
    serving.main(["--base-url", server.url, "--api-key", "wrong", "--num-prompts", "3", "--random-input-len", "8",
                  "--random-output-len", "2", "--vocab-size", str(VOCAB), "--warmup-requests", "0", "--no-flush-cache", "--output-file", str(out_file),
                  "--disable-tqdm"])
    [record] = _records(out_file)
    assert record["completed"] == 0 and record["failed"] == 3
    assert record["errors"] and record["errors"][0].startswith("HTTP 401")


def test_engine_mode_and_rate_sweep(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "runs.jsonl"
    results = serving.main(["--engine", "--model-path", str(tiny_llama), "--rate-sweep", "40,inf", "--num-prompts", "3",
                            "--output-file", str(out_file), "--disable-tqdm", "--plot", str(tmp_path / "sweep.svg"),
                            "--max-running-requests", "8", "--slo-ttft-ms", "60000", "--tenants", "a,b"])
    records = _records(out_file)
    assert [r["request_rate"] for r in records] == ["40", "inf"] and len(results) == 2
    expected = sum(r.max_new_tokens for r in make_workload("W3-online", VOCAB, num_requests=3).requests)
    for record in records:
        assert RECORD_KEYS <= record.keys()
        assert record["backend"] == "engine" and record["dataset"] == "W3-online" and record["base_url"] is None
        assert record["completed"] == 3 and record["failed"] == 0
        assert record["total_output_tokens"] == record["requested_output_tokens"] == expected
        assert record["engine_config"]["max_running_requests"] == 8
        assert record["device_busy"] > 0  # the engine's forward time over the run's wall time
        # --tenants a,b draws a for one request, b for two (seed 0); the engine reports queue times.
        assert {k: c["completed"] for k, c in record["by_class"].items()} == {"tenant a": 1, "tenant b": 2}
        assert all("p99_queue_ms" in c for c in record["by_class"].values()) and record["median_queue_ms"] >= 0
    stdout = capsys.readouterr().out
    assert "| 40 | 3 | 0 |" in stdout and "| inf | 3 | 0 |" in stdout and "DistServe goodput" in stdout
    assert svg_panels(tmp_path / "sweep.svg") == {title: 2 for title in SERVING_TITLES}  # a line per rate


def test_engine_mode_shared_prefix_hits_the_cache(tiny_llama: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "runs.jsonl"
    argv = ["--engine", "--model-path", str(tiny_llama), "--dataset", "generated-shared-prefix", "--gsp-num-groups", "2",
            "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "64", "--gsp-question-len", "8",
            "--gsp-output-len", "3", "--max-concurrency", "2", "--output-file", str(out_file), "--disable-tqdm"]
    serving.main(argv)
    serving.main([*argv, "--disable-radix-cache"])
    cached, uncached = _records(out_file)
    assert cached["completed"] == uncached["completed"] == 8
    assert cached["total_output_tokens"] == 24
    assert cached["cache_hit_rate"] > 0.5 and uncached["cache_hit_rate"] == 0.0
    assert uncached["engine_config"]["disable_radix_cache"] is True


def test_device_busy_comes_from_the_servers_forward_time() -> None:
    before, after = {"stats": {"forward_s": 1.0}}, {"stats": {"forward_s": 3.5}}
    assert serving.device_busy(before, after, 5.0) == 0.5
    assert serving.device_busy({}, after, 5.0) is None  # a server that does not report it
