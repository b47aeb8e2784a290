"""`--quantization int8`'s matmul per shape: gpu/csrc/int8_matmul.cpp against oneDNN's u8 x s8 kernel.

    python -m bench.int8_matmul [--rows 1,4,16,64,512] [--repeats 9] [--calls 50]

For each of SmolLM2-135M's linear layers (K x N: q/k/v fused, o, gate/up fused, down, the output
layer) an Int8Linear on random weights is called `--calls` times in a row with the same `rows`
activations (so its weights sit in the cache: this times the arithmetic, not the memory), through
each path of our kernel compiled here (512: AVX512-VNNI, 256: AVX2, so one machine times the path
another CPU takes) and through oneDNN's path (the same layer built without the kernel, with the
7-bit weights it gets there unless the CPU has VNNI). Our paths give the same bits (checked, and
oneDNN's too where it sums in int32); the table gives microseconds a call (medians of --repeats,
the columns alternating) and each path's speedup over oneDNN.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gpu.packed_linear import WEIGHT_MAX, Int8Kernels, Int8Linear, int8_kernels

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))  # SmolLM2-135M's, K x N


def call_us(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    args = _args()
    kernels = int8_kernels()
    if kernels is None or kernels.matmul is None:
        raise SystemExit("this CPU has neither AVX512-VNNI nor AVX2 (or the extension did not build): nothing to compare")
    onednn = Int8Kernels(kernels.quantize_rows, kernels.dequantize_rows, matmul=None)
    widths = torch.ops.actorserve.int8_matmul_widths()
    # With VNNI oneDNN's kernel sums in int32 and takes our 8-bit weights; without, 7-bit ones.
    onednn_exact = 512 in widths
    dtype = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {dtype} activations, us per call (median of {args.repeats} x {args.calls} calls)\n")
    header = ["oneDNN us"] + [f"ours {w}-bit us" for w in widths] + [f"speedup {w}-bit" for w in widths]
    print("| K x N | rows | " + " | ".join(header) + " |")
    print("|" + " --- |" * (len(header) + 2))
    for k, n in SHAPES:
        weight = torch.randn(n, k) * 0.05
        ours = Int8Linear([weight], [None], kernels)
        reference = Int8Linear([weight], [None], onednn, weight_max=WEIGHT_MAX if onednn_exact else None)
        for rows in args.rows:
            x = torch.randn(rows, k).to(dtype)
            paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"onednn": reference}
            for w in widths:
                paths[str(w)] = lambda x, w=w: torch.ops.actorserve.int8_matmul_at(
                    x, ours.kernel_weight, ours.kernel_offsets, ours.weight_scale, None, n, w)
            results = {name: path(x) for name, path in paths.items()}
            for name in paths:
                if name != "onednn" and not torch.equal(results[name], results[str(widths[0])]):
                    raise SystemExit(f"{k} x {n} at {rows} rows: the {name}-bit path's result is not the {widths[0]}-bit one's")
            if onednn_exact and not torch.equal(results["onednn"], results[str(widths[0])]):
                raise SystemExit(f"{k} x {n} at {rows} rows: the kernel's result is not oneDNN's")
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, path in paths.items():
                    times[name].append(call_us(path, x, args.calls))
            us = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{us['onednn']:.0f}"] + [f"{us[str(w)]:.0f}" for w in widths] + [f"{us['onednn'] / us[str(w)]:.2f}x" for w in widths]
            print(f"| {k} x {n} | {rows} | " + " | ".join(cells) + " |")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",") if r], default=[1, 4, 16, 64, 512])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--calls", type=int, default=50, help="calls in a row per timing")
    return p.parse_args()


if __name__ == "__main__":
    main()
