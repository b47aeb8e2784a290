"""Tool-call parsers: model text in, assistant content and OpenAI tool calls out, incrementally.

Every parser is fed the text of a choice piece by piece (`feed`) and told when it ended
(`finish`); a whole answer is the same machine fed once. So a streamed answer, concatenated, is
the non-streamed one by construction, and a marker split across tokens at any byte never reaches
`content`: text that could still be the start of a marker is held back until the next piece
decides it.

A call whose JSON opens as `{"name": "...", "arguments": {` (or `"parameters"`) streams: once that
head is read, a header piece (id, type, name) goes out, then the arguments object in pieces, as
the model writes it, until its braces close; its `arguments` are the model's own text of that
object. From the header on the call stands (a streamed header cannot be taken back): arguments cut
off by max_tokens stay cut off, as OpenAI's do. A call written any other way (keys in another
order, arguments as a JSON string) is read whole once its JSON is complete, and one that does not
parse goes back into `content` as the model wrote it, instead of a call the client cannot decode.
The formats, as SGLang and vLLM name their parsers:

- `hermes` (also `qwen25`, `qwen`, `qwen3`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, after optional content (Hermes 2 Pro, Qwen2.5, Qwen3).
- `llama3` (also `llama3_json`): the whole answer is `{"name": ..., "parameters": {...}}`, several
  joined by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2 JSON tool calling).

`NamedCall` and `RequiredCalls` read the output of a constrained request (`tool_choice` naming a
function: the arguments object itself; `required`: a JSON array of `{"name", "parameters"}`).
"""

from __future__ import annotations

import json
import re
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


# --- a call object read as it arrives -----------------------------------------------------------
_WHITESPACE = re.compile(r"\s*")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACE_OR_STRING = re.compile(r'["\\{}]')
Undecided = Literal["wait", "no"]


@dataclass(frozen=True, slots=True)
class CallHead:
    """`{"name": "...", "arguments": ` read up to the arguments' `{`, at `arguments_at`."""

    name: str
    arguments_at: int


# What a streamed call's head is made of, in order (None: the name, a JSON string).
HEAD_STEPS: tuple[tuple[str, ...] | None, ...] = (("{",), ('"name"',), (":",), None, (",",), ('"arguments"', '"parameters"'), (":",), ("{",))


@dataclass(slots=True)
class HeadReader:
    """Reads the head of the call object a growing text starts with, resuming each time at the
    step the text before left off (so a head costs its length once, not once per token)."""

    step: int = 0
    pos: int = 0
    name: str = ""

    def read(self, text: str) -> CallHead | Undecided:
        """The head; "wait" while `text` may still become one, "no" once it cannot (the call is
        then read whole, or is content). `text` must extend the text of the calls before."""
        while self.step < len(HEAD_STEPS):
            options = HEAD_STEPS[self.step]
            found = _literal(text, self.pos, options) if options is not None else self._name(text)
            if not isinstance(found, int):
                return found
            self.step, self.pos = self.step + 1, found
        return CallHead(self.name, self.pos - 1)

    def _name(self, text: str) -> int | Undecided:
        pos = _WHITESPACE.match(text, self.pos).end()  # type: ignore[union-attr]
        if pos == len(text):
            return "wait"
        literal = _JSON_STRING.match(text, pos)
        if literal is None:
            return "wait" if text[pos] == '"' else "no"  # an open string, or no string at all
        self.name = _string_value(literal.group())
        return literal.end() if self.name else "no"


def _literal(text: str, pos: int, options: tuple[str, ...]) -> int | Undecided:
    """Past whitespace and one of `options` at `pos`: where it ends, or whether it may yet come."""
    pos = _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
    rest = text[pos:]
    for option in options:
        if rest.startswith(option):
            return pos + len(option)
    return "wait" if any(option.startswith(rest) for option in options) else "no"


def _string_value(literal: str) -> str:
    try:
        value = json.loads(literal)
    except ValueError:  # a bad escape
        return ""
    return value if isinstance(value, str) else ""


@dataclass(slots=True)
class BraceDepth:
    """How deep in `{}` a JSON text is, strings and escapes skipped, across pieces."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False  # the piece before ended in a string's backslash

    def advance(self, text: str, until: int) -> int:
        """Read `text` until the depth falls to `until`: the index after that `}`, or -1."""
        pos = 0
        if self.escaped and text:
            self.escaped, pos = False, 1
        while (found := _BRACE_OR_STRING.search(text, pos)) is not None:
            char, pos = found.group(), found.end()
            if self.in_string:
                if char == "\\":
                    self.escaped = pos == len(text)
                    pos += 1
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char == "{":
                self.depth += 1
            elif char == "}":
                self.depth -= 1
                if self.depth == until:
                    return pos
        return -1


@dataclass(slots=True)
class OpenCall:
    """A call whose header is out: its arguments object streams as written, then the rest of the
    call object is read (and dropped) until the object closes."""

    index: int | None  # None: a call made after the first without parallel_tool_calls, read, not sent
    braces: BraceDepth = field(default_factory=lambda: BraceDepth(depth=1))
    in_arguments: bool = True

    def feed(self, text: str) -> tuple[str, str | None]:
        """(the arguments text in `text`, what follows the call object once it closed, else None)."""
        arguments = ""
        if self.in_arguments:
            end = self.braces.advance(text, 1)
            if end < 0:
                return text, None
            arguments, text, self.in_arguments = text[:end], text[end:], False
        end = self.braces.advance(text, 0)
        return arguments, None if end < 0 else text[end:]


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
        """A call read whole: its header and all its arguments at once."""
        self._stream_arguments(out, self._open(out, name), arguments)

    def _open(self, out: Parsed, name: str) -> OpenCall:
        """A call's header; its arguments follow through `_stream_arguments`."""
        self._held_space = ""
        if self.calls and not self.parallel:
            return OpenCall(None)
        self.calls += 1
        out.pieces.append(CallPiece(self.calls - 1, "", new_call_id(), name))
        return OpenCall(self.calls - 1)

    @staticmethod
    def _stream_arguments(out: Parsed, call: OpenCall, arguments: str) -> None:
        if arguments and call.index is not None:
            out.pieces.append(CallPiece(call.index, arguments))

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


HermesState = Literal["content", "head", "whole", "arguments", "tail"]


class HermesParser(ToolParser):
    """Content, and calls inside `<tool_call>` tags. In a call: "head" until its head decides it,
    then "arguments" (streamed) and "tail" (to the end tag), or "whole" (the body read at the end tag)."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._buf = ""
        self._state: HermesState = "content"
        self._open_call = OpenCall(None)
        self._head = HeadReader()
        self._searched = 0  # how much of a whole call's buffer has no end tag (a long call is scanned once)

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while self._step(out):
            pass
        return out

    def _step(self, out: Parsed) -> bool:
        """One move of the state machine over the buffer; False once it needs more text."""
        if self._state == "content":
            return self._read_content(out)
        if self._state == "head":
            head = self._head.read(self._buf)
            if head == "wait":
                return False
            if head == "no":
                self._state, self._searched = "whole", 0
            else:
                self._open_call = self._open(out, head.name)
                self._buf, self._state = self._buf[head.arguments_at :], "arguments"
            return True
        if self._state == "arguments":
            arguments, rest = self._open_call.feed(self._buf)
            self._stream_arguments(out, self._open_call, arguments)
            self._buf, self._state = (rest, "tail") if rest is not None else ("", "arguments")
            return rest is not None
        return self._find_end(out) if self._state == "whole" else self._skip_tail()

    def _read_content(self, out: Parsed) -> bool:
        start = self._buf.find(HERMES_START)
        if start < 0:
            keep = held_prefix(self._buf, HERMES_START)
            self._content(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._content(out, self._buf[:start])
        self._buf, self._state, self._head = self._buf[start + len(HERMES_START) :], "head", HeadReader()
        return True

    def _find_end(self, out: Parsed) -> bool:
        """The end tag of a call read whole."""
        end = self._buf.find(HERMES_END, self._search_from())
        if end < 0:
            self._searched = len(self._buf)
            return False
        self._close_call(out, self._buf[:end], HERMES_END)
        self._buf, self._state, self._searched = self._buf[end + len(HERMES_END) :], "content", 0
        return True

    def _skip_tail(self) -> bool:
        """After a streamed call's object: drop what comes before its end tag, or before the next
        call's start tag where the model left the end tag out."""
        end, start = self._buf.find(HERMES_END, self._search_from()), self._buf.find(HERMES_START, self._search_from())
        if end < 0 and start < 0:
            self._searched = len(self._buf)
            return False
        if start >= 0 and (end < 0 or start < end):
            self._buf = self._buf[start:]
        else:
            self._buf = self._buf[end + len(HERMES_END) :]
        self._state, self._searched = "content", 0
        return True

    def _search_from(self) -> int:
        """Where a tag may start in the buffer: the scan before found none."""
        return max(0, self._searched - len(HERMES_END) + 1)

    def finish(self) -> Parsed:
        out = Parsed()
        if self._state in ("head", "whole"):  # cut off before its end tag: a call if what came is whole JSON
            self._close_call(out, self._buf, "")
        elif self._state == "content":
            self._content(out, self._buf)
        elif self._state == "tail":  # no end tag after the call: what the model wrote after it
            self._content(out, self._buf.strip())
        self._buf, self._state = "", "content"
        self._release_space(out)
        return out

    def _close_call(self, out: Parsed, body: str, end_tag: str) -> None:
        call = _loads_call(body)
        if call is None:
            self._content(out, HERMES_START + body + end_tag)
        else:
            self._call(out, *call)


class Llama3JsonParser(ToolParser):
    """An answer that starts with `{` (or `<|python_tag|>`) is calls; any other is content."""

    SEPARATORS = "; \t\r\n"  # what may come between calls

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._buf = ""
        # "rest": the calls ended in text that is no call, held for finish, which makes it content
        self._mode: Literal["undecided", "content", "calls", "rest"] = "undecided"
        self._open_call: OpenCall | None = None
        self._head = HeadReader()  # of the call the buffer starts with

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
        elif self._mode == "calls":
            self._take_calls(out, text)
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        # After the calls, only separators may be left; anything else (a call cut off before its
        # head was read, JSON that is no call) is content, as the model wrote it. A streamed call
        # cut off has sent what it had.
        if self._open_call is not None:
            self._buf, self._open_call = "", None
        rest = self._buf if self._mode in ("undecided", "content") else self._buf.strip().strip(";").strip()
        self._content(out, rest)
        self._buf = ""
        self._release_space(out)
        return out

    def _take_calls(self, out: Parsed, piece: str) -> None:
        while True:
            if self._open_call is not None:
                arguments, rest = self._open_call.feed(self._buf)
                self._stream_arguments(out, self._open_call, arguments)
                if rest is None:
                    self._buf = ""
                    return
                self._buf, self._open_call, self._head = rest, None, HeadReader()
            if self._head.step == 0:  # between calls
                self._buf = self._buf.lstrip(self.SEPARATORS)
            text = self._buf
            if not text.startswith("{"):
                return
            head = self._head.read(text)
            if head == "wait":
                return
            if head == "no":
                self._take_whole_call(out, text, piece)
                return
            self._open_call = self._open(out, head.name)
            self._buf = text[head.arguments_at :]

    def _take_whole_call(self, out: Parsed, text: str, piece: str) -> None:
        """A call written some other way: read once its JSON is complete."""
        if "}" not in piece:  # only a closing brace can complete it
            return
        try:
            value, end = json.JSONDecoder().raw_decode(text)
        except ValueError:
            return  # not complete yet
        call = call_from_json(value)
        if call is None:
            self._mode = "rest"
            return
        self._call(out, *call)
        self._buf, self._head = text[end:], HeadReader()
        self._take_calls(out, self._buf)


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


class RequiredCalls(Llama3JsonParser):
    """`tool_choice: required`: a JSON array of `{"name", "parameters"}` (the grammar keeps it one),
    its calls streamed as Llama 3's are; cut off (finish_reason length) before any call, the client
    gets the text that came as content."""

    SEPARATORS = "[,] \t\r\n"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "calls"
        self._written: list[str] = []  # all of it, the content of an answer cut off before its first call

    def feed(self, text: str) -> Parsed:
        self._written.append(text)
        return super().feed(text)

    def finish(self) -> Parsed:
        out = Parsed("" if self.calls else "".join(self._written))
        self._buf, self._written, self._open_call = "", [], None
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
