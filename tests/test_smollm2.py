"""The default model, SmolLM2-135M-Instruct from its GGUF file, against transformers loading the same file."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoTokenizer

from gpu.gguf_loader import default_model_path
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from runtime.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference(smollm2_transformers):
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return smollm2_transformers, tokenizer


@contextlib.contextmanager
def _ignoring_eos(model) -> Iterator[None]:
    """Like our ignore_eos: EOS may be generated and generation goes on (min_new_tokens would
    instead forbid EOS and change the greedy choice). generate() fills an unset eos_token_id from
    the model's own generation config, so that one changes, and back: the model is shared."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def test_greedy_tokens_match_transformers_on_the_gguf_file(smollm2_dir, reference):
    hf, tokenizer = reference
    runner = ModelRunner(RunnerConfig(model_path=None, dtype="float32", max_total_tokens=1024, max_running_requests=4))
    assert runner.model_dir == smollm2_dir
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outputs = generate(runner, prompts, [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)] * 3)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad(), _ignoring_eos(hf):
            # An explicit mask: pad_token_id equals <|im_end|> here, and without one transformers
            # would mask the prompt's own <|im_end|> tokens.
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out.output_ids == ref.tolist(), tokenizer.decode(out.output_ids)
    assert "4" in tokenizer.decode(outputs[2].output_ids)  # a real model, not noise
