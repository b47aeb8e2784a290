"""The engine's model runner against Hugging Face transformers on the same tiny random weights."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.forward_batch import ForwardBatch
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from runtime.forward_mode import ForwardMode
from runtime.sampling_params import SamplingParams

TOLERANCE = 1e-4


@dataclass
class Seq:
    """One request's tokens and KV slots, grown the way the Adder grows them."""

    row: int
    tokens: list[int]
    slots: torch.Tensor
    computed: int = 0  # tokens whose KV is in the pool


def _grow(runner: ModelRunner, seq: Seq, new_tokens: list[int]) -> None:
    last = int(seq.slots[-1]) if seq.slots.numel() else None
    more = runner.allocator.alloc_extend(seq.slots.numel(), last, len(new_tokens))
    assert more is not None, "the test pool is large enough"
    runner.req_to_token.write(seq.row, seq.slots.numel(), more)
    seq.slots = torch.cat([seq.slots, more])
    seq.tokens.extend(new_tokens)


def _step(runner: ModelRunner, seqs: list[Seq], new: list[list[int]]) -> torch.Tensor:
    """Append `new[i]` to seqs[i] and run them as one batch; logits of every new token."""
    for seq, toks in zip(seqs, new):
        _grow(runner, seq, toks)
    out_loc = torch.cat([s.slots[s.computed : s.computed + len(t)] for s, t in zip(seqs, new)])
    batch = ForwardBatch.build(new, [s.row for s in seqs], [s.computed for s in seqs], out_loc, return_all_logits=True)
    logits = runner.forward(batch)
    for seq, toks in zip(seqs, new):
        seq.computed += len(toks)
    return logits, batch.mode


def _reference(hf, seqs: list[Seq], new_lens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([s.tokens])).logits[0, -n:] for s, n in zip(seqs, new_lens)])


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_model(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


@pytest.mark.parametrize("page_size", [1, 16])
def test_forward_matches_transformers(arch_model, page_size):
    path, hf = arch_model
    runner = ModelRunner(RunnerConfig(model_path=str(path), dtype="float32", max_total_tokens=4096, max_running_requests=8, page_size=page_size))
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(page_size)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    seqs = [Seq(runner.req_to_token.alloc(), [], torch.empty(0, dtype=torch.int64)) for _ in range(4)]

    # 1. Prefill of prompts of different lengths (one crosses a page boundary mid-page).
    lens = [5, 17, 33, 1]
    new = [rand(n) for n in lens]
    logits, mode = _step(runner, seqs, new)
    assert mode == ForwardMode.EXTEND
    assert (logits - _reference(hf, seqs, lens)).abs().max() <= TOLERANCE

    # 2. Extend on top of the cached prefixes (prefill split into prefix + extend).
    lens = [7, 3, 20, 40]
    new = [rand(n) for n in lens]
    logits, mode = _step(runner, seqs, new)
    assert (logits - _reference(hf, seqs, lens)).abs().max() <= TOLERANCE

    # 3. Several decode steps of the whole batch.
    for _ in range(3):
        new = [rand(1) for _ in seqs]
        logits, mode = _step(runner, seqs, new)
        assert mode == ForwardMode.DECODE
        assert (logits - _reference(hf, seqs, [1] * 4)).abs().max() <= TOLERANCE

    # 4. Mixed: one request extends a chunk while the others decode.
    lens = [1, 9, 1, 1]
    new = [rand(n) for n in lens]
    logits, mode = _step(runner, seqs, new)
    assert mode == ForwardMode.MIXED
    assert (logits - _reference(hf, seqs, lens)).abs().max() <= TOLERANCE


def test_greedy_generation_matches_transformers(arch_model):
    path, hf = arch_model
    runner = ModelRunner(RunnerConfig(model_path=str(path), dtype="float32", max_total_tokens=4096, max_running_requests=8))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (3, 8, 13, 21, 34, 55, 89, 120)]
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    outputs = generate(runner, prompts, [params] * len(prompts))
    distinct = set()
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
        assert out.output_ids == ref
        distinct.update(out.output_ids)
    # Parity is only meaningful if the model does not repeat one token forever.
    assert len(distinct) > 8
    assert runner.allocator.available_size() == runner.allocator.size
    assert runner.req_to_token.available() == 8
