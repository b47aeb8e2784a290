"""The runtime's injection points, driven directly: an Executor on a test-double StepRunner,
and an Actor's HandleObserver. Every wait is on a message or a future, never a sleep."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest
import torch

from actors.executor import Executor
from runtime.actor import Actor, ExitCallback, Mailbox
from runtime.forward_mode import ForwardMode
from runtime.messages import Batch, StepOut


def decode_batch(step: int, rows: list[int]) -> Batch:
    n = len(rows)
    return Batch(step=step, mode=ForwardMode.DECODE, reqs=[], rows=rows, prefix_lens=[8] * n, extend_lens=[1] * n,
                 extend_ids=[None] * n, out_cache_loc=torch.zeros(n, dtype=torch.int64), produces_token=[True] * n, final_token=[False] * n)


def out_of(batch: Batch) -> StepOut:
    """What the double's device samples: a pure function of the batch."""
    return StepOut(batch=batch, token_ids=[100 * batch.step + r for r in batch.rows], logprobs=None, top_logprobs=None, forward_s=0.5)


@dataclass
class Later:
    """A PendingStep, as the CUDA path returns: its result reaches the loop once `ready` is set."""

    out: StepOut
    ready: asyncio.Event

    async def result(self) -> StepOut:
        await self.ready.wait()
        return self.out


@dataclass
class DoubleDevice:
    """A StepRunner: steps in `pending` come back as a Later, a step in `failing` raises. Each
    step run is announced on `ran`, from the worker thread to the loop."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pending: set[int] = field(default_factory=set)
    failing: set[int] = field(default_factory=set)
    ran: asyncio.Queue[tuple[int, str]] = field(default_factory=asyncio.Queue)
    closed: bool = False

    def run(self, batch: Batch) -> StepOut | Later:
        self.loop.call_soon_threadsafe(self.ran.put_nowait, (batch.step, threading.current_thread().name))
        if batch.step in self.failing:
            raise RuntimeError(f"step {batch.step} failed on the device")
        out = out_of(batch)
        return Later(out, self.ready) if batch.step in self.pending else out

    def close(self) -> None:
        self.closed = True


def exit_future() -> tuple[asyncio.Future[BaseException | None], ExitCallback]:
    done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def on_exit(actor: Actor, error: BaseException | None) -> None:
        if not done.done():
            done.set_result(error)

    return done, on_exit


def executor_on(device: DoubleDevice) -> tuple[Executor, Mailbox[Batch], Mailbox[StepOut]]:
    inbox: Mailbox[Batch] = Mailbox()
    output: Mailbox[StepOut] = Mailbox()
    return Executor(device, inbox=inbox, output=output), inbox, output


async def test_executor_reports_a_double_devices_steps_in_launch_order() -> None:
    """A step whose result comes late (a launched CUDA step) holds back the steps after it."""
    device = DoubleDevice(asyncio.get_running_loop(), pending={0})
    executor, inbox, output = executor_on(device)
    crashed, on_exit = exit_future()
    executor.start(on_exit)
    batches = [decode_batch(step, [step, step + 1]) for step in range(3)]
    for b in batches:
        assert await inbox.send(b)
    ran = [await device.ran.get() for _ in batches]
    assert [step for step, _ in ran] == [0, 1, 2]
    assert {thread for _, thread in ran} == {"actorserve-forward_0"}  # one worker thread, in launch order
    assert output.empty()  # steps 1 and 2 are done, step 0's result is not: nothing passes it
    device.ready.set()
    assert [await output.get() for _ in batches] == [out_of(b) for b in batches]
    assert executor.steps == 3 and executor.forward_s == pytest.approx(1.5)
    await executor.stop()
    executor.shutdown(wait=True)
    assert device.closed and not crashed.done()


async def test_a_failing_step_stops_the_executor_and_reports_the_error() -> None:
    device = DoubleDevice(asyncio.get_running_loop(), failing={1})
    executor, inbox, output = executor_on(device)
    crashed, on_exit = exit_future()
    executor.start(on_exit)
    for step in range(2):
        assert await inbox.send(decode_batch(step, [0]))
    assert await output.get() == out_of(decode_batch(0, [0]))
    error = await crashed
    assert isinstance(error, RuntimeError) and "step 1 failed" in str(error)
    await executor.stop(drain=False)
    executor.shutdown(wait=True)
    assert device.closed


class Recorder(Actor[str]):
    """Logs each message it handles into `events` and announces it on `handled`."""

    def __init__(self, events: list[str]):
        super().__init__("recorder")
        self.events = events
        self.handled: asyncio.Queue[str] = asyncio.Queue()

    async def handle(self, msg: str) -> None:
        if msg == "raise":
            raise ValueError("bad message")
        self.events.append(f"handle {msg}")
        self.handled.put_nowait(msg)


@dataclass
class Observer:
    events: list[str]
    times: list[tuple[float, float]] = field(default_factory=list)

    def before(self, actor: Actor, msg: object) -> None:
        self.events.append(f"before {actor.name}.{msg}")

    def after(self, actor: Actor, msg: object, cpu_s: float, wall_s: float) -> None:
        self.events.append(f"after {actor.name}.{msg}")
        self.times.append((cpu_s, wall_s))


async def test_an_observer_sees_each_handle_from_outside() -> None:
    events: list[str] = []
    actor = Recorder(events)
    observer = Observer(events)
    crashed, on_exit = exit_future()
    actor.observer = observer
    actor.start(on_exit)
    for msg in ("a", "b"):
        await actor.send(msg)
        assert await actor.handled.get() == msg
    await actor.send("c")  # queued without yielding to the actor
    actor.observer = None  # read as each message is taken: "c" is handled unobserved
    assert await actor.handled.get() == "c"
    assert events == ["before recorder.a", "handle a", "after recorder.a", "before recorder.b", "handle b", "after recorder.b", "handle c"]
    assert len(observer.times) == 2 and all(cpu >= 0 and wall >= 0 for cpu, wall in observer.times)
    assert actor.cpu_s >= sum(cpu for cpu, _ in observer.times)
    actor.observer = observer
    events.clear()
    await actor.send("raise")
    assert isinstance(await crashed, ValueError)
    assert events == ["before recorder.raise"]  # no `after` for a handle that raised
    await actor.stop(drain=False)
