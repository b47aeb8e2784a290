"""SGLang 0.5.7's scheduling rules, one test each, driven through the actors' messages (issue 29).

Each names the rule as SGLang's source has it (scheduler.py, schedule_policy.py,
schedule_batch.py); the pure-function halves are in tests/test_prefill_adder.py and
tests/test_policy_order.py, the cache's in tests/test_prefix_cache.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from actors.adder import Adder
from actors.policy import Policy
from actors.prefill_adder import ratio_after_retraction
from cache import RadixCache, token_array
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator
from runtime.actor import Mailbox
from runtime.config import EngineConfig
from runtime.forward_mode import ForwardMode
from runtime.messages import AdderMsg, Batch, Enqueue, PolicyMsg, Pull, Ranked, Requeue
from runtime.req import CallerRequest, Req
from runtime.sampling_params import SamplingParams
from tests.actor_helpers import handle_queued, taken
from tests.test_adder_actor import KVPools, Rig


def _rig(pool: int = 64, rows: int = 4, page: int = 1, **config: Any) -> Rig:
    allocator = TokenSlotAllocator(pool, page)
    cache = RadixCache(allocator, page_size=page)
    to_policy: Mailbox[PolicyMsg] = Mailbox()
    to_executor: Mailbox[Batch] = Mailbox()
    adder = Adder(
        EngineConfig(model_path="unused", page_size=page, **config), KVPools(allocator, ReqToTokenPool(rows, 512)), cache,
        inbox=Mailbox(), policy=to_policy, executor=to_executor,
    )
    return Rig(adder, to_policy, to_executor)


def _req(rid: str, prompt: list[int], max_new: int = 3, priority: int = 0, logprobs: bool = False) -> Req:
    return Req(CallerRequest(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=max_new), priority=priority, return_logprob=logprobs), prompt_key=token_array(prompt))


def _prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


async def _offer(rig: Rig, reqs: list[Req]) -> list[Batch]:
    """The Policy's answer; with a step in flight (overlap off) the round comes when it reports."""
    launched = await rig.send(Ranked(reqs=reqs, num_waiting=0))
    if not launched and rig.launched:
        launched = await rig.report()
    return launched


async def _run_rounds(rig: Rig, rounds: list[list[Req]]) -> None:
    """Admit each list of requests in a round of its own (overlap off)."""
    for reqs in rounds:
        await _offer(rig, reqs)
        assert all(r.sched.req_row is not None for r in reqs), "not admitted"
    rig.sent()


async def _decode_until_retraction(rig: Rig) -> list[str]:
    while rig.launched:
        await rig.report()
        if rig.adder.counters["retractions"]:
            return [rid for rids, _ in rig.requeues() for rid in rids]
    raise AssertionError("no retraction happened")


async def _four_decoding() -> tuple[Rig, list[Req]]:
    """Four requests of 10 + 40 tokens on a pool of 128: admitted (new requests are charged in
    full, running ones at a tiny ratio), they run out of KV after about 20 tokens each. r2 and r3
    are admitted together: equal prompts and progress."""
    rig = _rig(pool=128, rows=4, disable_overlap_schedule=True, schedule_conservativeness=0.01)
    await rig.start()
    reqs = [_req(f"r{i}", _prompt(10, 100 * (i + 1)), max_new=40) for i in range(4)]
    await _run_rounds(rig, [reqs[:1], reqs[1:2], reqs[2:]])
    return rig, reqs


async def test_retract_decode_stops_once_the_next_decode_fits_counting_the_victims_prompt():
    """Rules 1 and 2 (schedule_batch.py retract_decode/release_req): one victim frees its output
    and, once unlocked and evicted, its cached prompt; that covers the next decode step of the three
    that stay, so SGLang retracts one. (A reserve of 20 tokens per survivor retracted two.)"""
    rig, reqs = await _four_decoding()
    requeued = await _decode_until_retraction(rig)
    assert rig.adder.counters["retractions"] == 1
    assert len(requeued) == 1
    assert len(rig.adder.running) == 3
    rig.adder.kv.check()


async def test_no_ratio_decay_on_the_retracting_step():
    """Rule 4 (scheduler.py update_running_batch): the step that retracts sets new_token_ratio from
    the retraction and does not also decay it."""
    rig, reqs = await _four_decoding()
    await _decode_until_retraction(rig)
    assert rig.adder.ratio.value == pytest.approx(ratio_after_retraction(rig.adder.running.synced()))


async def test_retraction_takes_the_request_admitted_last_among_equals():
    """Rule 3: four requests of equal prompt and progress; SGLang pops the last admitted."""
    rig, reqs = await _four_decoding()
    assert await _decode_until_retraction(rig) == ["r3"]
    assert reqs[2] in rig.adder.running


async def test_kv_short_with_rows_free_does_not_preempt():
    """Rule 5 (scheduler.py get_new_batch_prefill): preemption is tried only when every row is
    taken; a NO_TOKEN answer just ends the round."""
    rig = _rig(pool=64, rows=4, enable_priority_scheduling=True, disable_overlap_schedule=True)
    await rig.start()
    low = _req("low", _prompt(10, 100), max_new=50, priority=0)  # reserves enough to cover high
    await _run_rounds(rig, [[low]])
    high = _req("high", _prompt(10, 500), max_new=20, priority=100)
    await _offer(rig, [high])
    assert rig.adder.counters["preemptions"] == 0
    assert rig.requeues() == [(["high"], True)]
    assert not high.finished and low in rig.adder.running


async def test_a_preempting_request_is_admitted_in_the_same_round():
    """Rule 6 (schedule_policy.py preempt_to_schedule, then add_one_req): with nothing in flight
    the victim's row and KV come back at once and the important request prefills in that round
    (it was refused with 500 "does not fit" once the preemption left the engine idle)."""
    rig = _rig(pool=64, rows=1, enable_priority_scheduling=True, disable_overlap_schedule=True)
    await rig.start()
    low = _req("low", _prompt(10, 100), max_new=50, priority=0)
    await _run_rounds(rig, [[low]])
    high = _req("high", _prompt(10, 500), max_new=10, priority=100)
    (prefill,) = await _offer(rig, [high])  # the round after low's step reported: nothing in flight
    assert [r.rid for r in prefill.reqs] == ["high"] and prefill.mode is ForwardMode.EXTEND
    assert not high.finished
    assert rig.adder.counters["preemptions"] == 1
    assert rig.requeues() == [(["low"], False)]
    assert low.sched.req_row is None and not low.finished


async def test_a_preempting_request_waits_for_an_in_flight_victim():
    """Rule 6 with overlap (our stated deviation): a victim whose step is in flight keeps its KV
    until that step reports; the important request prefills in the round after it."""
    rig = _rig(pool=64, rows=1, enable_priority_scheduling=True)
    await rig.start()
    low = _req("low", _prompt(10, 100), max_new=50, priority=0)
    await _run_rounds(rig, [[low]])
    assert len(rig.launched) == 2  # overlap: low's next step is in flight at every round
    high = _req("high", _prompt(10, 500), max_new=10, priority=100)
    await _offer(rig, [high])
    assert rig.adder.counters["preemptions"] == 1 and rig.requeues() == [(["high"], True)]
    while rig.launched:
        await rig.report()
    assert low.sched.req_row is None and not high.finished


async def test_batch_is_full_latch_holds_new_requests_until_one_leaves():
    """Rule 7 (scheduler.py batch_is_full): after a NO_TOKEN round no request is taken, even as
    KV frees up, until a running request leaves the batch."""
    rig = _rig(pool=64, rows=4, disable_overlap_schedule=True)
    await rig.start()
    a = _req("a", _prompt(10, 100), max_new=20)
    await _run_rounds(rig, [[a]])
    big = _req("big", _prompt(30, 500), max_new=30)
    await _offer(rig, [big])
    pulls: list[Pull] = []
    while a in rig.adder.running:
        sent = rig.sent()
        assert all(not isinstance(m, Requeue) or m.reqs == [big] for m in sent)
        pulls += [m for m in sent if isinstance(m, Pull)]
        if pulls and isinstance(sent[-1], Pull):
            await rig.send(Ranked(reqs=[], num_waiting=1))  # the Policy gives what was asked: nothing
        await rig.report()
    assert len(pulls) > 3 and all(p.max_reqs == 0 for p in pulls)
    await rig.run_out()
    later = [m for m in rig.sent() if isinstance(m, Pull)]
    assert later and later[-1].max_reqs == 4


async def test_admission_at_an_idle_engine_does_not_round_the_extend_up_to_pages():
    """Rule 9 (schedule_policy.py add_one_req): pages of 16, a pool of 128, a 70-token prompt with
    50 new tokens is admitted and runs to its end (rounded up, 80 + 50 >= 128 was refused: 500)."""
    rig = _rig(pool=128, rows=2, page=16, disable_overlap_schedule=True)
    await rig.start()
    req = _req("a", _prompt(70, 100), max_new=50)
    (prefill,) = await rig.send(Ranked(reqs=[req], num_waiting=0))
    assert [r.rid for r in prefill.reqs] == ["a"]
    await rig.run_out()
    assert req.out.finish_reason is not None and req.out.finish_reason.kind == "length"
    assert len(req.out.output_ids) == 50


async def test_mixed_chunk_is_skipped_when_a_new_request_wants_logprobs():
    """Mixed chunk (scheduler.py ~2055): decodes join a prefill only when neither the running
    batch nor the new batch returns logprobs."""
    rig = _rig(pool=256, rows=4, disable_overlap_schedule=True, enable_mixed_chunk=True)
    await rig.start()
    await _run_rounds(rig, [[_req("a", _prompt(10, 100), max_new=20)]])
    (batch,) = await _offer(rig, [_req("b", _prompt(10, 500), max_new=5, logprobs=True)])
    assert batch.mode is ForwardMode.EXTEND and [r.rid for r in batch.reqs] == ["b"]


async def test_prefill_max_requests_caps_the_requests_of_one_prefill():
    rig = _rig(pool=256, rows=4, prefill_max_requests=2)
    await rig.start()
    (batch,) = await rig.send(Ranked(reqs=[_req(f"r{i}", _prompt(5, 100 * (i + 1))) for i in range(3)], num_waiting=0))
    assert [r.rid for r in batch.reqs] == ["r0", "r1"]
    assert rig.requeues() == [(["r2"], True)]


async def test_a_requeued_request_meets_the_queue_limit_as_an_arrival():
    """Rule 14 (scheduler.py _add_request_to_queue -> _abort_on_queued_limit): a retracted or
    preempted request coming back to a full queue is refused with 503 queue_full."""
    to_adder: Mailbox[AdderMsg] = Mailbox()
    policy = Policy(
        EngineConfig(model_path="unused", max_queued_requests=2), RadixCache(TokenSlotAllocator(1024, 1)),
        inbox=Mailbox(), adder=to_adder,
    )
    for i in range(2):
        await policy.send(Enqueue(_req(f"w{i}", [1, 2, 3])))
    back = _req("retracted", [4, 5, 6])
    await policy.send(Requeue(reqs=[back], front=False))
    await handle_queued(policy)
    assert [r.rid for r in policy.waiting] == ["w0", "w1"]
    assert back.finished and back.out.finish_reason is not None
    assert (back.out.finish_reason.status, back.out.finish_reason.code) == (503, "queue_full")
    assert taken(to_adder) == []
