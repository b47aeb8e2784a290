"""Tool-call parsers: model text in, assistant content and OpenAI tool calls out, incrementally.

Every parser is fed the text of a choice piece by piece (`feed`) and told when it ended
(`finish`); a whole answer is the same machine fed once. So a streamed answer, concatenated, is
the non-streamed one by construction, and a marker split across tokens at any byte never reaches
`content`: text that could still be the start of a marker is held back until the next piece
decides it.

A call is emitted once its JSON is complete and parses (a header piece with id, type and name,
then its `arguments`): a malformed call goes back into `content` as the model wrote it, instead of
a call the client cannot decode. The formats, as SGLang and vLLM name their parsers:

- `hermes` (also `qwen25`, `qwen`, `qwen3`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, after optional content (Hermes 2 Pro, Qwen2.5, Qwen3).
- `llama3` (also `llama3_json`): the whole answer is `{"name": ..., "parameters": {...}}`, several
  joined by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2 JSON tool calling).

`NamedCall` and `RequiredCalls` read the output of a constrained request (`tool_choice` naming a
function: the arguments object itself; `required`: a JSON array of `{"name", "parameters"}`).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

ToolParserName = Literal["hermes", "llama3"]
# Names a user may give --tool-call-parser (SGLang's and vLLM's), and the format each one reads.
TOOL_PARSERS: dict[str, ToolParserName] = {
    "hermes": "hermes",
    "qwen25": "hermes",
    "qwen": "hermes",
    "qwen3": "hermes",
    "llama3": "llama3",
    "llama3_json": "llama3",
}
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class CallPiece:
    """One piece of a streamed tool call: the header (id and name set, `arguments` empty) comes
    first, then pieces of `arguments` for the same `index`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Parsed:
    content: str = ""
    pieces: list[CallPiece] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.pieces.extend(other.pieces)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def call_from_json(value: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) from `{"name": ..., "arguments" | "parameters": {...}}`, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


class ToolParser(ABC):
    """Incremental parser of one choice's text."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel  # False (parallel_tool_calls): calls after the first are dropped
        self.calls = 0
        self._held_space = ""  # trailing whitespace of content, kept until we know what follows

    @abstractmethod
    def feed(self, text: str) -> Parsed:
        """The content and call pieces that `text` (the next piece of output) settles."""

    @abstractmethod
    def finish(self) -> Parsed:
        """Whatever is still held back, at the end of the output."""

    def _content(self, out: Parsed, text: str) -> None:
        # Whitespace between content and a call (or between calls) is layout, not content: it is
        # held until non-space text follows, dropped when a call follows.
        if not text:
            return
        stripped = text.rstrip()
        if stripped:
            out.content += self._held_space + stripped
            self._held_space = ""
        self._held_space += text[len(stripped):]

    def _call(self, out: Parsed, name: str, arguments: str) -> None:
        self._held_space = ""
        if self.calls and not self.parallel:
            return
        index = self.calls
        self.calls += 1
        out.pieces.append(CallPiece(index, "", new_call_id(), name))
        out.pieces.append(CallPiece(index, arguments))

    def _release_space(self, out: Parsed) -> None:
        if not self.calls:
            out.content += self._held_space
        self._held_space = ""


class PlainText(ToolParser):
    """No tools: all text is content."""

    def feed(self, text: str) -> Parsed:
        return Parsed(text)

    def finish(self) -> Parsed:
        return Parsed()


class HermesParser(ToolParser):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._buf = ""
        self._in_call = False
        self._searched = 0  # how much of a call's buffer has no end tag (a long call is scanned once)

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while True:
            if not self._in_call:
                start = self._buf.find(HERMES_START)
                if start < 0:
                    keep = held_prefix(self._buf, HERMES_START)
                    self._content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(out, self._buf[:start])
                self._buf = self._buf[start + len(HERMES_START) :]
                self._in_call, self._searched = True, 0
            end = self._buf.find(HERMES_END, max(0, self._searched - len(HERMES_END) + 1))
            if end < 0:
                self._searched = len(self._buf)
                return out
            self._close_call(out, self._buf[:end], HERMES_END)
            self._buf = self._buf[end + len(HERMES_END) :]

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_call:  # cut off before its end tag: a call if what came is whole JSON
            self._close_call(out, self._buf, "")
        else:
            self._content(out, self._buf)
        self._buf = ""
        self._release_space(out)
        return out

    def _close_call(self, out: Parsed, body: str, end_tag: str) -> None:
        self._in_call = False
        call = _loads_call(body)
        if call is None:
            self._content(out, HERMES_START + body + end_tag)
        else:
            self._call(out, *call)


class Llama3JsonParser(ToolParser):
    """An answer that starts with `{` (or `<|python_tag|>`) is calls; any other is content."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._buf = ""
        self._mode: Literal["undecided", "content", "calls"] = "undecided"

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return out
            calls = head.startswith(PYTHON_TAG) or head.startswith("{")
            self._mode = "calls" if calls else "content"
            self._buf = head.removeprefix(PYTHON_TAG) if calls else self._buf
            text = self._buf
        if self._mode == "content":
            self._content(out, self._buf)
            self._buf = ""
        elif "}" in text:  # only a closing brace can complete a call
            self._take_calls(out)
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        # After the calls, only separators may be left; anything else (a call cut off, JSON that
        # is no call) is content, as the model wrote it.
        rest = self._buf.strip().strip(";").strip() if self._mode == "calls" else self._buf
        self._content(out, rest)
        self._buf = ""
        self._release_space(out)
        return out

    def _take_calls(self, out: Parsed) -> None:
        decoder = json.JSONDecoder()
        while True:
            text = self._buf.lstrip().lstrip(";").lstrip()
            if not text.startswith("{"):
                return
            try:
                value, end = decoder.raw_decode(text)
            except ValueError:
                return  # not complete yet
            call = call_from_json(value)
            if call is None:
                return  # JSON that is no call: left for finish, which makes it content
            self._call(out, *call)
            self._buf = text[end:]


class NamedCall(ToolParser):
    """`tool_choice` naming a function: the whole output is its arguments (the grammar keeps it a
    valid object), streamed as it comes after a header piece."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if not self.calls:
            self.calls = 1
            out.pieces.append(CallPiece(0, "", new_call_id(), self.name))
        if text:
            out.pieces.append(CallPiece(0, text))
        return out

    def finish(self) -> Parsed:
        return self.feed("")


class RequiredCalls(ToolParser):
    """`tool_choice: required`: a JSON array of `{"name", "parameters"}`, read when it ends."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return Parsed()

    def finish(self) -> Parsed:
        out = Parsed()
        try:
            value = json.loads(self._buf)
        except ValueError:
            value = None
        calls = [call_from_json(item) for item in value] if isinstance(value, list) else [None]
        if not calls or None in calls:
            out.content = self._buf  # cut off (finish_reason length): the client gets what came
        else:
            for call in calls:
                assert call is not None
                self._call(out, *call)
        self._buf = ""
        return out


def _loads_call(body: str) -> tuple[str, str] | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None


def make_tool_parser(name: ToolParserName, parallel: bool = True) -> ToolParser:
    return HermesParser(parallel) if name == "hermes" else Llama3JsonParser(parallel)


def detect_tool_parser(chat_template: str) -> ToolParserName | None:
    """The format a chat template asks tool calls in, where its text leaves no doubt."""
    hermes = HERMES_START in chat_template
    llama3 = PYTHON_TAG in chat_template or "Environment: ipython" in chat_template
    if hermes == llama3:
        return None
    return "hermes" if hermes else "llama3"
