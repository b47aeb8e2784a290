"""The processes of a tensor-parallel group: rank 0 is the engine core, ranks 1..N-1 are started here.

Rank 0 binds the rendezvous (a `TCPStore`) before it starts anyone, so a port in use is one clear
error and no process is left behind. A rank exits on its own when rank 0's process is gone, so
none outlives its core, even after a kill -9.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os
import subprocess
import sys
import threading
import time

import msgspec
import torch

from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.tensor_parallel import TPGroup, make_idle_group

log = logging.getLogger("actorserve.tp")

STOP_JOIN_S = 10.0
PARENT_CHECK_PERIOD_S = 0.2
# How long rank 0 waits for the others to start and join (a fresh interpreter importing torch; on a
# loaded machine several seconds): never less than this, whatever dist_timeout_s says of collectives.
MIN_JOIN_TIMEOUT_S = 120.0


class Rendezvous(msgspec.Struct, frozen=True):
    host: str
    port: int
    size: int
    backend: str  # gloo | nccl
    # How long a collective waits for a peer: a rank that stops answering (hung, not dead: a dead
    # one is noticed at once) fails the step after this long instead of hanging the engine.
    timeout_s: float

    @classmethod
    def choose(cls, dist_init_addr: str | None, size: int, device: str, timeout_s: float) -> Rendezvous:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if dist_init_addr is None:
            return cls("127.0.0.1", 0, size, backend, timeout_s)  # port 0: the store picks a free one
        host, _, port = dist_init_addr.rpartition(":")
        return cls(host, int(port), size, backend, timeout_s)

    @property
    def join_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(self.timeout_s, MIN_JOIN_TIMEOUT_S))

    def join(self, store: torch.distributed.Store, rank: int) -> TPGroup:
        """Join the group as `rank` (blocks until every rank has): the steps' collectives in a group
        that times out after timeout_s, the idle wait in one that does not."""
        torch.distributed.init_process_group(self.backend, store=store, rank=rank, world_size=self.size, timeout=self.join_timeout)
        step_timeout = datetime.timedelta(seconds=self.timeout_s)
        steps = torch.distributed.new_group(backend=self.backend, timeout=step_timeout)
        return TPGroup(rank, self.size, steps, make_idle_group(self.backend), step_timeout)


class RankSpec(msgspec.Struct, frozen=True):
    """Everything a spawned rank needs (msgpack-encoded: a spawned process inherits nothing)."""

    rank: int
    rendezvous: Rendezvous
    runner: RunnerConfig
    threads: int | None
    parent_pid: int


class TPRanks:
    """Rank 0's side: the rendezvous store, the other ranks' processes and the group."""

    def __init__(self, rendezvous: Rendezvous, runner: RunnerConfig, threads: int | None):
        try:
            self.store = torch.distributed.TCPStore(
                rendezvous.host, rendezvous.port, rendezvous.size, is_master=True, wait_for_workers=False,
                timeout=rendezvous.join_timeout,
            )
        except Exception as exc:  # noqa: BLE001 - DistNetworkError and friends: say where
            raise RuntimeError(f"tensor parallelism cannot listen at {rendezvous.host}:{rendezvous.port}: {exc}") from exc
        self.rendezvous = msgspec.structs.replace(rendezvous, port=self.store.port)
        self.runner_config = runner
        # Plain subprocesses: the core is a daemonic multiprocessing child, which may not have any.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, rendezvous.size):
            spec = RankSpec(rank, self.rendezvous, _rank_runner(runner, rank), threads, os.getpid())
            argv = [sys.executable, "-m", "gpu.tp_ranks", msgspec.msgpack.encode(spec).hex()]
            self.procs.append(subprocess.Popen(argv, env=env))
        self.runner: ModelRunner | None = None
        self.failed = False

    def load(self) -> ModelRunner:
        """Join the group as rank 0 and load its shard (blocks until every rank has joined)."""
        self.runner = ModelRunner(self.runner_config, self.rendezvous.join(self.store, 0))
        return self.runner

    async def wait_exit(self) -> str:
        """Returns, with why, once any other rank's process has exited."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[subprocess.Popen] = loop.create_future()
        pidfds = [os.pidfd_open(proc.pid) for proc in self.procs]  # readable once the process exits
        for fd, proc in zip(pidfds, self.procs):
            loop.add_reader(fd, lambda p=proc: exited.done() or exited.set_result(p))
        try:
            proc = await exited
        finally:
            for fd in pidfds:
                loop.remove_reader(fd)
                os.close(fd)
        self.failed = True
        rank = self.procs.index(proc) + 1
        return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.wait()}"

    def close(self, graceful: bool) -> None:
        """Stop every other rank and leave the group. `graceful` (no forward running on rank 0,
        every rank healthy): a stop message, else a kill."""
        if graceful and self.runner is not None and not self.failed and all(p.poll() is None for p in self.procs):
            try:
                self.runner.stop_ranks()
            except Exception:  # noqa: BLE001 - a rank died meanwhile: the kill below covers it
                log.warning("could not tell the tensor-parallel ranks to stop", exc_info=True)
        deadline = time.monotonic() + (STOP_JOIN_S if graceful else 0.0)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _rank_runner(runner: RunnerConfig, rank: int) -> RunnerConfig:
    """Rank `rank`'s runner config: on CUDA the GPU after rank 0's by `rank`."""
    device = torch.device(runner.device)
    if device.type != "cuda":
        return runner
    return dataclasses.replace(runner, device=f"cuda:{(device.index or 0) + rank}")


def rank_main(spec_hex: str) -> None:
    """Entry point of ranks 1..N-1 (`python -m gpu.tp_ranks SPEC`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = msgspec.msgpack.decode(bytes.fromhex(spec_hex), type=RankSpec)
    threading.Thread(target=_exit_when_orphaned, args=(spec.parent_pid,), daemon=True).start()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    r = spec.rendezvous
    store = torch.distributed.TCPStore(r.host, r.port, r.size, is_master=False, timeout=r.join_timeout)
    group = r.join(store, spec.rank)
    try:
        runner = ModelRunner(spec.runner, group)
        runner.serve_ranks()
    finally:
        torch.distributed.destroy_process_group()


def _exit_when_orphaned(parent_pid: int) -> None:
    """Rank 0 (the core process) is gone, maybe killed: a rank has nothing left to serve."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_PERIOD_S)
    os._exit(1)


if __name__ == "__main__":
    rank_main(sys.argv[1])
