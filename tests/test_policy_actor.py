"""The Policy actor's answers to the Adder's Pulls (actors/policy.py)."""

from __future__ import annotations

from actors.policy import Policy
from cache import RadixCache
from gpu.kv_pool import TokenSlotAllocator
from runtime.actor import Mailbox
from runtime.config import EngineConfig
from runtime.messages import AdderMsg, Enqueue, Pull
from runtime.req import CallerRequest, Req
from runtime.sampling_params import SamplingParams
from tests.actor_helpers import handle_queued, taken


def _req(rid: str) -> Req:
    return Req(CallerRequest(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4)))


def _pull(block: bool) -> Pull:
    return Pull(max_reqs=64, running_routing_keys={}, block=block, preempt_priority=None)


def _policy(config: EngineConfig) -> tuple[Policy, Mailbox[AdderMsg]]:
    to_adder: Mailbox[AdderMsg] = Mailbox()
    return Policy(config, RadixCache(TokenSlotAllocator(1024, 1)), inbox=Mailbox(), adder=to_adder), to_adder


async def test_a_blocking_pull_takes_a_whole_burst_in_one_answer():
    policy, to_adder = _policy(EngineConfig(model_path="unused"))
    await policy.send(_pull(block=True))
    await handle_queued(policy)
    assert taken(to_adder) == []  # parked: nothing waits
    for i in range(5):  # one burst: all in the mailbox before the Policy runs
        await policy.send(Enqueue(_req(f"r{i}")))
    await handle_queued(policy)
    answers = taken(to_adder)
    assert [[r.rid for r in a.reqs] for a in answers] == [["r0", "r1", "r2", "r3", "r4"]]
    assert answers[0].num_waiting == 0
    await policy.send(_pull(block=False))  # not blocking: answered at once, empty
    await handle_queued(policy)
    (answer,) = taken(to_adder)
    assert answer.reqs == []
