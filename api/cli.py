"""The `actorserve` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        # Bad input from the user: one clear line, not a traceback.
        print(f"actorserve: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actorserve", description="SGLang's scheduler as asyncio actors.")
    commands = parser.add_subparsers(title="commands")
    _add_generate(commands.add_parser("generate", help="generate text offline (no server)"))
    from api.server import cli as serve_cli

    serve_cli.add_parser(commands)
    from api.router import http_router

    http_router.add_parser(commands)
    tiny = commands.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint for tests")
    from gpu import tiny_model

    tiny_model.add_cli_arguments(tiny)
    tiny.set_defaults(run=tiny_model.run_cli)
    return parser


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--input-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (auto on a CPU: bfloat16 if native there, else float32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(_generate_async(args))


async def _generate_async(args: argparse.Namespace) -> int:
    from api.frontend.engine import Engine
    from runtime.sampling_params import SamplingParams

    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos
    )
    # What can be refused without the model is refused before it loads.
    error = sampling.validation_error()
    if error is not None:
        raise ValueError(error)
    input_ids = _input_ids(args.input_ids) if args.input_ids is not None else None
    async with Engine(model_path=args.model_path, dtype=args.dtype, device=args.device, max_running_requests=1) as engine:
        prompt_ids = input_ids if input_ids is not None else _prompt_ids(args, engine.tokenizer)
        out = await engine.generate(input_ids=prompt_ids, sampling_params=sampling)
    if args.json:
        record = {
            "output_ids": out.output_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
        }
        print(json.dumps(record))
    else:
        print(out.text)
    return 0


def _input_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--input-ids must be comma-separated integers, got {text!r}") from None


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(args.prompt)


if __name__ == "__main__":
    sys.exit(main())
