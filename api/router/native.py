"""The router's compiled data plane (api/router/csrc/), built once by `make setup` and loaded with ctypes.

A Python hop costs more than the router's budget of 100 us of CPU per request before it parses or
routes anything (bench/router_http.py: a bare uvloop relay ~80-105 us, the kernel's loopback TCP
alone ~60-80), so `actorserve router` relays generation requests in C: relay.c runs an epoll loop
on a thread of its own and routes with route.c, the C twin of api/router/routing.py for byte prompts.
It is plain C against libc, compiled with the system's `cc` into `build/native/`; without a
compiler, or when the build fails, the router runs its Python data plane (api/router/relay.py) instead.

    python -m api.router.native    # build (what `make setup` runs) and report
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import subprocess
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "native"
FLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-pthread", "-Wl,-z,defs"]


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled data plane, or None (the reason logged once) when it cannot be built here."""
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as exc:
        log.warning("compiled router data plane unavailable, using the Python one: %s", exc)
        return None
    _declare(library)
    return library


def _build() -> Path:
    """The shared library for the current sources, compiled if it is not there yet."""
    sources = sorted(CSRC.glob("*.c"))
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    target = BUILD_DIR / f"actorserve_router-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    built = subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, sources)], capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"cc could not build {CSRC}:\n{built.stderr}")
    partial.replace(target)  # atomic: a concurrent loader sees the whole library or none
    for stale in BUILD_DIR.glob("actorserve_router-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


class RelayConfig(ctypes.Structure):
    """relay.c's struct relay_config."""

    _fields_ = [
        ("listen_fd", ctypes.c_int),
        ("control_fd", ctypes.c_int),
        ("num_workers", ctypes.c_int),
        ("hosts", ctypes.POINTER(ctypes.c_char_p)),  # the workers', then the control plane's
        ("ports", ctypes.POINTER(ctypes.c_int)),
        ("router", ctypes.c_void_p),
        ("connect_timeout_ms", ctypes.c_int),
        ("max_body", ctypes.c_int64),
        ("api_key", ctypes.c_char_p),  # None: clients need no key
        ("api_key_len", ctypes.c_size_t),
        ("worker_credentials", ctypes.c_char_p),  # None, or the header line sent to workers instead of the client's
    ]


def _declare(library: ctypes.CDLL) -> None:
    c = ctypes
    u8p = c.POINTER(c.c_uint8)
    signatures = {
        "route_new": (c.c_void_p, [c.c_int, c.c_int, c.c_double, c.c_int64, c.c_double, c.c_int64]),
        "route_free": (None, [c.c_void_p]),
        "route_choose": (c.c_int, [c.c_void_p, c.c_char_p, c.c_size_t, c.c_char_p, c.c_size_t, c.c_int]),
        "route_started": (None, [c.c_void_p, c.c_int, c.c_int64]),
        "route_finished": (None, [c.c_void_p, c.c_int, c.c_int64]),
        "route_set_healthy": (None, [c.c_void_p, c.c_int, c.c_int]),
        "route_requests": (c.c_int64, [c.c_void_p, c.c_int]),
        "route_tokens": (c.c_int64, [c.c_void_p, c.c_int]),
        "route_tree_size": (c.c_int64, [c.c_void_p, c.c_int]),
        "relay_run": (c.c_int, [c.POINTER(RelayConfig)]),
        "route_fields": (c.c_int, [c.c_char_p, c.c_size_t, c.POINTER(u8p), c.POINTER(c.c_size_t), c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    library = native_library()
    print(f"router data plane: {'compiled, ' + str(library._name) if library else 'unavailable (Python data plane)'}")
