"""The forward's thread gets several torch threads, every other thread of the process gets its own count.

torch's CPU ops run on OpenMP (the libgomp bundled with torch), which gives each thread that
starts a parallel region a team of threads of its own. Once a process holds more OpenMP threads
than it has CPUs, libgomp throttles every team: a team's idle threads spin ~100 times (instead of
~300,000) before sleeping on a futex, so each of the forward's several hundred parallel regions
per step pays a wake-up. On a 2-core machine, one parallel op run on a second thread (the model
loaded in `asyncio.to_thread`, a big `torch.zeros` on the event loop's thread) slowed SmolLM2's
batch-1 decode from ~18.5 to 28-36 ms per token, for as long as that thread lived. GOMP_SPINCOUNT
does not reach the throttled count.

So the engine core's process gives one torch thread to every thread (`torch.set_num_threads(1)`
at its start) and `TorchThreads.claim` gives the forward thread its count. torch keeps one count
per thread (OpenMP's) and one for threads that have not used torch yet (the last
`set_num_threads` anywhere). A thread takes that shared count on its first torch op, and so does
each shared library with torch's inline `parallel_for` on its first call there (libtorch_python,
a compiled extension): that is what can undo the forward thread's count later, so `claim` runs
before every step and costs one `get_num_threads` when nothing changed.

The price: on cores that other processes keep busy, a team that spins the full count loses its
time slices to the spinning (BENCHMARKS.md, "One user on a CPU": an int8 batch-1 step 131 ms at
load 3.5-4.3, against 31-33 ms throttled). GOMP_SPINCOUNT=100 in the server's environment, which
the core process inherits, gives such a machine the throttled behaviour back.

On a CPU the forward's team also holds every core while a step runs, and the serving path (the
core's event loop handing a token on, the frontend writing it to the client) waits for a time
slice: a request's first token often reached its client only after the next decode step ended.
`yield_cores_to_serving` gives the forward thread, and so the team it starts, a lower priority
(nice 10), so the few hundred microseconds of serving work a step produces run when they are ready.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TorchThreads:
    """torch's CPU threads: `forward` on the thread that runs the model, `others` on the rest."""

    forward: int
    others: int

    @classmethod
    def current(cls, forward: int | None = None) -> TorchThreads:
        """`forward` threads for the forward (None: as many as now), the rest keep the current count."""
        others = torch.get_num_threads()
        return cls(forward or others, others)

    def claim(self) -> None:
        """On the forward thread: give it `forward` threads, leaving `others` to the threads that
        take up torch later."""
        if torch.get_num_threads() == self.forward:
            return
        torch.set_num_threads(self.forward)  # this thread's count, and the shared one...
        if self.others != self.forward:  # ...which only another thread can set back without its own
            setter = threading.Thread(target=torch.set_num_threads, args=(self.others,), name="actorserve-torch-threads")
            setter.start()
            setter.join()


FORWARD_NICE = 10  # BENCHMARKS.md (one user): repeated-prompt TTFT 12.5 ms median against 14.8 at 0


def yield_cores_to_serving() -> None:
    """On a CPU engine's forward thread, before its first torch op: lower its scheduling priority,
    which the OpenMP team it then starts inherits (Linux keeps a nice value per thread; raising it
    needs no privilege). Elsewhere nothing changes."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FORWARD_NICE)
