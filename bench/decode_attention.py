"""CPU decode attention against the memory bandwidth: the compiled kernel's bytes/s over a plain read
of the same K/V bytes, measured in the same run.

    python -m bench.decode_attention [--batch 64] [--context 256] [--layers 30] [--dtype bfloat16]
        [--heads 9] [--kv-heads 3] [--head-dim 64] [--scatter] [--repeats 15] [--width 512|256|0]
        [--kv-cache-dtype auto|int8]

Every layer has a K and a V pool of its own, as in the engine, and a decode step reads each once,
so with `--layers` pools together larger than the last-level cache each call reads its rows from
memory. Per layer, medians over --repeats passes through all layers:
- `kernel`: gpu/cpu_ops.py's decode_attention (one query token per request, `--context` keys each);
- `plain read`: a reduction over the same pools (`max` over their bytes as int64, two reads of
  a 64-byte line per instruction at most), the bandwidth a pass over those bytes gets here;
- `in cache`: the kernel on one layer's pools again and again, its cost without waiting on memory.
Slots are contiguous per request (what a fresh allocation gives) unless --scatter spreads each
request's slots over the whole pool at random. --width picks the kernel's path: the widest vectors
in bits it may use (512: AVX-512, 256: AVX2, 0: the generic loops; default the widest compiled), so
one machine can time the path another CPU would take. --kv-cache-dtype int8 makes the pools 8-bit
rows with their scales (gpu/kv_quant.py), as `--kv-cache-dtype int8` makes the engine's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu.cpu_ops import cpu_kernels
from gpu.kv_quant import quantize_rows


@dataclass(frozen=True, slots=True)
class Pools:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    q: torch.Tensor
    req_to_token: torch.Tensor
    req_rows: torch.Tensor
    key_begin: torch.Tensor
    key_end: torch.Tensor
    scale: float

    @property
    def bytes_per_layer(self) -> int:
        """What one layer's call reads of the pools: every request's K and V rows."""
        rows = int((self.key_end - self.key_begin).sum())
        return 2 * rows * self.k[0].shape[1] * self.k[0].shape[2] * self.k[0].element_size()


def make_pools(args: argparse.Namespace) -> Pools:
    dtype = getattr(torch, args.dtype)
    slots = args.batch * args.context
    store = quantize_rows if args.kv_cache_dtype == "int8" else (lambda x: x.to(dtype))
    k = [store(torch.randn(slots, args.kv_heads, args.head_dim)) for _ in range(args.layers)]
    v = [store(torch.randn(slots, args.kv_heads, args.head_dim)) for _ in range(args.layers)]
    order = torch.randperm(slots) if args.scatter else torch.arange(slots)
    req_to_token = order.view(args.batch, args.context).to(torch.int32).contiguous()
    return Pools(
        k, v, torch.randn(args.batch, args.heads, args.head_dim).to(dtype), req_to_token, torch.arange(args.batch),
        torch.zeros(args.batch, dtype=torch.long), torch.full((args.batch,), args.context, dtype=torch.long), args.head_dim**-0.5,
    )


def per_layer_ms(fn: Callable[[int], object], layers: int, repeats: int) -> float:
    """Median over `repeats` passes of fn(layer) for every layer, in ms per layer (one warm-up)."""
    def one_pass() -> float:
        start = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        return (time.perf_counter() - start) / layers * 1e3

    one_pass()
    return statistics.median(one_pass() for _ in range(repeats))


def main() -> None:
    args = _args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not built here (python -m gpu.cpu_ops says why)")
    widths = torch.ops.actorserve.decode_attention_widths()
    width = widths[0] if args.width is None else args.width
    if width not in widths:
        raise SystemExit(f"--width {width} is not compiled here; choose one of {widths}")
    p = make_pools(args)

    def attend(layer: int) -> None:
        torch.ops.actorserve.decode_attention_at(p.q, p.k[layer], p.v[layer], p.req_to_token, p.req_rows, p.key_begin, p.key_end, p.scale, width)

    def read(layer: int) -> None:
        p.k[layer].view(-1).view(torch.int64).max()
        p.v[layer].view(-1).view(torch.int64).max()

    # Alternating, so that a change in the machine's load falls on both alike.
    kernel_ms, read_ms = [], []
    for _ in range(args.rounds):
        kernel_ms.append(per_layer_ms(attend, args.layers, args.repeats))
        read_ms.append(per_layer_ms(read, args.layers, args.repeats))
    cached_ms = per_layer_ms(lambda _: attend(0), args.layers, args.repeats)
    kernel, plain = statistics.median(kernel_ms), statistics.median(read_ms)
    mb = p.bytes_per_layer / 1e6
    print(f"decode attention, batch {args.batch} x {args.context} keys, {args.heads} heads / {args.kv_heads} K/V heads x "
          f"{args.head_dim}, {args.dtype}{', int8 K/V' if args.kv_cache_dtype == 'int8' else ''}, {args.layers} layers' pools ({mb * args.layers:.0f} MB), slots "
          f"{'scattered' if args.scatter else 'contiguous'}, vectors of at most {width} bits, {torch.get_num_threads()} threads\n")
    print("| pass | ms per layer | GB/s |")
    print("| --- | --- | --- |")
    print(f"| kernel | {kernel:.3f} | {mb / kernel:.1f} |")
    print(f"| plain read | {plain:.3f} | {mb / plain:.1f} |")
    print(f"| kernel, in cache | {cached_ms:.3f} | |")
    print(f"\nkernel at {plain / kernel:.0%} of the plain read's bandwidth")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--layers", type=int, default=30, help="pools, one pair per layer (SmolLM2-135M has 30)")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--scatter", action="store_true", help="each request's slots spread over the pool at random")
    p.add_argument("--repeats", type=int, default=15, help="passes through all layers per round")
    p.add_argument("--width", type=int, default=None, help="the kernel's widest vectors in bits: 512, 256 or 0 (generic)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto", help="int8: 8-bit K/V rows with their scales")
    p.add_argument("--rounds", type=int, default=3, help="kernel and plain read alternate this many times")
    return p.parse_args()


if __name__ == "__main__":
    main()
