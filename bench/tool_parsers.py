"""The CPU the chat parsers add per streamed token (api/chat_tools.py, issue 31).

    python -m bench.tool_parsers [--repeats 7] [--answers 200]

An answer of a thinking model that calls tools (reasoning, a sentence of content, two
<tool_call>s) is cut into the pieces the tiny models' tokenizer decodes it to (~2 characters
each, so markers split often), and fed piece by piece to a fresh parser per answer, as a streamed
chat does: plain text (no parsing), hermes, qwen3 reasoning + hermes, and llama3 on its own
format. Median microseconds per token over --repeats runs of --answers answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from api.chat_tools import ChoiceParser
from api.reasoning_parser import ReasoningParser
from api.tool_parsers import HermesParser, Llama3JsonParser, PlainText

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--answers", type=int, default=200)
    args = p.parse_args()
    print(f"{'parser':<16} {'tokens':>6} {'us/token (median)':>18}")
    for name, (factory, text) in CASES.items():
        tokens = pieces(text)
        runs = [per_token_us(factory, tokens, args.answers) for _ in range(args.repeats)]
        print(f"{name:<16} {len(tokens):>6} {statistics.median(runs):>18.2f}")


if __name__ == "__main__":
    main()
