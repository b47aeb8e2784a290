"""Compiled CPU kernels (gpu/csrc/), built once by `make setup` and loaded on first use.

PyTorch has no decode attention that reads K/V where it lies in a paged pool: the torch path
copies every request's keys and values out of the pool in every layer and then runs a flash kernel
made for long query blocks, which together cost twice what reading the pool once does. The kernel
here walks each request's slots directly (gpu/csrc/decode_attention.cpp); new tokens (prefill,
extend) attend causally the same way, in tiles that skip keys past their last position
(gpu/csrc/extend_attention.cpp), where PyTorch's CPU flash kernel computes whole blocks. RMSNorm
(with the residual add before it), SiLU-and-multiply and RoPE are each one pass instead of four
to eight ops (gpu/csrc/elementwise.cpp), rounding where the torch code rounds; and the new tokens'
K/V go into their pool slots by a plain copy instead of an indexed assignment; greedy sampling's
argmax reads each row once, vectorised (torch's is not, on bfloat16).

It is built with torch's extension builder (ninja, the system C++ compiler, `-march=native`) into
`build/cpu_ops/` beside the sources; a machine without a compiler, or a failed build, falls back
to the torch path with one warning, so nothing depends on the kernel being there.

    python -m gpu.cpu_ops    # build (what `make setup` runs) and report
    # the bfloat16 dot-product paths on a CPU without AVX512-BF16 (needs SIMDe's headers):
    ACTORSERVE_EMULATE_AVX512BF16=1 python -m pytest tests/test_attention.py -k kernel
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("decode_attention.cpp", "extend_attention.cpp", "elementwise.cpp")]
BUILD_DIR = Path(__file__).resolve().parent.parent / "build" / "cpu_ops"
# The instruction set the kernels are built for: this CPU's, or one named (ACTORSERVE_MARCH=x86-64-v3:
# AVX2 without AVX-512), into a build folder of its own, so one machine can run and time the paths
# an older CPU takes.
MARCH = os.environ.get("ACTORSERVE_MARCH", "native")
# "1": build the AVX-512 attention paths (BF16 and VNNI dot products, float32 in 512-bit lanes) on any
# x86 CPU, their intrinsics emulated (csrc/simde_avx512bf16.h), into a build folder of their own, so
# the kernel tests can check those paths where the CPU lacks them.
EMULATE_BF16 = os.environ.get("ACTORSERVE_EMULATE_AVX512BF16") == "1"

# (q, k_pool, v_pool, req_to_token, req_rows, key_begin, key_end, scale) -> (out, lse)
DecodeAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens, scale) -> out
ExtendAttention = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class CpuKernels:
    decode_attention: DecodeAttention
    extend_attention: ExtendAttention
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (residual, x, weight, eps): residual += x in place, returns rms_norm(residual)
    add_rms_norm_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]  # [rows, 2 * inter] gate then up -> [rows, inter]
    rope_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (x, positions, cos, sin), in place
    # (k_pool, v_pool, slots, k, v): the new tokens' rows copied into their slots, in place
    write_kv_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    argmax_rows: Callable[[torch.Tensor], torch.Tensor]  # [rows, vocab] -> int64 [rows], as max(dim=-1).indices


@cache
def cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None (with the reason logged once) when they cannot be built or
    loaded here."""
    try:
        return build_cpu_kernels()
    except Exception as exc:  # a missing compiler surfaces as any of several error types
        log.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None


def build_cpu_kernels() -> CpuKernels:
    """The compiled kernels, built first if needed; a failed build raises with the compiler's output
    (the test suite fails on it wherever `cxx_compiler()` finds a compiler)."""
    _load()
    ops = torch.ops.actorserve
    return CpuKernels(ops.decode_attention, ops.extend_attention, ops.rms_norm, ops.add_rms_norm_, ops.silu_mul, ops.rope_, ops.write_kv_, ops.argmax_rows)


def cxx_compiler() -> str | None:
    """The C++ compiler torch's extension builder would run (`$CXX`, else `c++`), if it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def build_extension(name: str, sources: list[Path], build_dir: Path) -> None:
    """Build (when needed) and load another extension from gpu/csrc, the way the kernels are."""
    _load(name, sources, build_dir)


def build_target(build_dir: Path, march: str, emulate_bf16: bool) -> tuple[list[str], Path]:
    """The compiler flags and the build folder for kernels built for `march`, with the AVX512-BF16
    paths emulated or not: every target other than this CPU's own gets a folder of its own."""
    # -fno-trapping-math: without it GCC keeps nearbyint a call where AVX-512 is missing (it must
    # leave the inexact flag alone, which nothing here reads), and every loop through it scalar:
    # silu_mul took 12 ms of an AVX2 machine's float32 decode step at batch 64, 0.6 ms with it.
    flags = ["-O3", f"-march={march}", "-fopenmp", "-fno-trapping-math"]
    if march != "native":
        build_dir = build_dir.with_name(f"{build_dir.name}_{march}")
    if emulate_bf16:
        flags += ["-DACTORSERVE_BF16_DOT", "-DACTORSERVE_EMULATE_AVX512", "-include", str(CSRC / "simde_avx512bf16.h")]
        build_dir = build_dir.with_name(build_dir.name + "_emulated_bf16")
    return flags, build_dir


def _load(name: str = "actorserve_cpu_ops", sources: list[Path] = SOURCES, build_dir: Path = BUILD_DIR) -> None:
    from torch.utils import cpp_extension

    flags, build_dir = build_target(build_dir, MARCH, EMULATE_BF16)
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's builder runs `ninja` from PATH; the pip-installed one sits beside this interpreter,
    # which is not on PATH when the venv is not activated.
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            # torch rebuilds when the sources or flags change; the digest makes a header change count,
            # and a change of CPU too: -march=native code from another machine can stop on an
            # illegal instruction (machines of one kind do not all expose AVX-512).
            extra_cflags=[*flags, f"-DACTORSERVE_CSRC_DIGEST={_csrc_digest()}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path


def _csrc_digest() -> str:
    digest = hashlib.sha256(_cpu_features().encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _cpu_features() -> str:
    """The CPU's instruction-set flags where Linux lists them, else the processor's name."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"CPU kernels: {'built in ' + str(BUILD_DIR) if cpu_kernels() else 'unavailable (torch path)'}")
