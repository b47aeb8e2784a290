"""The one command for a machine with a GPU: run the CUDA tests, then measure the GPU path.

    python -m bench.gpu_check [--out bench/results_gpu.md] [--quick] [--skip-tests] [--skip-engine]
        [--models tiny-llama,tiny-qwen3,tiny-qwen3-gqa8,smollm2] [--batches 1,8,32,64,128,256]
        [--engine-variants flashinfer+graphs,flashinfer,torch] [--concurrency 1,16,64,256]

1. Runs tests/test_cuda.py and tests/test_graph_runner.py with pytest and records the outcome.
2. Decode step table, straight on a `ModelRunner`: for each model, each batch size, and each of
   flashinfer + CUDA graphs / flashinfer eager / torch eager: milliseconds per decode step at
   CONTEXT tokens of context (random KV, as in bench.forward; the content does not change the
   cost), and whether the greedy tokens of that step agree with torch eager on the same KV.
   Steps are launched back to back with no host sync in between; the clock stops after a
   synchronize, so this is GPU + launch time, not host post-processing. Checked: each FlashInfer
   runner took the decode kernel its GQA group calls for (tensor cores from group 4: the tiny
   models are groups 4, 4 and 8, SmolLM2 3), and its greedy token equals torch eager's in every
   row where torch's top two logits are at least CLEAR_GAP apart (random KV makes many rows
   near-ties, where bf16 kernels may pick either token); every batch starts from KV drawn afresh.
3. Engine table: REQUESTS requests (PROMPT_LEN prompt tokens, NEW_TOKENS generated, greedy) all
   submitted at t=0 through `actorserve.Engine`, with graphs on / off and overlap on / off, flashinfer
   and torch: output tokens per second from the first submit to the last answer.
4. Tensor parallelism (with --tp-size N, default 2 where there are two GPUs): the same workload
   through `Engine(tp_size=N)` (NCCL, flashinfer + graphs, overlap on) against tp_size=1, and
   whether every greedy answer equals tp_size=1's.

Writes a Markdown report to --out and prints it. Without CUDA it says so and exits with status 2;
it exits 1 when the tests or the decode checks failed, 0 otherwise. bfloat16 throughout
(FlashInfer needs half types).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.flashinfer_backend import FlashInferAttention
from gpu.forward_batch import ForwardBatch
from gpu.model_runner import ModelRunner, RunnerConfig
from runtime.forward_mode import ForwardMode

CONTEXT = 256
STEPS = 16
REPEATS = 5
DTYPE = "bfloat16"
REQUESTS, PROMPT_LEN, NEW_TOKENS = 256, 128, 128
CONCURRENCY = (1, 16, 64, 256)
TEST_FILES = ("tests/test_cuda.py", "tests/test_graph_runner.py")
# Rows whose reference top-two logits are this far apart must get the same greedy token from
# every variant: bf16 kernels move these logits by about 0.1 (tests/test_cuda.py's tolerances).
CLEAR_GAP = 0.5
TINY_MODELS = {  # name: (arch, query heads, kv heads), head_dim 64 (a size FlashInfer has kernels for)
    "tiny-llama": ("llama", 8, 2),
    "tiny-qwen3": ("qwen3", 8, 2),
    "tiny-qwen3-gqa8": ("qwen3", 8, 1),
}
DEVICE = "cuda"  # a module constant so the measuring code can be smoke-run on a CPU


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    backend: str
    graphs: bool


@dataclass(frozen=True, slots=True)
class StepResult:
    ms: float  # median per decode step
    tokens: torch.Tensor  # greedy tokens of the first step, one per row
    gaps: torch.Tensor  # the first step's top-two logit gap per row


@dataclass(frozen=True, slots=True)
class DecodeRuns:
    steps: dict[int, StepResult]  # by batch size
    gqa_group: int
    tensor_cores: bool | None  # FlashInfer's decode kernel; None for torch attention


Measured = dict[str, dict[str, DecodeRuns]]  # model: variant name: its runs
RUNNER_VARIANTS = (Variant("flashinfer+graphs", "flashinfer", True), Variant("flashinfer", "flashinfer", False), Variant("torch", "torch", False))


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device here: the GPU path (FlashInfer, CUDA graphs, streams) cannot be checked on this machine.")
        return 2
    sections = [_environment()]
    out = Path(args.out)

    def add(*texts: str) -> None:  # written after each section, so a run cut short keeps what it measured
        sections.extend(texts)
        out.write_text("\n".join(sections))

    tests_ok = True
    if not args.skip_tests:
        tests_ok, text = _run_tests()
        add(text)
    models = {name: _model_dir(name) for name in args.models}
    measured = _measure_decode({k: v for k, v in models.items() if v}, args.batches, _variants([v.name for v in RUNNER_VARIANTS]))
    failures = _decode_failures(measured)
    add(_render_decode(measured, args.batches), _checks_section(failures))
    if not args.skip_engine:
        add(_engine_table({k: v for k, v in models.items() if v}, args.concurrency, _variants(args.engine_variants), args.requests))
    if args.tp_size > 1:
        add(_tp_table({k: v for k, v in models.items() if v}, args.tp_size, args.requests))
    missing = [k for k, v in models.items() if v is None]
    if missing:
        add(f"Not measured (model not available here): {', '.join(missing)}.\n")
    report = "\n".join(sections)
    print(report)
    print(f"written to {args.out}")
    return 0 if tests_ok and not failures else 1


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results_gpu.md")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-engine", action="store_true", help="no engine throughput table (section 3)")
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and requests (a smoke run)")
    p.add_argument("--models", type=_csv, default=[*TINY_MODELS, "smollm2"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in _csv(s)], default=[1, 8, 16, 32, 64, 128, 256])
    p.add_argument("--engine-variants", type=_csv, default=[v.name for v in RUNNER_VARIANTS], help="the engine table's, of " + ", ".join(v.name for v in RUNNER_VARIANTS))
    p.add_argument("--concurrency", type=lambda s: tuple(int(x) for x in _csv(s)), help="the engine table's max running requests (default 1,16,64,256; --quick 1,16)")
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    p.add_argument("--tp-size", type=int, default=2 if two_gpus else 1, help="tensor-parallel ranks for section 4 (1: skip it)")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or ((1, 16) if args.quick else CONCURRENCY)
    unknown = set(args.engine_variants) - {v.name for v in RUNNER_VARIANTS}
    if unknown:
        p.error(f"unknown --engine-variants {', '.join(sorted(unknown))}")
    args.requests = 32 if args.quick else REQUESTS
    if args.quick:
        args.batches = [b for b in args.batches if b <= 32]
    return args


def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _variants(names: list[str]) -> tuple[Variant, ...]:
    have_flashinfer = importlib.util.find_spec("flashinfer") is not None
    return tuple(v for v in RUNNER_VARIANTS if v.name in names and (have_flashinfer or v.backend == "torch"))


# --- report sections ------------------------------------------------------------------------------
def _environment() -> str:
    props = torch.cuda.get_device_properties(0)
    fi = "not installed"
    if importlib.util.find_spec("flashinfer") is not None:
        import flashinfer

        fi = getattr(flashinfer, "__version__", "installed")
    return (
        "# GPU check\n\n"
        f"Command: `python -m bench.gpu_check {' '.join(sys.argv[1:])}`\n\n"
        f"- GPU: {props.name}, {props.total_memory / (1 << 30):.0f} GiB, {props.multi_processor_count} SMs\n"
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), flashinfer {fi}, Python {platform.python_version()}\n"
        f"- dtype {DTYPE}; decode context {CONTEXT} tokens; medians of {REPEATS} runs of {STEPS} steps\n"
    )


def _run_tests() -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", *TEST_FILES]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
    status = "passed" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
    return proc.returncode == 0, f"## Tests: {status}\n\n`{' '.join(cmd[1:])}`\n\n```\n{tail}\n```\n"


def _decode_table(models: dict[str, str], batches: list[int], variants: tuple[Variant, ...]) -> str:
    return _render_decode(_measure_decode(models, batches, variants), batches)


def _measure_decode(models: dict[str, str], batches: list[int], variants: tuple[Variant, ...]) -> Measured:
    return {name: {v.name: _decode_runs(path, v, batches) for v in variants} for name, path in models.items()}


def _render_decode(measured: Measured, batches: list[int]) -> str:
    variants = list(next(iter(measured.values()), {}))
    lines = [
        "## Decode step (ModelRunner)\n",
        "ms per decode step; `agree` = share of the rows clear of a near-tie (torch's top two logits at least "
        f"{CLEAR_GAP} apart) whose greedy token equals torch eager's on the same KV; "
        "`decode kernel` = FlashInfer's for the model's GQA group.\n",
        "| model | batch | " + " | ".join(f"{v} ms" for v in variants) + " | " + " | ".join(f"{v} tok/s" for v in variants)
        + " | agree | GQA group | decode kernel |",
        "| --- | --- | " + " | ".join("---" for _ in range(2 * len(variants))) + " | --- | --- | --- |",
    ]
    for name, runs in measured.items():
        group = next(iter(runs.values())).gqa_group
        for bs in batches:
            ms = [runs[v].steps[bs].ms for v in variants]
            agree = [_agreement([runs[v].steps[bs]], [runs["torch"].steps[bs]]) for v in variants if v != "torch"]
            lines.append(
                f"| {name} | {bs} | " + " | ".join(f"{m:.3f}" for m in ms) + " | "
                + " | ".join(f"{bs / m * 1e3:,.0f}" for m in ms) + f" | {min(agree, default=1.0):.0%} | {group} | {_kernel(runs)} |"
            )
    return "\n".join(lines) + "\n"


def _kernel(runs: dict[str, DecodeRuns]) -> str:
    kernels = {r.tensor_cores for r in runs.values() if r.tensor_cores is not None}
    if not kernels:
        return "-"
    return "mixed" if len(kernels) > 1 else "tensor cores" if kernels == {True} else "CUDA cores"


def _decode_failures(measured: Measured) -> list[str]:
    """What fails the checks of section 2 (see the module doc)."""
    failures = []
    for name, runs in measured.items():
        group = next(iter(runs.values())).gqa_group
        kernel = _kernel(runs)
        if kernel != "-" and kernel != ("tensor cores" if group >= 4 else "CUDA cores"):
            failures.append(f"{name}: GQA group {group} took the {kernel} decode kernel")
        reference = list(runs["torch"].steps.values())
        if not any(bool((r.gaps >= CLEAR_GAP).any()) for r in reference):
            failures.append(f"{name}: no row is clear of a near-tie, nothing to compare")
        for variant, run in runs.items():
            agree = _agreement(list(run.steps.values()), reference)
            if agree < 1.0:
                failures.append(f"{name}: {variant} differs from torch eager in {1 - agree:.1%} of the rows clear of a near-tie")
    return failures


def _checks_section(failures: list[str]) -> str:
    if not failures:
        return "## Decode checks: passed\n\nEvery FlashInfer runner took its GQA group's decode kernel and agreed with torch eager.\n"
    return "## Decode checks: FAILED\n\n" + "\n".join(f"- {f}" for f in failures) + "\n"


def _engine_table(models: dict[str, str], concurrency: tuple[int, ...], variants: tuple[Variant, ...], requests: int) -> str:
    lines = [
        "## Engine throughput (all requests at t=0)\n",
        f"{requests} requests, {PROMPT_LEN} prompt + {NEW_TOKENS} new tokens each, greedy; output tokens per second. "
        "`max running` caps the decode batch.\n",
        "| model | variant | overlap | max running | tok/s | wall s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, path in models.items():
        for v in variants:
            for overlap in (True, False):
                for running in concurrency:
                    tok_s, wall, _ = asyncio.run(_engine_run(path, v, overlap, running, requests))
                    lines.append(f"| {name} | {v.name} | {'on' if overlap else 'off'} | {running} | {tok_s:,.0f} | {wall:.2f} |")
    return "\n".join(lines) + "\n"


def _tp_table(models: dict[str, str], tp_size: int, requests: int) -> str:
    lines = [
        f"## Tensor parallelism (tp_size {tp_size} against 1)\n",
        f"{requests} requests as above, flashinfer + CUDA graphs, overlap on, 64 running.\n",
        "| model | tp_size | tok/s | wall s | answers equal tp_size 1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    variant = RUNNER_VARIANTS[0]
    for name, path in models.items():
        reference: list[list[int]] = []
        for tp in (1, tp_size):
            tok_s, wall, answers = asyncio.run(_engine_run(path, variant, True, 64, requests, tp_size=tp))
            reference = reference or answers
            lines.append(f"| {name} | {tp} | {tok_s:,.0f} | {wall:.2f} | {'yes' if answers == reference else 'NO'} |")
    return "\n".join(lines) + "\n"


# --- measurements ---------------------------------------------------------------------------------
def _decode_runs(path: str, variant: Variant, batches: list[int]) -> DecodeRuns:
    max_bs = max(batches)
    runner = ModelRunner(
        RunnerConfig(
            model_path=path, dtype=DTYPE, device=DEVICE, max_total_tokens=max_bs * (CONTEXT + STEPS * (REPEATS + 2)) + 64,
            max_running_requests=max_bs, attention_backend=variant.backend, disable_cuda_graph=not variant.graphs, cuda_graph_max_bs=max_bs,
        )
    )
    mc = runner.model_config
    out = DecodeRuns(
        {bs: _decode_one(runner, bs) for bs in batches}, mc.num_heads // mc.num_kv_heads, runner.attn.use_tensor_cores if isinstance(runner.attn, FlashInferAttention) else None
    )
    del runner
    _free_cached()
    return out


def _random_kv(runner: ModelRunner) -> None:
    # The same seed and shapes in every runner, so their KV and hence their logits are comparable.
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for t in runner.kv.k + runner.kv.v:
        t.normal_(generator=gen)


def _decode_one(runner: ModelRunner, bs: int) -> StepResult:
    """Decode `bs` requests at CONTEXT tokens: the first step's tokens, then the timed steps."""
    # Fresh for each batch: the timed steps of the batch before wrote their own greedy tokens'
    # KV, which differ between variants at near-ties, into slots this batch may get.
    _random_kv(runner)
    total = CONTEXT + STEPS * (REPEATS + 2)
    rows = [runner.req_to_token.alloc() for _ in range(bs)]
    slots = [runner.allocator.alloc(total) for _ in range(bs)]
    try:
        for row, s in zip(rows, slots):
            runner.req_to_token.write(row, 0, s)
        slot_table = torch.stack(slots)  # [bs, total] on the device
        rows_dev = torch.tensor(rows, device=DEVICE)
        tokens = torch.arange(bs, device=DEVICE) % runner.vocab_size
        pos = CONTEXT

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            nonlocal pos
            batch = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=tokens, positions=torch.full((bs,), pos, device=DEVICE),
                out_cache_loc=slot_table[:, pos], req_rows=rows_dev, prefix_lens=[pos] * bs, extend_lens=[1] * bs,
            )
            pos += 1
            return runner.forward(batch)

        top2 = forward(tokens).float().topk(2, dim=-1)
        first, gaps = top2.indices[:, 0].cpu(), (top2.values[:, 0] - top2.values[:, 1]).cpu()
        pos = CONTEXT  # the timed steps rewrite the same positions: the cost does not depend on the values
        ms = _median_ms(lambda: _timed_steps(lambda t: forward(t).argmax(-1), tokens))
        return StepResult(ms, first, gaps)
    finally:
        for row, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_to_token.free(row)


def _timed_steps(step: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(STEPS):
        tokens = step(tokens)
    _sync()
    return (time.perf_counter() - start) / STEPS


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _free_cached() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _median_ms(fn: Callable[[], float]) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(REPEATS)) * 1e3


def _agreement(results: list[StepResult], reference: list[StepResult]) -> float:
    """Share of the rows clear of a near-tie in `reference` where `results` chose the same token
    (1.0 when no row is clear)."""
    tokens, wanted = torch.cat([r.tokens for r in results]), torch.cat([r.tokens for r in reference])
    clear = torch.cat([r.gaps for r in reference]) >= CLEAR_GAP
    return float((tokens[clear] == wanted[clear]).float().mean()) if bool(clear.any()) else 1.0


async def _engine_run(
    path: str, variant: Variant, overlap: bool, running: int, requests: int, tp_size: int = 1
) -> tuple[float, float, list[list[int]]]:
    from api.frontend.engine import Engine

    gen = torch.Generator().manual_seed(0)
    config = dict(
        model_path=path, device=DEVICE, dtype=DTYPE, attention_backend=variant.backend, disable_cuda_graph=not variant.graphs,
        disable_overlap_schedule=not overlap, max_running_requests=running, cuda_graph_max_bs=running,
        max_total_tokens=requests * (PROMPT_LEN + NEW_TOKENS) + 1024,  # all of them fit: no retraction
        tp_size=tp_size,
    )
    async with Engine(**config) as engine:
        vocab = engine.vocab_size
        prompts = [torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(requests)]
        params = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}
        await engine.generate(input_ids=prompts[0][:8], sampling_params={"max_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(input_ids=p, sampling_params=params) for p in prompts))
        wall = time.perf_counter() - start
    del engine
    _free_cached()
    return sum(len(o.output_ids) for o in outs) / wall, wall, [o.output_ids for o in outs]


def _model_dir(name: str) -> str | None:
    if name == "smollm2":
        try:
            from gpu.gguf_loader import default_model_path, gguf_to_hf_dir

            return str(gguf_to_hf_dir(default_model_path()))
        except Exception as exc:  # the GGUF package is optional; say what is missing
            print(f"smollm2 unavailable: {exc}", file=sys.stderr)
            return None
    if name not in TINY_MODELS:
        return name  # a checkpoint directory
    from gpu.tiny_model import make_tiny_model

    arch, heads, kv_heads = TINY_MODELS[name]
    out = Path(tempfile.gettempdir()) / f"actorserve-gpu-check-{name}"
    if not (out / "model.safetensors").exists():
        make_tiny_model(out, arch, vocab_size=4096, hidden_size=512, num_layers=4, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, intermediate_size=1536)
    return str(out)


if __name__ == "__main__":
    sys.exit(main())
