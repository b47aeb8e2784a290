"""The frontend's side of the engine core process: starting it, talking to it, noticing its death.

`CoreClient` starts api/core/process.py in a fresh interpreter (`CoreProcess`), owns the two IPC
sockets and the requests the core holds, detokenizes the token ids of each `CoreOutputs` and hands
every delta to its stream, all of a step in one pass. api/frontend/replicas.py holds one per data-parallel replica.

Bounded both ways: at most `max_in_core` requests are in the core at once (a credit returned
with each final delta: its running batch, its queue limit and `core_backlog` more); later ones
wait here, in arrival order, and an abort takes one out at once. Nothing here waits on a reader: a stream merges what its reader has not taken.
"""

from __future__ import annotations

import asyncio
import codecs
import itertools
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from api.core.engine_core import CoreSetup
from runtime.config import EngineConfig
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
from runtime.detokenize import ByteTable, IncrementalDetokenizer, delta_text
from runtime.req import Admission, FinishReason, Req, end_request, reason_of
from runtime.stats import CoreStats
from runtime.stream import Delta, StepOutbox

STARTUP_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 10.0
READ_RECHECK_MS = 50
CONNECT_TIMEOUT_S = 10.0  # from the core's CoreHello until the frontend's socket sees its connection
OUTPUT_TAIL_BYTES = 4096  # how much of the core's last output an error message quotes
OUTPUT_TAIL_LINES = 20


class CoreClient:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        on_failure: Callable[[str], None],
        setup: CoreSetup | None = None,
        *,
        on_tokens: Callable[[int], None] = lambda n: None,
        on_end: Callable[[Req], None] = lambda req: None,
    ):
        """`on_failure(why)`: the core died or failed (its requests are ended already);
        `on_tokens(n)`: a step produced n tokens; `on_end(req)`: a request left this client."""
        self.config = config
        self.setup = setup
        self.tokenizer = tokenizer
        self.byte_table = ByteTable.of(tokenizer)  # None: the tokenizer is not byte-level BPE
        self.on_failure = on_failure
        self.on_tokens = on_tokens
        self.on_end = on_end
        self.live: dict[str, Req] = {}  # sent to the core, not ended
        self.backlog: dict[str, Req] = {}  # waiting for a credit (insertion order: arrival)
        self.max_in_core = 0  # set once the core has resolved its limits
        self.stats: CoreStats | None = None  # the core's latest report (from the end of `start` on)
        self._answers: dict[int, asyncio.Future[Any]] = {}  # ticket -> the core's answer to a query
        self._tickets = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._sockets = CoreSockets.create()
        # A process that exits without close() still removes the directory (the core then sees its
        # parent gone and exits).
        weakref.finalize(self, self._sockets.remove)
        self._ctx = zmq.asyncio.Context()
        # A plain socket: a send never waits (no high-water mark), so it can happen anywhere.
        self._send_ctx = zmq.Context()
        self._to_core = self._send_ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._process: CoreProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> CoreReady:
        """Start the core and wait until its model is loaded; raises RuntimeError (with the core's
        reason: its message, or the end of its output) if it cannot."""
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.bind(self._sockets.to_core)
        self._from_core.bind(self._sockets.from_core)
        try:
            self._process = CoreProcess(self._sockets)
            first = await self._handshake()
        except BaseException:
            await self.close()
            raise
        if not isinstance(first, CoreReady):
            await self.close()
            raise RuntimeError(first.message if isinstance(first, CoreFailed) else f"unexpected first message {first!r}")
        self._process.output.mark()  # a later death quotes only what the core wrote after this
        cfg = first.config
        assert cfg.max_running_requests is not None
        # Room for the core's running batch, its queue limit, and requests it is about to refuse.
        self.max_in_core = cfg.max_running_requests + (cfg.max_queued_requests or 0) + self.config.core_backlog
        try:
            self.stats = await self._first_stats()
        except BaseException:
            await self.close()
            raise
        self._reader = asyncio.create_task(self._read(), name="core-client.read")
        asyncio.get_running_loop().add_reader(self._process.exit_fd, self._process_exited)
        return first

    def send(self, msg: ToCore) -> None:
        try:
            self._to_core.send(self._encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:  # no core connected (it never started, or is gone): no one to tell
            pass

    def submit(self, req: Req) -> None:
        """Send a validated request to the core, or hold it until a credit comes back."""
        if req.sched.abort_requested:  # aborted while it waited in the link's mailbox
            self._end_unsent(req)
        elif len(self.live) < self.max_in_core and not self.backlog:
            self._send_request(req)
        else:
            self.backlog[req.rid] = req

    def abort(self, rid: str) -> None:
        held = self.backlog.pop(rid, None)
        if held is not None:
            self._end_unsent(held)
        elif rid in self.live:
            self.send(CoreAbort(rid))

    async def flush_cache(self) -> bool:
        """Drop the core's prefix cache; False if it was busy (or is gone)."""
        return bool(await self._ask(CoreFlush, False))

    async def clear_storage(self) -> bool:
        """Remove the core's storage-tier files; False without a storage tier (or if it is gone)."""
        return bool(await self._ask(lambda ticket: CoreFlush(ticket, "storage"), False))

    async def current_stats(self) -> CoreStats | None:
        """The core's counters as they are now (after everything sent before this call); the
        latest known when the core is gone."""
        return await self._ask(CoreStatsQuery, self.stats)

    async def _ask(self, query: Callable[[int], CoreFlush | CoreStatsQuery], if_gone: Any) -> Any:
        if self._closing:
            return if_gone
        ticket = next(self._tickets)
        answer = self._answers[ticket] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(lambda _: self._answers.pop(ticket, None))
        self.send(query(ticket))
        result = await answer
        return if_gone if result is None else result

    async def close(self) -> None:
        """Stop the core (asking first, then killing), close the sockets, remove their directory.
        Callers at once share one close: a second `Context.term()` would block the loop."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closing = True
        process = self._process
        if process is not None:
            asyncio.get_running_loop().remove_reader(process.exit_fd)
            if process.exitcode is None:
                await self._ask_to_exit(process)
            await process.release()
            self._process = None
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._answer_all(None)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        self._send_ctx.term()
        self._sockets.remove()

    # --- internals ----------------------------------------------------------------------------
    async def _handshake(self) -> FromCore:
        """CoreHello, then tell the core what to load; its answer (CoreReady or CoreFailed)."""
        hello = await self._next_while_starting()
        if not isinstance(hello, CoreHello):
            return hello
        setup = None if self.setup is None else msgspec.msgpack.encode(self.setup)
        await self._send_start(self._encoder.encode(CoreStart(self.config.core(), setup, list(sys.path))))
        return await self._next_while_starting()

    async def _send_start(self, start: bytes) -> None:
        """The core connected before its hello, but this socket's side of that connection may
        attach a moment later; until it does, a send finds no peer."""
        assert self._process is not None
        deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
        while True:
            try:
                return self._to_core.send(start, flags=zmq.NOBLOCK)
            except zmq.Again:
                if self._process.exitcode is not None:
                    raise RuntimeError(f"the engine core process {self._process.exit_message()} while starting") from None
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"the engine core did not connect within {CONNECT_TIMEOUT_S:.0f} s") from None
                await asyncio.sleep(0.001)

    async def _next_while_starting(self) -> FromCore:
        """The core's next message; RuntimeError if it exits or says nothing for too long first."""
        assert self._process is not None
        recv = asyncio.ensure_future(self._from_core.recv())
        exited = await self._process.wait_exit_or(recv, STARTUP_TIMEOUT_S)
        if recv.done():
            return self._decoder.decode(recv.result())
        recv.cancel()
        if not exited:
            raise RuntimeError(f"the engine core sent nothing for {STARTUP_TIMEOUT_S:.0f} s while starting")
        raise RuntimeError(f"the engine core process {self._process.exit_message()} while starting")

    async def _first_stats(self) -> CoreStats:
        """The core publishes its counters right after CoreReady; stats() has them from the start."""
        while True:
            msg = await self._next_while_starting()
            if isinstance(msg, CoreFailed):
                raise RuntimeError(msg.message)
            if isinstance(msg, CoreStatsReport):
                return msg.stats

    async def _ask_to_exit(self, process: CoreProcess) -> None:
        self.send(CoreShutdown())
        if not await process.wait_exit_or(None, EXIT_TIMEOUT_S):
            process.kill()
            await process.wait_exit_or(None, EXIT_TIMEOUT_S)

    async def _read(self) -> None:
        while True:
            # ZMQ's notification FD is edge-triggered and a wakeup can be missed (seen: a frontend
            # that read nothing for seconds while the core's outputs queued, until another
            # socket call looked again); a poll with a timeout looks again at least this often.
            if not await self._from_core.poll(READ_RECHECK_MS):
                continue
            msg = self._decoder.decode(await self._from_core.recv())
            if isinstance(msg, CoreOutputs):
                self._deliver(msg)
            elif isinstance(msg, CoreStatsReport):
                self.stats = msg.stats  # periodic or asked for: the newest either way
                if msg.ticket is not None:
                    self._answer(msg.ticket, msg.stats)
            elif isinstance(msg, CoreFlushed):
                self._answer(msg.ticket, msg.done)
            elif isinstance(msg, CoreFailed):
                self._fail(msg.message)
                return

    def _end_unsent(self, req: Req) -> None:
        end_request(req, FinishReason("abort"))
        self.on_end(req)

    def _send_request(self, req: Req) -> None:
        self.live[req.rid] = req
        self.send(CoreRequest(req.asked))

    def _deliver(self, msg: CoreOutputs) -> None:
        """Detokenize a step's outputs and push each to its stream; then spend returned credits."""
        live = self.live
        deltas = iter(msg.deltas)
        tokens = 0
        for rid, token in zip(msg.rids, msg.tokens):
            delta = next(deltas) if token == StepOutbox.RICH else None
            req = live.get(rid)
            if req is None:
                continue  # already ended here (the frontend failed it)
            if delta is None:
                delta = self._plain_delta(req, token)
                detok = req.out.detokenizer
                if detok is not None:  # the common case: a decoding request's next token
                    delta.text = detok.push(delta.output_ids)
                    tokens += 1
                    req.stream.push(delta)
                    continue
            else:
                req.out.output_ids.extend(delta.output_ids)
                if req.out.admission is None and delta.queue_time is not None:
                    req.out.admission = Admission(delta.cached_tokens, delta.queue_time)
            tokens += len(delta.output_ids)
            detok = req.out.detokenizer
            if detok is None and delta.output_ids:
                detok = req.out.detokenizer = IncrementalDetokenizer.for_req(self.tokenizer, req, self.byte_table)
            if detok is not None:
                delta.text = delta_text(detok, delta.output_ids, delta.finish_reason, delta.matched_stop, req.asked.sampling.no_stop_trim)
            if delta.finish_reason is not None:
                del live[rid]
                end_request(req, reason_of(delta), delta)  # the core's reason, now the frontend's record too
                self.on_end(req)
                continue
            assert req.stream is not None
            req.stream.push(delta)
        self.on_tokens(tokens)
        while self.backlog and len(live) < self.max_in_core:
            rid = next(iter(self.backlog))
            self._send_request(self.backlog.pop(rid))

    def _answer(self, ticket: int, result: Any) -> None:
        future = self._answers.get(ticket)
        if future is not None and not future.done():
            future.set_result(result)

    def _answer_all(self, result: Any) -> None:
        for future in list(self._answers.values()):
            if not future.done():
                future.set_result(result)

    @staticmethod
    def _plain_delta(req: Req, token: int) -> Delta:
        """A plain token's delta, with what the core's first delta said about the request."""
        req.out.output_ids.append(token)
        delta = Delta(rid=req.rid, output_ids=[token], prompt_tokens=len(req.asked.input_ids), completion_tokens=len(req.out.output_ids))
        if req.out.admission is not None:
            delta.cached_tokens, delta.queue_time = req.out.admission.cached_tokens, req.out.admission.queue_time
        return delta

    def _process_exited(self) -> None:
        assert self._process is not None
        asyncio.get_running_loop().remove_reader(self._process.exit_fd)
        # Nothing connects to these sockets again. Removed now, not only in close(): a server
        # that exits on the failure can be killed during its shutdown, and the core that would
        # then have removed them (as an orphan) is gone.
        self._sockets.remove()
        if not self._closing:
            self._fail(f"the engine core process {self._process.exit_message()}")

    def _fail(self, message: str) -> None:
        if self._closing:
            return
        self._closing = True
        held = [*self.live.values(), *self.backlog.values()]
        self.live.clear()
        self.backlog.clear()
        for req in held:
            end_request(req, FinishReason("abort", message=message, status=500))
            self.on_end(req)
        self._answer_all(None)
        self.on_failure(message)


class CoreProcess:
    """The engine core's interpreter: `python -P -m api.core.process` (never the caller's main
    module; -P keeps the working directory's modules from shadowing ours), its exit watched on the
    loop through a pidfd, its stdout and stderr copied to this process's stderr by `OutputTail`
    (the caller's stdout stays the caller's)."""

    __slots__ = ("popen", "exit_fd", "output")

    def __init__(self, sockets: CoreSockets):
        read_fd, write_fd = os.pipe()
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-P", "-m", "api.core.process", sockets.directory, str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd, env=_core_env(),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.output = OutputTail(read_fd)
        self.exit_fd = os.pidfd_open(self.popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; -N if signal N ended it."""
        return self.popen.poll()

    def exit_message(self) -> str:
        """'exited with code N', and the end of what it wrote since `output.mark()`, if anything."""
        self.popen.wait()  # the pidfd said it exited: this reaps it at once
        tail = self.output.tail()
        return f"exited with code {self.popen.returncode}" + (f"; its last output:\n{tail}" if tail else "")

    def kill(self) -> None:
        self.popen.kill()

    async def wait_exit_or(self, other: asyncio.Future[Any] | None, timeout: float) -> bool:
        """Wait until the process exits, `other` completes or the timeout passes; True if it exited.
        The pidfd is watched by the loop: no thread is left blocked in a wait."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self.exit_fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait([exited] if other is None else [exited, other], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(self.exit_fd)
            exited.cancel()
        return self.exitcode is not None

    async def release(self) -> None:
        """After it exited: reap it, close the pidfd, let the output copier see the end."""
        self.popen.wait()
        os.close(self.exit_fd)
        await asyncio.to_thread(self.output.join, EXIT_TIMEOUT_S)


class OutputTail:
    """Copies a pipe to this process's stderr as it comes (a thread: a busy loop never makes the
    core wait on its own logging) and keeps the last `OUTPUT_TAIL_BYTES` for error messages."""

    __slots__ = ("_tail", "_thread")

    def __init__(self, read_fd: int):
        self._tail = bytearray()
        self._thread = threading.Thread(target=self._copy, args=(read_fd,), name="actorserve-core-output", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        """Forget what came so far: `tail` quotes what comes after."""
        self._tail = bytearray()

    def tail(self) -> str:
        """The last lines copied since `mark`. Called once the core exited: its last words may
        still be in the pipe, so this waits (a second at most) for the copy to reach the end."""
        self._thread.join(1.0)
        lines = bytes(self._tail).decode(errors="replace").strip().splitlines()
        return "\n".join(lines[-OUTPUT_TAIL_LINES:])

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _copy(self, read_fd: int) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with open(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                self._tail += chunk
                del self._tail[:-OUTPUT_TAIL_BYTES]
                _write_stderr(decoder.decode(chunk))


def _write_stderr(text: str) -> None:
    """Our stderr may be gone (closed, or None under pythonw): the copy must go on regardless,
    or the core would block on a full pipe."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass


def _core_env() -> dict[str, str]:
    """This environment, with our packages importable wherever the caller runs from."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [root, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
