"""The Policy actor's answers to the Adder's Pulls (actors/policy.py)."""

from __future__ import annotations

import asyncio

from actors.policy import Policy
from cache import RadixCache
from gpu.kv_pool import TokenSlotAllocator
from runtime.actor import Actor
from runtime.config import EngineConfig
from runtime.messages import Enqueue, Pull, Ranked
from runtime.req import Req
from runtime.sampling_params import SamplingParams


class Inbox(Actor[Ranked]):
    """Stands in for the Adder: keeps every answer."""

    def __init__(self) -> None:
        super().__init__("adder")
        self.answers: list[Ranked] = []

    async def handle(self, msg: Ranked) -> None:
        self.answers.append(msg)


def _req(rid: str) -> Req:
    return Req(rid=rid, origin_input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _pull(block: bool) -> Pull:
    return Pull(max_reqs=64, running_routing_keys={}, block=block, preempt_priority=None)


async def test_a_blocking_pull_takes_a_whole_burst_in_one_answer():
    adder = Inbox()
    policy = Policy(EngineConfig(model_path="unused"), RadixCache(TokenSlotAllocator(1024, 1)), adder)
    for actor in (adder, policy):
        actor.start(lambda actor, error: None)
    try:
        await policy.send(_pull(block=True))
        await _settle()
        assert adder.answers == []  # parked: nothing waits
        for i in range(5):  # one burst: all in the mailbox before the Policy runs
            await policy.send(Enqueue(_req(f"r{i}")))
        await _settle()
        assert [[r.rid for r in a.reqs] for a in adder.answers] == [["r0", "r1", "r2", "r3", "r4"]]
        assert adder.answers[0].num_waiting == 0
        await policy.send(_pull(block=False))  # not blocking: answered at once, empty
        await _settle()
        assert len(adder.answers) == 2 and adder.answers[1].reqs == []
    finally:
        for actor in (policy, adder):
            await actor.stop(drain=False)
