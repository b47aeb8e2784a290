"""The engine core in its own process (`inline_core=False`): the same answers as inline, and every
way it can fail ends every request with an error, leaving no process or socket file behind."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from api.frontend.engine import Engine, EngineError, InvalidRequest
from runtime.ipc import CoreSockets
from runtime.req import Admission, SchedState
from tests.engine_helpers import assert_idle_invariants, decoding, process_alive, wait_gone

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [9] * 40, [11, 12, 13, 14, 15, 16], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("qwen3", max_position_embeddings=1024))


async def _wait_stats(engine: Engine, done, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while not done(stats := engine.stats()):
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)
    return stats


async def _outputs(engine: Engine) -> list[tuple[list[int], list[float], str]]:
    outs = await asyncio.gather(*[
        engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 12}, return_logprob=True) for p in PROMPTS
    ])
    return [(o.output_ids, o.logprobs, o.finish_reason) for o in outs]


async def test_same_greedy_answers_as_inline_and_nothing_left_behind(model_path):
    async with Engine(model_path=model_path, dtype="float32", inline_core=True) as inline:
        expected = await _outputs(inline)
    engine = Engine(model_path=model_path, dtype="float32", inline_core=False)
    async with engine:
        pid, sockets = engine.client.pid, engine.client._sockets
        assert pid != os.getpid() and process_alive(pid) and sockets.exists()
        got = await _outputs(engine)
        assert [g[0] for g in got] == [e[0] for e in expected]
        assert [x for g in got for x in g[1]] == pytest.approx([x for e in expected for x in e[1]], abs=1e-5)
        assert engine.config.dtype == "float32" and engine.config.context_length == 1024
        text = await engine.generate(prompt="hello there", sampling_params={**GREEDY, "max_new_tokens": 5, "stop": ["zzz"]})
        assert text.completion_tokens == 5
        with pytest.raises(InvalidRequest, match="context length"):
            await engine.generate(input_ids=[1] * 10, sampling_params={"max_new_tokens": 5000})
        assert await engine.flush_cache() is True
        # The counters reach the frontend every few milliseconds: wait for this work's to arrive.
        stats = await _wait_stats(engine, lambda s: s["generated_tokens"] == 4 * 12 + 5 and s["kv_free"] == s["kv_pool_size"])
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert not process_alive(pid) and not sockets.exists()


async def test_every_delta_reports_the_admission_the_core_reported(model_path):
    """Plain tokens carry only an id over the boundary; their deltas still report the cached prefix
    and queue time of the core's first delta, which the frontend keeps in its own record (it
    writes none of the core's scheduling state)."""
    prompt = list(range(11, 41))
    async with Engine(model_path=model_path) as engine:
        await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})
        deltas, req = [], None
        async for delta in engine.stream(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8}, rid="again"):
            req = req or engine.client.live["again"]
            deltas.append(delta)
        # (a slow reader gets tokens merged into fewer deltas: each still carries the report)
        assert sum(len(d.output_ids) for d in deltas) == 8 and deltas[0].queue_time is not None
        assert {(d.cached_tokens, d.queue_time) for d in deltas} == {(len(prompt) - 1, deltas[0].queue_time)}
        assert req.out.admission == Admission(len(prompt) - 1, deltas[0].queue_time)
        assert req.sched == SchedState(enqueue_time=req.sched.enqueue_time)


async def test_an_idle_core_reports_nothing_and_a_busy_one_reports_its_counters(model_path):
    async with Engine(model_path=model_path) as engine:
        await asyncio.sleep(0.3)  # the reports of the start are in
        idle = engine.client.stats
        await asyncio.sleep(0.3)  # six periods: only the clocks moved
        assert engine.client.stats is idle
        await engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 3})
        await _wait_stats(engine, lambda s: s["generated_tokens"] == 3)  # from a report, not a query


@pytest.mark.parametrize("inline_core", [True, False], ids=["inline", "core-process"])
async def test_random_disconnects_free_every_slot(model_path, inline_core):
    """Inline, this found aborts that came after a request's last token was launched: that
    request left the running set, the OutputProcessor skipped its token, and its stream (and
    its Receiver entry) never ended."""
    rng = random.Random(0)
    async with Engine(model_path=model_path, inline_core=inline_core, max_running_requests=16) as engine:

        async def client(i: int) -> None:
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
            agen = engine.stream(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": rng.randrange(1, 30)})
            keep = rng.randrange(0, 4)
            async with asyncio.timeout(60):
                async for _ in agen:
                    keep -= 1
                    if keep < 0:
                        break  # leaving the loop aborts the request in the core
            await agen.aclose()

        tasks = [asyncio.create_task(client(i)) for i in range(1000)]
        for task in tasks[::7]:
            await asyncio.sleep(0)
            task.cancel()  # some are cancelled before or while they run
        await asyncio.gather(*tasks, return_exceptions=True)
        stats = await _wait_stats(engine, lambda s: s["num_running"] == 0 and s["num_waiting"] == 0)
        stats = await _wait_stats(engine, lambda s: s["kv_free"] + s["kv_cached"] == s["kv_pool_size"])
        assert stats["rows_free"] == engine.config.max_running_requests
        assert not engine.receiver.live and (inline_core or not engine.client.live)


async def test_the_core_holds_at_most_its_credit_and_the_rest_wait_in_order(model_path):
    """With one row and a backlog of one, the core holds two requests; the rest wait in the
    frontend in arrival order, and an abort takes one out without reaching the core."""
    engine = Engine(model_path=model_path, inline_core=False, max_running_requests=1, core_backlog=1)
    async with engine:
        assert engine.client.max_in_core == 2
        finished: list[str] = []

        async def run(rid: str) -> str:
            out = await engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 8}, rid=rid)
            finished.append(rid)
            return out.finish_reason

        tasks = {rid: asyncio.create_task(run(rid)) for rid in "abcdef"}
        while len(engine.client.backlog) < 4:
            await asyncio.sleep(0.005)
        assert list(engine.client.backlog) == ["c", "d", "e", "f"]
        aborted_before = (await engine.current_stats())["aborted"]
        await engine.abort("e")
        assert await asyncio.wait_for(tasks["e"], 5) == "abort"
        held = []
        while not all(t.done() for t in tasks.values()):
            stats = await engine.current_stats()
            held.append(stats["num_running"] + stats["num_waiting"])
            await asyncio.sleep(0.005)
        assert max(held) <= 2 and [t.result() for rid, t in tasks.items() if rid != "e"] == ["length"] * 5
        assert [rid for rid in finished if rid != "e"] == ["a", "b", "c", "d", "f"]
        assert (await engine.current_stats())["aborted"] == aborted_before  # "e" never reached the core
        await assert_idle_invariants(engine)


async def test_kill_9_of_the_core_mid_stream_fails_every_request_at_once(model_path):
    engine = Engine(model_path=model_path, inline_core=False)
    await engine.start()
    pid, sockets = engine.client.pid, engine.client._sockets
    try:
        streams = await decoding(engine, PROMPTS, {**GREEDY, "max_new_tokens": 900})
        os.kill(pid, signal.SIGKILL)
        held_when_failed: list[int] = []

        async def until_failed(agen: AsyncIterator) -> EngineError | None:
            try:
                async for _ in agen:
                    pass
            except EngineError as exc:
                held_when_failed.append(len(engine.client.live) + len(engine.client.backlog))
                return exc
            return None

        results = await asyncio.wait_for(asyncio.gather(*[until_failed(s) for s in streams]), 30)  # a hang guard
        # At once: the one exit ended every request together, so no stream saw another still held.
        assert held_when_failed == [0] * len(streams)
        assert all(isinstance(r, EngineError) and "exited with code -9" in str(r) for r in results), results
        assert "exited" in engine.stats()["failure"]
        assert not sockets.exists()  # at once: a server killed while it shuts down leaves none
        with pytest.raises(EngineError):
            await engine.generate(input_ids=[1, 2])
    finally:
        await engine.close()
    assert not process_alive(pid) and not sockets.exists()


async def test_a_core_that_fails_removes_its_socket_files(model_path, monkeypatch):
    """A server exits when its core fails; killed during that shutdown (before it saw the core
    exit), it left the socket files behind: the failed core removes them itself."""
    from api.core.engine_core import CoreSetup

    engine = Engine(model_path=model_path, inline_core=False, core_setup=CoreSetup(step_runner="tests.test_engine_behaviour:failing_device"))
    await engine.start()
    pid, sockets = engine.client.pid, engine.client._sockets
    monkeypatch.setattr(CoreSockets, "remove", lambda self: None)  # in this process, the frontend's
    try:
        with pytest.raises(EngineError, match="simulated device failure"):
            await asyncio.wait_for(engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY), timeout=30)
        await wait_gone(pid, 10, "the failed core")
        assert not sockets.exists()
    finally:
        monkeypatch.undo()
        await engine.close()
    assert not sockets.exists()


@pytest.fixture
def socket_dirs(monkeypatch) -> list[CoreSockets]:
    """The socket directories the engines of a test create (other tests' engines may run beside)."""
    created: list[CoreSockets] = []
    create = CoreSockets.create

    def recorded(cls) -> CoreSockets:
        created.append(create())
        return created[-1]

    monkeypatch.setattr(CoreSockets, "create", classmethod(recorded))
    return created


async def test_core_startup_failure_is_a_clear_error_without_leftovers(model_path, socket_dirs):
    engine = Engine(model_path=model_path, inline_core=False, attention_backend="flashinfer")
    with pytest.raises(RuntimeError, match="could not start.*flashinfer"):
        await engine.start()
    assert not engine._started
    assert socket_dirs and not any(s.exists() for s in socket_dirs)  # its socket files are gone
    assert not _core_children()


def _core_children() -> list[str]:
    """This process's children that run the engine core (zombies too: an unreaped one leaks)."""
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    return [c for c in children if "api.core.process" in _read(f"/proc/{c}/cmdline") or _read(f"/proc/{c}/stat").endswith(" Z")]


def _read(path: str) -> str:
    """A /proc file's text ('' once the process is gone); a stat file up to its state field."""
    try:
        text = Path(path).read_text(errors="ignore")
    except OSError:
        return ""
    return text[: text.rfind(")") + 3] if path.endswith("/stat") else text


def _cores_running_in(directory: Path) -> list[str]:
    """Engine core processes (anyone's children) whose working directory is `directory`."""
    pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if "api.core.process" in _read(f"/proc/{pid}/cmdline") and _cwd(pid) == directory]


def _cwd(pid: str) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def die_loudly(core) -> None:
    """A CoreSetup function: the core writes its reason and exits while starting, before it can
    say anything over its socket."""
    print("the device caught fire", file=sys.stderr, flush=True)
    os._exit(3)


async def test_a_core_that_dies_while_starting_raises_with_its_last_output(model_path, socket_dirs):
    from api.core.engine_core import CoreSetup

    engine = Engine(model_path=model_path, inline_core=False, core_setup=CoreSetup("tests.test_core_process:die_loudly"))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*the device caught fire"):
        await engine.start()
    assert not engine._started and not _core_children()
    assert socket_dirs and not any(s.exists() for s in socket_dirs)


def _readme_embedded_example(model_path: str) -> str:
    """README's embedded example as written, with the tiny model in place of the default one."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "from actorserve import Engine" in b]
    assert "__main__" not in block  # run as most people write a script: unguarded
    return block.replace("Engine(", f"Engine(model_path={model_path!r}, ", 1)


@pytest.mark.parametrize("how", ["script", "python -c"])
def test_readme_embedded_example_runs_unguarded_from_another_directory(model_path, tmp_path, how):
    """The core's interpreter never imports the caller's main module (multiprocessing's spawn did,
    and an unguarded script then failed while starting)."""
    example = _readme_embedded_example(model_path)
    (tmp_path / "embed.py").write_text(example)
    command = [sys.executable, "embed.py"] if how == "script" else [sys.executable, "-c", example]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}  # this tree's code, wherever it is
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.strip().splitlines()
    assert len(printed) >= 1 and printed[-1].endswith("]") and "None" in printed[-1], done.stdout
    assert not _cores_running_in(tmp_path)  # the Engine's close ended its core


def test_the_core_exits_when_its_frontend_is_killed(model_path, tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, sys
        from api.frontend.engine import Engine

        async def main():
            engine = Engine(model_path={model_path!r}, inline_core=False)
            await engine.start()
            print(engine.client.pid, engine.client._sockets.directory, flush=True)
            await asyncio.sleep(600)

        if __name__ == "__main__":
            asyncio.run(main())
    """)
    (tmp_path / "frontend.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    frontend = subprocess.Popen([sys.executable, str(tmp_path / "frontend.py")], stdout=subprocess.PIPE, text=True, env=env)
    try:
        core_pid, sockets_dir = frontend.stdout.readline().split()
        assert process_alive(int(core_pid))
        frontend.kill()
        frontend.wait(10)
        deadline = time.monotonic() + 10
        while process_alive(int(core_pid)):
            assert time.monotonic() < deadline, "the core outlived its frontend"
            time.sleep(0.05)
        assert not Path(sockets_dir).exists()  # the core removed the socket files it was left with
    finally:
        if frontend.poll() is None:
            frontend.kill()
            frontend.wait()


def test_http_server_over_a_core_process(model_path):
    import http.client
    import json

    from api.server.app import ServerSettings
    from tests.test_server import ServerThread

    with ServerThread({"model_path": model_path, "inline_core": False}, ServerSettings()) as server:

        def call(method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            conn.request(method, path, body=json.dumps(body) if body else None, headers={"content-type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()

        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
        status, raw = call("POST", "/v1/chat/completions", body)
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
        status, raw = call("GET", "/get_server_info")
        assert status == 200 and json.loads(raw)["inline_core"] is False
        os.kill(server.engine.client.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (status := call("GET", "/health")[0]) == 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert status == 503
        status, raw = call("POST", "/v1/chat/completions", body)
        assert status == 500 and json.loads(raw)["error"]["code"] == "engine_error"
