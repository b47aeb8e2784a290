"""Deadlines: the request's service class, edf ordering and the early refusal of requests the
queue would make late (actors/policy.py, actors/policy_order.py, runtime/service.py)."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest

import actors.policy
from actors.policy import BacklogRate, Policy, estimated_first_token_s
from actors.policy_order import QueueOrderer
from api.frontend.engine import Engine, InvalidRequest
from cache import RadixCache
from gpu.kv_pool import TokenSlotAllocator
from runtime.config import EngineConfig
from runtime.messages import Enqueue, Pull
from runtime.req import CallerRequest, Req, SchedState
from runtime.sampling_params import SamplingParams
from runtime.service import ServiceClass, service_error
from runtime.stream import Delta
from runtime.actor import Mailbox
from tests.actor_helpers import handle_queued


def _req(rid: str, arrival: float, prompt: int = 10, stream: Any = None, **service: float) -> Req:
    return Req(CallerRequest(rid=rid, input_ids=[1] * prompt, sampling=SamplingParams(max_new_tokens=4), service=ServiceClass(**service), arrival_time=arrival), stream=stream, sched=SchedState(enqueue_time=arrival))


def test_the_first_token_is_due_at_the_earliest_deadline_asked():
    assert ServiceClass(slo_ttft_ms=200).first_token_due(10.0, None) == pytest.approx(10.2)
    assert ServiceClass(slo_ttft_ms=900, deadline_ms=300).first_token_due(10.0, None) == pytest.approx(10.3)
    assert ServiceClass().first_token_due(10.0, 500) == pytest.approx(10.5)  # the server's default
    assert ServiceClass(slo_ttft_ms=100).first_token_due(10.0, 500) == pytest.approx(10.1)
    assert ServiceClass().first_token_due(10.0, None) == math.inf


@pytest.mark.parametrize(("service", "field"), [
    (ServiceClass(tenant=""), "tenant"),
    (ServiceClass(tenant="x" * 257), "tenant"),
    (ServiceClass(slo_ttft_ms=0), "slo_ttft_ms"),
    (ServiceClass(slo_ttft_ms=float("nan")), "slo_ttft_ms"),
    (ServiceClass(deadline_ms=-5), "deadline_ms"),
    (ServiceClass(deadline_ms=True), "deadline_ms"),  # type: ignore[arg-type]
])
def test_a_bad_service_class_names_its_field(service, field):
    problem = service_error(service)
    assert problem is not None and problem[1] == field and field in problem[0]


def test_edf_orders_by_due_time_and_puts_requests_without_one_last():
    config = EngineConfig(schedule_policy="edf", default_slo_ttft_ms=None)
    orderer = QueueOrderer(config, None, random.Random(0))
    queue = [_req("none", 0.0), _req("late", 0.0, slo_ttft_ms=900), _req("soon", 0.5, slo_ttft_ms=100), _req("mid", 0.1, deadline_ms=600)]
    assert [r.rid for r in orderer.order(queue, None, now=1.0)] == ["soon", "mid", "late", "none"]
    with_default = QueueOrderer(EngineConfig(schedule_policy="edf", default_slo_ttft_ms=300), None, random.Random(0))
    assert [r.rid for r in with_default.order(queue, None, now=1.0)] == ["none", "soon", "mid", "late"]


def test_the_wait_estimate_takes_the_slower_of_taking_requests_and_prefilling_them():
    assert estimated_first_token_s(10, 1000, 100, reqs_per_s=None, prefill_tokens_per_s=1e4) is None
    # 10 ahead at 20 req/s = 0.5 s; their 1,000 tokens at 10k tok/s = 0.1 s; own 100 tokens 0.01 s.
    assert estimated_first_token_s(10, 1000, 100, reqs_per_s=20, prefill_tokens_per_s=1e4) == pytest.approx(0.51)
    assert estimated_first_token_s(10, 20_000, 100, reqs_per_s=20, prefill_tokens_per_s=1e4) == pytest.approx(2.01)


def test_the_backlog_rate_counts_what_was_kept_while_the_queue_stays_backlogged():
    rate = BacklogRate()
    rate.answered(0.0, 4, backlogged=False)
    rate.answered(1.0, 4, backlogged=True)  # the interval began with nothing waiting: no sample
    assert rate.per_s is None
    rate.answered(1.5, 5, backlogged=True)  # the answer at 1.0 handed out 4: 8 req/s
    assert rate.per_s == pytest.approx(8.0)
    rate.gave_back(3)  # the Adder admitted 2 of those 5
    rate.answered(2.0, 0, backlogged=True)  # 2 kept over 0.5 s: 4 req/s
    assert rate.per_s == pytest.approx(0.8 * 8 + 0.2 * 4)
    rate.answered(2.5, 6, backlogged=False)  # a decode round took nothing: 0 req/s
    assert rate.per_s == pytest.approx(0.8 * (0.8 * 8 + 0.2 * 4))
    before = rate.per_s
    rate.answered(9.0, 3, backlogged=True)  # after an idle stretch: starts a new interval only
    assert rate.per_s == before


class _StoppedClock:
    """actors.policy's `time` in a test: monotonic() stays where the test put it, so a slow
    machine cannot make a request late between its arrival and the Policy's check."""

    def __init__(self, now: float):
        self.now = now

    def monotonic(self) -> float:
        return self.now


async def test_a_request_the_queue_would_make_late_is_refused_at_once(monkeypatch):
    now = 1000.0
    monkeypatch.setattr(actors.policy, "time", _StoppedClock(now))
    config = EngineConfig(model_path="unused", schedule_policy="edf", reject_infeasible=True)
    policy = Policy(config, RadixCache(TokenSlotAllocator(1024, 1)), inbox=Mailbox(), adder=Mailbox())
    policy.backlog_rate.per_s = 10.0  # as measured: 10 requests/s taken from a backlogged queue
    await policy.send(Pull(max_reqs=0, running_routing_keys={}, block=False, prefill_tokens_per_s=1e4))
    await handle_queued(policy)
    policy.waiting = [_req(f"q{i}", now, slo_ttft_ms=400) for i in range(20)]  # 2 s of queue, all due first
    urgent, relaxed, due_first = (
        _req("urgent", now, stream=_Recorder(), slo_ttft_ms=500),
        _req("relaxed", now, stream=_Recorder(), slo_ttft_ms=5_000),
        _req("first", now, stream=_Recorder(), slo_ttft_ms=100),
    )
    for req in (urgent, relaxed, due_first):
        await policy.send(Enqueue(req))
    await handle_queued(policy)
    # urgent: 20 requests due before it take ~2 s, it is due in 0.5 s; relaxed is due in 5 s;
    # first: nothing is due before it.
    assert urgent.stream.finished_with == (503, "deadline_infeasible")
    assert relaxed.stream.finished_with is None and due_first.stream.finished_with is None
    assert policy.infeasible == 1 and len(policy.waiting) == 22


class _Recorder:
    finished = False
    finished_with: tuple[int | None, str | None] | None = None

    def push(self, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self.finished, self.finished_with = True, (delta.status, delta.code)


def test_reject_infeasible_needs_edf():
    with pytest.raises(ValueError, match="reject_infeasible estimates the wait in deadline order"):
        EngineConfig(reject_infeasible=True)


async def test_the_engine_refuses_a_bad_deadline_by_name_and_serves_good_ones(tiny_llama):
    async with Engine(model_path=str(tiny_llama), dtype="float32", inline_core=True, schedule_policy="edf") as engine:
        with pytest.raises(InvalidRequest, match="slo_ttft_ms must be a positive number"):
            await engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2}, slo_ttft_ms=-1)
        outs = await asyncio.gather(*(
            engine.generate(input_ids=[5, i], sampling_params={"max_new_tokens": 3, "ignore_eos": True}, tenant="t", slo_ttft_ms=10_000.0 - i)
            for i in range(4)
        ))
        assert [len(o.output_ids) for o in outs] == [3] * 4
