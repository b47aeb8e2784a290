"""Compiled CPU kernels (gpu/csrc/), built once by `make setup` and loaded on first use.

PyTorch has no decode attention that reads K/V where it lies in a paged pool: the torch path
copies every request's keys and values out of the pool in every layer and then runs a flash kernel
made for long query blocks, which together cost twice what reading the pool once does. The kernel
here walks each request's slots directly (gpu/csrc/decode_attention.cpp).

It is built with torch's extension builder (ninja, the system C++ compiler, `-march=native`) into
`build/cpu_ops/` beside the sources; a machine without a compiler, or a failed build, falls back
to the torch path with one warning, so nothing depends on the kernel being there.

    python -m gpu.cpu_ops    # build (what `make setup` runs) and report
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / "decode_attention.cpp"]
BUILD_DIR = Path(__file__).resolve().parent.parent / "build" / "cpu_ops"
FLAGS = ["-O3", "-march=native", "-fopenmp"]

# (q, k_pool, v_pool, req_to_token, req_rows, key_begin, key_end, scale) -> (out, lse)
DecodeAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@cache
def decode_attention_kernel() -> DecodeAttention | None:
    """The compiled paged decode attention, or None (with the reason logged once) when it
    cannot be built or loaded here."""
    try:
        _load()
    except Exception as exc:  # a missing compiler surfaces as any of several error types
        log.warning("CPU decode attention kernel unavailable, using the torch path: %s", exc)
        return None
    return torch.ops.actorserve.decode_attention


def _load() -> None:
    from torch.utils import cpp_extension

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # torch's builder runs `ninja` from PATH; the pip-installed one sits beside this interpreter.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        cpp_extension.load(
            name="actorserve_cpu_ops",
            sources=[str(s) for s in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(BUILD_DIR),
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    kernel = decode_attention_kernel()
    print(f"CPU decode attention kernel: {'built in ' + str(BUILD_DIR) if kernel else 'unavailable (torch path)'}")
