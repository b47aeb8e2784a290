"""The Adder actor driven message by message (actors/adder.py): what it launches, what it hands
back to the Policy, and where every KV slot is after each message (its KVLedger's rule)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from actors.adder import Adder
from cache import RadixCache, token_array
from gpu.kv_pool import ReqToTokenPool, TokenSlotAllocator
from runtime.actor import Mailbox
from runtime.config import EngineConfig
from runtime.forward_mode import ForwardMode
from runtime.messages import AdderMsg, Batch, FlushCache, PolicyMsg, Pull, Ranked, Requeue, StepDone, Wake
from runtime.req import FinishReason, CallerRequest, Req, end_request
from runtime.sampling_params import SamplingParams
from tests.actor_helpers import taken

TOKEN = 7  # every simulated step samples this token


@dataclass
class KVPools:
    """The part of a ModelRunner the Adder reads: its slot allocator and request rows."""

    allocator: TokenSlotAllocator
    req_to_token: ReqToTokenPool


@dataclass
class Rig:
    adder: Adder
    to_policy: Mailbox[PolicyMsg]
    to_executor: Mailbox[Batch]
    launched: list[Batch] = field(default_factory=list)  # at the executor, not reported yet, oldest first

    async def send(self, msg: AdderMsg) -> list[Batch]:
        """Handle `msg`; returns the batches it launched. The KV books balance after every message."""
        await self.adder.handle(msg)
        self.adder.kv.check()
        new = taken(self.to_executor)
        self.launched += new
        return new

    def sent(self) -> list[PolicyMsg]:
        return taken(self.to_policy)

    def requeues(self) -> list[tuple[list[str], bool]]:
        return [([r.rid for r in m.reqs], m.front) for m in self.sent() if isinstance(m, Requeue)]

    async def start(self) -> Pull:
        """The first Wake (what `start` queues): the Adder asks the Policy for candidates."""
        await self.send(Wake())
        (pull,) = self.sent()
        assert isinstance(pull, Pull)
        return pull

    async def report(self, stop: tuple[Req, ...] = ()) -> list[Batch]:
        """The OutputProcessor's part for the oldest launched step: append a token per producing
        row, end requests at their length limit (or in `stop`), and report the step. Returns the
        batches the report launched."""
        batch = self.launched.pop(0)
        return await self.send(StepDone(step=batch.step, finished=_outputs(batch, stop)))

    async def run_out(self) -> None:
        while self.launched:
            await self.report()


def _outputs(batch: Batch, stop: tuple[Req, ...]) -> list[Req]:
    finished = []
    for req, produces in zip(batch.reqs, batch.produces_token):
        if not produces or req.finished or req.sched.abort_requested:
            continue
        req.out.output_ids.append(TOKEN)
        if req in stop or len(req.out.output_ids) >= req.asked.sampling.max_new_tokens:
            end_request(req, FinishReason("stop" if req in stop else "length"))
            finished.append(req)
    return finished


def _rig(pool: int = 64, rows: int = 4, **config: Any) -> Rig:
    allocator = TokenSlotAllocator(pool, 1)
    cache = RadixCache(allocator, page_size=1)
    to_policy: Mailbox[PolicyMsg] = Mailbox()
    to_executor: Mailbox[Batch] = Mailbox()
    adder = Adder(
        EngineConfig(model_path="unused", **config), KVPools(allocator, ReqToTokenPool(rows, 256)), cache,
        inbox=Mailbox(), policy=to_policy, executor=to_executor,
    )
    return Rig(adder, to_policy, to_executor)


def _req(rid: str, prompt: list[int], max_new: int = 3, priority: int = 0) -> Req:
    return Req(CallerRequest(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=max_new), priority=priority), prompt_key=token_array(prompt))


def _rids(batch: Batch) -> list[str]:
    return [r.rid for r in batch.reqs]


async def test_the_first_wake_asks_the_policy_for_a_request_per_free_row_and_waits():
    rig = _rig(rows=4)
    pull = await rig.start()
    assert (pull.max_reqs, pull.block, pull.preempt_priority) == (4, True, None)
    assert rig.launched == []
    await rig.send(Wake())  # the blocking Pull is still parked at the Policy: no second one
    assert rig.sent() == [] and rig.launched == []


async def test_a_ranked_candidate_is_prefilled_whole_into_fresh_slots():
    rig = _rig(pool=64, disable_overlap_schedule=True)
    await rig.start()
    req = _req("a", [11, 12, 13, 14, 15])
    (batch,) = await rig.send(Ranked(reqs=[req], num_waiting=0))
    assert batch.step == 0 and batch.mode is ForwardMode.EXTEND
    assert _rids(batch) == ["a"] and batch.rows == [req.sched.req_row]
    assert (batch.prefix_lens, batch.extend_lens, batch.extend_ids) == ([0], [5], [[11, 12, 13, 14, 15]])
    assert batch.produces_token == [True]
    assert len(set(batch.out_cache_loc.tolist())) == 5
    assert rig.adder.kv.held(req.sched.req_row) == 5
    assert rig.adder.kv.free_slots() == 64 - 5
    assert req.sched.cached_tokens == 0 and req.sched.admitted_time is not None


async def test_candidates_past_the_kv_budget_go_back_to_the_front_of_the_queue():
    rig = _rig(pool=32)
    await rig.start()
    fits, too_many = _req("a", list(range(1, 11)), max_new=8), _req("b", list(range(20, 30)), max_new=8)
    prefill, *_ = await rig.send(Ranked(reqs=[fits, too_many], num_waiting=0))
    assert _rids(prefill) == ["a"]
    assert rig.requeues() == [(["b"], True)]
    assert too_many.sched.req_row is None and not too_many.finished


async def test_candidates_past_the_free_rows_go_back_to_the_front_of_the_queue():
    rig = _rig(rows=1)
    await rig.start()
    prefill, *_ = await rig.send(Ranked(reqs=[_req("a", [1, 2, 3]), _req("b", [4, 5, 6])], num_waiting=0))
    assert _rids(prefill) == ["a"]
    assert rig.requeues() == [(["b"], True)]


@pytest.mark.parametrize(("disable_overlap", "depth"), [(False, 2), (True, 1)])
async def test_decode_steps_launch_up_to_the_overlap_depth_and_stop_at_max_new_tokens(disable_overlap, depth):
    rig = _rig(disable_overlap_schedule=disable_overlap)
    await rig.start()
    req = _req("a", [1, 2, 3, 4], max_new=4)
    await rig.send(Ranked(reqs=[req], num_waiting=0))
    most_in_flight = 0
    while rig.launched:
        await rig.report()
        most_in_flight = max(most_in_flight, len(rig.launched))
        assert all(b.mode is ForwardMode.DECODE and b.extend_ids == [None] and b.out_cache_loc.numel() == 1 for b in rig.launched)
    assert most_in_flight == depth
    assert rig.adder.next_step == 4  # one prefill and three decodes make the four tokens
    assert req.out.output_ids == [TOKEN] * 4 and req.out.finish_reason.kind == "length"
    assert rig.adder.kv.open_rows() == [] and rig.adder.running.reqs == []


async def test_decode_positions_follow_the_prompt_one_token_per_step():
    rig = _rig(disable_overlap_schedule=True)
    await rig.start()
    await rig.send(Ranked(reqs=[_req("a", [1, 2, 3, 4], max_new=4)], num_waiting=0))
    positions = []
    while rig.launched:
        positions.append((rig.launched[0].prefix_lens, rig.launched[0].extend_lens))
        await rig.report()
    assert positions == [([0], [4]), ([4], [1]), ([5], [1]), ([6], [1])]


async def test_a_finished_request_keeps_its_kv_until_its_last_launched_step_reports():
    rig = _rig(pool=64)
    await rig.start()
    req = _req("a", [1, 2, 3, 4], max_new=10)
    await rig.send(Ranked(reqs=[req], num_waiting=0))
    await rig.report()
    assert [b.step for b in rig.launched] == [1, 2]  # two decodes in flight (overlap)
    row = req.sched.req_row
    assert await rig.report(stop=(req,)) == []  # the output side saw a stop token at step 1
    assert req.out.finish_reason.kind == "stop" and req not in rig.adder.running
    assert rig.adder.kv.open_rows() == [row]  # step 2 still writes its KV
    await rig.report()
    assert rig.adder.kv.open_rows() == [] and req.sched.req_row is None
    # Its tokens with KV (prompt + the two sampled before step 2's) went into the prefix cache.
    assert rig.adder.kv.cache.total_size() == 4 + 2
    assert rig.adder.kv.free_slots() == 64 - 6


async def test_the_adder_pulls_again_once_the_pipeline_has_room():
    rig = _rig(rows=4, disable_overlap_schedule=True)
    await rig.start()
    await rig.send(Ranked(reqs=[_req("a", [1, 2, 3, 4], max_new=10)], num_waiting=0))
    assert rig.sent() == []  # one step in flight fills the pipeline
    await rig.report()
    (pull,) = rig.sent()
    assert isinstance(pull, Pull) and pull.max_reqs == 3 and pull.block  # the queue was empty


async def test_candidates_arriving_while_the_pipeline_is_full_wait_for_a_step_to_report():
    rig = _rig()
    await rig.start()
    a, b = _req("a", [1, 2, 3, 4], max_new=10), _req("b", [5, 6, 7, 8], max_new=10)
    await rig.send(Ranked(reqs=[a], num_waiting=0))
    await rig.report()
    assert len(rig.launched) == 2
    assert await rig.send(Ranked(reqs=[b], num_waiting=0)) == []
    assert b.sched.req_row is None
    (prefill,) = await rig.report()
    assert prefill.mode is ForwardMode.EXTEND and _rids(prefill) == ["b"]


async def test_an_aborted_running_request_leaves_on_the_wake_and_frees_its_kv_after_its_steps():
    rig = _rig(pool=64)
    await rig.start()
    req = _req("a", [1, 2, 3, 4], max_new=10)
    await rig.send(Ranked(reqs=[req], num_waiting=0))
    await rig.report()
    assert len(rig.launched) == 2
    req.sched.abort_requested = True  # the Receiver's part of an abort
    await rig.send(Wake(req.rid))
    assert req.out.finish_reason.kind == "abort" and rig.adder.counters["aborted"] == 1
    assert req not in rig.adder.running
    assert req.sched.req_row is not None  # the two steps in flight still write its KV
    await rig.run_out()
    assert rig.adder.next_step == 3 and rig.adder.kv.open_rows() == []
    # Only the prompt stays cached (it was cached at prefill); its decoded KV is freed.
    assert rig.adder.kv.cache.total_size() == 4
    assert rig.adder.kv.free_slots() == 64 - 4
    assert req.out.output_ids == [TOKEN]  # the aborted steps' tokens are dropped


async def test_an_aborted_candidate_ends_without_a_batch_or_a_requeue():
    rig = _rig()
    await rig.start()
    req = _req("a", [1, 2, 3])
    req.sched.abort_requested = True
    assert await rig.send(Ranked(reqs=[req], num_waiting=0)) == []
    assert rig.requeues() == []
    assert req.out.finish_reason.kind == "abort" and req.sched.req_row is None


async def test_a_request_sharing_a_cached_prompt_prefix_extends_only_its_suffix():
    rig = _rig(pool=64, disable_overlap_schedule=True)
    await rig.start()
    shared = list(range(1, 9))
    first = _req("a", shared, max_new=10)
    await rig.send(Ranked(reqs=[first], num_waiting=0))
    await rig.report()
    second = _req("b", shared + [20, 21], max_new=2)
    await rig.send(Ranked(reqs=[second], num_waiting=0))
    (batch,) = await rig.report()
    # The first request still runs: its prompt was cached when it was prefilled, not at its end.
    assert first.sched.req_row is not None and not first.finished
    assert _rids(batch) == ["b"]
    assert (batch.prefix_lens, batch.extend_lens, batch.extend_ids) == ([8], [2], [[20, 21]])
    assert batch.out_cache_loc.numel() == 2
    assert second.sched.cached_tokens == 8


async def test_the_same_prompt_again_computes_only_its_last_token():
    rig = _rig(pool=64)
    await rig.start()
    prompt = [3, 1, 4, 1, 5, 9]
    first = _req("a", prompt, max_new=1)
    await rig.send(Ranked(reqs=[first], num_waiting=0))
    await rig.run_out()
    assert first.finished and rig.adder.kv.open_rows() == []
    again = _req("b", prompt, max_new=1)
    (batch,) = await rig.send(Ranked(reqs=[again], num_waiting=0))
    # the last prompt token is computed again: its logits sample the first new token
    assert (batch.prefix_lens, batch.extend_lens, batch.extend_ids) == ([5], [1], [[9]])
    assert again.sched.cached_tokens == 5


async def test_a_long_prompt_is_prefilled_in_chunks_and_only_the_last_samples():
    rig = _rig(pool=64, chunked_prefill_size=4, disable_overlap_schedule=True)
    await rig.start()
    req = _req("a", list(range(1, 11)), max_new=2)
    await rig.send(Ranked(reqs=[req], num_waiting=0))
    chunks = []
    while rig.launched[0].mode is ForwardMode.EXTEND:
        batch = rig.launched[0]
        chunks.append((batch.prefix_lens, batch.extend_lens, batch.produces_token))
        await rig.report()
    assert chunks == [([0], [4], [False]), ([4], [4], [False]), ([8], [2], [True])]
    assert req.out.output_ids == [TOKEN]


async def test_a_request_too_large_for_an_idle_pool_is_refused_not_pulled_forever():
    rig = _rig(pool=16)
    await rig.start()
    req = _req("a", list(range(1, 15)), max_new=8)
    assert await rig.send(Ranked(reqs=[req], num_waiting=0)) == []
    assert req.out.finish_reason.kind == "abort" and req.out.finish_reason.status == 400
    assert "14 prompt tokens" in req.out.finish_reason.message and "16 tokens" in req.out.finish_reason.message
    assert rig.requeues() == []


async def test_short_decode_memory_retracts_a_request_and_requeues_it_at_the_back():
    rig = _rig(pool=64, disable_overlap_schedule=True, schedule_conservativeness=0.1)
    await rig.start()
    a, b = _req("a", [1, 2, 3, 4], max_new=50), _req("b", [5, 6, 7, 8, 9, 10], max_new=50)
    await rig.send(Ranked(reqs=[a], num_waiting=1))
    await rig.send(Ranked(reqs=[b], num_waiting=0))  # waits for step 0 (overlap depth 1)
    requeues: list[tuple[list[str], bool]] = []
    while rig.launched and not requeues:
        await rig.report()
        requeues = rig.requeues()
    assert rig.adder.counters["retractions"] == 1
    assert requeues == [(["b"], False)]  # equal progress: the longer prompt goes (SGLang's order)
    assert (b.sched.req_row, b.sched.computed_len, b.sched.launched_outputs) == (None, 0, len(b.out.output_ids))
    assert not b.finished and b.out.output_ids
    (batch,) = rig.launched
    assert _rids(batch) == ["a"] and batch.mode is ForwardMode.DECODE


async def test_with_every_row_taken_the_pull_names_the_priority_to_beat():
    rig = _rig(rows=1, enable_priority_scheduling=True, disable_overlap_schedule=True)
    await rig.start()
    await rig.send(Ranked(reqs=[_req("a", [1, 2, 3], max_new=10, priority=5)], num_waiting=0))
    await rig.report()
    (pull,) = rig.sent()
    assert (pull.max_reqs, pull.preempt_priority) == (1, 5)


async def test_a_more_important_candidate_preempts_a_running_request():
    rig = _rig(rows=1, enable_priority_scheduling=True)
    await rig.start()
    low, high = _req("low", [1, 2, 3, 4], max_new=10, priority=0), _req("high", [5, 6, 7, 8], max_new=10, priority=20)
    await rig.send(Ranked(reqs=[low], num_waiting=0))
    await rig.report()
    assert len(rig.launched) == 2
    rig.sent()
    await rig.send(Ranked(reqs=[high], num_waiting=0))
    assert await rig.report() == []  # the victim's row comes back only after step 2
    assert rig.adder.counters["preemptions"] == 1
    assert rig.requeues() == [(["high"], True)]
    await rig.report()
    requeue, pull = rig.sent()
    assert (requeue.reqs, requeue.front) == ([low], False) and not low.finished
    assert low.sched.req_row is None and low.sched.computed_len == 0
    assert isinstance(pull, Pull) and pull.max_reqs == 1 and pull.preempt_priority is None
    prefill, *_ = await rig.send(Ranked(reqs=[high], num_waiting=1))
    assert _rids(prefill) == ["high"] and prefill.mode is ForwardMode.EXTEND


async def test_a_candidate_within_the_threshold_does_not_preempt():
    rig = _rig(rows=1, enable_priority_scheduling=True)
    await rig.start()
    low, close = _req("low", [1, 2, 3, 4], max_new=10, priority=0), _req("close", [5, 6, 7, 8], max_new=10, priority=10)
    await rig.send(Ranked(reqs=[low], num_waiting=0))
    await rig.report()
    rig.sent()
    await rig.send(Ranked(reqs=[close], num_waiting=0))
    launched = await rig.report()
    assert rig.adder.counters["preemptions"] == 0
    assert rig.requeues() == [(["close"], True)]
    assert [_rids(b) for b in launched] == [["low"]]


async def test_the_measured_prefill_rate_rides_on_the_next_pull():
    rig = _rig(pool=256, disable_overlap_schedule=True)
    await rig.start()
    await rig.send(Ranked(reqs=[_req("a", list(range(1, 101)), max_new=4)], num_waiting=0))
    prefill = rig.launched.pop(0)
    await rig.send(StepDone(step=prefill.step, finished=_outputs(prefill, ()), prefill_tokens=100, forward_s=0.5))
    (pull,) = rig.sent()
    assert pull.prefill_tokens_per_s == pytest.approx(200.0)


async def test_flush_cache_empties_the_cache_only_while_nothing_runs():
    rig = _rig(pool=64)
    await rig.start()
    req = _req("a", [1, 2, 3, 4], max_new=10)
    await rig.send(Ranked(reqs=[req], num_waiting=0))
    busy = asyncio.get_running_loop().create_future()
    await rig.send(FlushCache(busy))
    assert busy.result() is False and rig.adder.kv.cache.total_size() == 4
    req.sched.abort_requested = True
    await rig.send(Wake(req.rid))
    await rig.run_out()
    idle = asyncio.get_running_loop().create_future()
    await rig.send(FlushCache(idle))
    assert idle.result() is True
    assert rig.adder.kv.cache.total_size() == 0 and rig.adder.kv.free_slots() == 64


async def test_after_a_prefill_from_idle_a_decode_launches_before_the_prefill_reports():
    rig = _rig()  # overlap depth 2
    await rig.start()
    launched = await rig.send(Ranked(reqs=[_req("a", [1, 2, 3, 4], max_new=10)], num_waiting=0))
    assert [b.mode for b in launched] == [ForwardMode.EXTEND, ForwardMode.DECODE]
