"""The frontend's engine cores: one per data-parallel replica (`dp_size`), each a process with
its own KV pool, prefix cache and scheduler, and the router that picks one per request.

`Replicas` owns the `CoreClient`s, the `Router` and which replica holds each request. A replica
that dies ends its own requests with an error and is taken out of the rotation; the others keep
serving. The engine fails only when no replica is left.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import msgspec

from api.core.engine_core import CoreSetup
from api.frontend.core_client import CoreClient
from api.router.routing import NoHealthyReplica, Router
from runtime.actor import Actor, Mailbox
from runtime.config import EngineConfig
from runtime.ipc import CoreReady
from runtime.messages import Enqueue, Wake
from runtime.req import FinishReason, Req, end_request
from runtime.stats import CoreStats, merged


class Replicas:
    def __init__(self, config: EngineConfig, tokenizer: Any, on_failure: Callable[[str], None], setup: CoreSetup | None = None):
        self.config = config
        self.on_failure = on_failure
        self.router = Router(
config.router(), config.dp_size
        )
        self.clients = [
            CoreClient(
                _replica_config(config, i), tokenizer, self._failed_callback(i), setup,
                on_tokens=self._tokens_callback(i), on_end=self._end_callback(i),
            )
            for i in range(config.dp_size)
        ]
        self.owner: dict[str, int] = {}  # rid -> the replica that holds it
        self.failures: dict[int, str] = {}  # replica -> why it is down
        self._closing: list[asyncio.Task[None]] = []
        self.link = CoreLink(self)

    # --- api/frontend/cores.py's EngineCores ----------------------------------------------------
    @property
    def actors(self) -> list[Actor]:
        return [self.link]

    @property
    def to_policy(self) -> Mailbox[Enqueue | Wake]:
        return self.link.mailbox

    @property
    def to_adder(self) -> Mailbox[Wake]:
        return self.link.mailbox  # type: ignore[return-value]

    async def start(self) -> CoreReady:
        """Start every replica at once; all must come up (a failure closes the others)."""
        results = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
            prefix = "" if len(self.clients) == 1 else f"replica {results.index(errors[0])}: "
            raise RuntimeError(f"{prefix}{errors[0]}") from errors[0]
        first = results[0]
        assert isinstance(first, CoreReady)
        # The replicas resolved the same model and limits; only core_threads and device differ.
        return first

    def submit(self, req: Req) -> None:
        try:
            replica = self.router.choose(req.asked.input_ids, req.asked.routing_key)
        except NoHealthyReplica:
            end_request(req, FinishReason("abort", message="no engine replica is serving", status=500))
            return
        self.owner[req.rid] = replica
        self.router.started(replica, len(req.asked.input_ids))
        self.clients[replica].submit(req)

    def abort(self, rid: str) -> None:
        replica = self.owner.get(rid)
        if replica is not None:
            self.clients[replica].abort(rid)

    async def clear_storage(self) -> bool:
        """Every live replica removes its storage-tier files (replicas may share a directory)."""
        return all(await asyncio.gather(*(c.clear_storage() for c in self._up())))

    async def flush_cache(self) -> bool:
        """Every live replica drops its prefix cache; False if any was busy."""
        done = await asyncio.gather(*(c.flush_cache() for c in self._up()))
        if all(done):
            for i in self._up_indices():
                self.router.tree.drop_replica(i)
        return all(done)

    def stats(self) -> dict[str, Any]:
        return self._merge([c.stats for c in self.clients])

    async def current_stats(self) -> dict[str, Any]:
        fresh = await asyncio.gather(*(c.current_stats() for c in self._up()))
        latest = dict(zip(self._up_indices(), fresh))
        return self._merge([latest.get(i) or c.stats for i, c in enumerate(self.clients)])

    async def close(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    # --- internals ----------------------------------------------------------------------------
    def _up_indices(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self.failures]

    def _up(self) -> list[CoreClient]:
        return [self.clients[i] for i in self._up_indices()]

    def _merge(self, per_replica: list[CoreStats | None]) -> dict[str, Any]:
        """The engine's counters (the replicas' merged) as a dict, with each replica's own."""
        reports = [s.as_dict() if s is not None else {} for s in per_replica]
        if len(per_replica) == 1:
            return reports[0]
        up = [s for i, s in enumerate(per_replica) if i not in self.failures and s is not None]
        engine = merged(up).as_dict() if up else {}
        engine["dp_size"] = len(per_replica)
        engine["replicas"] = [
            {"replica": i, "up": i not in self.failures, "failure": self.failures.get(i), **report} for i, report in enumerate(reports)
        ]
        return engine

    def _failed_callback(self, replica: int) -> Callable[[str], None]:
        def failed(message: str) -> None:
            self.failures[replica] = message
            self.router.set_healthy(replica, False)
            if len(self.failures) == len(self.clients):
                self.on_failure(message if len(self.clients) == 1 else f"every replica is down; replica {replica}: {message}")
            else:  # reap it now; the others keep serving
                self._closing.append(asyncio.get_running_loop().create_task(self.clients[replica].close()))

        return failed

    def _tokens_callback(self, replica: int) -> Callable[[int], None]:
        return lambda n: self.router.progressed(replica, n)

    def _end_callback(self, replica: int) -> Callable[[Req], None]:
        def ended(req: Req) -> None:
            if self.owner.pop(req.rid, None) is not None:
                self.router.finished(replica, len(req.asked.input_ids) + len(req.out.output_ids))

        return ended


class CoreLink(Actor[Enqueue | Wake]):
    """Where the Receiver's requests and aborts leave for the core processes."""

    def __init__(self, replicas: Replicas):
        super().__init__("core-link")
        self.replicas = replicas

    async def handle(self, msg: Enqueue | Wake) -> None:
        if isinstance(msg, Enqueue):
            self.replicas.submit(msg.req)
        elif msg.rid is not None:
            self.replicas.abort(msg.rid)


def _replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """One replica's config: its processes' share of the CPU's threads, its own GPUs (tp_size of
    them, from cuda:replica*tp_size), its own rendezvous port."""
    processes = config.dp_size * config.tp_size
    if processes == 1:
        return config
    changes: dict[str, Any] = {}
    if config.core_threads is None:
        changes["core_threads"] = max(1, (os.cpu_count() or 1) // processes)
    if config.device == "cuda":
        changes["device"] = f"cuda:{replica * config.tp_size}"
    if config.dist_init_addr is not None and replica:
        host, _, port = config.dist_init_addr.rpartition(":")
        changes["dist_init_addr"] = f"{host}:{int(port) + replica}"
    return msgspec.structs.replace(config, **changes)
