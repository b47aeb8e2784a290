"""`--reject-infeasible` sees the running batch (issue 33, item 3): with every row taken by long
requests, a request whose first token is due before the first of them can leave is refused at
once, instead of being served late."""

from __future__ import annotations

import time

from actors.policy import Policy
from cache import RadixCache, token_array
from gpu.kv_pool import TokenSlotAllocator
from runtime.actor import Mailbox
from runtime.config import EngineConfig
from runtime.messages import AdderMsg, Enqueue, Pull, StepDone
from runtime.req import CallerRequest, Req
from runtime.sampling_params import SamplingParams
from runtime.service import ServiceClass
from tests.actor_helpers import handle_queued
from tests.test_sglang_rules import _rig, _run_rounds


def _policy(**config: object) -> tuple[Policy, Mailbox[AdderMsg]]:
    to_adder: Mailbox[AdderMsg] = Mailbox()
    cfg = EngineConfig(model_path="unused", schedule_policy="edf", reject_infeasible=True, **config)  # type: ignore[arg-type]
    return Policy(cfg, RadixCache(TokenSlotAllocator(1024, 1)), inbox=Mailbox(), adder=to_adder), to_adder


def _urgent(rid: str, slo_ms: float = 5.0, priority: int = 0) -> Req:
    return Req(CallerRequest(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=8), priority=priority, service=ServiceClass(slo_ttft_ms=slo_ms), arrival_time=time.monotonic()))


def _full_batch(first_exit_s: float | None, preempt_priority: int | None = None) -> Pull:
    """What the Adder's Pull says with every row taken by requests that leave in `first_exit_s`."""
    return Pull(
        max_reqs=0, running_routing_keys={}, block=False, preempt_priority=preempt_priority,
        prefill_tokens_per_s=None, kv_free=10_000, first_exit_s=first_exit_s,
    )


async def _enqueue_after(policy: Policy, pull: Pull, req: Req) -> None:
    await policy.send(pull)
    await handle_queued(policy)
    await policy.send(Enqueue(req))
    await handle_queued(policy)


async def test_a_full_batch_makes_a_tight_first_token_deadline_infeasible():
    policy, _ = _policy()
    req = _urgent("a")
    await _enqueue_after(policy, _full_batch(first_exit_s=1.0), req)
    assert req.finished and req.out.finish_reason is not None
    assert (req.out.finish_reason.status, req.out.finish_reason.code) == (503, "deadline_infeasible")
    assert policy.infeasible == 1 and policy.waiting == []


async def test_a_deadline_after_the_first_exit_is_accepted():
    policy, _ = _policy()
    req = _urgent("a", slo_ms=5_000)
    await _enqueue_after(policy, _full_batch(first_exit_s=1.0), req)
    assert not req.finished and policy.waiting == [req]


async def test_a_request_that_may_preempt_is_not_blocked_by_the_full_batch():
    policy, _ = _policy(enable_priority_scheduling=True)
    req = _urgent("a", priority=100)
    await _enqueue_after(policy, _full_batch(first_exit_s=1.0, preempt_priority=0), req)
    assert not req.finished and policy.waiting == [req]


async def test_too_little_kv_blocks_like_a_full_batch():
    policy, _ = _policy()
    req = _urgent("a")
    pull = Pull(max_reqs=4, running_routing_keys={}, block=False, kv_free=5, first_exit_s=1.0)
    await _enqueue_after(policy, pull, req)
    assert (req.out.finish_reason.status, req.out.finish_reason.code) == (503, "deadline_infeasible")  # type: ignore[union-attr]


async def test_the_adders_pull_reports_when_the_first_running_request_leaves():
    """The Adder times decode steps and counts the rounds to the earliest last token."""
    rig = _rig(pool=256, rows=2, disable_overlap_schedule=True)
    await rig.start()
    long_req = Req(CallerRequest(rid="a", input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=40)), prompt_key=token_array([5, 6, 7]))
    short = Req(CallerRequest(rid="b", input_ids=[8, 9], sampling=SamplingParams(max_new_tokens=30)), prompt_key=token_array([8, 9]))
    await _run_rounds(rig, [[long_req, short]])
    await rig.send(StepDone(step=rig.launched.pop(0).step, finished=[], forward_s=0.02))
    (pull,) = [m for m in rig.sent() if isinstance(m, Pull)]
    assert pull.max_reqs == 0 and pull.kv_free == 256 - 5  # the prompts are cached and locked
    # Asked before the next decode round: b's 30th token comes 29 rounds after its prefill.
    assert pull.first_exit_s is not None and abs(pull.first_exit_s - 29 * 0.02) < 1e-9
