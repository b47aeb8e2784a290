"""`Req`: the state of one request as it moves between actors.

A `Req` travels by reference inside one process. Each field has one writer; the others only read
it, and only after a message handed the request over:

| fields | written by |
| --- | --- |
| rid, origin_input_ids, prompt_key, sampling, priority, routing_key, extra_key, service, return_logprob, top_logprobs_num, logprob_start_len, arrival_time, stream | Receiver (before the first message; never changed after) |
| abort_requested | Receiver (the flag travels with the request, so whoever holds it sees it) |
| enqueue_time | Receiver (and Adder when it requeues a preempted or retracted request) |
| req_row, cached_tokens, admitted_time, computed_len, launched_outputs, last_step | Adder (the KV of its row: the Adder's KVLedger) |
| output_ids, output_logprobs, output_top_logprobs, input_logprobs, input_top_logprobs, finish_reason, detokenizer, end_token_ids, plain_below, unsent | OutputProcessor (Adder sets finish_reason only for aborts it performs) |
| constraint | Policy (before the request joins the queue; after that only the Executor's thread advances it) |

In the frontend of a core process (api/core_client.py) the core's actors are elsewhere: the
`CoreClient` writes output_ids, cached_tokens, admitted_time and detokenizer from the core's outputs.

`fill_ids` (prompt + generated tokens) is derived, never stored.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


from runtime.sampling_params import SamplingParams
from runtime.service import ServiceClass
from runtime.stream import Delta, RemoteStream, RequestStream

if TYPE_CHECKING:
    from actors.detokenizer import IncrementalDetokenizer
    from actors.grammar import Constraint


@dataclass(slots=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended the request
    message: str | None = None  # why an abort happened
    status: int | None = None  # for aborts the client did not ask for: 400 (refused), 503 (queue), 500 (engine)
    code: str | None = None  # machine-readable, e.g. queue_timeout
    param: str | None = None  # the request field a refusal is about


def token_finish(
    params: SamplingParams, num_output: int, new_token: int, eos_token_ids: Sequence[int]
) -> FinishReason | None:
    """Token-based finish after `new_token`, the `num_output`-th output token. SGLang's order:
    length first, then (from the min_new_tokens-th token on) stop token ids, then EOS."""
    if num_output >= params.max_new_tokens:
        return FinishReason("length")
    if num_output < params.min_new_tokens:
        return None
    if new_token in params.stop_token_ids:
        return FinishReason("stop", matched=new_token)
    if not params.ignore_eos and new_token in eos_token_ids:
        return FinishReason("stop", matched=new_token)
    return None


@dataclass(slots=True, eq=False, repr=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    routing_key: str | None = None
    extra_key: str | None = None
    service: ServiceClass = ServiceClass()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: logprobs of the prompt tokens from there on are wanted
    arrival_time: float = 0.0
    enqueue_time: float = 0.0
    stream: RequestStream | RemoteStream | None = None  # RemoteStream: in the core process
    abort_requested: bool = False
    # origin_input_ids as the prefix cache's array('i'), encoded once on arrival: ordering a
    # burst of long prompts would otherwise spend most of its round encoding them.
    prompt_key: array | None = None

    # Adder
    req_row: int | None = None  # its row of the request-to-token table holds its KV slots
    cached_tokens: int = 0  # prefix hits reported to the user (first admission)
    admitted_time: float | None = None  # first admission (monotonic); queue time = this - arrival_time
    computed_len: int = 0  # tokens whose KV is (or will be, once launched) in the pool
    launched_outputs: int = 0  # output tokens that launched steps will produce
    last_step: int = -1  # the latest launched step that includes this request

    # OutputProcessor
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt tokens logprob_start_len, logprob_start_len + 1, ...; None for token 0 (no context).
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # Per-request output state lives on the request, so it ends with it whoever ends it.
    detokenizer: IncrementalDetokenizer | None = None
    end_token_ids: frozenset[int] | None = None  # stop token ids and EOS, gathered at the first token
    # Core process: while fewer outputs than this, a token that is not an end token ends
    # nothing and carries nothing but itself (see OutputProcessor._decode_step); 0: never.
    plain_below: int = 0
    unsent: Delta | None = None  # tokens/text held back by stream_interval
    # Constrained decoding: set by the Policy once the grammar compiled, then used only by the
    # Executor's forward thread (actors/grammar.py).
    constraint: Constraint | None = None

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, row={self.req_row})"

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def input_logprobs_pending(self) -> bool:
        """Prompt logprobs are wanted and not all computed yet: the prompt from
        logprob_start_len - 1 on must be computed, not served from the prefix cache."""
        return self.logprob_start_len >= 0 and len(self.input_logprobs) < len(self.origin_input_ids) - self.logprob_start_len

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling.max_new_tokens - len(self.output_ids))


def end_request(req: Req, reason: FinishReason, final: Delta | None = None) -> None:
    """End `req`, from whichever actor holds it: `finish_reason` is the one record that it
    ended, and the stream gets its final delta (`final`, or an empty one) with the usage so far.
    A request that already ended stays as it was."""
    if req.finish_reason is not None:
        return
    req.finish_reason = reason
    req.detokenizer = None
    if req.stream is None:
        return
    delta = final if final is not None else Delta(rid=req.rid)
    delta.finish_reason, delta.matched_stop = reason.kind, reason.matched
    delta.error, delta.status, delta.code, delta.param = reason.message, reason.status, reason.code, reason.param
    describe(req, delta)
    req.stream.push(delta)


def describe(req: Req, delta: Delta) -> None:
    """What every delta says about its request (SGLang's meta_info shows it in every chunk)."""
    delta.completion_tokens = len(req.output_ids)
    delta.prompt_tokens = len(req.origin_input_ids)
    delta.cached_tokens = req.cached_tokens
    if req.admitted_time is not None:
        delta.queue_time = req.admitted_time - req.arrival_time
