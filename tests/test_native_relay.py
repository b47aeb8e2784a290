"""The router's compiled data plane (api/router/csrc/relay.c) alone: what only it does (a head size limit,
distrust of bytes past a response) and how it leaves (its thread and every socket it opened). The
cases both planes share are in tests/test_relay.py."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter

import pytest

from tests.test_relay import Worker, _connect, _eventually, _post, _raw, _settled, _still_serves, _streaming, raw_routed, routed, router_for, sends

PLANE = "compiled"


pytestmark = pytest.mark.usefixtures("native_plane")  # skipped only without a C compiler (tests/conftest.py)


@pytest.mark.parametrize("at_once", [True, False], ids=["at once", "in pieces"])
async def test_a_request_head_over_64_kib_is_431_however_it_arrives(at_once):
    worker = Worker()
    async with routed(worker, PLANE) as (router, base):
        request = _post(b"/generate", b"{}", b"x-big: %s\r\n" % (b"y" * 70000))
        reader, writer = await _connect(base)
        for i in range(0, len(request), len(request) if at_once else 8192):
            writer.write(request[i:i + (len(request) if at_once else 8192)])
            await writer.drain()
            await asyncio.sleep(0 if at_once else 0.005)
        got = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert got.startswith(b"HTTP/1.1 431") and b"larger than 65536 bytes" in got
        assert worker.bodies == []
        await _settled(router)
        await _still_serves(base)


async def test_bytes_past_a_responses_length_are_an_error_and_take_the_worker_out():
    async with raw_routed(sends(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokSURPRISE"), PLANE) as (router, base, _):
        got = await _raw(base, _post(b"/generate", b"{}"), b"never")
        assert got.startswith(b"HTTP/1.1 200") and not got.endswith(b"ok")  # cut short, then closed
        assert "a request failed: malformed response" in router.down_reason[0]
        await _settled(router)


def _open_files() -> Counter[str]:
    """What the process's descriptors refer to: each socket is an inode of its own, so one the
    router leaked shows up even when some unrelated descriptor closed meanwhile."""
    found: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[os.readlink(f"/proc/self/fd/{fd}")] += 1
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


async def test_close_ends_the_thread_and_closes_every_socket_it_opened():
    worker = Worker(events=1000, gap_s=0.01)
    url = await worker.start()
    assert worker.runner is not None
    try:
        before = _open_files()
        async with router_for([url], PLANE) as (router, base):
            held = [await _connect(base) for _ in range(2)]
            for _, writer in held:  # two requests at once: two worker connections, then idle in the pool
                writer.write(_post(b"/generate", b"{}"))
            for reader, writer in held:
                assert (await asyncio.wait_for(reader.readuntil(b"}"), 5)).startswith(b"HTTP/1.1 200")
                writer.close()
            reader, writer = await _streaming(base)  # and a stream in flight
        assert "actorserve-relay" not in [t.name for t in threading.enumerate()]
        assert router.load(0) == (0, 0)  # the routing state is freed: read, it says nothing is in flight
        assert not (await asyncio.wait_for(reader.read(), 5)).endswith(b"0\r\n\r\n")  # cut off by the close
        writer.close()
        await _eventually(lambda: not _open_files() - before)  # the worker's ends close as it sees the router's go
        assert not _open_files() - before
    finally:
        await worker.runner.cleanup()
