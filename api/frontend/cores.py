"""What an `Engine` needs from its engine core, wherever that runs: `EngineCores`.

Two kinds stand behind it: `InlineCore`, the core's actors on the caller's own loop (tests,
benchmarks, `--inline-core`), and `Replicas` (api/frontend/replicas.py), one core process per
data-parallel replica reached through `CoreClient`s. The Engine starts the actors it is given,
points its Receiver at the two mailboxes, and never asks which kind it has.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from api.core.engine_core import Core
from runtime.actor import Actor, Mailbox
from runtime.messages import Enqueue, FlushCache, FlushTarget, Wake


class EngineCores(Protocol):
    @property
    def actors(self) -> list[Actor]:
        """The actors the Engine runs beside its Receiver."""

    @property
    def to_policy(self) -> Mailbox[Enqueue | Wake]:
        """Where the Receiver sends requests."""

    @property
    def to_adder(self) -> Mailbox[Wake]:
        """Where the Receiver tells of aborts besides (the same mailbox for core processes)."""

    def stats(self) -> dict[str, Any]:
        """The counters as last known (a core process reports them periodically): the core's
        `CoreStats` (replicas': merged, and each replica's) as a dict."""

    async def current_stats(self) -> dict[str, Any]:
        """The counters as they are now."""

    async def flush_cache(self) -> bool:
        """Drop every cached prefix; False while requests are running."""

    async def clear_storage(self) -> bool:
        """Remove the storage tier's block files; False without a storage tier."""

    async def close(self) -> None:
        """Release what the core holds once its actors are stopped (threads, processes)."""


class InlineCore:
    """The engine core on the caller's loop."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @property
    def actors(self) -> list[Actor]:
        return self.core.actors

    @property
    def to_policy(self) -> Mailbox[Enqueue | Wake]:
        return self.core.policy.mailbox  # type: ignore[return-value]

    @property
    def to_adder(self) -> Mailbox[Wake]:
        return self.core.adder.mailbox  # type: ignore[return-value]

    def stats(self) -> dict[str, Any]:
        return self.core.stats().as_dict()

    async def current_stats(self) -> dict[str, Any]:
        return self.core.stats().as_dict()

    async def flush_cache(self) -> bool:
        return await self._flush("cache")

    async def clear_storage(self) -> bool:
        return await self._flush("storage")

    async def _flush(self, what: FlushTarget) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if not await self.core.adder.send(FlushCache(done, what)):
            return False
        return await done

    async def close(self) -> None:
        self.core.executor.shutdown()
