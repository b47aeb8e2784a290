"""Streams and events for the overlap schedule on CUDA.

The scheduling stream (the event-loop thread's device work: table writes, input copies) and the
forward stream (each step's forward and sampling, from the Executor's worker).

Host values go to the device with `host_to_device()`: a blocking host-to-device copy synchronizes
the current stream (PyTorch's `memcpy_and_sync`), which on the forward stream means waiting for
the step in flight and losing the overlap; a non-blocking copy from pinned memory does not.

The tensors a step reads (inputs built on the scheduling stream, the batch's slot tensors) are
handed to `copy_out(keep_alive=...)` and referenced until the event has fired: freeing them
earlier would let the caching allocator give their memory to new work on the scheduling stream
while the forward stream still reads it.

On a CPU there are no streams: `HostResult.ready()` wraps tensors that are already on the host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class HostResult:
    """Host copies of a step's results, complete once `event` has fired (None: complete now)."""

    tensors: tuple[torch.Tensor | None, ...]
    event: torch.cuda.Event | None = None
    keep_alive: tuple[object, ...] = ()
    _waiter: ThreadPoolExecutor | None = field(default=None, repr=False)

    @classmethod
    def ready(cls, *tensors: torch.Tensor | None) -> HostResult:
        return cls(tuple(None if t is None else t.cpu() for t in tensors))

    def done(self) -> bool:
        if self.event is None or self.event.query():
            self._release()
            return True
        return False

    async def wait(self) -> tuple[torch.Tensor | None, ...]:
        """The host tensors, once the GPU has written them; the event loop keeps running."""
        if not self.done():
            assert self.event is not None
            await asyncio.get_running_loop().run_in_executor(self._waiter, self.event.synchronize)
            self._release()
        return self.tensors

    def _release(self) -> None:
        self.event = None
        self.keep_alive = ()


class StepStreams:
    """The scheduling and forward streams of one CUDA device, and the host copies of results."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"StepStreams needs a CUDA device, got {device}")
        self.device = device
        self.schedule = torch.cuda.current_stream(device)
        self.forward = torch.cuda.Stream(device)
        self.loads = torch.cuda.Stream(device)  # host-tier loads, layer by layer (gpu/kv_pool.py's LayerLoads)
        # Steps complete in launch order, so one thread waiting on one event at a time suffices.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actorserve-cuda-event")

    @contextmanager
    def launch(self) -> Iterator[torch.cuda.Stream]:
        """Issue the enclosed work on the forward stream, after the scheduling stream's work (a
        device-side wait: the host does not synchronize)."""
        self.forward.wait_stream(self.schedule)
        with torch.cuda.stream(self.forward):
            yield self.forward

    def copy_out(self, tensors: Sequence[torch.Tensor | None], keep_alive: Sequence[object] = ()) -> HostResult:
        """Non-blocking copies into pinned host memory on the current (forward) stream, then an event."""
        host = tuple(None if t is None else _pinned_copy(t) for t in tensors)
        event = torch.cuda.Event(blocking=True)  # the waiting helper thread sleeps instead of spinning
        event.record()
        return HostResult(host, event, (*tensors, *keep_alive), self._waiter)

    def close(self) -> None:
        self._waiter.shutdown(wait=False, cancel_futures=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without synchronizing the current stream; the caching host
    allocator keeps the pinned block until the copy has run, so the caller may drop `t` at once."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
