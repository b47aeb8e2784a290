"""Tools and reasoning in chat completions: what a request's `tools` / `tool_choice` ask of the
prompt and of decoding, and how each choice's text becomes content, `reasoning_content` and
`tool_calls`, whole or streamed.

- `tool_choice` "none" (or no tools): the tools are not rendered and nothing is parsed (as SGLang).
- "auto": the tools are rendered through the chat template and the answer is read by the
  --tool-call-parser (or the one the template's text names); without `parallel_tool_calls` only
  the first call is made.
- "required" / a named function: decoding is constrained by the structured-output grammar, so the
  call always parses and validates: a named function's output is its arguments object (the tool's
  `parameters` schema), "required" an array of `{"name", "parameters"}` (one item without
  `parallel_tool_calls`), as SGLang and vLLM constrain it.

The stream of a choice: one chunk per engine delta with what the parsers settled (reasoning,
content, tool-call pieces: id, type and name first, then arguments), then what they still held at
the end, then exactly one chunk with `finish_reason` and an empty delta ("tool_calls" where a
stopped answer made calls).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from api.server.openai_schema import ChatCompletionRequest, NamedToolChoice, ToolDef, invalid
from api.server.reasoning_parser import REASONING_PARSERS, THINK_START, ReasoningParser, Split
from api.server.tool_parsers import (
    TOOL_PARSERS,
    CallPiece,
    NamedCall,
    PlainText,
    RequiredCalls,
    ToolParser,
    ToolParserName,
    detect_tool_parser,
    make_tool_parser,
)

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ChatParsers:
    """The server's parsers, resolved once from the flags and the chat template."""

    tool_call_parser: ToolParserName | None
    reasoning_parser: str | None  # a key of REASONING_PARSERS
    tool_template: bool  # the chat template renders `tools`

    @classmethod
    def resolve(cls, tool_call_parser: str | None, reasoning_parser: str | None, chat_template: str | None) -> ChatParsers:
        """Flags win; without them, what the template's text names unambiguously."""
        template = chat_template or ""
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
        tools = TOOL_PARSERS[tool_call_parser] if tool_call_parser else detect_tool_parser(template)
        thinking = "enable_thinking" in template and THINK_START in template
        reasoning = reasoning_parser or ("qwen3" if thinking else None)
        return cls(tools, reasoning, "tools" in template)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What one chat request asks of the template, the sampler and the parsers."""

    mode: Mode
    tools: tuple[dict[str, Any], ...]  # as the template renders them
    tool_parser: ToolParserName | None
    forced_name: str | None
    tool_schema: str | None  # JSON schema decoding follows (required / named)
    reasoning: bool | None  # None: no reasoning parsing; else whether answers start inside it
    parallel: bool = True  # parallel_tool_calls

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return {"tools": list(self.tools)} if self.tools else {}

    def choice_parser(self) -> ChoiceParser:
        tools: ToolParser
        if self.mode == "named":
            assert self.forced_name is not None
            tools = NamedCall(self.forced_name)
        elif self.mode == "required":
            tools = RequiredCalls()
        elif self.mode == "auto" and self.tool_parser is not None:
            tools = make_tool_parser(self.tool_parser, self.parallel)
        else:
            tools = PlainText()
        reasoning = ReasoningParser(self.reasoning) if self.reasoning is not None and self.mode not in ("named", "required") else None
        return ChoiceParser(tools, reasoning)


def plan_chat(req: ChatCompletionRequest, parsers: ChatParsers) -> ChatPlan:
    """The request's plan; a 400 naming the field (or the flag) for what cannot be served."""
    tools = req.tools or []
    mode = _mode(req.tool_choice, bool(tools))
    if mode != "none" and not parsers.tool_template:
        raise invalid("tools were sent, but this model's chat template does not render tools: serve it with a --chat-template that does", "tools")
    if mode == "auto" and parsers.tool_call_parser is None:
        raise invalid(f"tools were sent, but the server reads no tool calls: start it with --tool-call-parser ({', '.join(TOOL_PARSERS)})", "tools")
    _check_tools(tools)
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    if named is not None and named not in {t.function.name for t in tools}:
        raise invalid(f"tool_choice names the function {named!r}, which is not among tools", "tool_choice")
    rendered = tuple(_rendered(t) for t in tools) if mode != "none" else ()
    schema = _forced_schema(mode, tools, named, req.parallel_tool_calls)
    problem = schema_problem(schema) if schema is not None else None
    if problem is not None:  # else the engine's refusal would name json_schema, a field never sent
        raise invalid(f"tools: these parameters cannot constrain a forced call (tool_choice {mode}): {problem}", "tools")
    return ChatPlan(mode, rendered, parsers.tool_call_parser, named, schema, _reasoning(req, parsers), req.parallel_tool_calls)


@functools.lru_cache(maxsize=256)
def schema_problem(schema: str) -> str | None:
    """Why a JSON schema cannot become a grammar (as the engine's compiler lowers it), or None."""
    from actors.json_schema import json_schema_grammar

    try:
        json_schema_grammar(schema)
    except ImportError:
        return None  # no xgrammar: the engine says so itself
    except (RuntimeError, ValueError) as exc:  # xgrammar's errors, and json_schema's own refusals
        return str(exc).splitlines()[0]
    return None


def _mode(choice: str | NamedToolChoice | None, has_tools: bool) -> Mode:
    if choice is None:
        return "auto" if has_tools else "none"
    if not has_tools and choice != "none":
        raise invalid("tool_choice needs tools", "tool_choice")
    return "named" if isinstance(choice, NamedToolChoice) else choice  # type: ignore[return-value]


def _check_tools(tools: list[ToolDef]) -> None:
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema of type object", "tools")
        if names.index(tool.function.name) != i:
            raise invalid(f"tools[{i}].function.name {tool.function.name!r} is already the name of tools[{names.index(tool.function.name)}]", "tools")


def _rendered(tool: ToolDef) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def _forced_schema(mode: Mode, tools: list[ToolDef], named: str | None, parallel: bool) -> str | None:
    if mode == "named":
        return orjson.dumps(next(_parameters(t) for t in tools if t.function.name == named)).decode()
    if mode != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return orjson.dumps(array).decode()


def _reasoning(req: ChatCompletionRequest, parsers: ChatParsers) -> bool | None:
    kwargs = req.chat_template_kwargs or {}
    if parsers.reasoning_parser is None or not req.separate_reasoning or kwargs.get("enable_thinking") is False:
        return None
    return REASONING_PARSERS[parsers.reasoning_parser]


# --- per choice -------------------------------------------------------------------------------
@dataclass(slots=True)
class Settled:
    """What one piece of a choice's text settled."""

    reasoning: str = ""
    content: str = ""
    pieces: list[CallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.pieces)


class ChoiceParser:
    """Reasoning first, then tool calls in what is not reasoning."""

    def __init__(self, tools: ToolParser, reasoning: ReasoningParser | None):
        self.tools = tools
        self.reasoning = reasoning

    @property
    def made_calls(self) -> bool:
        return self.tools.calls > 0

    def feed(self, text: str) -> Settled:
        if self.reasoning is None:
            parsed = self.tools.feed(text)
            return Settled("", parsed.content, parsed.pieces)
        split = self.reasoning.feed(text)
        parsed = self.tools.feed(split.content)
        return Settled(split.reasoning, parsed.content, parsed.pieces)

    def finish(self) -> Settled:
        """What both parsers still held: the reasoning parser's rest goes through the tools'."""
        split = self.reasoning.finish() if self.reasoning is not None else Split()
        parsed = self.tools.feed(split.content)
        parsed.extend(self.tools.finish())
        return Settled(split.reasoning, parsed.content, parsed.pieces)


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


def message(text: str, parser: ChoiceParser) -> dict[str, Any]:
    """The whole answer's assistant message."""
    settled = parser.feed(text)
    rest = parser.finish()
    content = settled.content + rest.content
    reasoning = settled.reasoning + rest.reasoning
    calls = _whole_calls(settled.pieces + rest.pieces)
    out: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if parser.reasoning is not None:
        out["reasoning_content"] = reasoning or None
    if calls:
        out["tool_calls"] = calls
    return out


def _whole_calls(pieces: list[CallPiece]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if piece.id is not None:
            calls[piece.index] = {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}
        calls[piece.index]["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]


def delta_bodies(settled: Settled) -> Iterator[dict[str, Any]]:
    """The `delta`s of the chunks one settled piece is streamed as: reasoning and content
    together, then each tool-call piece in its own chunk (the header, then arguments)."""
    text: dict[str, Any] = {}
    if settled.reasoning:
        text["reasoning_content"] = settled.reasoning
    if settled.content:
        text["content"] = settled.content
    if text:
        yield text
    for piece in settled.pieces:
        if piece.id is not None:
            call = {"index": piece.index, "id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}
        elif piece.arguments:
            call = {"index": piece.index, "function": {"arguments": piece.arguments}}
        else:
            continue
        yield {"tool_calls": [call]}
