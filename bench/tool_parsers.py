"""What tool calling costs (issue 31): the chat parsers' CPU per streamed token, and a forced
call's grammar per decode step against free decoding.

    python -m bench.tool_parsers [--repeats 7] [--answers 200] [--engine-repeats 3] [--skip-engine]

An answer of a thinking model that calls tools (reasoning, a sentence of content, two
<tool_call>s) is cut into the pieces the tiny models' tokenizer decodes it to (~2 characters
each, so markers split often), and fed piece by piece to a fresh parser per answer, as a streamed
chat does: plain text (no parsing), hermes, qwen3 reasoning + hermes, and llama3 on its own
format. Median microseconds per token over --repeats runs of --answers answers.

Then, through `actorserve.Engine` on bench.offline's tiny Qwen3: 16 requests of 64 greedy tokens, free
against `tool_choice: required` (the grammar the chat server builds from a tool whose arguments
are at least 1,000 integers, so no call can end before its 64 tokens and both runs decode the same
tokens), alternating --engine-repeats times after a warm-up: median seconds and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable

import msgspec

from api.server.chat_tools import ChatParsers, ChoiceParser, plan_chat
from api.server.openai_schema import ChatCompletionRequest
from api.server.reasoning_parser import ReasoningParser
from api.server.tool_parsers import HermesParser, Llama3JsonParser, PlainText

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "celsius", "note": "a <b> and </tool in text"}}
THINKING = "<think>\nThe user asks for the weather in two cities; I should call the tool twice, once per city.\n</think>\n\n"
HERMES_ANSWER = THINKING + "Let me look both up.\n" + "\n".join(f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>" for _ in range(2))
LLAMA3_ANSWER = "; ".join(json.dumps({"name": CALL["name"], "parameters": CALL["arguments"]}) for _ in range(2))

Factory = Callable[[], ChoiceParser]
CASES: dict[str, tuple[Factory, str]] = {
    "plain text": (lambda: ChoiceParser(PlainText(), None), HERMES_ANSWER),
    "hermes": (lambda: ChoiceParser(HermesParser(), None), HERMES_ANSWER),
    "qwen3 + hermes": (lambda: ChoiceParser(HermesParser(), ReasoningParser(starts_in_reasoning=False)), HERMES_ANSWER),
    "llama3": (lambda: ChoiceParser(Llama3JsonParser(), None), LLAMA3_ANSWER),
}


def pieces(text: str) -> list[str]:
    """`text` as the tiny tokenizer's tokens decode it, one piece per token."""
    from tokenizers import Tokenizer

    from gpu.tiny_model import _tokenizer_json

    tokenizer = Tokenizer.from_str(_tokenizer_json(512))
    ids = tokenizer.encode(text).ids
    out, sent = [], ""
    for n in range(1, len(ids) + 1):
        whole = tokenizer.decode(ids[:n])
        out.append(whole[len(sent) :])
        sent = whole
    assert "".join(out) == text
    return out


def per_token_us(factory: Factory, tokens: list[str], answers: int) -> float:
    start = time.perf_counter()
    for _ in range(answers):
        parser = factory()
        for piece in tokens:
            parser.feed(piece)
        parser.finish()
    return (time.perf_counter() - start) / (answers * len(tokens)) * 1e6


RECORD_TOOL = {
    "type": "function",
    "function": {
        "name": "record",
        "parameters": {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}}, "required": ["values"]},
    },
}
ROWS, NEW_TOKENS, PROMPT_TOKENS = 16, 64, 32


def forced_schema() -> str:
    """The JSON schema a chat request with RECORD_TOOL and tool_choice required decodes under."""
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [RECORD_TOOL], "tool_choice": "required"}
    req = msgspec.convert(body, ChatCompletionRequest)
    plan = plan_chat(req, ChatParsers("hermes", None, tool_template=True))
    assert plan.tool_schema is not None
    return plan.tool_schema


async def engine_runs(repeats: int) -> dict[str, list[float]]:
    from api.frontend.engine import Engine
    from bench.offline import engine_vocab_size, tiny_qwen3_dir

    config = {"model_path": str(tiny_qwen3_dir())}
    rng = random.Random(0)
    vocab = engine_vocab_size(config)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(PROMPT_TOKENS)] for _ in range(ROWS)]
    kinds = {"free": {}, "tool_choice required": {"json_schema": forced_schema()}}

    async def run(engine: Engine, extra: dict) -> float:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
        start = time.perf_counter()
        outs = await asyncio.gather(*[engine.generate(input_ids=p, sampling_params=params) for p in prompts])
        assert all(o.finish_reason == "length" and o.completion_tokens == NEW_TOKENS for o in outs), [o.finish_reason for o in outs]
        return time.perf_counter() - start

    times: dict[str, list[float]] = {label: [] for label in kinds}
    async with Engine(**config) as engine:
        for extra in kinds.values():  # warm-up: the grammar's first compile, the first forwards
            await run(engine, extra)
        for _ in range(repeats):
            for label, extra in kinds.items():
                times[label].append(await run(engine, extra))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--answers", type=int, default=200)
    p.add_argument("--engine-repeats", type=int, default=3)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    print(f"{'parser':<16} {'tokens':>6} {'us/token (median)':>18}")
    for name, (factory, text) in CASES.items():
        tokens = pieces(text)
        runs = [per_token_us(factory, tokens, args.answers) for _ in range(args.repeats)]
        print(f"{name:<16} {len(tokens):>6} {statistics.median(runs):>18.2f}")
    if args.skip_engine:
        return
    times = asyncio.run(engine_runs(args.engine_repeats))
    print(f"\n| {ROWS} x {NEW_TOKENS} tokens, tiny Qwen3 | s (median) | ms per step |")
    print("| --- | --- | --- |")
    medians = {label: statistics.median(t) for label, t in times.items()}
    for label, median in medians.items():
        print(f"| {label} | {median:.2f} | {1e3 * median / NEW_TOKENS:.1f} |")
    print(f"\ntime ratio tool_choice required / free: {medians['tool_choice required'] / medians['free']:.3f}")


if __name__ == "__main__":
    main()
