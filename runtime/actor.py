"""The actor base: a bounded mailbox, a run loop, an orderly stop and failure reporting.

An actor owns its state and changes it only inside `handle`, one message at a time, on the event
loop thread. A full mailbox makes `send` wait: that is how backpressure travels from the device
back to admission. If `handle` raises, the actor stops and the `on_exit` callback given to
`start` hears about it; the Engine then fails every in-flight request (nothing hangs).

Mailboxes exist before the actors: whoever wires actors together creates every mailbox first
and hands each actor its own (`inbox`) and its peers' at construction, so the edges between
actors are all in one place (api/core/engine_core.py, api/frontend/engine.py) and a test can drive one actor by
calling `handle` and reading its peers' mailboxes.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import msgspec

M = TypeVar("M")

DEFAULT_MAILBOX_SIZE = 1024


class Stop(msgspec.Struct, frozen=True):
    """Ends an actor's loop once the messages sent before it are handled (a drain)."""


ExitCallback = Callable[["Actor", BaseException | None], None]


class HandleObserver(Protocol):
    """Sees every message an actor handles (how benchmarks time the actors from outside).
    Called on the loop thread: `before` right before `handle`, `after` once it returned (not when
    it raised), with the loop thread's CPU seconds and the wall seconds spent in it."""

    def before(self, actor: Actor, msg: object) -> None: ...

    def after(self, actor: Actor, msg: object, cpu_s: float, wall_s: float) -> None: ...


class Mailbox(Generic[M]):
    """One actor's bounded queue of messages; its peers hold it to send."""

    def __init__(self, size: int = DEFAULT_MAILBOX_SIZE):
        self._queue: asyncio.Queue[M | Stop] = asyncio.Queue(size)
        self._closed = asyncio.Event()  # the actor stopped: nothing sent now will be handled

    async def send(self, msg: M) -> bool:
        """Queue `msg`, waiting while the mailbox is full. False if it was closed first: then the
        message was not queued and no one will handle it."""
        if self._closed.is_set():
            return False
        if not self._queue.full():
            self._queue.put_nowait(msg)
            return True
        put = asyncio.ensure_future(self._queue.put(msg))
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait((put, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            put.cancel()
            closed.cancel()
        return put.done() and not put.cancelled()

    def put_nowait(self, msg: M | Stop) -> None:
        self._queue.put_nowait(msg)

    def get_nowait(self) -> M | Stop:
        return self._queue.get_nowait()

    async def get(self) -> M | Stop:
        return await self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()

    def qsize(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        self._closed.set()

    def reopen(self) -> None:
        self._closed.clear()


class Actor(ABC, Generic[M]):
    def __init__(self, name: str, inbox: Mailbox[M] | None = None):
        self.name = name
        self.mailbox: Mailbox[M] = inbox if inbox is not None else Mailbox()
        self._tasks: list[asyncio.Task[None]] = []
        self._on_exit: ExitCallback | None = None
        # CPU seconds of the loop thread inside `handle` (what this actor costs; includes other
        # tasks that ran while a handle awaited, which the actors' handles rarely do).
        self.cpu_s = 0.0
        self.observer: HandleObserver | None = None  # settable at any time; None costs nothing

    @abstractmethod
    async def handle(self, msg: M) -> None:
        """Handle one message; may send messages to other actors."""

    async def send(self, msg: M) -> bool:
        return await self.mailbox.send(msg)

    def start(self, on_exit: ExitCallback) -> None:
        self._on_exit = on_exit
        self.mailbox.reopen()
        self.spawn(self._run(), "loop")

    def spawn(self, coro, what: str) -> asyncio.Task[None]:
        """Run a helper coroutine that belongs to this actor: its failure is the actor's failure."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}.{what}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        return task

    @property
    def alive(self) -> bool:
        return any(not t.done() for t in self._tasks)

    async def stop(self, drain: bool = True, timeout: float = 5.0) -> None:
        """Drain (handle what is queued, then stop) or cancel; never leaves a task behind.
        Senders still waiting for room in the mailbox are released (their `send` is False)."""
        self.mailbox.close()
        if drain and self.alive:
            try:
                self.mailbox.put_nowait(Stop())
            except asyncio.QueueFull:
                drain = False
        if drain:
            await asyncio.wait([t for t in self._tasks if not t.done()] or [asyncio.sleep(0)], timeout=timeout)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def on_stop(self) -> None:
        """Called once when the loop ends by a drain; subclasses release what they hold."""

    async def _run(self) -> None:
        while True:
            msg = await self.mailbox.get()
            if isinstance(msg, Stop):
                await self.on_stop()
                return
            observer = self.observer
            if observer is None:
                start = time.thread_time()
                await self.handle(msg)
                self.cpu_s += time.thread_time() - start
            else:
                await self._observed(observer, msg)

    async def _observed(self, observer: HandleObserver, msg: M) -> None:
        observer.before(self, msg)
        wall, start = time.perf_counter(), time.thread_time()
        await self.handle(msg)
        cpu_s, wall_s = time.thread_time() - start, time.perf_counter() - wall
        self.cpu_s += cpu_s
        observer.after(self, msg, cpu_s, wall_s)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and self._on_exit is not None:
            self._on_exit(self, error)
