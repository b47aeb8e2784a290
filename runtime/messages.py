"""The messages between actors, one tagged union per mailbox.

    Receiver  <- Submit | AbortRequest
    Policy    <- Enqueue | Pull | Requeue | Wake | Served | GrammarCompiled (from itself)
    Adder     <- Ranked | StepDone | Wake | FlushCache
    Executor  <- Batch
    Output    <- StepOut

All of these stay inside one process (the core's, or the Engine's when the core runs inline):
`Req` objects travel by reference (runtime/req.py says who writes which record), device tensors
ride along in `Batch`, `FlushCache` carries a Future. What crosses to a core process is runtime/ipc.py's messages
instead: plain data, encoded with msgspec (a `CoreRequest` is a `Req`'s caller record).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
import torch

from runtime.forward_mode import ForwardMode
from runtime.req import Req
from runtime.service import ServiceClass
from runtime.stream import RequestStream


class GenerateSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A request as a caller states it, before validation and tokenization."""

    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    # SamplingParams fields; "max_new_tokens": None asks for as many as the context leaves.
    sampling: dict[str, Any] = {}
    priority: int | None = None
    routing_key: str | None = None
    extra_key: str | None = None
    service: ServiceClass = ServiceClass()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: logprobs of the prompt tokens from this position on (-1: none).
    logprob_start_len: int = -1


class Submit(msgspec.Struct, frozen=True, tag=True):
    spec: GenerateSpec
    stream: RequestStream


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    rid: str


class Enqueue(msgspec.Struct, frozen=True, tag=True):
    req: Req


class Pull(msgspec.Struct, frozen=True, tag=True):
    """The Adder asks for candidates; `block`: answer only once something is waiting."""

    max_reqs: int
    running_routing_keys: dict[str, int]
    block: bool
    # Every request row is taken: only a request that may preempt a running one of this
    # priority (the least important) is worth sending; the others stay queued (and evictable).
    preempt_priority: int | None = None
    # Prompt tokens per second the device prefills (measured on recent prefill steps; None
    # until one ran): the Policy's deadline feasibility estimate.
    prefill_tokens_per_s: float | None = None
    # Also for that estimate: KV slots free or evictable now, and seconds until the first running
    # request is expected to leave (its remaining steps at the measured decode step time; None
    # until a decode step was timed or while nothing runs).
    kv_free: int = 0
    first_exit_s: float | None = None


class Served(msgspec.Struct, frozen=True, tag=True):
    """Tokens one step generated, per tenant (sent by the Adder only with fairness on)."""

    tokens: dict[str, int]


class Requeue(msgspec.Struct, frozen=True, tag=True):
    reqs: list[Req]
    front: bool  # candidates not admitted go back in front; preempted/retracted ones at the end


class GrammarCompiled(msgspec.Struct, frozen=True, tag=True):
    """A request's grammar compiled (or failed to) in the Policy's compile thread."""

    req: Req
    compiled: Any  # actors.grammar.Compiled


class Wake(msgspec.Struct, frozen=True, tag=True):
    """Something changed for a request this actor may hold (an abort): look again. `rid` names
    the request for a peer in another process, which cannot see the shared flag."""

    rid: str | None = None


class Ranked(msgspec.Struct, frozen=True, tag=True):
    reqs: list[Req]  # best first; the Adder now owns them and returns the ones it does not admit
    num_waiting: int  # still queued at the Policy after these


class StepDone(msgspec.Struct, frozen=True, tag=True):
    step: int
    finished: list[Req]
    prefill_tokens: int = 0  # prompt tokens the step computed (decode rows not counted)
    forward_s: float = 0.0  # the device's time for the step


FlushTarget = Literal["cache", "storage"]


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    done: asyncio.Future
    # "cache": drop the prefix cache (refused while requests run); "storage": remove the storage
    # tier's block files (SGLang's /clear_hicache_storage_backend; refused without a storage tier).
    what: FlushTarget = "cache"


class StorageBlock(msgspec.Struct, frozen=True):
    """A host-tier block's name in the storage tier (cache/storage_tier.py): its chain key and
    its token ids as int32 bytes."""

    key: bytes
    tokens: bytes


class KVCopy(msgspec.Struct, frozen=True):
    """One copy between the device KV pool and the host tier's (cache/host_tier.py), done by the
    Executor before the forward of the batch that carries it, in the order given."""

    to_host: bool
    device_slots: torch.Tensor
    host_slots: torch.Tensor
    # After this copy to the host, also write the block to the storage tier (off the step).
    persist: StorageBlock | None = None
    # A block read from the storage tier: fills `host_slots` from this ([2 x layers, tokens,
    # heads, dim]) instead of the device (`device_slots` is empty).
    staged: torch.Tensor | None = None


class Batch(msgspec.Struct, frozen=True, tag=True):
    """One forward step. Decode rows carry no token values: the Executor reads them from its
    token pool at (row, position), so this batch can launch before the previous step's tokens
    reach the host."""

    step: int
    mode: ForwardMode
    reqs: list[Req]
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    extend_ids: list[list[int] | None]  # None: a decode row, its one input id is in the token pool
    out_cache_loc: torch.Tensor
    produces_token: list[bool]  # False for a chunk that does not end its prompt
    # True where the step launches the row's last allowed output token (its max_new_tokens-th):
    # the Adder decides it when it launches the step, the OutputProcessor ends the request with
    # "length" on that token (SGLang checks length first).
    final_token: list[bool]
    kv_copies: list[KVCopy] = []  # host tier stores and loads to do first


class InputLogprobs(msgspec.Struct, frozen=True):
    """Logprobs of prompt tokens start .. start + len(logprobs) - 1, computed by one step."""

    start: int
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


class StepOut(msgspec.Struct, frozen=True, tag=True):
    batch: Batch
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    forward_s: float  # seconds the worker spent on this step
    # Per batch row, for requests that asked for prompt logprobs; None when no row did.
    input_logprobs: list[InputLogprobs | None] | None = None


ReceiverMsg = Submit | AbortRequest
PolicyMsg = Enqueue | Pull | Requeue | Wake | GrammarCompiled | Served
AdderMsg = Ranked | StepDone | Wake | FlushCache
