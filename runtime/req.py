"""`Req`: one request as it moves between actors, by reference, inside one process.

Three records, each with its owners:
- `req.asked` (`CallerRequest`) is what the caller asked (prompt, sampling, priority, ...), built
  by the Receiver and frozen: no actor can change it, and it crosses to a core process as it is.
- `req.sched` (`SchedState`) is the core's scheduling and KV state: the Adder's, but for the
  abort flag and enqueue time (Receiver) and the grammar constraint (Policy).
- `req.out` (`OutputState`) is what was generated and what the stream still owes: the
  OutputProcessor's (the `CoreClient`'s in a core process's frontend).

An actor reads another's record only after a message handed the request over. A request ends
in one place, `end_request`, whichever actor ends it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from runtime.sampling_params import SamplingParams
from runtime.service import ServiceClass
from runtime.stream import Delta, RemoteStream, RequestStream

if TYPE_CHECKING:
    import torch

    from runtime.detokenize import IncrementalDetokenizer


@dataclass(slots=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended the request
    message: str | None = None  # why an abort happened
    status: int | None = None  # for aborts the client did not ask for: 400 (refused), 503 (queue), 500 (engine)
    code: str | None = None  # machine-readable, e.g. queue_timeout
    param: str | None = None  # the request field a refusal is about


def token_finish(
    params: SamplingParams, num_output: int, new_token: int, eos_token_ids: Sequence[int], final: bool
) -> FinishReason | None:
    """Token-based finish after `new_token`, the `num_output`-th output token; `final`: the Adder
    launched it as the request's last allowed one (its max_new_tokens-th). SGLang's order:
    length first, then (from the min_new_tokens-th token on) stop token ids, then EOS."""
    if final:
        return FinishReason("length")
    if num_output < params.min_new_tokens:
        return None
    if new_token in params.stop_token_ids:
        return FinishReason("stop", matched=new_token)
    if not params.ignore_eos and new_token in eos_token_ids:
        return FinishReason("stop", matched=new_token)
    return None


@dataclass(slots=True)
class Constraint:
    """A request's grammar matcher (actors/grammar.py builds and advances it), and the tokens a
    grammar never allows (special tokens that are not end-of-sequence: xgrammar lets some
    through, and then refuses them)."""

    matcher: Any  # xgrammar.GrammarMatcher
    never: torch.Tensor  # token ids
    eos: torch.Tensor  # token ids


@dataclass(slots=True)
class SchedState:
    """The core's scheduling and KV state of one request. The Adder writes it (its KV through the
    Adder's KVLedger), except `enqueue_time` and `abort_requested` (the Receiver, at arrival and
    on an abort) and `constraint` (the Policy, once the grammar compiled; after that only the
    Executor's forward thread advances it). A core process's frontend writes none of it but the
    abort flag: what the core reports of the request is in `OutputState`."""

    enqueue_time: float = 0.0  # reset by the Adder when it requeues a preempted or retracted request
    # The flag travels with the request, so whoever holds it sees the abort without a message.
    abort_requested: bool = False
    constraint: Constraint | None = None
    req_row: int | None = None  # its row of the request-to-token table holds its KV slots
    cached_tokens: int = 0  # prefix hits reported to the user (first admission)
    admitted_time: float | None = None  # first admission (monotonic); queue time = this - arrival_time
    computed_len: int = 0  # tokens whose KV is (or will be, once launched) in the pool
    launched_outputs: int = 0  # output tokens that launched steps will produce
    last_step: int = -1  # the latest launched step that includes this request
    # A storage-tier read started when it was queued (cache.storage_tier.Prefetch): the Policy
    # sets it, the Adder takes it at the first admission attempt.
    prefetch: object | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """A request's first admission, as its stream reports it."""

    cached_tokens: int  # prompt tokens served from the prefix cache
    queue_time: float  # seconds from arrival


@dataclass(slots=True)
class OutputState:
    """What the request produced and what its stream still owes: written by the OutputProcessor
    (or, in a core process's frontend, the `CoreClient`); `finish_reason` only by `end_request`."""

    # Set once: from the Adder's record when the first delta is described (the core), from the
    # core's first delta (the frontend).
    admission: Admission | None = None

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt tokens logprob_start_len, logprob_start_len + 1, ...; None for token 0 (no context).
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    detokenizer: IncrementalDetokenizer | None = None
    end_token_ids: frozenset[int] | None = None  # stop token ids and EOS, gathered at the first token
    # Core process: a token that is neither an end token nor the last allowed one ends nothing
    # and carries nothing but itself (see OutputProcessor._decode_step).
    plain: bool = False
    unsent: Delta | None = None  # tokens/text held back by stream_interval


class CallerRequest(msgspec.Struct, frozen=True, array_like=True):
    """What the caller asked, validated and tokenized: built once by the Receiver and sent as-is
    to a core process (runtime/ipc.py's `CoreRequest` carries it). No actor changes it."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    routing_key: str | None = None
    extra_key: str | None = None
    service: ServiceClass = ServiceClass()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: logprobs of the prompt tokens from there on are wanted
    arrival_time: float = 0.0  # time.monotonic(): one clock for every process of the machine


class Req(msgspec.Struct, frozen=True, eq=False):
    """One request inside one process: what the caller asked (`asked`), where its outputs go, and
    the state each side keeps of it (`sched`, `out`)."""

    asked: CallerRequest
    stream: RequestStream | RemoteStream | None = None  # RemoteStream: in the core process
    # asked.input_ids as the prefix cache's array('i'), encoded once on arrival: ordering a
    # burst of long prompts would otherwise spend most of its round encoding them.
    prompt_key: array | None = None
    sched: SchedState = msgspec.field(default_factory=SchedState)
    out: OutputState = msgspec.field(default_factory=OutputState)

    @property
    def rid(self) -> str:
        return self.asked.rid

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, prompt={len(self.asked.input_ids)}, out={len(self.out.output_ids)}, row={self.sched.req_row})"

    @property
    def fill_ids(self) -> list[int]:
        return self.asked.input_ids + self.out.output_ids

    @property
    def input_logprobs_pending(self) -> bool:
        """Prompt logprobs are wanted and not all computed yet: the prompt from
        logprob_start_len - 1 on must be computed, not served from the prefix cache."""
        start = self.asked.logprob_start_len
        return start >= 0 and len(self.out.input_logprobs) < len(self.asked.input_ids) - start

    @property
    def seq_len(self) -> int:
        return len(self.asked.input_ids) + len(self.out.output_ids)

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None

    @property
    def max_new_tokens(self) -> int:
        return self.asked.sampling.max_new_tokens

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.asked.sampling.max_new_tokens - len(self.out.output_ids))


def end_request(req: Req, reason: FinishReason, final: Delta | None = None) -> None:
    """End `req`, from whichever actor holds it: `finish_reason` is the one record that it
    ended, and the stream gets its final delta (`final`, or an empty one) with the usage so far.
    A request that already ended stays as it was."""
    if req.out.finish_reason is not None:
        return
    req.out.finish_reason = reason
    req.out.detokenizer = None
    if req.stream is None:
        return
    delta = final if final is not None else Delta(rid=req.rid)
    delta.finish_reason, delta.matched_stop = reason.kind, reason.matched
    delta.error, delta.status, delta.code, delta.param = reason.message, reason.status, reason.code, reason.param
    describe(req, delta)
    req.stream.push(delta)


def reason_of(final: Delta) -> FinishReason:
    """The finish reason a final delta carries (what `end_request` wrote into it on the other
    side of the process boundary)."""
    assert final.finish_reason is not None
    return FinishReason(final.finish_reason, final.matched_stop, final.error, final.status, final.code, final.param)


def mark_aborted(req: Req) -> bool:
    """The caller gave `req` up: set the flag its holder reads (the Receiver's side, in either
    process). False when it was set already, so the holder is told once."""
    if req.sched.abort_requested:
        return False
    req.sched.abort_requested = True
    return True


def describe(req: Req, delta: Delta) -> None:
    """What every delta says about its request (SGLang's meta_info shows it in every chunk)."""
    delta.completion_tokens = len(req.out.output_ids)
    delta.prompt_tokens = len(req.asked.input_ids)
    if req.out.admission is None and req.sched.admitted_time is not None:  # the core: the Adder admitted it
        req.out.admission = Admission(req.sched.cached_tokens, req.sched.admitted_time - req.asked.arrival_time)
    if req.out.admission is not None:
        delta.cached_tokens, delta.queue_time = req.out.admission.cached_tokens, req.out.admission.queue_time
