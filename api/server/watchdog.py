"""`--watchdog-timeout`: a replica that has requests running and finishes no forward step for
that long is hung (a stuck kernel, a deadlocked collective); the server then fails loudly (every
client gets a 500 naming it, the process exits with 1) instead of hanging, as SGLang's does.

It reads the counters the engine already keeps (forward_steps, num_running; with dp_size > 1
each replica's), so it costs nothing on the engine's side.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol


class _Stats(Protocol):
    def stats(self) -> dict[str, Any]: ...


class Watchdog:
    """Progress of each replica; `check` says which one is hung, if any (pure: tests feed it)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._since: dict[int, tuple[Any, float]] = {}  # replica -> (its step count, when it last changed)

    def check(self, stats: dict[str, Any], now: float) -> str | None:
        for replica, counters in enumerate(stats.get("replicas") or [stats]):
            if not counters.get("up", True):
                continue  # a dead replica is the router's business, not a hang
            steps, running = counters.get("forward_steps"), counters.get("num_running", 0)
            last = self._since.get(replica)
            if not running or last is None or last[0] != steps:
                self._since[replica] = (steps, now)
                continue
            if now - last[1] > self.timeout_s:
                where = f"replica {replica}" if "replicas" in stats else "the engine core"
                return (
                    f"watchdog: {where} finished no forward step in {now - last[1]:.0f} s with {running} requests running "
                    f"(--watchdog-timeout {self.timeout_s:g})"
                )
        return None


async def watch(engine: _Stats, timeout_s: float) -> str:
    """Returns why, once a replica is hung; runs until cancelled otherwise."""
    dog = Watchdog(timeout_s)
    period = min(1.0, timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        hung = dog.check(engine.stats(), time.monotonic())
        if hung is not None:
            return hung
