"""torch's CPU threads in the engine core: several on the forward thread, one on every other
thread (gpu/torch_threads.py says why: libgomp throttles every team once two threads have one)."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from api.core.engine_core import Core, CoreSetup
from api.frontend.engine import Engine
from gpu.torch_threads import FORWARD_NICE, TorchThreads, yield_cores_to_serving


def _on_new_thread(fn: Callable[[], Any]) -> Any:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


@pytest.fixture
def shared_threads():
    """The test process's count is restored afterwards, for this thread and threads to come."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_claim_gives_the_forward_thread_its_count_and_leaves_the_others_theirs(shared_threads) -> None:
    threads = TorchThreads(forward=3, others=1)
    torch.set_num_threads(1)
    with ThreadPoolExecutor(1) as forward:
        assert forward.submit(lambda: (threads.claim(), torch.get_num_threads())[1]).result() == 3
        assert torch.get_num_threads() == 1  # this thread's own count is untouched
        assert _on_new_thread(torch.get_num_threads) == 1  # a thread that starts later takes the others' count
        # A library that re-reads the shared count on the forward thread (torch's inline
        # parallel_for does, once per shared library) drops it to 1; the next claim restores it.
        forward.submit(torch.set_num_threads, 1).result()
        assert forward.submit(torch.get_num_threads).result() == 1
        assert forward.submit(lambda: (threads.claim(), torch.get_num_threads())[1]).result() == 3
        assert _on_new_thread(torch.get_num_threads) == 1


def _kernel_calls() -> list[Callable[[], Any]]:
    from gpu.cpu_ops import cpu_kernels
    from gpu.packed_linear import int8_kernels

    kernels, int8 = cpu_kernels(), int8_kernels()
    if kernels is None or int8 is None:
        pytest.skip("the compiled CPU kernels are not built here")
    x = torch.randn(64, 32)
    return [
        lambda: kernels.rms_norm(x, torch.ones(32), 1e-6),
        lambda: kernels.silu_mul(torch.randn(64, 64)),
        lambda: kernels.rope_(torch.randn(64, 2, 32), torch.arange(64), torch.randn(64, 32), torch.randn(64, 32)),
        lambda: int8.quantize_rows(x),
        lambda: int8.dequantize_rows(torch.randn(64, 32), torch.rand(64, 1), None, torch.float32),
    ]


def test_the_compiled_kernels_keep_the_forward_threads_count(shared_threads) -> None:
    """Their first call on a thread must not set it back to the shared count (as torch's inline
    at::parallel_for does, once per thread in each shared library)."""
    threads = TorchThreads(forward=3, others=1)
    torch.set_num_threads(1)
    for call in _kernel_calls():
        with ThreadPoolExecutor(1) as forward:  # a thread none of the kernels ran on yet
            assert forward.submit(lambda: (threads.claim(), call(), torch.get_num_threads())[2]).result() == 3


def test_current_keeps_the_count_for_the_others(shared_threads) -> None:
    assert TorchThreads.current() == TorchThreads(shared_threads, shared_threads)
    assert TorchThreads.current(forward=5) == TorchThreads(5, shared_threads)


def record_threads(core: Core, path: str) -> None:
    """CoreSetup function: after each step, the forward thread's torch threads and those of a
    thread started then; now, the loop thread's (one JSON line each)."""
    step_runner = core.executor.step_runner
    run = step_runner.run

    def observed(batch: Any) -> Any:
        out = run(batch)
        _append(path, {"forward": torch.get_num_threads(), "new_thread": _on_new_thread(torch.get_num_threads), "nice": _nice()})
        return out

    step_runner.run = observed  # type: ignore[method-assign]
    _append(path, {"loop": torch.get_num_threads(), "thread": threading.current_thread().name, "nice": _nice()})


def _nice(tid: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


async def test_the_core_process_gives_several_torch_threads_to_its_forward_thread_only(tiny_model_factory, tmp_path: Path) -> None:
    path = tmp_path / "threads.jsonl"
    setup = CoreSetup("tests.test_torch_threads:record_threads", {"path": str(path)})
    model = str(tiny_model_factory("llama"))
    async with Engine(model_path=model, dtype="float32", inline_core=False, core_threads=3, core_setup=setup) as engine:
        out = await engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    assert len(out.output_ids) == 4
    records = [json.loads(line) for line in path.read_text().splitlines()]
    loop, steps = records[0], records[1:]
    # The forward thread yields the cores to the serving path; the event loop keeps its priority.
    nice = FORWARD_NICE if sys.platform == "linux" else 0
    assert loop == {"loop": 1, "thread": "MainThread", "nice": 0}
    assert len(steps) >= 4  # the prefill and the decode steps
    assert all(s == {"forward": 3, "new_thread": 1, "nice": nice} for s in steps), steps


@pytest.mark.skipif(sys.platform != "linux", reason="a nice value per thread is Linux's")
def test_the_forward_threads_openmp_team_inherits_its_priority(shared_threads) -> None:
    """The team a thread starts at its first parallel op is created by that thread, after
    `yield_cores_to_serving`: its workers run at the forward thread's priority."""
    before = set(os.listdir("/proc/self/task"))

    def forward() -> tuple[int, dict[int, int]]:
        yield_cores_to_serving()
        torch.set_num_threads(2)
        torch.ones(1 << 22).sum()  # big enough to run in parallel: the team starts here
        me = threading.get_native_id()
        team = {int(t) for t in set(os.listdir("/proc/self/task")) - before} - {me}
        return _nice(), {t: _nice(t) for t in team}

    mine, team = _on_new_thread(forward)
    assert mine == FORWARD_NICE and _nice() == 0
    assert team and set(team.values()) == {FORWARD_NICE}, team
