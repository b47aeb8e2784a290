"""Static-batch generation straight on a `ModelRunner`, without the scheduler.

All prompts are prefilled together, then decoded together until each one stops. It is the
smallest complete use of the runner: the `generate` command and the parity tests use it, and it
is the reference the scheduled engine is compared against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu.forward_batch import ForwardBatch
from gpu.model_runner import ModelRunner
from gpu.sampler import SamplingInfo
from runtime.req import token_finish
from runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerationOutput:
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Running:
    index: int
    row: int
    prompt: list[int]
    params: SamplingParams
    slots: torch.Tensor
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def check_prompt(prompt: Sequence[int], max_new_tokens: int, context_len: int, vocab_size: int) -> None:
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) + max_new_tokens > context_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens and asks for {max_new_tokens} new tokens, "
            f"more than the context length of {context_len} tokens"
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def generate(runner: ModelRunner, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[GenerationOutput]:
    """Generate for every prompt as one batch; KV slots and rows are returned before returning."""
    if len(prompts) != len(params):
        raise ValueError("generate needs one SamplingParams per prompt")
    for prompt, p in zip(prompts, params):
        check_prompt(prompt, p.max_new_tokens, runner.context_len, runner.vocab_size)
        error = p.validation_error(runner.vocab_size)
        if error:
            raise ValueError(error)
    running = _admit(runner, prompts, params)
    try:
        _run(runner, running)
    finally:
        for r in running:
            runner.allocator.free(r.slots)
            runner.req_to_token.free(r.row)
    return [GenerationOutput(r.output, r.finish_reason or "length", r.logprobs) for r in running]


def _admit(runner: ModelRunner, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[_Running]:
    running: list[_Running] = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        row = runner.req_to_token.alloc()
        slots = runner.allocator.alloc(len(prompt) + p.max_new_tokens)
        if row is None or slots is None:
            for r in running:
                runner.allocator.free(r.slots)
                runner.req_to_token.free(r.row)
            if row is not None:
                runner.req_to_token.free(row)
            raise RuntimeError(f"{len(prompts)} prompts do not fit in the KV pool or the request rows at once")
        runner.req_to_token.write(row, 0, slots)
        running.append(_Running(i, row, list(prompt), p, slots))
    return running


def _run(runner: ModelRunner, running: list[_Running]) -> None:
    active = [r for r in running if r.params.max_new_tokens > 0]
    for r in running:
        if r.params.max_new_tokens == 0:
            r.finish_reason = "length"
    inputs = [r.prompt for r in active]
    prefix = [0] * len(active)
    while active:
        lens = [len(ids) for ids in inputs]
        out_loc = torch.cat([r.slots[p : p + n] for r, p, n in zip(active, prefix, lens)])
        batch = ForwardBatch.build(inputs, [r.row for r in active], prefix, out_loc, runner.device)
        info = SamplingInfo.from_params([r.params for r in active], runner.device)
        result = runner.sample(
            runner.forward(batch),
            info,
            output_ids=[r.output for r in active],
            prompt_ids=[r.prompt for r in active],
            steps=[len(r.output) for r in active],
        )
        tokens = result.token_ids.tolist()
        for j, r in enumerate(active):
            r.output.append(tokens[j])
            if result.logprobs is not None:
                r.logprobs.append(float(result.logprobs[j]))
            final = len(r.output) >= r.params.max_new_tokens  # this loop is its own scheduler
            reason = token_finish(r.params, len(r.output), tokens[j], runner.model_config.eos_token_ids, final)
            r.finish_reason = None if reason is None else reason.kind
        prefix = [p + n for p, n in zip(prefix, lens)]
        keep = [j for j, r in enumerate(active) if r.finish_reason is None]
        active = [active[j] for j in keep]
        prefix = [prefix[j] for j in keep]
        inputs = [[r.output[-1]] for r in active]
