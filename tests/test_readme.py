"""README.md's examples against a live server, so the README cannot rot: every curl command of its
bash blocks and every Python block that talks to a server run as written, with only the port
changed, against a tiny model served on a free loopback port."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.server.app import ServerSettings
from tests.test_server import ServerThread

README = Path(__file__).parent.parent / "README.md"
README_ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):30000")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _curl_commands() -> list[str]:
    commands = []
    for block in _blocks("bash"):
        joined = block.replace("\\\n", " ")  # continuation lines make one command
        commands += [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]
    return commands


def _server_python_blocks() -> list[str]:
    return [block for block in _blocks("python") if README_ADDRESS.search(block)]


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerThread]:
    with ServerThread({"model_path": str(tiny_llama), "max_running_requests": 4}, ServerSettings()) as s:
        yield s


def _at(server: ServerThread, text: str) -> str:
    return README_ADDRESS.sub(f"127.0.0.1:{server.port}", text)


def test_readme_opens_with_make_serve_and_make_test() -> None:
    first = _blocks("bash")[0]
    assert first.lstrip().startswith("make serve") and "make test" in first


def test_readme_has_server_examples() -> None:
    assert len(_curl_commands()) >= 3 and _server_python_blocks()


@pytest.mark.parametrize("command", _curl_commands())
def test_readme_curl_command_succeeds(server: ServerThread, command: str) -> None:
    done = subprocess.run(["bash", "-c", _at(server, command)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if '"stream": true' in command:
        events = [line[6:] for line in done.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 1, done.stdout
        bodies = [json.loads(e) for e in events[:-1]]
    else:
        bodies = [json.loads(done.stdout)]
    assert all("error" not in body for body in bodies), done.stdout


@pytest.mark.parametrize("block", _server_python_blocks())
def test_readme_python_block_succeeds(server: ServerThread, block: str) -> None:
    done = subprocess.run([sys.executable, "-c", _at(server, block)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the example printed nothing"
