"""The Receiver actor driven message by message (api/frontend/receiver.py): what it hands the Policy,
what it refuses, and how it routes aborts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from api.frontend.receiver import WORST_PRIORITY, ModelLimits, Receiver
from cache import token_array
from runtime.actor import Mailbox
from runtime.config import EngineConfig
from runtime.messages import AbortRequest, Enqueue, GenerateSpec, Submit, Wake
from runtime.req import FinishReason, CallerRequest, Req, end_request
from runtime.sampling_params import SamplingParams
from runtime.service import ServiceClass
from runtime.stream import Delta, RequestStream
from tests.actor_helpers import taken

VOCAB = 100
LIMITS = ModelLimits(context_len=256, vocab_size=VOCAB, kv_pool_size=1024, page_size=1)


class CharTokenizer:
    """One token per character: all the Receiver asks of a tokenizer is `encode`."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]


@dataclass
class Rig:
    receiver: Receiver
    to_policy: Mailbox[Any]
    to_adder: Mailbox[Any]

    async def submit(self, rid: str = "r", **spec: Any) -> RequestStream:
        stream = RequestStream(rid)
        await self.receiver.handle(Submit(GenerateSpec(rid=rid, **spec), stream))
        return stream

    def enqueued(self) -> list[Req]:
        msgs = taken(self.to_policy)
        assert all(isinstance(m, Enqueue) for m in msgs), msgs
        return [m.req for m in msgs]


def _rig(limits: ModelLimits = LIMITS, shared_peer: bool = False, **config: Any) -> Rig:
    to_policy: Mailbox[Any] = Mailbox()
    to_adder = to_policy if shared_peer else Mailbox()
    receiver = Receiver(EngineConfig(model_path="unused", **config), CharTokenizer(), limits, policy=to_policy, adder=to_adder)
    return Rig(receiver, to_policy, to_adder)


async def test_a_submitted_prompt_is_enqueued_as_a_well_formed_req():
    rig = _rig()
    stream = await rig.submit(
        "r1", input_ids=[5, 6, 7], sampling={"max_new_tokens": 8, "temperature": 0.5, "stop_token_ids": [9]},
        routing_key="k", extra_key="x", service=ServiceClass(tenant="t"),
    )
    (req,) = rig.enqueued()
    assert (req.rid, req.asked.input_ids, req.prompt_key) == ("r1", [5, 6, 7], token_array([5, 6, 7]))
    assert (req.asked.sampling.max_new_tokens, req.asked.sampling.temperature, req.asked.sampling.stop_token_ids) == (8, 0.5, [9])
    assert (req.asked.routing_key, req.asked.extra_key, req.asked.service.tenant, req.asked.priority) == ("k", "x", "t", 0)
    assert req.sched.enqueue_time == req.asked.arrival_time > 0
    assert (req.sched.req_row, req.sched.abort_requested, req.sched.computed_len) == (None, False, 0)
    assert req.stream is stream and not stream.finished
    assert req.asked.return_logprob is False and req.asked.logprob_start_len == -1
    assert rig.to_adder.empty()
    assert rig.receiver.live == {"r1": req}


@pytest.mark.parametrize("off_loop_chars", [4096, 2])  # 2: the text is tokenized in a thread
async def test_text_is_tokenized_into_the_prompt(off_loop_chars):
    rig = _rig(tokenize_off_loop_chars=off_loop_chars)
    await rig.submit(text="hello", sampling={"max_new_tokens": 4})
    (req,) = rig.enqueued()
    assert req.asked.input_ids == CharTokenizer().encode("hello")


async def test_no_token_limit_asks_for_what_the_context_leaves():
    rig = _rig()
    await rig.submit(input_ids=[1, 2, 3, 4], sampling={"max_new_tokens": None})
    (req,) = rig.enqueued()
    assert req.asked.sampling.max_new_tokens == LIMITS.context_len - 4


async def test_a_token_limit_past_what_the_kv_pool_holds_is_clamped_to_it():
    rig = _rig(ModelLimits(context_len=256, vocab_size=VOCAB, kv_pool_size=32, page_size=1))
    await rig.submit(input_ids=[1, 2, 3, 4], sampling={"max_new_tokens": 50, "min_new_tokens": 40})
    (req,) = rig.enqueued()
    # SGLang's scheduler clamp where the pool binds: (pool - 1) - prompt - 1
    assert (req.asked.sampling.max_new_tokens, req.asked.sampling.min_new_tokens) == (31 - 4 - 1, 31 - 4 - 1)


async def test_the_clamp_leaves_no_page_slack_as_sglangs_does():
    """Pages of 16, a pool of 128: a 70-token prompt may ask for 56 new tokens (was 24)."""
    rig = _rig(ModelLimits(context_len=4096, vocab_size=VOCAB, kv_pool_size=128, page_size=16))
    await rig.submit(input_ids=[1] * 70, sampling={"max_new_tokens": 100})
    (req,) = rig.enqueued()
    assert req.asked.sampling.max_new_tokens == 127 - 70 - 1


@pytest.mark.parametrize(
    ("config", "given", "expected"),
    [
        ({}, 3, 0),  # priority scheduling off: every request is equal
        ({"enable_priority_scheduling": True}, 3, 3),
        ({"enable_priority_scheduling": True}, None, -WORST_PRIORITY),
        ({"enable_priority_scheduling": True, "schedule_low_priority_values_first": True}, None, WORST_PRIORITY),
    ],
)
async def test_priority_is_kept_or_defaulted_to_the_worst(config, given, expected):
    rig = _rig(**config)
    await rig.submit(input_ids=[1, 2], sampling={"max_new_tokens": 2}, priority=given)
    (req,) = rig.enqueued()
    assert req.asked.priority == expected


BAD_INPUTS = [
    ({"text": "hi", "input_ids": [1, 2]}, {}, "text", "exactly one of text and input_ids"),
    ({}, {}, "text", "exactly one of text and input_ids"),
    ({"input_ids": []}, {}, "input_ids", "the prompt is empty"),
    ({"text": ""}, {}, "text", "the prompt is empty"),
    ({"input_ids": [5, VOCAB]}, {}, "input_ids", "outside the vocabulary"),
    ({"input_ids": [1] * 256}, {}, "input_ids", "context length is 256"),
    ({"input_ids": [1, 2, 3, 4], "sampling": {"max_new_tokens": 253}}, {}, "max_new_tokens", "at most 252 new tokens"),
    ({"input_ids": [1], "sampling": {"temperature": -1.0}}, {}, "temperature", "temperature must be >= 0"),
    ({"input_ids": [1], "sampling": {"temprature": 1.0}}, {}, "temprature", "unknown field"),
    ({"input_ids": [1], "sampling": {"max_new_tokens": "ten"}}, {}, "max_new_tokens", "Expected `int"),
    ({"input_ids": [1], "sampling": {"logit_bias": {"a": 1.0}}}, {}, "logit_bias", "must be token ids"),
    ({"input_ids": [1], "sampling": {"stop_token_ids": [VOCAB]}}, {}, "stop_token_ids", "outside the vocabulary"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, {}, "logprob_start_len", "got 2"),
    ({"input_ids": [1], "service": ServiceClass(tenant="")}, {}, "tenant", "tenant must be"),
    ({"input_ids": [1], "service": ServiceClass(slo_ttft_ms=-5)}, {}, "slo_ttft_ms", "positive number"),
    ({"input_ids": [1], "priority": 1}, {"abort_on_priority_when_disabled": True}, "priority", "priority scheduling is disabled"),
    ({"input_ids": [1], "priority": 2**63}, {"enable_priority_scheduling": True}, "priority", "64-bit"),
]


@pytest.mark.parametrize(("spec", "config", "param", "phrase"), BAD_INPUTS)
async def test_bad_input_ends_the_stream_naming_the_field_and_sends_nothing(spec, config, param, phrase):
    rig = _rig(**config)
    stream = await rig.submit("bad", **spec)
    delta = await stream.next()  # already pushed: returns at once
    assert (delta.finish_reason, delta.status, delta.param) == ("abort", 400, param)
    assert phrase in delta.error
    assert rig.to_policy.empty() and rig.to_adder.empty()
    assert rig.receiver.live == {}


async def test_a_prompt_the_kv_pool_cannot_hold_is_refused():
    rig = _rig(ModelLimits(context_len=256, vocab_size=VOCAB, kv_pool_size=16, page_size=1))
    stream = await rig.submit(input_ids=[1] * 12, sampling={"max_new_tokens": 1})
    delta = await stream.next()
    # SGLang's max_req_input_len: (pool - 1) - 5 = 10
    assert (delta.status, delta.param) == (400, "input_ids") and "KV pool of 16 tokens holds prompts of at most 9" in delta.error
    assert rig.to_policy.empty()


async def test_a_request_id_in_use_is_refused():
    rig = _rig()
    await rig.submit("same", input_ids=[1, 2])
    second = await rig.submit("same", input_ids=[3, 4])
    delta = await second.next()
    assert (delta.finish_reason, delta.status, delta.param) == ("abort", 400, "rid")
    assert [r.asked.input_ids for r in rig.enqueued()] == [[1, 2]]


async def test_an_abort_flags_the_request_and_wakes_both_peers_once():
    rig = _rig()
    await rig.submit("r1", input_ids=[1, 2])
    (req,) = rig.enqueued()
    await rig.receiver.handle(AbortRequest("r1"))
    assert req.sched.abort_requested
    assert taken(rig.to_policy) == [Wake("r1")] and taken(rig.to_adder) == [Wake("r1")]
    await rig.receiver.handle(AbortRequest("r1"))  # already asked: nothing new to look at
    assert rig.to_policy.empty() and rig.to_adder.empty()
    assert not req.finished  # the actor holding it ends it


async def test_an_abort_wakes_a_peer_serving_as_both_policy_and_adder_once():
    rig = _rig(shared_peer=True)  # the link to a core process
    await rig.submit("r1", input_ids=[1, 2])
    rig.enqueued()
    await rig.receiver.handle(AbortRequest("r1"))
    assert taken(rig.to_policy) == [Wake("r1")]


async def test_an_abort_for_an_unknown_request_does_nothing():
    rig = _rig()
    await rig.submit("r1", input_ids=[1, 2])
    (req,) = rig.enqueued()
    await rig.receiver.handle(AbortRequest("other"))
    assert rig.to_policy.empty() and rig.to_adder.empty()
    assert not req.sched.abort_requested and rig.receiver.live == {"r1": req}


async def test_a_request_leaves_the_live_map_with_its_final_delta_only():
    rig = _rig()
    stream = await rig.submit("r1", input_ids=[1, 2])
    (req,) = rig.enqueued()
    stream.push(Delta(rid="r1", output_ids=[5]))
    assert rig.receiver.live == {"r1": req}
    end_request(req, FinishReason("stop"))
    assert rig.receiver.live == {}
    await rig.receiver.handle(AbortRequest("r1"))  # it ended: nothing to abort
    assert rig.to_policy.empty() and rig.to_adder.empty() and not req.sched.abort_requested
    await rig.submit("r1", input_ids=[3])  # its id is free again
    assert [r.asked.input_ids for r in rig.enqueued()] == [[3]]


def test_what_the_caller_asked_cannot_be_changed_after_the_receiver_built_it():
    req = Req(CallerRequest(rid="r", input_ids=[1, 2], sampling=SamplingParams()))
    with pytest.raises(AttributeError, match="immutable"):
        req.asked.priority = 5  # type: ignore[misc]
    req.sched.enqueue_time = 1.0  # the owners' records stay writable
    req.out.output_ids.append(7)
    assert (req.asked.priority, req.sched.enqueue_time, req.fill_ids) == (0, 1.0, [1, 2, 7])
