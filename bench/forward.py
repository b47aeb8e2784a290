"""Forward-pass speed: the engine's paged model runner against transformers' contiguous cache.

    python -m bench.forward [--model tiny-qwen3|smollm2|PATH] [--dtype float32|bfloat16] [--repeats 5] [--tp-size N]
        [--quantization int8,gguf] [--kv-cache-dtype auto|int8]

Decode: one step at batch 1 / 16 / 64 with 256 tokens of context per request, then at batch 64 / 128
with contexts drawn uniformly from 33..768 (W1-mixed's spread, which uniform batches hide: padding
to the longest request is what such a batch costs). transformers gets the mixed batch the way
static batching does, left-padded to the longest context with an attention mask. The KV content
does not change the cost, so both sides start from random KV instead of a slow real prefill.
Prefill: one 512-token prompt; both sides compute logits for the last token only.
Times are medians over --repeats runs of --steps decode steps each. On a CPU, "torch path" is the
same runner without the CPU kernels (compiled decode attention, packed linears: `cpu_kernels`), and
"its matmuls alone" times the prefill's linear layers by themselves, the bound for the prefill.
--tp-size N adds a column: the same runner split over N tensor-parallel ranks (gloo on a CPU), each
with cpu_count / N torch threads; the other columns use every thread. --quantization adds a column
per quantization named (and its speedup over transformers in --dtype): the same runner with int8
linear layers (int8: gpu/packed_linear.py's Int8Linear) or with the GGUF file's Q4/Q8 blocks as they
are (gguf: gpu/gguf_linear.py), activations in --dtype. --kv-cache-dtype int8 gives every engine
column 8-bit K/V rows (gpu/kv_quant.py); transformers keeps its cache in --dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu.forward_batch import ForwardBatch
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.tp_ranks import Rendezvous, TPRanks
from runtime.config import QUANTIZATIONS

CONTEXT = 256
MIXED_CONTEXT = (33, 768)
PREFILL = 512


def main() -> None:
    args = _args()
    torch.manual_seed(0)
    model_path = _model_path(args.model)
    max_bs = max(args.batches + args.mixed_batches)
    pool = max_bs * (max(CONTEXT, MIXED_CONTEXT[1]) + args.steps + 1) + PREFILL
    config = RunnerConfig(model_path=model_path, dtype=args.dtype, max_running_requests=max_bs, max_total_tokens=pool, kv_cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(config)
    # The same runner without the CPU kernels: the compiled decode attention and packed linears.
    plain = ModelRunner(dataclasses.replace(config, cpu_kernels=False)) if runner.device.type == "cpu" and not args.no_torch_path else None
    hf = _hf_model(runner.model_dir, runner.dtype)
    threads = torch.get_num_threads()
    split = _split_runner(config, args.tp_size, threads) if args.tp_size > 1 else None
    quantized = {q: ModelRunner(dataclasses.replace(config, quantization=q)) for q in args.quantization}
    print(f"model={args.model} dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} threads={threads} steps={args.steps} repeats={args.repeats}")
    headers = ["engine ms"] + (["torch path ms"] if plain else []) + ([f"engine tp={args.tp_size} ms"] if split else [])
    headers += [f"engine {q} ms" for q in quantized]
    speedups = ["engine speedup"] + [f"{q} speedup" for q in quantized]
    print(f"{'case':<30}" + "".join(f"{h:>18}" for h in headers + ["transformers ms"] + speedups))
    cases = [(f"decode bs={bs} ctx={CONTEXT}", [CONTEXT] * bs) for bs in args.batches]
    lo, hi = MIXED_CONTEXT
    cases += [(f"decode bs={bs} ctx={lo}..{hi}", torch.randint(lo, hi + 1, (bs,)).tolist()) for bs in args.mixed_batches]
    try:
        for case, contexts in cases:
            decode = lambda r: _median(lambda: _engine_decode(r, contexts, args.steps), args.repeats) / args.steps  # noqa: E731
            baseline = _median(lambda: _hf_decode(hf, contexts, args.steps), args.repeats) / args.steps
            _row(case, [decode(runner), decode(plain) if plain else None, _on_split(split, decode)], baseline, [decode(r) for r in quantized.values()])
        prefill = lambda r: _median(lambda: _engine_prefill(r), args.repeats)  # noqa: E731
        baseline = _median(lambda: _hf_prefill(hf, runner.vocab_size), args.repeats)
        engine = prefill(runner)
        _row(f"prefill {PREFILL} tokens", [engine, prefill(plain) if plain else None, _on_split(split, prefill)], baseline, [prefill(r) for r in quantized.values()])
        limit = _median(lambda: _prefill_matmuls(runner), args.repeats)
        print(f"{'  its matmuls alone':<30}{limit * 1e3:>18.2f}   (prefill / matmuls: {engine / limit:.2f}x)")
    finally:
        if split is not None:
            split[0].close(graceful=True)


def _split_runner(config: RunnerConfig, tp_size: int, threads: int) -> tuple[TPRanks, ModelRunner, int]:
    """Ranks 1.. in their own processes; this process is rank 0 (its threads set per measurement)."""
    per_rank = max(1, threads // tp_size)
    ranks = TPRanks(Rendezvous.choose(None, tp_size, config.device, 300.0), config, per_rank)
    return ranks, ranks.load(), per_rank


def _on_split(split: tuple[TPRanks, ModelRunner, int] | None, measure: Callable[[ModelRunner], float]) -> float | None:
    if split is None:
        return None
    _, runner, per_rank = split
    threads = torch.get_num_threads()
    torch.set_num_threads(per_rank)
    try:
        return measure(runner)
    finally:
        torch.set_num_threads(threads)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3", help="tiny-qwen3, smollm2, or a checkpoint path")
    p.add_argument("--dtype", default="float32")
    sizes = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--batches", type=sizes, default=[1, 16, 64], help="decode batch sizes, every context 256")
    p.add_argument("--mixed-batches", type=sizes, default=[64, 128], help="decode batch sizes, contexts 33..768 ('' for none)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tp-size", type=int, default=1, help="also time the runner split over this many tensor-parallel ranks")
    p.add_argument("--no-torch-path", action="store_true", help="skip the column without the CPU kernels")
    p.add_argument("--quantization", type=_quantizations, default=[],
                   help="also time the runner with int8 linear layers (int8) or the GGUF file's blocks kept (gguf); comma-separated")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto", help="the engine's KV pools: the model's dtype or 8-bit rows")
    return p.parse_args()


def _model_path(name: str) -> str | None:
    if name == "smollm2":
        return None
    if name != "tiny-qwen3":
        return name
    from gpu.tiny_model import make_tiny_model

    out = Path(tempfile.gettempdir()) / "actorserve-bench-tiny-qwen3"
    # A "tiny" model big enough that the forward, not Python overhead, is what gets timed.
    make_tiny_model(out, "qwen3", seed=0, vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768)
    return str(out)


def _hf_model(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def _median(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


def _quantizations(text: str) -> list[str]:
    names = [q for q in text.split(",") if q]
    unknown = set(names) - set(QUANTIZATIONS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown quantization {', '.join(sorted(unknown))}; choose {', '.join(QUANTIZATIONS)}")
    return names


def _row(case: str, engine_s: list[float | None], baseline_s: float, quantized_s: list[float]) -> None:
    times = [t for t in [*engine_s, *quantized_s] if t is not None]
    cells = "".join(f"{t * 1e3:>18.2f}" for t in times)
    speedups = "".join(f"{baseline_s / t:>17.2f}x" for t in [engine_s[0], *quantized_s])
    print(f"{case:<30}{cells}{baseline_s * 1e3:>18.2f}{speedups}")


def _engine_decode(runner: ModelRunner, contexts: list[int], steps: int) -> float:
    bs = len(contexts)
    rows = [runner.req_to_token.alloc() for _ in range(bs)]
    slots = [runner.allocator.alloc(ctx + steps) for ctx in contexts]
    try:
        for row, s in zip(rows, slots):
            runner.req_to_token.write(row, 0, s)
        tokens = torch.randint(0, runner.vocab_size, (bs,)).tolist()
        start = time.perf_counter()
        for step in range(steps):
            out_loc = torch.stack([s[ctx + step] for s, ctx in zip(slots, contexts)])
            prefix_lens = [ctx + step for ctx in contexts]
            batch = ForwardBatch.build([[t] for t in tokens], rows, prefix_lens, out_loc, runner.device)
            tokens = runner.sampler.greedy(runner.forward(batch)).tolist()  # what the engine's sampler does
        return time.perf_counter() - start
    finally:
        for row, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_to_token.free(row)


def _hf_decode(hf, contexts: list[int], steps: int) -> float:
    from transformers import DynamicCache

    cfg = hf.config
    bs, longest = len(contexts), max(contexts)
    cache = DynamicCache(config=cfg)
    kv_shape = (bs, cfg.num_key_value_heads, longest, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(kv_shape, dtype=hf.dtype), torch.randn(kv_shape, dtype=hf.dtype), layer)
    # Left padding, as in static-batch generate; no mask at all when every context is equal.
    pad = torch.tensor([longest - ctx for ctx in contexts])
    mask = torch.arange(longest + steps)[None, :] >= pad[:, None] if int(pad.max()) else None
    tokens = torch.randint(0, cfg.vocab_size, (bs, 1))
    start = time.perf_counter()
    with torch.inference_mode():
        for step in range(steps):
            positions = torch.tensor(contexts)[:, None] + step
            attention_mask = None if mask is None else mask[:, : longest + step + 1].long()
            out = hf(input_ids=tokens, position_ids=positions, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - start


def _engine_prefill(runner: ModelRunner) -> float:
    row = runner.req_to_token.alloc()
    slots = runner.allocator.alloc(PREFILL)
    try:
        runner.req_to_token.write(row, 0, slots)
        ids = torch.randint(0, runner.vocab_size, (PREFILL,)).tolist()
        start = time.perf_counter()
        runner.forward(ForwardBatch.build([ids], [row], [0], slots, runner.device))
        return time.perf_counter() - start
    finally:
        runner.allocator.free(slots)
        runner.req_to_token.free(row)


def _prefill_matmuls(runner: ModelRunner) -> float:
    """The prefill's linear layers alone, as the runner runs them (packed or not), on inputs of the
    prefill's shapes: the bound the rest of the forward is measured against."""
    model, layout = runner.model, runner.layout
    hidden = torch.randn(PREFILL, runner.model_config.hidden_size, dtype=runner.dtype)
    heads_out = torch.randn(PREFILL, layout.num_heads * runner.model_config.head_dim, dtype=runner.dtype)
    mlp_out = torch.randn(PREFILL, layout.intermediate_size, dtype=runner.dtype)
    start = time.perf_counter()
    with torch.inference_mode():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for proj in [attn.qkv] if attn.qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]:
                proj(hidden)
            attn.o_proj(heads_out)
            for proj in [mlp.gate_up] if mlp.gate_up is not None else [mlp.gate_proj, mlp.up_proj]:
                proj(hidden)
            mlp.down_proj(mlp_out)
        last = hidden[-1:]
        model.packed_head(last) if model.packed_head is not None else F.linear(last, model.output_weight())
    return time.perf_counter() - start


def _hf_prefill(hf, vocab_size: int) -> float:
    ids = torch.randint(0, vocab_size, (1, PREFILL))
    start = time.perf_counter()
    with torch.inference_mode():
        hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
