"""Does a host-tier load overlap the forward? One prefill whose prefix comes back from the host tier.

    python -m bench.host_tier_overlap [--prefix 32768] [--new 1024] [--layers 16] [--hidden 1536]
        [--repeats 7] [--backend flashinfer|torch] [--device cuda]

A random model (llama, head_dim 64) on a ModelRunner; one request whose first PREFIX tokens'
KV sits in pinned host buffers (the host tier's), and NEW tokens to prefill after them. Timed,
medians of REPEATS after a warm-up, clock stopped after a synchronize:

- forward: the prefill alone, its prefix already on the device;
- loads: the prefix's KV copied to the device, every layer;
- loads, then forward: the loads made before the forward starts (what a forward that does not
  go layer by layer, such as a captured graph, gets);
- layer by layer: gpu/kv_pool.py's LayerLoads as the Executor issues them: every layer's copy
  on the side stream at once, the forward waiting for each layer's just before that layer.

`overlap` is the time layer by layer saves against loads-then-forward, as a share of the most
it could save (the shorter of the two parts). On a CPU LayerLoads copies on the forward's thread,
so nothing overlaps there (a smoke run: `--device cpu --backend torch`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.cuda_streams import StepStreams
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVMove, LayerLoads
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.tiny_model import make_tiny_model


@dataclass(frozen=True, slots=True)
class Timings:
    forward_ms: float
    loads_ms: float
    serial_ms: float  # loads, then the forward
    layered_ms: float  # LayerLoads: each layer's load just before it
    same_logits: bool  # layer by layer onto a zeroed prefix gives the forward's logits, bit for bit

    @property
    def overlap(self) -> float:
        """Share of the most that overlapping could save (the shorter part) that it saved."""
        return (self.serial_ms - self.layered_ms) / min(self.forward_ms, self.loads_ms)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("No CUDA device here: this measures copies that overlap a GPU's forward (--device cpu for a smoke run).")
        return 2
    runner = _runner(args)
    t = measure(runner, args.prefix, args.new, args.repeats)
    kv_bytes = runner.kv_bytes_per_token() * args.prefix
    print(_report(args, runner, t, kv_bytes))
    return 0 if t.same_logits else 1


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=32768, help="tokens loaded from the host tier")
    p.add_argument("--new", type=int, default=1024, help="tokens prefilled after them")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backend", choices=("flashinfer", "torch"), default="flashinfer")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    return p.parse_args(argv)


def _runner(args: argparse.Namespace) -> ModelRunner:
    heads = args.hidden // 64
    path = Path(tempfile.gettempdir()) / f"actorserve-host-tier-overlap-{args.layers}x{args.hidden}"
    make_tiny_model(
        path, "llama", dtype=args.dtype, vocab_size=4096, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=64, intermediate_size=args.hidden * 3,
        max_position_embeddings=args.prefix + args.new + 64,
    )
    return ModelRunner(
        RunnerConfig(
            model_path=str(path), dtype=args.dtype, device=args.device, max_total_tokens=args.prefix + args.new + 64,
            max_running_requests=2, attention_backend=args.backend, disable_cuda_graph=True,
        )
    )


def measure(runner: ModelRunner, prefix: int, new: int, repeats: int) -> Timings:
    """The four timings of one request: PREFIX tokens from the host tier, NEW prefilled after them."""
    device = runner.kv.k[0].device
    host = runner.kv.host_buffers(prefix)
    for t in host.k + host.v:
        t.normal_()
    row, slots = runner.req_to_token.alloc(), runner.allocator.alloc(prefix + new)
    runner.req_to_token.write(row, 0, slots)
    streams = StepStreams(device) if device.type == "cuda" else None
    move = KVMove(False, slots[:prefix], torch.arange(prefix))

    def batch(loads: LayerLoads | None) -> ForwardBatch:  # a fresh one: a forward may keep state on it
        fb = ForwardBatch.build([[3 + i % 4000 for i in range(new)]], [row], [prefix], slots[prefix:], device)  # ids < vocab 4096
        fb.layer_loads = loads
        return fb

    def loads(side: torch.cuda.Stream | None) -> LayerLoads:
        return LayerLoads([move], host, runner.kv, side)

    def forward() -> torch.Tensor:
        return runner.forward(batch(None))

    def copies() -> None:
        loads(None).finish()

    def serial() -> None:
        copies()
        forward()

    def layered() -> torch.Tensor:
        return runner.forward(batch(loads(streams.loads if streams is not None else None)))

    try:
        with torch.inference_mode():
            for mine, theirs in zip(runner.kv.k + runner.kv.v, host.k + host.v):
                mine[slots[:prefix]] = theirs.to(device)  # the prefix there without LayerLoads
            expected = forward()
            timings = [_median_ms(fn, device, repeats) for fn in (forward, copies, serial, layered)]
            for t in runner.kv.k + runner.kv.v:
                t[slots[:prefix]] = 0  # only loads made before each layer can give the same logits
            same = torch.equal(layered(), expected)
        return Timings(*timings, same_logits=same)
    finally:
        runner.allocator.free(slots)
        runner.req_to_token.free(row)
        if streams is not None:
            streams.close()


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: kernels, plans, the allocator's first blocks
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _report(args: argparse.Namespace, runner: ModelRunner, t: Timings, kv_bytes: int) -> str:
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    mc = runner.model_config
    return "\n".join([
        f"# Host-tier load against the forward ({where}, {args.backend}, {args.dtype})\n",
        f"A {mc.num_layers}-layer random llama (hidden {mc.hidden_size}, {mc.num_heads}/{mc.num_kv_heads} heads of 64); "
        f"one request: {args.prefix} prefix tokens from host buffers ({kv_bytes / 2**20:.0f} MiB of KV, "
        f"{kv_bytes / t.loads_ms / 1e6:.1f} GB/s alone), {args.new} new tokens prefilled. Medians of {args.repeats}.\n",
        "| forward ms | loads ms | loads, then forward ms | layer by layer ms | overlap | logits as with the prefix there |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {t.forward_ms:.2f} | {t.loads_ms:.2f} | {t.serial_ms:.2f} | {t.layered_ms:.2f} | {t.overlap:.0%} | {'yes' if t.same_logits else 'NO'} |",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
