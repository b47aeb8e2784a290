"""What crosses between the frontend process and the engine core process, and how.

Plain data only (ids, sampling fields, deltas, counters): msgspec Structs encoded with msgpack
over ZMQ IPC sockets in a private temporary directory. Two one-way channels, each a PUSH/PULL
pair: requests and aborts go to the core; the core answers with at most one `CoreOutputs` per
loop iteration, carrying every request's part of that step.

Starting: the core process is a fresh interpreter (`python -m api.core.process DIR PID`) that
connects, says `CoreHello`, and is told what to load by one `CoreStart`; then `CoreReady` or
`CoreFailed`.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec

from runtime.config import CoreConfig
from runtime.messages import FlushTarget
from runtime.req import CallerRequest
from runtime.stats import CoreStats
from runtime.stream import Delta


class CoreStart(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The first message to a core process: what to load. `setup`: an encoded `api.core.engine_core.CoreSetup`
    (runtime imports nothing of api); `sys_path`: the frontend's, so that the functions a setup
    names ("module:name") import in the core as they would in the frontend."""

    config: CoreConfig
    setup: bytes | None
    sys_path: list[str]


class CoreRequest(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A validated, tokenized request (the Receiver's checks are done), as the Receiver built it."""

    asked: CallerRequest


class CoreAbort(msgspec.Struct, frozen=True, tag=True, array_like=True):
    rid: str


class CoreFlush(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Drop the prefix cache (or the storage tier's files: `what`); answered by `CoreFlushed`
    with the same ticket."""

    ticket: int
    what: FlushTarget = "cache"


class CoreStatsQuery(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Ask for the counters now (not the last periodic ones); answered by `CoreStatsReport` with the ticket."""

    ticket: int


class CoreShutdown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    pass


ToCore = CoreRequest | CoreAbort | CoreFlush | CoreStatsQuery | CoreShutdown


class CoreHello(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The core process is up and connected: it waits for its `CoreStart`."""


class CoreReady(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The model is loaded: the settings resolved against it, and the limits the Receiver checks."""

    config: CoreConfig
    vocab_size: int
    eos_token_ids: list[int]


class CoreFailed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The core could not start, or crashed; `message` says why."""

    message: str


class CoreOutputs(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A loop iteration's outputs, in order (see `StepOutbox`): entry i is request rids[i]'s
    plain new token tokens[i], or (tokens[i] == StepOutbox.RICH) the next delta of `deltas`."""

    rids: list[str]
    tokens: list[int]
    deltas: list[Delta]


class CoreStatsReport(msgspec.Struct, frozen=True, tag=True, array_like=True):
    stats: CoreStats
    ticket: int | None = None  # the query answered; None: the periodic report


class CoreFlushed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    ticket: int
    done: bool


FromCore = CoreHello | CoreReady | CoreFailed | CoreOutputs | CoreStatsReport | CoreFlushed


@dataclass(frozen=True, slots=True)
class CoreSockets:
    """The two IPC endpoints, in a directory only this engine uses (removed by `remove`)."""

    directory: str

    @classmethod
    def create(cls) -> CoreSockets:
        return cls(tempfile.mkdtemp(prefix="actorserve-"))

    @property
    def to_core(self) -> str:
        return f"ipc://{self.directory}/to_core"

    @property
    def from_core(self) -> str:
        return f"ipc://{self.directory}/from_core"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def exists(self) -> bool:
        return Path(self.directory).exists()
