"""`actorserve serve` as a user runs it: a subprocess, one ready line, a clean stop on a signal."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float, lines: list[str] | None = None) -> str:
    """The first stderr line with `needle`; `lines` (if given) keeps collecting every line."""
    lines = [] if lines is None else lines
    found = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)  # keep reading to the end: a full pipe would block the server
            if needle in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout):
        proc.kill()
        pytest.fail(f"no {needle!r} line within {timeout} s:\n{''.join(lines)}")
    return next(line for line in lines if needle in line)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_starts_answers_and_stops_cleanly(tiny_llama: Path, sig: signal.Signals) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model-path", str(tiny_llama), "--port", str(port),
           "--api-key", "k", "--schedule-policy", "lpm", "--chunked-prefill-size", "64"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        line = _wait_for_line(proc, "ready", 120)
        assert f"http://127.0.0.1:{port}" in line and tiny_llama.name in line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        out = client.chat.completions.create(model=tiny_llama.name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.usage.completion_tokens <= 3
        # A request in flight when the signal comes ends with an error event and [DONE], no hang.
        body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Authorization": "Bearer k"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
        proc.send_signal(sig)
        rest = [line.strip() for line in response if line.startswith(b"data: ")]
        assert rest[-1] == b"data: [DONE]" and b'"error"' in rest[-2]
        assert proc.wait(timeout=15) == 0  # a bound on hanging, not a timing
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_exits_non_zero_when_the_core_process_dies(tiny_llama: Path) -> None:
    """kill -9 of the engine core mid-stream: the client gets an error event and [DONE], the
    server exits with 1, and the core leaves nothing behind."""
    port = _free_port()
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model-path", str(tiny_llama), "--port", str(port)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        _wait_for_line(proc, "ready", 120)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        core = next(int(c) for c in children if b"api.core.process" in Path(f"/proc/{c}/cmdline").read_bytes())
        body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        os.kill(core, signal.SIGKILL)
        rest = [line.strip() for line in response if line.startswith(b"data: ")]
        assert rest[-1] == b"data: [DONE]" and b"engine core process exited" in rest[-2]
        assert proc.wait(timeout=15) == 1
        assert not Path(f"/proc/{core}").exists() or b"Z" in Path(f"/proc/{core}/stat").read_bytes().split(b") ")[1][:1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_sglang_launch_line_starts_and_serves(tiny_llama: Path) -> None:
    """The flags SGLang's documentation puts in a launch command, as written there."""
    from transformers import AutoTokenizer

    port = _free_port()
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model-path", str(tiny_llama), "--host", "127.0.0.1", "--port", str(port),
           "--mem-fraction-static", "0.8", "--chat-template", "chatml", "--trust-remote-code", "--enable-metrics",
           "--log-requests", "--watchdog-timeout", "300", "--kv-cache-dtype", "auto"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    lines: list[str] = []
    try:
        _wait_for_line(proc, "ready", 120, lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert out.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(str(tiny_llama)).encode(chatml, add_special_tokens=False))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/metrics")
        assert conn.getresponse().status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0  # a bound on hanging, not a timing
        for _ in range(100):  # the reader thread may still be at the pipe's last lines
            if "shutting down" in "".join(lines):
                break
            time.sleep(0.05)
        logged = "".join(lines)
        assert f"Receive: rid='{out.id}'" in logged and f"Finish: rid='{out.id}', finish_reason='length'" in logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
