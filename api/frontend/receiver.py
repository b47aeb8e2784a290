"""Receiver: validates and tokenizes requests, builds `Req`s, routes aborts.

Bad input is answered here, before anything is queued or allocated: the caller's stream ends at
once with status 400 and a message naming the parameter. The Receiver owns the registry of live
requests (rid -> Req); a request leaves it when its stream delivers the final delta.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from cache import token_array
from runtime.actor import Actor, Mailbox
from runtime.config import EngineConfig
from runtime.messages import AbortRequest, Enqueue, GenerateSpec, Submit, Wake
from runtime.req import CallerRequest, FinishReason, Req, SchedState, end_request, mark_aborted
from runtime.sampling_params import SamplingParams
from runtime.service import service_error

# A request without a priority gets the worst value (as in SGLang).
WORST_PRIORITY = 2**62
INT64 = range(-(2**63), 2**63)  # what the core process's msgpack and int64 tensors can carry
U64 = 2**64 - 1


class InvalidInput(Exception):
    """A request the engine refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ModelLimits:
    context_len: int
    vocab_size: int
    kv_pool_size: int
    page_size: int


class Receiver(Actor[Submit | AbortRequest]):
    def __init__(
        self, config: EngineConfig, tokenizer: Any, limits: ModelLimits, *, policy: Mailbox[Enqueue | Wake], adder: Mailbox[Wake],
    ):
        super().__init__("receiver")
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self.policy = policy
        self.adder = adder
        self.live: dict[str, Req] = {}
        self._building: Submit | None = None  # the request being validated (tokenizing may await)

    async def handle(self, msg: Submit | AbortRequest) -> None:
        if isinstance(msg, AbortRequest):
            await self._abort(msg.rid)
            return
        self._building = msg
        try:
            req = await self._build(msg)
        except InvalidInput as exc:
            msg.stream.finish("abort", error=str(exc), status=400, param=exc.param)
            return
        finally:
            self._building = None
        self.live[req.rid] = req
        msg.stream.on_final = lambda rid=req.rid: self.live.pop(rid, None)
        await self.policy.send(Enqueue(req))

    def fail_all(self, message: str, status: int = 500, code: str | None = None) -> None:
        """The engine failed (500) or is shutting down (503): end every request it holds with
        an error, whether live, being validated or still in the mailbox (called by the
        supervisor once the actors are stopped, so none of them is answered twice)."""
        waiting = [self._building] if self._building is not None else []
        while not self.mailbox.empty():
            msg = self.mailbox.get_nowait()
            if isinstance(msg, Submit):
                waiting.append(msg)
        for req in list(self.live.values()):
            end_request(req, FinishReason("abort", message=message, status=status, code=code))
        for submit in waiting:  # not a request yet: only its stream exists
            submit.stream.finish("abort", error=message, status=status, code=code)
        self.live.clear()
        self._building = None

    async def _abort(self, rid: str) -> None:
        req = self.live.get(rid)
        if req is None or not mark_aborted(req):
            return
        # Whoever holds the request now sees the flag; both are told to look (once, when both
        # are the link to a core process).
        await self.policy.send(Wake(rid))
        if self.adder is not self.policy:
            await self.adder.send(Wake(rid))

    async def _build(self, msg: Submit) -> Req:
        spec = msg.spec
        if spec.rid in self.live:
            raise InvalidInput(f"request id {spec.rid!r} is already in use", "rid")
        service_problem = service_error(spec.service)
        if service_problem is not None:
            raise InvalidInput(*service_problem)
        sampling, up_to_context = self._sampling(spec)
        input_ids = await self._input_ids(spec)
        sampling = self._fit_to_context(sampling, len(input_ids), up_to_context)
        now = time.monotonic()
        asked = CallerRequest(
            rid=spec.rid,
            input_ids=input_ids,
            sampling=sampling,
            priority=self._priority(spec.priority),
            routing_key=spec.routing_key,
            extra_key=spec.extra_key,
            service=spec.service,
            return_logprob=spec.return_logprob,
            top_logprobs_num=sampling.top_logprobs_num,  # capped at the vocabulary
            logprob_start_len=self._logprob_start(spec, len(input_ids)),
            arrival_time=now,
        )
        return Req(asked, prompt_key=token_array(input_ids), sched=SchedState(enqueue_time=now), stream=msg.stream)

    @staticmethod
    def _logprob_start(spec: GenerateSpec, prompt_len: int) -> int:
        start = spec.logprob_start_len
        if spec.return_logprob and not -1 <= start < prompt_len:
            raise InvalidInput(
                f"logprob_start_len must be -1 (no prompt logprobs) or a position in the {prompt_len}-token "
                f"prompt (0 .. {prompt_len - 1}), got {start}",
                "logprob_start_len",
            )
        return start if spec.return_logprob else -1

    def _sampling(self, spec: GenerateSpec) -> tuple[SamplingParams, bool]:
        """The params, and whether max_new_tokens is left to the context (given as None)."""
        sampling = _logit_bias_ids(spec.sampling)
        up_to_context = "max_new_tokens" in sampling and sampling["max_new_tokens"] is None
        if up_to_context:  # a placeholder the range checks accept; _fit_to_context sets the real one
            sampling = {**sampling, "max_new_tokens": self.limits.context_len}
        try:
            params = msgspec.convert(sampling, SamplingParams)
        except msgspec.ValidationError as exc:
            raise InvalidInput(f"invalid sampling_params: {exc}", _param_of(str(exc))) from None
        params = msgspec.structs.replace(params, logprobs=spec.return_logprob, top_logprobs_num=spec.top_logprobs_num)
        error = params.validation_error(self.limits.vocab_size)
        if error:
            raise InvalidInput(error, error.split(" ", 1)[0])
        return self._within_64_bits(params), up_to_context

    def _within_64_bits(self, params: SamplingParams) -> SamplingParams:
        """JSON ints have no bound, int64 tensors and msgpack do. These three have no upper bound
        in meaning, so they are brought into range without changing what they ask for: top_k and
        top_logprobs_num past the vocabulary mean all of it (the sampler caps output top logprobs
        the same way), and a seed is used modulo 2**64 anyway (`mix_seed`)."""
        vocab = self.limits.vocab_size
        return msgspec.structs.replace(
            params,
            top_k=min(params.top_k, vocab),
            top_logprobs_num=min(params.top_logprobs_num, vocab),
            seed=None if params.seed is None else params.seed & U64,
        )

    async def _input_ids(self, spec: GenerateSpec) -> list[int]:
        if (spec.text is None) == (spec.input_ids is None):
            raise InvalidInput("give exactly one of text and input_ids", "text")
        if spec.input_ids is not None:
            ids = list(spec.input_ids)
            bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise InvalidInput(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.limits.vocab_size})", "input_ids")
        elif len(spec.text) > self.config.tokenize_off_loop_chars:
            ids = await asyncio.to_thread(self.tokenizer.encode, spec.text)  # a long prompt must not stall the loop
        else:
            ids = self.tokenizer.encode(spec.text)
        if not ids:
            raise InvalidInput("the prompt is empty", "input_ids" if spec.input_ids is not None else "text")
        return ids

    def _fit_to_context(self, sampling: SamplingParams, prompt_len: int, up_to_context: bool) -> SamplingParams:
        """Refuse what cannot fit the context (as SGLang's and vLLM's frontends do); fill in or
        clamp max_new_tokens to what the KV pool can hold (as SGLang's scheduler does)."""
        limits = self.limits
        if prompt_len >= limits.context_len:
            raise InvalidInput(
                f"the prompt has {prompt_len} tokens, but the context length is {limits.context_len} tokens "
                "(the prompt must leave room for at least one new token)",
                "input_ids",
            )
        # The pool's limits are SGLang's scheduler's (max_req_len = pool - 1 where the pool binds):
        # a prompt of max_req_len - 5 or more is refused, max_new_tokens is clamped to
        # max_req_len - prompt - 1. A request alone then always fits (its last token's KV is never
        # written). The context's are its tokenizer manager's, below.
        pool_len = limits.kv_pool_size - 1
        if prompt_len >= pool_len - 5:
            raise InvalidInput(
                f"the prompt has {prompt_len} tokens, but the KV pool of {limits.kv_pool_size} tokens "
                f"holds prompts of at most {pool_len - 6} tokens",
                "input_ids",
            )
        pool_room = pool_len - prompt_len - 1
        context_room = limits.context_len - prompt_len
        if not up_to_context and sampling.max_new_tokens > context_room:
            raise InvalidInput(
                f"the prompt has {prompt_len} tokens and asks for {sampling.max_new_tokens} new tokens, "
                f"{prompt_len + sampling.max_new_tokens} in all, more than the context length of {limits.context_len} "
                f"tokens: ask for at most {context_room} new tokens, or give no limit",
                "max_new_tokens",
            )
        room = min(context_room, pool_room)
        if up_to_context or sampling.max_new_tokens > room:
            sampling = msgspec.structs.replace(sampling, max_new_tokens=room, min_new_tokens=min(sampling.min_new_tokens, room))
        return sampling

    def _priority(self, priority: int | None) -> int:
        cfg = self.config
        if not cfg.enable_priority_scheduling:
            if priority is not None and cfg.abort_on_priority_when_disabled:
                raise InvalidInput("priority was given but priority scheduling is disabled (enable_priority_scheduling)", "priority")
            return 0
        if priority is None:
            return WORST_PRIORITY if cfg.schedule_low_priority_values_first else -WORST_PRIORITY
        if priority not in INT64:
            raise InvalidInput(f"priority must be a 64-bit signed integer, got {priority}", "priority")
        return priority


def _logit_bias_ids(sampling: dict[str, Any]) -> dict[str, Any]:
    """logit_bias keyed by token ids: JSON gives them as strings ("50256": -100)."""
    bias = sampling.get("logit_bias")
    if not isinstance(bias, dict) or all(isinstance(k, int) for k in bias):
        return sampling
    try:
        return {**sampling, "logit_bias": {int(k): v for k, v in bias.items()}}
    except (TypeError, ValueError):
        raise InvalidInput(f"logit_bias keys must be token ids, got {list(bias)[:5]}", "logit_bias") from None


def _param_of(message: str) -> str | None:
    # msgspec names the path as "... - at `$.field`"
    if "`$." in message:
        return message.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0]
    if "unknown field" in message.lower() and "`" in message:
        return message.split("`", 2)[1]
    return None
