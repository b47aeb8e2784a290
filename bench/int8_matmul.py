"""`--quantization int8`'s matmul per shape: gpu/csrc/int8_matmul.cpp against oneDNN's u8 x s8 kernel.

    python -m bench.int8_matmul [--rows 1,4,16,64,512] [--repeats 9] [--calls 50]

For each of SmolLM2-135M's linear layers (K x N: q/k/v fused, o, gate/up fused, down, the output
layer) an Int8Linear on random weights is called `--calls` times in a row with the same `rows`
activations (so its weights sit in the cache: this times the arithmetic, not the memory), through
the AVX512-VNNI kernel and through oneDNN's path (the same layer built without the kernel, as on a
CPU without VNNI). Their results are the same bits; the table gives microseconds a call (medians of
--repeats, the two alternating) and the kernel's speedup.
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
    if kernels is None or kernels.vnni is None:
        raise SystemExit("this CPU has no AVX512-VNNI int8 kernel (or the extension did not build): nothing to compare")
    onednn = Int8Kernels(kernels.quantize_rows, kernels.dequantize_rows, vnni=None)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, bfloat16 activations, us per call (median of {args.repeats} x {args.calls} calls)\n")
    print("| K x N | rows | oneDNN us | ours us | speedup |")
    print("| --- | --- | --- | --- | --- |")
    for k, n in SHAPES:
        weight = torch.randn(n, k) * 0.05
        # 8-bit weights on both: with VNNI, oneDNN's kernel sums in int32 without saturating.
        ours, reference = Int8Linear([weight], [None], kernels), Int8Linear([weight], [None], onednn, weight_max=WEIGHT_MAX)
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            if not torch.equal(ours(x), reference(x)):
                raise SystemExit(f"{k} x {n} at {rows} rows: the kernel's result is not oneDNN's")
            times: dict[str, list[float]] = {"onednn": [], "ours": []}
            for _ in range(args.repeats):
                times["onednn"].append(call_us(reference, x, args.calls))
                times["ours"].append(call_us(ours, x, args.calls))
            a, b = statistics.median(times["onednn"]), statistics.median(times["ours"])
            print(f"| {k} x {n} | {rows} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",") if r], default=[1, 4, 16, 64, 512])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--calls", type=int, default=50, help="calls in a row per timing")
    return p.parse_args()


if __name__ == "__main__":
    main()
