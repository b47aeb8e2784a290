"""`actorserve router`'s compiled data plane (api/router/csrc/relay.c) on a thread of its own, and the
control socket between it and the Python router (api/router/http_router.py).

The thread owns the public listening socket, its clients, the connections to the workers and the
routing state (route.c); ctypes releases the GIL for as long as `relay_run` runs. The Python side
keeps what is not per request: health checks, /get_server_info, broadcasts (relay.c passes every
request but generation to the Python router's private listener, the client's key checked first). They talk in lines over a
socketpair:

    Python -> C   "down <worker> <503 body>"   take the worker out, end its requests in flight
                  "up <worker>"                 route to it again
    C -> Python   "failed <worker> <why>"       a request's connection to the worker failed

Closing the Python end stops the loop; the thread closes every connection it opened on its way out.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import socket
import threading
from collections.abc import Callable

from api.router.native import RelayConfig
from api.router.relay import host_port
from api.router.routing import RouterConfig
from runtime.config import ROUTER_POLICIES

log = logging.getLogger("actorserve.router")


class NativePlane:
    def __init__(self, library: ctypes.CDLL, urls: list[str], routing: RouterConfig, connect_timeout_s: float,
                 max_body: int, on_failed: Callable[[int, str], None], api_key: str | None = None,
                 worker_api_key: str | None = None):
        self._library = library
        self._addresses = [host_port(url) for url in urls]
        self._routing = routing
        self._connect_timeout_ms = max(1, int(connect_timeout_s * 1000))
        self._max_body = max_body
        self._on_failed = on_failed
        self._api_key = None if api_key is None else api_key.encode()
        self._worker_credentials = None if worker_api_key is None else b"authorization: Bearer %s\r\n" % worker_api_key.encode()
        self._router = ctypes.c_void_p(library.route_new(
            ROUTER_POLICIES.index(routing.policy), len(urls), routing.cache_threshold, routing.balance_abs_threshold,
            routing.balance_rel_threshold, routing.max_tree_tokens,
        ))
        if not self._router:
            raise MemoryError("route_new failed")
        self._keep: list[object] = []  # what the C side points into, alive while the thread runs
        self._control: asyncio.Transport | None = None
        self._thread: threading.Thread | None = None
        self._thread_end: socket.socket | None = None
        self._listener: socket.socket | None = None

    async def start(self, listener: socket.socket, control_port: int) -> None:
        """Serve `listener` (bound, listening) from the thread; other paths go to `control_port`."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        listener.setblocking(False)
        self._listener, self._thread_end = listener, theirs
        loop = asyncio.get_running_loop()
        self._control, _ = await loop.create_unix_connection(lambda: _ControlLines(self._on_failed), sock=ours)
        addresses = [*self._addresses, ("127.0.0.1", control_port)]
        hosts = (ctypes.c_char_p * len(addresses))(*(host.encode() for host, _ in addresses))
        ports = (ctypes.c_int * len(addresses))(*(port for _, port in addresses))
        config = RelayConfig(listener.fileno(), theirs.fileno(), len(self._addresses), hosts, ports, self._router,
                             self._connect_timeout_ms, self._max_body, self._api_key, len(self._api_key or b""),
                             self._worker_credentials)
        self._keep = [hosts, ports, config]
        self._thread = threading.Thread(target=self._run, args=(config,), name="actorserve-relay", daemon=True)
        self._thread.start()

    def _run(self, config: RelayConfig) -> None:
        if self._library.relay_run(ctypes.byref(config)) != 0:
            log.error("the compiled data plane could not start (epoll)")

    def worker_down(self, worker: int, body: bytes) -> None:
        self._send(b"down %d %s\n" % (worker, body))

    def worker_up(self, worker: int) -> None:
        self._send(b"up %d\n" % worker)

    def _send(self, line: bytes) -> None:
        if self._control is not None and not self._control.is_closing():
            self._control.write(line)

    def load(self, worker: int) -> tuple[int, int]:
        """Requests in flight and their prompt bytes: read while the thread writes them, so a
        snapshot, as any load figure is."""
        if not self._router:  # closed
            return 0, 0
        return self._library.route_requests(self._router, worker), self._library.route_tokens(self._router, worker)

    async def close(self) -> None:
        if self._control is not None:
            self._control.close()  # the thread sees EOF and stops
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for sock in (self._thread_end, self._listener):
            if sock is not None:
                sock.close()
        if self._router:
            self._library.route_free(self._router)
            self._router = ctypes.c_void_p()
        self._keep = []


class _ControlLines(asyncio.Protocol):
    def __init__(self, on_failed: Callable[[int, str], None]):
        self._on_failed = on_failed
        self._pending = b""

    def data_received(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            kind, _, rest = line.partition(b" ")
            worker, _, why = rest.partition(b" ")
            if kind == b"failed" and worker.isdigit():
                self._on_failed(int(worker), why.decode(errors="replace"))
            else:
                log.error("unknown line from the compiled data plane: %r", line)

