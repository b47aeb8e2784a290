"""Reasoning parser: a thinking model's `<think>...</think>` into `reasoning_content`, the rest
into `content`, incrementally (the same machine for streamed and whole answers, as in
api/server/tool_parsers.py, so split markers never leak).

As SGLang names them (`--reasoning-parser`):
- `qwen3`: reasoning only where the answer opens with `<think>` (Qwen3's template lets the model
  write it; with `enable_thinking: false` the template closes an empty block in the prompt).
- `deepseek-r1` (also `deepseek_r1`, `qwen3-thinking`): the template opens `<think>` in the
  prompt, so the answer is reasoning from its first token until `</think>`.

Whitespace around the reasoning (the newlines after `<think>`, before `</think>` and after it) is
layout and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from api.server.tool_parsers import held_prefix

THINK_START, THINK_END = "<think>", "</think>"
# Names a user may give --reasoning-parser, and whether the answer starts inside the reasoning.
REASONING_PARSERS: dict[str, bool] = {"qwen3": False, "deepseek-r1": True, "deepseek_r1": True, "qwen3-thinking": True}

State = Literal["start", "reasoning", "after", "content"]


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool):
        self.starts_in_reasoning = starts_in_reasoning
        self._state: State = "start"
        self._buf = ""
        self._reasoned = False  # some reasoning text went out (its leading whitespace is dropped)

    def feed(self, text: str) -> Split:
        self._buf += text
        if self._state == "start" and not self._open():
            return Split()
        if self._state == "reasoning":
            reasoning = self._reason()
            if self._state == "reasoning":
                return Split(reasoning)
            return Split(reasoning, self._content())
        return Split("", self._content())

    def finish(self) -> Split:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "start" and self.starts_in_reasoning):
            text = buf.removeprefix(THINK_START) if self._state == "start" else buf
            return Split(text.rstrip() if self._reasoned else text.strip())
        return Split("", buf if self._state != "after" else buf.lstrip())

    def _open(self) -> bool:
        """Leave the start state once the answer's head decides it; False while it cannot."""
        head = self._buf.lstrip()
        if head.startswith(THINK_START):
            self._state, self._buf = "reasoning", head[len(THINK_START) :]
        elif THINK_START.startswith(head):
            return False  # empty, whitespace or the start of <think>
        else:
            self._state = "reasoning" if self.starts_in_reasoning else "content"
        return True

    def _reason(self) -> str:
        """Reasoning text this piece settles; moves on to "after" at </think>."""
        end = self._buf.find(THINK_END)
        if end >= 0:
            text, self._buf = self._buf[:end].rstrip(), self._buf[end + len(THINK_END) :]
            self._state = "after"
        else:
            cut = len(self._buf) - held_prefix(self._buf, THINK_END)
            text = self._buf[:cut].rstrip()  # trailing space waits: </think> may follow it
            self._buf = self._buf[len(text) :]
        if not self._reasoned:
            text = text.lstrip()
            self._reasoned = bool(text)
        return text

    def _content(self) -> str:
        if self._state == "after":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return ""
            self._state = "content"
        text, self._buf = self._buf, ""
        return text
