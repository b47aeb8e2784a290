"""The channel from the actors back to one caller: `RequestStream` of `Delta`s.

Producers never wait on a slow reader: a push merges into the one pending delta, so a client
that stops reading costs memory bounded by its own output, and the OutputProcessor never blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec


class Delta(msgspec.Struct, kw_only=True):
    rid: str
    text: str = ""  # new text since the previous delta
    output_ids: list[int] = []  # new token ids since the previous delta
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    # Prompt tokens with their logprobs (None for the first prompt token), when asked for.
    input_token_ids: list[int] = []
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[list[tuple[int, float]]] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first admission (first delta on)
    error: str | None = None  # why the request was refused or aborted by the engine
    param: str | None = None  # the request field an error is about
    code: str | None = None  # a machine-readable reason, e.g. queue_full, queue_timeout, evicted
    status: int | None = None  # HTTP-like status for refusals: 400 invalid, 503 rejected, 500 engine

    def merge(self, later: Delta) -> None:
        """Fold a later delta into this one (the reader has not taken this one yet). Called for
        every token a slow reader has not taken: an empty field of `later` costs one test."""
        self.text += later.text
        self.output_ids = self.output_ids + later.output_ids
        if later.logprobs or later.top_logprobs:
            self.logprobs = self.logprobs + later.logprobs
            self.top_logprobs = self.top_logprobs + later.top_logprobs
        if later.input_token_ids or later.input_logprobs or later.input_top_logprobs:
            self.input_token_ids = self.input_token_ids + later.input_token_ids
            self.input_logprobs = self.input_logprobs + later.input_logprobs
            self.input_top_logprobs = self.input_top_logprobs + later.input_top_logprobs
        if (later.finish_reason is not None or later.matched_stop is not None or later.error is not None
                or later.param is not None or later.code is not None or later.status is not None):
            for name in ("finish_reason", "matched_stop", "error", "param", "code", "status"):
                if getattr(later, name) is not None:
                    setattr(self, name, getattr(later, name))
        if later.queue_time is not None:
            self.queue_time = later.queue_time
        self.prompt_tokens = later.prompt_tokens or self.prompt_tokens
        self.completion_tokens = later.completion_tokens
        self.cached_tokens = later.cached_tokens or self.cached_tokens


class _Producer:
    """The producer side every stream shares: the final delta goes out once, whoever ends the
    request, and tells the owner's registry (`on_final`) to forget it."""

    __slots__ = ("rid", "_finished", "on_final")

    def __init__(self, rid: str):
        self.rid = rid
        self._finished = False  # a final delta was pushed
        self.on_final: Callable[[], object] | None = None

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, delta: Delta) -> bool:
        """Queue a delta; False (and nothing queued) once the request has already ended."""
        if self._finished:
            return False
        self._finished = delta.finish_reason is not None
        if self._finished and self.on_final is not None:
            self.on_final()
        self._queue(delta)
        return True

    def finish(self, reason: str, *, error: str | None = None, status: int | None = None, **meta) -> bool:
        return self.push(Delta(rid=self.rid, finish_reason=reason, error=error, status=status, **meta))

    def _queue(self, delta: Delta) -> None:
        raise NotImplementedError


class RequestStream(_Producer):
    """A caller's stream: at most one pending (merged) delta, taken by `next`."""

    __slots__ = ("_pending", "_ready", "_closed")

    def __init__(self, rid: str):
        super().__init__(rid)
        self._pending: Delta | None = None
        self._ready = asyncio.Event()
        self._closed = False  # the reader took the final delta

    def _queue(self, delta: Delta) -> None:
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        self._ready.set()

    async def next(self) -> Delta | None:
        """The next (merged) delta, or None after the final one was taken."""
        if self._closed:
            return None
        await self._ready.wait()
        delta, self._pending = self._pending, None
        self._ready.clear()
        assert delta is not None
        self._closed = delta.finish_reason is not None
        return delta


class StepOutbox:
    """What the engine core process sends next, in the order it was pushed: an entry is either
    one plain token of a request (`tokens[i] >= 0`) or a whole `Delta` (`tokens[i] == RICH`,
    the next of `deltas`). Plain tokens are the common case, a decode step's one new token of a
    request with nothing else to say; they cross as two flat lists instead of a Delta each.
    The first entry schedules `send` for the end of this loop iteration: one message for all
    that the iteration pushed."""

    RICH = -1
    __slots__ = ("rids", "tokens", "deltas", "send")

    def __init__(self, send: Callable[[list[str], list[int], list[Delta]], object]):
        self.rids: list[str] = []
        self.tokens: list[int] = []
        self.deltas: list[Delta] = []
        self.send = send

    def add_tokens(self, rids: list[str], tokens: list[int]) -> None:
        if rids:
            self._schedule()
            self.rids += rids
            self.tokens += tokens

    def add_delta(self, delta: Delta) -> None:
        self._schedule()
        self.rids.append(delta.rid)
        self.tokens.append(self.RICH)
        self.deltas.append(delta)

    def flush(self) -> None:
        if self.rids:
            taken = self.rids, self.tokens, self.deltas
            self.rids, self.tokens, self.deltas = [], [], []
            self.send(*taken)

    def _schedule(self) -> None:
        if not self.rids:
            asyncio.get_running_loop().call_soon(self.flush)


class RemoteStream(_Producer):
    """A request's stream inside the engine core process: its deltas go into the core's
    `StepOutbox` (plain tokens are put there by the OutputProcessor, a step's all together)."""

    __slots__ = ("outbox",)

    def __init__(self, rid: str, outbox: StepOutbox):
        super().__init__(rid)
        self.outbox = outbox

    def _queue(self, delta: Delta) -> None:
        self.outbox.add_delta(delta)
