"""Response bodies of the HTTP faces: OpenAI completions and chat (whole and streamed chunks) and
SGLang's native /generate, built from the engine's `Delta`s.

Bodies are plain dicts/lists encoded once by the server; a `Choice` accumulates one engine
request's deltas for whole answers, for usage and for the cumulative text of native streams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api.server.chat_tools import ChatPlan, ChoiceParser, delta_bodies, finish_reason, message
from runtime.stream import Delta

TokenText = Callable[[int], str]  # token id -> its text, for logprobs


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    rid: str = ""
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_ids: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    final: Delta | None = None
    deltas: int = 0  # how many were added

    def add(self, delta: Delta) -> None:
        self.deltas += 1
        self.rid = delta.rid
        self.text += delta.text
        self.output_ids.extend(delta.output_ids)
        self.logprobs.extend(delta.logprobs)
        self.top_logprobs.extend(delta.top_logprobs)
        self.input_token_ids.extend(delta.input_token_ids)
        self.input_logprobs.extend(delta.input_logprobs)
        self.input_top_logprobs.extend(delta.input_top_logprobs)
        if delta.finish_reason is not None:
            self.final = delta

    @property
    def finish_reason(self) -> str | None:
        return None if self.final is None else self.final.finish_reason

    @property
    def matched_stop(self) -> int | str | None:
        return None if self.final is None else self.final.matched_stop


def usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """A prompt is counted once however many choices (n) it has, as OpenAI does."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    for c in choices:
        if c.final is not None:
            prompt[c.prompt_index] = max(prompt.get(c.prompt_index, 0), c.final.prompt_tokens)
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.final.cached_tokens)
    prompt_tokens = sum(prompt.values())
    completion_tokens = sum(len(c.output_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


# --- /v1/completions --------------------------------------------------------------------------
def echoed(delta: Delta, prompt_text: str) -> Delta:
    """`echo`: the prompt's text in front of a choice's first delta (the prompt's tokens and
    logprobs arrive with that delta, as prompt logprobs)."""
    return msgspec.structs.replace(delta, text=prompt_text + delta.text)


def completion_response(rid: str, model: str, created: int, choices: Sequence[Choice], token_text: TokenText | None) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _completion_logprobs(
                    c.input_token_ids + c.output_ids, c.input_logprobs + c.logprobs, c.input_top_logprobs + c.top_logprobs, 0, token_text
                ),
                "finish_reason": c.finish_reason,
                "matched_stop": c.matched_stop,
            }
            for c in choices
        ],
        "usage": usage(choices),
    }


def completion_chunk(
    rid: str, model: str, created: int, index: int, delta: Delta, text_offset: int, token_text: TokenText | None
) -> dict[str, Any]:
    choice = {
        "index": index,
        "text": delta.text,
        "logprobs": _completion_logprobs(
            delta.input_token_ids + delta.output_ids,
            delta.input_logprobs + delta.logprobs,
            delta.input_top_logprobs + delta.top_logprobs,
            text_offset,
            token_text,
        ),
        "finish_reason": delta.finish_reason,
    }
    if delta.finish_reason is not None:
        choice["matched_stop"] = delta.matched_stop
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def _completion_logprobs(
    ids: list[int], logprobs: list[float | None], top: list[list[tuple[int, float]]], offset: int, token_text: TokenText | None
) -> dict[str, Any] | None:
    """OpenAI's legacy logprobs; an echoed first prompt token has null logprob and top logprobs."""
    if token_text is None:
        return None
    tokens = [token_text(t) for t in ids[: len(logprobs)]]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [None if lp is None else {token_text(t): v for t, v in row} for row, lp in zip(top, logprobs)] if top else None,
        "text_offset": offsets,
    }


# --- /v1/chat/completions ---------------------------------------------------------------------
def chat_response(
    rid: str, model: str, created: int, choices: Sequence[Choice], token_text: TokenText | None, plan: ChatPlan | None = None
) -> dict[str, Any]:
    """`plan`: the request's tools and reasoning (api/server/chat_tools.py); None: plain text answers."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_chat_choice(c, token_text, plan) for c in choices],
        "usage": usage(choices),
    }


def _chat_choice(c: Choice, token_text: TokenText | None, plan: ChatPlan | None) -> dict[str, Any]:
    parser = plan.choice_parser() if plan is not None else None
    msg = message(c.text, parser) if parser is not None else {"role": "assistant", "content": c.text}
    return {
        "index": c.index,
        "message": msg,
        "logprobs": _chat_logprobs(c.output_ids, c.logprobs, c.top_logprobs, token_text),
        "finish_reason": finish_reason(c.finish_reason, parser is not None and parser.made_calls),
        "matched_stop": c.matched_stop,
    }


class ChatStream:
    """The chunks of a streamed chat answer, each choice read by its own parsers: what a delta
    settles (reasoning, content, tool-call pieces) in chunks with no finish_reason, then one chunk
    per choice with an empty delta and the finish_reason."""

    def __init__(self, rid: str, model: str, created: int, indices: Sequence[tuple[int, int]], plan: ChatPlan, token_text: TokenText | None):
        self.head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        self.choices = [Choice(index, prompt_index) for index, prompt_index in indices]
        self.parsers = [plan.choice_parser() for _ in indices]
        self.token_text = token_text

    def opening(self) -> list[dict[str, Any]]:
        """OpenAI streams open each choice with the role and empty content."""
        return [self._chunk(c.index, {"role": "assistant", "content": ""}, None, None) for c in self.choices]

    def chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        self.choices[index].add(delta)
        parser: ChoiceParser = self.parsers[index]
        settled = parser.feed(delta.text)
        if delta.finish_reason is not None:
            rest = parser.finish()
            settled.reasoning += rest.reasoning
            settled.content += rest.content
            settled.pieces.extend(rest.pieces)
        logprobs = _chat_logprobs(delta.output_ids, delta.logprobs, delta.top_logprobs, self.token_text)
        bodies = [self._chunk(index, body, None, logprobs if i == 0 else None) for i, body in enumerate(delta_bodies(settled))]
        if not bodies and logprobs is not None and logprobs["content"]:  # the tokens' text is held back
            bodies.append(self._chunk(index, {}, None, logprobs))
        if delta.finish_reason is not None:
            final = self._chunk(index, {}, finish_reason(delta.finish_reason, parser.made_calls), None)
            final["choices"][0]["matched_stop"] = delta.matched_stop
            bodies.append(final)
        return bodies

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage(self.choices)}

    def _chunk(self, index: int, delta: dict[str, Any], reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


def usage_chunk(rid: str, obj: str, model: str, created: int, choices: Sequence[Choice]) -> dict[str, Any]:
    """The extra last chunk of `stream_options.include_usage`: no choices, the whole usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(choices)}


def _chat_logprobs(
    ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], token_text: TokenText | None
) -> dict[str, Any] | None:
    if token_text is None:
        return None
    content = []
    for i, lp in enumerate(logprobs):
        item = _token_logprob(token_text(ids[i]), lp)
        item["top_logprobs"] = [_token_logprob(token_text(t), v) for t, v in top[i]] if i < len(top) else []
        content.append(item)
    return {"content": content}


def _token_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


# --- /generate (SGLang native) ----------------------------------------------------------------
def generate_body(choice: Choice, e2e_latency: float, *, logprobs: bool, token_text: TokenText | None, index: int | None = None) -> dict[str, Any]:
    """One native answer (or one stream chunk): cumulative text and ids, with meta_info."""
    meta: dict[str, Any] = {
        "id": choice.rid,
        "finish_reason": _native_finish_reason(choice),
        "prompt_tokens": choice.final.prompt_tokens if choice.final is not None else 0,
        "completion_tokens": len(choice.output_ids),
        "cached_tokens": choice.final.cached_tokens if choice.final is not None else 0,
        "e2e_latency": e2e_latency,
    }
    if logprobs:
        meta["input_token_logprobs"] = _token_logprobs(choice.input_logprobs, choice.input_token_ids, token_text)
        meta["output_token_logprobs"] = _token_logprobs(choice.logprobs, choice.output_ids, token_text)
        meta["input_top_logprobs"] = _top_logprobs(choice.input_top_logprobs, token_text)
        meta["output_top_logprobs"] = _top_logprobs(choice.top_logprobs, token_text)
    if choice.final is not None and choice.final.error:
        meta["error"] = choice.final.error
    body: dict[str, Any] = {"text": choice.text, "output_ids": choice.output_ids, "meta_info": meta}
    if index is not None:
        body["index"] = index
    return body


def _token_logprobs(logprobs: Sequence[float | None], ids: Sequence[int], token_text: TokenText | None) -> list[list[Any]]:
    """SGLang's [logprob, token_id, text or None] per token."""
    return [[lp, t, token_text(t) if token_text else None] for lp, t in zip(logprobs, ids)]


def _top_logprobs(rows: Sequence[Sequence[tuple[int, float]]], token_text: TokenText | None) -> list[list[list[Any]]]:
    return [[[v, t, token_text(t) if token_text else None] for t, v in row] for row in rows]


def _native_finish_reason(choice: Choice) -> dict[str, Any] | None:
    final = choice.final
    if final is None or final.finish_reason is None:
        return None
    if final.finish_reason == "length":
        return {"type": "length", "length": len(choice.output_ids)}
    if final.finish_reason == "stop":
        return {"type": "stop", "matched": final.matched_stop}
    return {"type": final.finish_reason, "message": final.error}
