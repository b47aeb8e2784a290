"""The engine core in a process of its own: `python -m api.core.process SOCKETS_DIR PARENT_PID`.

The frontend (api/frontend/core_client.py) binds both IPC sockets and starts this module in a fresh
interpreter, so the caller's main module is never imported here (a script without a
`__main__` guard, a notebook or `python -c` all work). It connects, says `CoreHello`, is told
what to load by a `CoreStart`, loads the model and answers `CoreReady` (or `CoreFailed`). Then
`CoreServer` turns `CoreRequest`s into `Req`s for the Policy and sends back every delta the core's
actors push, one `CoreOutputs` per loop iteration. It exits when told to, when an actor crashes
(after saying `CoreFailed`), or when the frontend process is gone (no orphan holds the model's
memory). Anything it cannot say over the socket (an interpreter that fails to start, a crash
before connecting) goes to its stderr, which the frontend shows when it exits early.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

import msgspec
import torch
import zmq
import zmq.asyncio

from api.core.engine_core import Core, CoreSetup, load_core
from cache import token_array
from gpu.tp_ranks import TPRanks
from runtime.actor import Actor
from runtime.config import CoreConfig
from runtime.ipc import (
    CoreAbort,
    CoreFailed,
    CoreFlush,
    CoreFlushed,
    CoreHello,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreSockets,
    CoreStart,
    CoreStatsReport,
    CoreStatsQuery,
    FromCore,
    ToCore,
)
from runtime.messages import Enqueue, FlushCache, FlushTarget, Wake
from runtime.req import Req, SchedState, mark_aborted
from runtime.stats import CoreStats
from runtime.stream import RemoteStream, StepOutbox

log = logging.getLogger("actorserve.core")

STATS_PERIOD_S = 0.05  # how often the core looks for changed counters to send the frontend
PARENT_CHECK_PERIOD_S = 0.2


def main(argv: list[str]) -> None:
    """Process entry point: `argv` is [SOCKETS_DIR, PARENT_PID]; the rest comes in `CoreStart`."""
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sockets_dir, parent_pid = argv
    config = uvloop.run(_run(CoreSockets(sockets_dir), int(parent_pid)))
    if config is not None and config.tp_size > 1:
        # Everything is sent and the other ranks are stopped; a thread may still be blocked in a
        # collective with a rank that died, and the interpreter would join it before exiting.
        logging.shutdown()
        os._exit(0)


async def _run(sockets: CoreSockets, parent_pid: int) -> CoreConfig | None:
    """Serve the frontend at `sockets`; the config it started with (None: it left before that)."""
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(sockets.to_core)
    # A plain socket: sends happen from loop callbacks and never wait (the connecting side of
    # a PUSH queues without a bound), so a slow frontend never stalls the device loop.
    sync_ctx = zmq.Context()
    outbox = sync_ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.connect(sockets.from_core)
    encoder = msgspec.msgpack.Encoder()
    outputs = StepOutbox(lambda rids, tokens, deltas: outbox.send(encoder.encode(CoreOutputs(rids, tokens, deltas))))
    try:
        outbox.send(encoder.encode(CoreHello()))
        start = await _start_message(inbox, parent_pid)
        if start is None:
            sockets.remove()  # the frontend that owned the socket files cannot remove them now
            return None
        config, setup = _apply_start(start)
        try:
            core = await load_core(config, outputs, setup)
        except Exception as exc:  # the frontend shows this line instead of a bare exit code
            outbox.send(encoder.encode(CoreFailed(f"the engine core could not start: {exc}")))
            return config
        runner = core.runner
        outbox.send(encoder.encode(CoreReady(core.config, runner.vocab_size, list(runner.model_config.eos_token_ids))))
        if await CoreServer(core, inbox, outbox, encoder, outputs).run(parent_pid):
            sockets.remove()
        return config
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)  # the last outputs and a CoreFailed still reach the frontend
        ctx.term()
        sync_ctx.term()


async def _start_message(inbox: zmq.asyncio.Socket, parent_pid: int) -> CoreStart | None:
    """The frontend's `CoreStart`, or None if the frontend process is gone before sending it."""
    recv = asyncio.ensure_future(inbox.recv())
    parent_gone = asyncio.create_task(_parent_gone(parent_pid))
    await asyncio.wait([recv, parent_gone], return_when=asyncio.FIRST_COMPLETED)
    for task in (recv, parent_gone):
        task.cancel()
    await asyncio.gather(recv, parent_gone, return_exceptions=True)
    if recv.cancelled():  # it had not come when the parent was found gone
        return None
    return msgspec.msgpack.decode(recv.result(), type=CoreStart)


def _apply_start(start: CoreStart) -> tuple[CoreConfig, CoreSetup | None]:
    sys.path.extend(path for path in start.sys_path if path not in sys.path)
    config = start.config
    # Several torch threads on the forward thread only, one on every other (gpu/torch_threads.py).
    config = msgspec.structs.replace(config, core_threads=config.core_threads or torch.get_num_threads())
    torch.set_num_threads(1)
    setup = None if start.setup is None else msgspec.msgpack.decode(start.setup, type=CoreSetup)
    return config, setup


class CoreServer:
    """Owns the core side of the channel: the live requests by rid and the outgoing deltas."""

    def __init__(
        self, core: Core, inbox: zmq.asyncio.Socket, outbox: zmq.Socket, encoder: msgspec.msgpack.Encoder, outputs: StepOutbox
    ):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.live: dict[str, Req] = {}
        self.outputs = outputs  # this loop iteration's outputs, sent together
        self._failure: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def run(self, parent_pid: int) -> bool:
        """Serve until told to stop, an actor crashes or the frontend is gone. True when no one
        uses the sockets again: the frontend is gone, or this core failed (a frontend killed before
        it saw this process exit would leave them behind)."""
        for actor in self.core.actors:
            actor.start(self._actor_exited)
        parent_gone = asyncio.create_task(_parent_gone(parent_pid))
        watchers = [
            asyncio.create_task(self._read(), name="reader"), asyncio.create_task(self._publish_stats(), name="stats publisher"), parent_gone,
        ]
        if self.core.tp_ranks is not None:
            watchers.append(asyncio.create_task(self._watch_ranks(self.core.tp_ranks), name="tensor-parallel watcher"))
        try:
            await asyncio.wait([*watchers, self._failure], return_when=asyncio.FIRST_COMPLETED)
            for task in watchers:
                if task.done() and task.exception() is not None and not self._failure.done():
                    log.error("the engine core's %s failed", task.get_name(), exc_info=task.exception())
                    self._failure.set_result(f"the engine core's {task.get_name()} failed: {task.exception()!r}")
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            for actor in self.core.actors:
                await actor.stop(drain=False)
            healthy = not self._failure.done()
            self.core.executor.shutdown(wait=healthy and self.core.tp_ranks is not None)
            if self.core.tp_ranks is not None:
                self.core.tp_ranks.close(graceful=healthy)
            if self._failure.done():
                self.outputs.flush()
                self._send(CoreFailed(self._failure.result()))
        return (parent_gone.done() and not parent_gone.cancelled()) or self._failure.done()

    # --- frontend -> core -------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            msg = self.decoder.decode(await self.inbox.recv())
            if isinstance(msg, CoreRequest):
                await self._enqueue(msg)
            elif isinstance(msg, CoreAbort):
                await self._abort(msg.rid)
            elif isinstance(msg, CoreFlush):
                asyncio.create_task(self._flush(msg.ticket, msg.what))
            elif isinstance(msg, CoreStatsQuery):
                self._send(CoreStatsReport(self.core.stats(), msg.ticket))
            elif isinstance(msg, CoreShutdown):
                return

    async def _enqueue(self, msg: CoreRequest) -> None:
        stream = RemoteStream(msg.asked.rid, self.outputs)
        asked = msg.asked
        req = Req(asked, prompt_key=token_array(asked.input_ids), sched=SchedState(enqueue_time=time.monotonic()), stream=stream)
        self.live[req.rid] = req
        stream.on_final = lambda rid=req.rid: self.live.pop(rid, None)
        await self.core.policy.send(Enqueue(req))

    async def _abort(self, rid: str) -> None:
        req = self.live.get(rid)
        if req is None or not mark_aborted(req):
            return
        await self.core.policy.send(Wake())
        await self.core.adder.send(Wake())

    async def _flush(self, ticket: int, what: FlushTarget) -> None:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await self.core.adder.send(FlushCache(done, what))
        self._send(CoreFlushed(ticket, await done))

    # --- core -> frontend -------------------------------------------------------------------
    def _send(self, msg: FromCore) -> None:
        self.outbox.send(self.encoder.encode(msg))

    async def _publish_stats(self) -> None:
        last: CoreStats | None = None
        while True:
            stats = self.core.stats()
            # The clocks always move: an idle core sends nothing (and wakes no frontend).
            if last is None or msgspec.structs.replace(stats, time=last.time, loop_cpu_s=last.loop_cpu_s) != last:
                self._send(CoreStatsReport(stats))
                last = stats
            await asyncio.sleep(STATS_PERIOD_S)

    async def _watch_ranks(self, ranks: TPRanks) -> None:
        why = await ranks.wait_exit()
        if not self._failure.done():
            log.error("%s: the engine core stops", why)
            self._failure.set_result(why)

    def _actor_exited(self, actor: Actor, error: BaseException | None) -> None:
        if error is not None and not self._failure.done():
            log.error("%s actor crashed", actor.name, exc_info=error)
            self._failure.set_result(f"{actor.name} actor crashed: {error!r}")


async def _parent_gone(parent_pid: int) -> None:
    """Returns once the frontend process has exited (this process is then re-parented)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_CHECK_PERIOD_S)
    log.warning("the frontend process %d is gone: the engine core exits", parent_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
