"""Offline throughput: a standard workload through `actorserve.Engine` and through transformers `generate`.

    python -m bench.offline --workload W1-mixed --model tiny-qwen3 [--dtype float32|bfloat16]
        [--threads N] [--baseline-batch-size 16] [--num-requests N] [--no-baseline] [engine flags]

Both sides run in this process, one after the other, with the same dtype and torch threads:

- engine: every request submitted at t=0 to one Engine (`ignore_eos`, greedy, each request's own
  `max_new_tokens`); the clock runs from the first submit to the last answer.
- baseline: transformers `generate` over static batches of `--baseline-batch-size` requests in
  workload order, left padded, greedy. A static batch decodes until its longest request is done,
  so every batch generates exactly its largest `max_new_tokens` (`min_new_tokens` equal to it,
  which also keeps EOS out, like ignore_eos) and the rows that wanted fewer tokens are waste.

Throughput counts useful tokens only: the sum of the requests' own output lengths, the same number
on both sides. `ratio` = engine_tok_s / baseline_tok_s. Each side first runs a small warm-up (and
the engine then drops its prefix cache), so neither pays one-time costs in the timed run. One JSON
object is printed (and appended to `--json`); progress goes to stderr.

Engine flags are EngineConfig's (`--schedule-policy lpm`, `--disable-radix-cache`, ...), spelled
as for `actorserve serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import uvloop

from api.frontend.engine import Engine, GenerateOutput
from api.server.cli import _add_field  # the one definition of how EngineConfig fields become flags
from bench.workloads import Request, make_workload
from runtime.config import EngineConfig

OFFLINE_WORKLOADS = ("W1-mixed", "W1-mixed-64", "W2-shared-prefix")
OWN_FLAGS = ("model_path", "dtype")  # --model and --dtype are this command's own
WARMUP_REQUESTS = 4
WARMUP_NEW_TOKENS = 8


def tiny_qwen3_dir() -> Path:
    """bench.forward's tiny Qwen3: big enough that the forward, not Python, is what gets timed."""
    from gpu.tiny_model import make_tiny_model

    out = Path(tempfile.gettempdir()) / "actorserve-bench-tiny-qwen3"
    if not (out / "model.safetensors").exists():
        make_tiny_model(out, "qwen3", seed=0, vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768)
    return out


def model_path(name: str) -> str | None:
    """tiny-qwen3, smollm2 (None: the Engine's default model) or a checkpoint path."""
    if name == "smollm2":
        return None
    if name == "tiny-qwen3":
        return str(tiny_qwen3_dir())
    return name


# --- the engine side ---------------------------------------------------------------------------------


@dataclass
class EngineRun:
    elapsed_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    stats: dict[str, Any]
    model_dir: Path
    vocab_size: int


async def run_engine(config: dict[str, Any], requests: list[Request]) -> EngineRun:
    async with Engine(**config) as engine:
        await _warm_up(engine)
        start = time.perf_counter()
        outs = await asyncio.gather(*(_generate(engine, r) for r in requests))
        elapsed = time.perf_counter() - start
        assert engine.model_dir is not None
        return EngineRun(
            elapsed_s=elapsed,
            output_tokens=sum(o.completion_tokens for o in outs),
            prompt_tokens=sum(o.prompt_tokens for o in outs),
            cached_tokens=sum(o.cached_tokens for o in outs),
            stats=await engine.current_stats(),
            model_dir=engine.model_dir,
            vocab_size=engine.vocab_size,
        )


def engine_vocab_size(config: dict[str, Any]) -> int:
    """The model's vocabulary, read without starting an engine (the workload needs it first)."""
    from gpu.loader import resolve_model_dir
    from gpu.model_config import ModelConfig

    return ModelConfig.from_dir(resolve_model_dir(config.get("model_path"))).vocab_size


async def _generate(engine: Engine, r: Request) -> GenerateOutput:
    params = {"max_new_tokens": r.max_new_tokens, "temperature": 0, "ignore_eos": True}
    out = await engine.generate(input_ids=r.input_ids, sampling_params=params)
    assert out.finish_reason == "length" and out.completion_tokens == r.max_new_tokens, (out.finish_reason, out.completion_tokens)
    return out


async def _warm_up(engine: Engine) -> None:
    span = engine.vocab_size - 20
    warm = [Request(i, [10 + (i * 13 + j) % span for j in range(16 + 8 * i)], WARMUP_NEW_TOKENS) for i in range(WARMUP_REQUESTS)]
    await asyncio.gather(*(_generate(engine, r) for r in warm))
    # The timed run starts from an empty prefix cache; the last release may trail the answers.
    for _ in range(100):
        if await engine.flush_cache():
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("the engine did not become idle after the warm-up")


# --- the transformers side ---------------------------------------------------------------------------------


@dataclass
class BaselineRun:
    elapsed_s: float
    output_tokens: int  # useful: each request's own max_new_tokens
    generated_tokens: int  # what the static batches computed, padding rows included


def run_baseline(model_dir: Path, dtype: torch.dtype, requests: list[Request], batch_size: int) -> BaselineRun:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generation-config notes per call would flood the output
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if isinstance(pad_id, int) else 0
    warm = [Request(i, [10 + j for j in range(16 + 8 * i)], WARMUP_NEW_TOKENS) for i in range(WARMUP_REQUESTS)]
    _generate_static(model, warm, pad_id)
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(requests), batch_size):
        generated += _generate_static(model, requests[i : i + batch_size], pad_id)
        _progress(f"baseline: {min(i + batch_size, len(requests))}/{len(requests)} requests")
    elapsed = time.perf_counter() - start
    return BaselineRun(elapsed, sum(r.max_new_tokens for r in requests), generated)


def _generate_static(model: Any, batch: list[Request], pad_id: int) -> int:
    """One static batch, left padded; returns the tokens it generated (all rows, to the longest)."""
    width = max(len(r.input_ids) for r in batch)
    ids = torch.tensor([[pad_id] * (width - len(r.input_ids)) + r.input_ids for r in batch])
    mask = torch.tensor([[0] * (width - len(r.input_ids)) + [1] * len(r.input_ids) for r in batch])
    new = max(r.max_new_tokens for r in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=pad_id, use_cache=True,
        )
    assert out.shape == (len(batch), width + new), out.shape
    return len(batch) * new


# --- the command -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1-mixed", choices=OFFLINE_WORKLOADS)
    p.add_argument("--model", default="tiny-qwen3", help="tiny-qwen3, smollm2 (the default model) or a checkpoint path")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both sides")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--num-requests", type=int, default=None, help="keep the first N requests of the workload")
    p.add_argument("--baseline-batch-size", type=int, default=16)
    p.add_argument("--no-baseline", action="store_true", help="engine only")
    p.add_argument("--json", type=Path, default=None, help="also append the result as a JSON line here")
    engine = p.add_argument_group("engine", "EngineConfig fields, as for actorserve serve")
    for f in msgspec.structs.fields(EngineConfig):
        if f.name not in OWN_FLAGS:
            _add_field(engine, f)
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    config = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(EngineConfig) if f.name not in OWN_FLAGS}
    config.update(model_path=model_path(args.model), dtype=args.dtype)
    EngineConfig(**config)  # contradictions are reported before anything loads
    return config


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    config = engine_config(args)
    vocab = engine_vocab_size(config)
    workload = make_workload(args.workload, vocab, seed=args.seed, num_requests=args.num_requests)
    _progress(f"engine: {len(workload.requests)} requests, {workload.output_tokens} output tokens")
    eng = uvloop.run(run_engine(config, workload.requests))
    result = _engine_result(args, config, workload.requests, eng)
    if not args.no_baseline:
        _progress("baseline: transformers generate")
        base = run_baseline(eng.model_dir, getattr(torch, args.dtype), workload.requests, args.baseline_batch_size)
        result.update(
            baseline_tok_s=base.output_tokens / base.elapsed_s,
            baseline_s=base.elapsed_s,
            baseline_generated_tokens=base.generated_tokens,
            baseline_batch_size=args.baseline_batch_size,
            ratio=result["engine_tok_s"] / (base.output_tokens / base.elapsed_s),
        )
    return result


def _engine_result(args: argparse.Namespace, config: dict[str, Any], requests: list[Request], eng: EngineRun) -> dict[str, Any]:
    stats = eng.stats
    return {
        "workload": args.workload,
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "num_requests": len(requests),
        "seed": args.seed,
        "output_tokens": eng.output_tokens,
        "prompt_tokens": eng.prompt_tokens,
        "engine_tok_s": eng.output_tokens / eng.elapsed_s,
        "engine_s": eng.elapsed_s,
        "cached_tokens": eng.cached_tokens,
        "cache_hit_rate": eng.cached_tokens / eng.prompt_tokens,
        "steps": stats["steps"],
        "retractions": stats["retractions"],
        "preemptions": stats["preemptions"],
        "scheduler_s": stats["scheduler_s"],
        "forward_s": stats["forward_s"],
        "kv_pool_size": stats["kv_pool_size"],
        "engine_flags": {k: v for k, v in config.items() if k not in ("model_path", "dtype") and v != _default(k)},
    }


def _default(name: str) -> Any:
    return next(f.default for f in msgspec.structs.fields(EngineConfig) if f.name == name)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json is not None:
        with args.json.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
