"""`Engine`: the embedded asyncio library over the five actors.

    async with Engine(model_path=..., schedule_policy="lpm") as engine:
        out = await engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 16})
        async for delta in engine.stream(prompt="Hi"):
            ...

Keyword arguments of `Engine(...)` are `EngineConfig` fields. Many tasks may call one Engine at
once. With `inline_core=False` the core (Policy, Adder, Executor, OutputProcessor) runs in a
process of its own (api/core/process.py) and this process keeps the Receiver and the streams.
Invalid requests raise `InvalidRequest`; a full queue, a queue timeout or eviction by a
higher-priority request raise `Rejected`; an engine failure raises `EngineError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

import msgspec

from api.frontend.receiver import ModelLimits, Receiver
from api.core.engine_core import Core, CoreSetup, load_core
from api.frontend.core_client import CoreClient
from api.launch import check_load_format, load_tokenizer, needs_tokenizer
from api.frontend.cores import EngineCores, InlineCore
from api.frontend.replicas import Replicas
from gpu.loader import resolve_model_dir
from gpu.model_runner import ModelRunner
from runtime.actor import Actor
from runtime.config import DETERMINISTIC_SEED, EngineConfig
from runtime.messages import AbortRequest, GenerateSpec, Submit
from runtime.sampling_params import SamplingParams
from runtime.service import ServiceClass
from runtime.stream import Delta, RequestStream


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
SETTLE_TIMEOUT_S = 5.0  # the most a close waits for the core's last copies (see Engine.close)


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


P = ParamSpec("P")


def _collected(
    stream: Callable[Concatenate[Engine, P], AsyncIterator[Delta]],
) -> Callable[Concatenate[Engine, P], Coroutine[Any, Any, GenerateOutput]]:
    """`Engine.generate`: `stream`'s arguments, the request run to its end and its deltas joined."""

    @functools.wraps(stream)  # help() and inspect show stream's typed keywords
    async def generate(engine: Engine, *args: P.args, **kwargs: P.kwargs) -> GenerateOutput:
        parts: list[Delta] = []
        async with contextlib.aclosing(stream(engine, *args, **kwargs)) as deltas:
            async for delta in deltas:
                parts.append(delta)
        return _join(parts)

    generate.__name__ = generate.__qualname__ = "generate"
    generate.__doc__ = "Run one request to the end and return its joined output; the arguments are `stream`'s."
    generate.__signature__ = inspect.signature(stream).replace(return_annotation=GenerateOutput)  # type: ignore[attr-defined]
    return generate


class Engine:
    def __init__(self, *, core_setup: CoreSetup | None = None, **kwargs: Any):
        """`kwargs`: EngineConfig fields. `core_setup`: changes to the core made where it is
        loaded (benchmarks: a simulated device as the Executor's step runner)."""
        self.config = EngineConfig(**kwargs).resolved_deterministic()
        self.core_setup = core_setup
        self._actors: list[Actor] = []
        self._failure: str | None = None
        self._failed = asyncio.Event()  # set with _failure
        self._failing: asyncio.Task[None] | None = None  # the stop a failure started
        self._started = False
        self._closed = False
        self._rid_counter = itertools.count()
        self.tokenizer: Any = None
        self.vocab_size = 0  # the model's, once started
        self.model_dir: Path | None = None  # the checkpoint directory (a GGUF file converted), once started
        self.cores: EngineCores | None = None  # once started
        # Inline: the core itself, for tests and benchmarks that look inside. Core process: None.
        self.core: Core | None = None
        self.runner: ModelRunner | None = None
        self.replicas: Replicas | None = None  # the core processes (one per dp replica), when not inline

    @property
    def client(self) -> CoreClient | None:
        """The first (with dp_size 1, the only) core process's client."""
        return None if self.replicas is None else self.replicas.clients[0]

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            return
        cores, limits = await (self._start_inline() if self.config.inline_core else self._start_core_processes())
        self.cores = cores
        self.receiver = Receiver(self.config, self.tokenizer, limits, policy=cores.to_policy, adder=cores.to_adder)
        self._actors = [self.receiver, *cores.actors]
        for actor in self._actors:
            actor.start(self._actor_exited)
        self._started, self._closed = True, False

    async def _start_inline(self) -> tuple[EngineCores, ModelLimits]:
        core = await load_core(self.config.core(), setup=self.core_setup)
        self.core, self.config, self.tokenizer, self.runner = core, self.config.with_core(core.config), core.tokenizer, core.runner
        self.vocab_size, self.model_dir = core.runner.vocab_size, core.runner.model_dir
        return InlineCore(core), core.limits

    async def _start_core_processes(self) -> tuple[EngineCores, ModelLimits]:
        check_load_format(self.config.load_format, self.config.model_path)
        self.model_dir = await asyncio.to_thread(resolve_model_dir, self.config.model_path)  # converts a GGUF once
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config, self.model_dir)
        replicas = Replicas(self.config, self.tokenizer, self._core_failed, self.core_setup)
        ready = await replicas.start()
        # The core settings the first core resolved (limits, dtype), but its own share of threads and
        # device are per replica: the frontend keeps what it was given.
        self.replicas, self.vocab_size = replicas, ready.vocab_size
        resolved = msgspec.structs.replace(ready.config, core_threads=self.config.core_threads, device=self.config.device)
        self.config = self.config.with_core(resolved)
        cfg = self.config
        assert cfg.context_length is not None and cfg.max_total_tokens is not None
        return replicas, ModelLimits(cfg.context_length, ready.vocab_size, cfg.max_total_tokens, cfg.page_size)

    async def close(self) -> None:
        """Abort what is in flight, stop every actor and its tasks. With the host tier and no
        request in flight, the core first ends its last step, the copies its last request left
        (ForwardMode.IDLE): that request's blocks then reach storage, where an engine started
        next on the same directory finds them."""
        if self._failing is not None:  # a failure is already stopping everything: wait for it
            await asyncio.shield(self._failing)
        if not self._started:
            return
        self._closed = True
        if self.config.enable_hierarchical_cache and self._failure is None and not self.receiver.live:
            await self._settle()
        await self._stop_actors("the engine is shutting down", status=503, code=SHUTTING_DOWN)

    async def _settle(self) -> None:
        """Wait, SETTLE_TIMEOUT_S at most (a core that stops answering), until the core's Adder
        is idle: every step it launched has reported."""
        until_idle = asyncio.ensure_future(self._until_idle())
        done, _ = await asyncio.wait({until_idle}, timeout=SETTLE_TIMEOUT_S)
        if not done:
            until_idle.cancel()
            await asyncio.gather(until_idle, return_exceptions=True)

    async def _until_idle(self) -> None:
        while not (await self.current_stats()).get("adder_idle", True):
            await asyncio.sleep(0.002)

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
        tenant: str | None = None,
        slo_ttft_ms: float | None = None,
        deadline_ms: float | None = None,
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
        `tenant` (fairness, metrics), `slo_ttft_ms` (first token due this long after arrival)
        and `deadline_ms` (the whole answer due), read by `--schedule-policy edf`;
        `return_logprob` with `top_logprobs_num` alternatives per output token, and prompt
        logprobs from position `logprob_start_len` on (-1: none)."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = msgspec.structs.asdict(sampling_params)
        # --preferred-sampling-params: under what the request gives, as SGLang merges them.
        sampling = {**(self.config.preferred_sampling_params or {}), **(sampling_params or {})}
        if self.config.enable_deterministic_inference and sampling.get("seed") is None:
            sampling["seed"] = DETERMINISTIC_SEED
        unservable = needs_tokenizer(sampling) if self.config.skip_tokenizer_init else None
        if unservable is not None:
            hint = " (stop_token_ids do not)" if unservable == "stop" else ""
            raise InvalidRequest(f"{unservable} needs a tokenizer, and this server runs with --skip-tokenizer-init{hint}", unservable)
        spec = GenerateSpec(
            rid=rid or f"req-{uuid.uuid4().hex[:12]}-{next(self._rid_counter)}",
            text=prompt,
            input_ids=input_ids,
            sampling=sampling,
            priority=priority,
            routing_key=routing_key,
            extra_key=extra_key,
            service=ServiceClass(tenant=tenant, slo_ttft_ms=slo_ttft_ms, deadline_ms=deadline_ms),
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

    generate = _collected(stream)

    async def abort(self, rid: str) -> None:
        if self._started:
            await self.receiver.send(AbortRequest(rid))

    async def flush_cache(self) -> bool:
        """Drop every cached prefix; False (nothing done) while requests are running or when the
        engine is not running."""
        if not self._started or self.cores is None:
            return False
        return await self.cores.flush_cache()

    async def clear_hicache_storage(self) -> bool:
        """Remove the storage tier's block files (SGLang's /clear_hicache_storage_backend), also
        while requests run; False without a storage tier or when the engine is not running."""
        if not self._started or self.cores is None:
            return False
        return await self.cores.clear_storage()

    def stats(self) -> dict[str, Any]:
        """The engine's counters; with a core process, as of its latest report: at most
        `STATS_PERIOD_S` behind, but an idle core reports nothing, so its clocks (`time`,
        `loop_cpu_s`) may be older. `current_stats` waits for the core's counters as they are now."""
        if not self._started or self.cores is None:
            return {"running": False, "failure": self._failure}
        return {**self.cores.stats(), "failure": self._failure}

    async def current_stats(self) -> dict[str, Any]:
        if not self._started or self.cores is None:
            return self.stats()
        return {**await self.cores.current_stats(), "failure": self._failure}

    async def wait_failure(self) -> str:
        """Returns once the engine has failed (a crashed actor, a dead core process): why."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

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

    def fail(self, reason: str) -> None:
        """End the engine as a crash would (every request in flight gets a 500 naming `reason`):
        for a supervisor that found the core hung."""
        self._core_failed(reason)

    def _actor_exited(self, actor: Actor, error: BaseException | None) -> None:
        if error is not None:
            self._core_failed(f"{actor.name} actor crashed: {error!r}")

    def _core_failed(self, message: str) -> None:
        """An actor crashed, or the core process died or crashed: end everything with a 500."""
        if self._failure is not None:
            return
        self._failure = message
        self._failed.set()
        self._failing = asyncio.get_running_loop().create_task(self._stop_actors(self._failure, status=500))

    async def _stop_actors(self, message: str, status: int, code: str | None = None) -> None:
        """Stop every actor, then end every request still held (live, in validation or in the
        Receiver's mailbox) with `message`: nothing is left waiting for a final delta."""
        self._started = False
        for actor in self._actors:
            await actor.stop(drain=False)
        self.receiver.fail_all(message, status=status, code=code)
        assert self.cores is not None
        await self.cores.close()


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
