"""Tool-call and reasoning parsers on scripted model text, split at every boundary: each text is
fed whole, in two pieces cut at every character, and one character at a time; every way must
settle the same content, reasoning and calls (the expected values are written out by hand), and no
piece of a marker may reach content or reasoning on the way."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from api.server.chat_tools import ChoiceParser, Settled, delta_bodies, message
from api.server.reasoning_parser import ReasoningParser
from api.server.tool_parsers import HermesParser, Llama3JsonParser, NamedCall, PlainText, RequiredCalls, detect_tool_parser

Factory = Callable[[], ChoiceParser]
Outcome = tuple[str, str, list[tuple[str, dict]]]  # reasoning, content, calls (name, arguments)
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>")


def hermes() -> ChoiceParser:
    return ChoiceParser(HermesParser(), None)


def llama3() -> ChoiceParser:
    return ChoiceParser(Llama3JsonParser(), None)


def qwen3_hermes() -> ChoiceParser:
    return ChoiceParser(HermesParser(), ReasoningParser(starts_in_reasoning=False))


def r1_plain() -> ChoiceParser:
    return ChoiceParser(PlainText(), ReasoningParser(starts_in_reasoning=True))


def splits(text: str) -> Iterator[list[str]]:
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def run(factory: Factory, pieces: list[str]) -> tuple[Outcome, list[Settled]]:
    parser = factory()
    settled = [parser.feed(p) for p in pieces] + [parser.finish()]
    calls: dict[int, list] = {}
    for s in settled:
        for piece in s.pieces:
            if piece.id is not None:
                assert piece.index not in calls, "a second header for one call"
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments  # KeyError: arguments before their header
    assert sorted(calls) == list(range(len(calls)))
    outcome = (
        "".join(s.reasoning for s in settled),
        "".join(s.content for s in settled),
        [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))],
    )
    return outcome, settled


CASES: list[tuple[str, Factory, str, Outcome]] = [
    (
        "hermes: content, then a call",
        hermes,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ("", "Let me check.", [("get_weather", {"city": "Paris"})]),
    ),
    (
        "hermes: parallel calls",
        hermes,
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"y": "<tool_call>"}}\n</tool_call>\n',
        ("", "", [("a", {"x": 1}), ("b", {"y": "<tool_call>"})]),
    ),
    ("hermes: no call, a lookalike", hermes, "a < b, <tool and <tool_cal are text", ("", "a < b, <tool and <tool_cal are text", [])),
    (
        "hermes: malformed JSON stays content",
        hermes,
        'Sure <tool_call>{"name": oops}</tool_call>',
        ("", 'Sure <tool_call>{"name": oops}</tool_call>', []),
    ),
    ("hermes: cut off before the end tag", hermes, '<tool_call>\n{"name": "f", "arguments": {}}', ("", "", [("f", {})])),
    ("hermes: cut off inside the JSON", hermes, '<tool_call>\n{"name": "f", "argu', ("", '<tool_call>\n{"name": "f", "argu', [])),
    ("hermes: a partial start marker at the end", hermes, "Done <tool_ca", ("", "Done <tool_ca", [])),
    ("llama3: one call", llama3, '{"name": "f", "parameters": {"x": 1}}', ("", "", [("f", {"x": 1})])),
    (
        "llama3: two calls joined by ;",
        llama3,
        ' {"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": "a;b"}}',
        ("", "", [("f", {}), ("g", {"y": "a;b"})]),
    ),
    ("llama3: python tag", llama3, '<|python_tag|>{"name": "f", "arguments": {"q": "}"}}', ("", "", [("f", {"q": "}"})])),
    ("llama3: plain text", llama3, "Hello {there}", ("", "Hello {there}", [])),
    ("llama3: JSON that is no call", llama3, '{"not": "a call"}', ("", '{"not": "a call"}', [])),
    (
        "hermes: an end tag, braces and escaped quotes inside the arguments' strings",
        hermes,
        '<tool_call>{"name": "f", "arguments": {"y": "</tool_call> } {", "q": "a \\"}\\" b"}}</tool_call>after',
        ("", "after", [("f", {"y": "</tool_call> } {", "q": 'a "}" b'})]),
    ),
    (
        "hermes: arguments before the name are read whole",
        hermes,
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
        ("", "", [("f", {"a": 1})]),
    ),
    (
        "hermes: a call without its end tag, then the next call",
        hermes,
        '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
        ("", "", [("a", {}), ("b", {"x": 1})]),
    ),
    ("hermes: no end tag after the call", hermes, '<tool_call>{"name": "f", "arguments": {}} and more', ("", "and more", [("f", {})])),
    (
        "llama3: nested objects, python tag, two calls",
        llama3,
        '<|python_tag|>{"name": "f", "parameters": {"a": {"b": {"c": "}}"}}}};{"name": "g", "parameters": {}}',
        ("", "", [("f", {"a": {"b": {"c": "}}"}}}), ("g", {})]),
    ),
    (
        "qwen3: reasoning, then content",
        qwen3_hermes,
        "<think>\nI should answer.\n</think>\n\nThe answer.",
        ("I should answer.", "The answer.", []),
    ),
    ("qwen3: no reasoning", qwen3_hermes, "Plain answer, no <think> here", ("", "Plain answer, no <think> here", [])),
    (
        "qwen3: reasoning, then a call",
        qwen3_hermes,
        '<think>call f</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
        ("call f", "", [("f", {"a": 1})]),
    ),
    ("qwen3: reasoning cut off", qwen3_hermes, "<think>\na < b </thin", ("a < b </thin", "", [])),
    ("deepseek-r1: reasoning from the first token", r1_plain, "step one\n</think>\n\nfinal", ("step one", "final", [])),
    ("deepseek-r1: a <think> the model writes anyway", r1_plain, "<think>x</think>y", ("x", "y", [])),
]


@pytest.mark.parametrize(("factory", "text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_split_settles_the_same_answer(factory: Factory, text: str, expected: Outcome) -> None:
    for pieces in splits(text):
        outcome, settled = run(factory, pieces)
        assert outcome == expected, pieces
        if expected[2] or "<think>" in text:  # where markers were parsed, none may leak
            for s in settled:
                for marker in MARKERS:
                    for n in range(2, len(marker) + 1):
                        assert marker[:n] not in s.content + s.reasoning or marker[:n] in expected[1] + expected[0], (pieces, s)


def test_the_whole_message_of_a_call_has_null_content_and_json_arguments() -> None:
    msg = message('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call>', hermes())
    assert msg["content"] is None
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": '{"a": [1, 2]}'}


def test_streamed_deltas_put_id_type_and_name_before_arguments() -> None:
    parser = hermes()
    bodies = [b for text in ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',) for b in delta_bodies(parser.feed(text))]
    bodies += list(delta_bodies(parser.finish()))
    assert bodies == [
        {"tool_calls": [{"index": 0, "id": bodies[0]["tool_calls"][0]["id"], "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    ]


def test_forced_parsers() -> None:
    named = ChoiceParser(NamedCall("f"), None)
    first = named.feed('{"a"')
    assert [(p.id is not None, p.name, p.arguments) for p in first.pieces] == [(True, "f", ""), (False, None, '{"a"')]
    assert [p.arguments for p in named.feed(": 1}").pieces] == [": 1}"]
    assert message('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', ChoiceParser(RequiredCalls(), None))["tool_calls"][1]["function"] == {
        "name": "g",
        "arguments": "{}",
    }
    assert message('[{"name": "f", "param', ChoiceParser(RequiredCalls(), None)) == {"role": "assistant", "content": '[{"name": "f", "param'}


def test_templates_name_their_tool_format() -> None:
    assert detect_tool_parser("... <tool_call>\\n{...}</tool_call> ...") == "hermes"
    assert detect_tool_parser("Environment: ipython ... <|python_tag|>") == "llama3"
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_bench_tool_parsers_runs_and_prints_one_row_per_parser(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from bench import tool_parsers

    monkeypatch.setattr(sys, "argv", ["bench.tool_parsers", "--repeats", "1", "--answers", "2", "--skip-engine"])
    tool_parsers.main()  # --skip-engine: the engine part is a separate smoke run below
    rows = [line.rsplit(None, 2) for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0].strip() for r in rows] == list(tool_parsers.CASES)
    for (name, tokens, us), (_, text) in zip(rows, tool_parsers.CASES.values()):
        assert int(tokens) == len(tool_parsers.pieces(text)) > 100 and float(us) > 0
    # the answers the bench feeds are what the parsers read as calls
    assert message(tool_parsers.HERMES_ANSWER, qwen3_hermes())["tool_calls"][1]["function"]["name"] == "get_weather"
    assert len(message(tool_parsers.LLAMA3_ANSWER, llama3())["tool_calls"]) == 2


def test_without_parallel_calls_only_the_first_call_is_made() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    for pieces in splits(text):
        outcome, _ = run(lambda: ChoiceParser(HermesParser(parallel=False), None), pieces)
        assert outcome == ("", "", [("a", {})]), pieces
    outcome, _ = run(lambda: ChoiceParser(Llama3JsonParser(parallel=False), None), ['{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'])
    assert outcome == ("", "", [("a", {})])


# --- arguments stream as the model writes them ---------------------------------------------------
STREAMED: list[tuple[str, Factory, str, list[str]]] = [
    (
        "hermes",
        hermes,
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",  "days": 2, "note": "a } and </tool_call>"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": {"name": "utc"}}}\n</tool_call>',
        ['{"city": "Paris",  "days": 2, "note": "a } and </tool_call>"}', '{"zone": {"name": "utc"}}'],
    ),
    (
        "qwen3 + hermes",
        qwen3_hermes,
        '<think>two calls</think>\n<tool_call>{"name": "a", "arguments": {"x": [1, 2, 3]}}</tool_call><tool_call>{"name": "b", "arguments": {"s": "\\"q\\""}}</tool_call>',
        ['{"x": [1, 2, 3]}', '{"s": "\\"q\\""}'],
    ),
    (
        "llama3",
        llama3,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "get_time", "parameters": {"zone": "a;b}"}}',
        ['{"city": "Paris", "days": 2}', '{"zone": "a;b}"}'],
    ),
]


def argument_pieces(settled: list[Settled]) -> dict[int, list[str]]:
    """Each call's arguments pieces, in the order they were settled."""
    pieces: dict[int, list[str]] = {}
    for s in settled:
        for piece in s.pieces:
            if piece.id is not None:
                pieces[piece.index] = []
            elif piece.arguments:
                pieces[piece.index].append(piece.arguments)
    return pieces


@pytest.mark.parametrize(("factory", "text", "arguments"), [c[1:] for c in STREAMED], ids=[c[0] for c in STREAMED])
def test_arguments_stream_in_pieces_that_join_to_the_whole_answers(factory: Factory, text: str, arguments: list[str]) -> None:
    from bench.tool_parsers import pieces as tokens

    whole = [call["function"]["arguments"] for call in message(text, factory())["tool_calls"]]
    assert whole == arguments  # the model's own text of each arguments object
    for cut in [*splits(text), tokens(text)]:
        _, settled = run(factory, cut)
        assert ["".join(p) for p in argument_pieces(settled).values()] == whole, cut
    for cut in (list(text), tokens(text)):  # token by token, every call's arguments come in pieces
        _, settled = run(factory, cut)
        assert all(len(p) > 1 for p in argument_pieces(settled).values()), cut


def test_a_streamed_call_cut_off_keeps_what_came() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    for cut in splits(text):
        parser = hermes()
        settled = [parser.feed(p) for p in cut] + [parser.finish()]
        assert [p.name for s in settled for p in s.pieces if p.id is not None] == ["f"]
        assert "".join(p.arguments for s in settled for p in s.pieces) == '{"a": [1, 2'
        assert "".join(s.content for s in settled) == ""


def test_required_calls_stream_their_arguments_too() -> None:
    text = '[{"name": "f", "parameters": {"a": [1, {"b": "]"}]}}, {"name": "g", "parameters": {}}]'
    whole = message(text, ChoiceParser(RequiredCalls(), None))["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [("f", '{"a": [1, {"b": "]"}]}'), ("g", "{}")]
    for cut in splits(text):
        outcome, settled = run(lambda: ChoiceParser(RequiredCalls(), None), cut)
        assert outcome == ("", "", [("f", {"a": [1, {"b": "]"}]}), ("g", {})]), cut
        assert ["".join(p) for p in argument_pieces(settled).values()] == ['{"a": [1, {"b": "]"}]}', "{}"]
    _, settled = run(lambda: ChoiceParser(RequiredCalls(), None), list(text))
    assert len(argument_pieces(settled)[0]) > 1
