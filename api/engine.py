"""`Engine`: the embedded asyncio library over the five actors.

    async with Engine(model_path=..., schedule_policy="lpm") as engine:
        out = await engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 16})
        async for delta in engine.stream(prompt="Hi"):
            ...

Keyword arguments of `Engine(...)` are `EngineConfig` fields. Many tasks may call one Engine at
once. Invalid requests raise `InvalidRequest`; a full queue, a queue timeout or eviction by a
higher-priority request raise `Rejected`; an engine failure raises `EngineError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from actors.adder import Adder
from actors.executor import Executor
from actors.output import OutputProcessor
from actors.policy import Policy
from actors.receiver import ModelLimits, Receiver
from gpu.loader import load_tokenizer
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.prefix_cache import ChunkCache, PrefixCache, RadixCache
from runtime.actor import Actor
from runtime.config import EngineConfig
from runtime.messages import AbortRequest, FlushCache, GenerateSpec, Submit
from runtime.sampling_params import SamplingParams
from runtime.stream import Delta, RequestStream

DEFAULT_MAX_RUNNING_REQUESTS = 256


class InvalidRequest(ValueError):
    """The request is invalid; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Rejected(RuntimeError):
    """The engine refused the request for now: full queue, queue timeout, priority eviction, or
    shutdown. `code` says which: "queue_full", "queue_timeout", "evicted" or "shutting_down"."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


SHUTTING_DOWN = "shutting_down"  # Rejected.code while and after the engine closes


class EngineError(RuntimeError):
    """The engine failed or is not running."""


class GenerateOutput(msgspec.Struct, kw_only=True):
    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    # With return_logprob and logprob_start_len >= 0: the prompt tokens from there on, their
    # logprobs (None for the very first prompt token) and top logprobs.
    input_token_ids: list[int] = []
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[list[tuple[int, float]]] = []


class Engine:
    def __init__(self, **kwargs: Any):
        self.config = EngineConfig(**kwargs)
        self._actors: list[Actor] = []
        self._failure: str | None = None
        self._started = False
        self._closed = False
        self._rid_counter = itertools.count()
        self.runner: ModelRunner | None = None
        self.tokenizer: Any = None

    # --- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            return
        cfg = self.config
        runner = await asyncio.to_thread(ModelRunner, self._runner_config())
        self.runner = runner
        self.tokenizer = await asyncio.to_thread(load_tokenizer, runner.model_dir)
        self.config = cfg = msgspec.structs.replace(
            cfg, dtype=runner.dtype_name, context_length=runner.context_len, max_total_tokens=runner.allocator.size,
            max_running_requests=runner.req_to_token.max_requests,
        )
        self.prefix_cache = self._prefix_cache(runner)
        output = OutputProcessor(self.tokenizer, runner.model_config.eos_token_ids, cfg.stream_interval)
        executor = Executor(runner, output)
        adder = Adder(cfg, runner, self.prefix_cache, executor)
        policy = Policy(cfg, self.prefix_cache, adder)
        adder.policy = policy
        output.adder = adder
        limits = ModelLimits(runner.context_len, runner.vocab_size, runner.allocator.size, cfg.page_size)
        self.receiver = Receiver(cfg, self.tokenizer, limits, policy, adder)
        self.policy, self.adder, self.executor, self.output = policy, adder, executor, output
        self._actors = [self.receiver, policy, adder, executor, output]
        for actor in self._actors:
            actor.start(self._actor_exited)
        self._started, self._closed = True, False

    async def close(self) -> None:
        """Abort what is in flight, stop every actor and its tasks."""
        if not self._started:
            return
        self._closed = True
        await self._stop_actors("the engine is shutting down", status=503, code=SHUTTING_DOWN)

    # --- requests -----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        priority: int | None = None,
        routing_key: str | None = None,
        extra_key: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> GenerateOutput:
        """Run one request to the end; the arguments are `stream`'s."""
        parts: list[Delta] = []
        deltas = self.stream(
            prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid, priority=priority,
            routing_key=routing_key, extra_key=extra_key, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
        )
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                parts.append(delta)
        return _join(parts)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        priority: int | None = None,
        routing_key: str | None = None,
        extra_key: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> AsyncIterator[Delta]:
        """Deltas of one request as they are produced; the last has `finish_reason` set.
        Leaving the loop early (or being cancelled) aborts the request.

        Give exactly one of `prompt` (text, tokenized here) and `input_ids`. `sampling_params`:
        SGLang's names; `max_new_tokens: None` asks for as many as the context leaves.
        `rid`: the request id (default: a fresh one); `priority`: with priority scheduling on;
        `routing_key` (policy `routing-key`) and `extra_key` (a prefix-cache namespace);
        `return_logprob` with `top_logprobs_num` alternatives per output token, and prompt
        logprobs from position `logprob_start_len` on (-1: none)."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = msgspec.structs.asdict(sampling_params)
        spec = GenerateSpec(
            rid=rid or f"req-{uuid.uuid4().hex[:12]}-{next(self._rid_counter)}",
            text=prompt,
            input_ids=input_ids,
            sampling=dict(sampling_params or {}),
            priority=priority,
            routing_key=routing_key,
            extra_key=extra_key,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
        )
        stream = RequestStream(spec.rid)
        await self._submit(Submit(spec=spec, stream=stream))
        try:
            while (delta := await stream.next()) is not None:
                _raise_for_refusal(delta)
                yield delta
        finally:
            if not stream.finished and self._started:
                await self.abort(spec.rid)

    async def abort(self, rid: str) -> None:
        if self._started:
            await self.receiver.send(AbortRequest(rid))

    async def flush_cache(self) -> bool:
        """Drop every cached prefix; False (nothing done) while requests are running."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await self.adder.send(FlushCache(done))
        return await done

    def stats(self) -> dict[str, Any]:
        if not self._started:
            return {"running": False}
        return {
            **self.adder.stats(),
            "aborted": self.adder.counters["aborted"] + self.policy.aborted,
            "num_waiting": len(self.policy.waiting),
            "rejected": self.policy.rejected,
            "queue_timeouts": self.policy.timed_out,
            "generated_tokens": self.output.generated_tokens,
            "forward_steps": self.executor.steps,
            "forward_s": self.executor.forward_s,
            "failure": self._failure,
        }

    # --- internals ----------------------------------------------------------------------------
    def _runner_config(self) -> RunnerConfig:
        cfg = self.config
        return RunnerConfig(
            model_path=cfg.model_path,
            dtype=cfg.dtype,
            device=cfg.device,
            max_total_tokens=cfg.max_total_tokens,
            max_running_requests=cfg.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
            page_size=cfg.page_size,
            context_length=cfg.context_length,
            attention_backend=cfg.attention_backend,
            disable_cuda_graph=cfg.disable_cuda_graph,
            cuda_graph_max_bs=cfg.cuda_graph_max_bs,
        )

    def _prefix_cache(self, runner: ModelRunner) -> PrefixCache:
        cfg = self.config
        if cfg.disable_radix_cache:
            return ChunkCache(runner.allocator)
        return RadixCache(runner.allocator, page_size=cfg.page_size, eviction_policy=cfg.radix_eviction_policy)

    async def _submit(self, msg: Submit) -> None:
        if self._failure is not None:
            raise EngineError(f"the engine has failed: {self._failure}")
        if self._closed:
            raise Rejected("the engine has shut down", SHUTTING_DOWN)
        if not self._started:
            raise EngineError("the engine is not running: use `async with Engine(...)` or `await engine.start()`")
        delivered = await self.receiver.send(msg)
        if not delivered or not self._started:  # stopped while this waited for room: no one will read it
            if self._failure is not None:
                msg.stream.finish("abort", error=f"the engine has failed: {self._failure}", status=500)
            else:
                msg.stream.finish("abort", error="the engine has shut down", status=503, code=SHUTTING_DOWN)

    def _actor_exited(self, actor: Actor, error: BaseException | None) -> None:
        if error is None or self._failure is not None:
            return
        self._failure = f"{actor.name} actor crashed: {error!r}"
        asyncio.get_running_loop().create_task(self._stop_actors(self._failure, status=500))

    async def _stop_actors(self, message: str, status: int, code: str | None = None) -> None:
        """Stop every actor, then end every request still held (live, in validation or in the
        Receiver's mailbox) with `message`: nothing is left waiting for a final delta."""
        self._started = False
        for actor in self._actors:
            await actor.stop(drain=False)
        self.receiver.fail_all(message, status=status, code=code)
        self.executor.shutdown()


def _raise_for_refusal(delta: Delta) -> None:
    if delta.status is None:
        return
    message = delta.error or "request refused"
    if delta.status == 400:
        raise InvalidRequest(message, delta.param)
    if delta.status == 503:
        raise Rejected(message, delta.code)
    raise EngineError(message)


def _join(parts: list[Delta]) -> GenerateOutput:
    last = parts[-1]
    return GenerateOutput(
        rid=last.rid,
        text="".join(p.text for p in parts),
        output_ids=[t for p in parts for t in p.output_ids],
        finish_reason=last.finish_reason or "abort",
        matched_stop=last.matched_stop,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        logprobs=[x for p in parts for x in p.logprobs],
        top_logprobs=[x for p in parts for x in p.top_logprobs],
        input_token_ids=[x for p in parts for x in p.input_token_ids],
        input_logprobs=[x for p in parts for x in p.input_logprobs],
        input_top_logprobs=[x for p in parts for x in p.input_top_logprobs],
    )
