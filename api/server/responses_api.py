"""OpenAI's Responses API (`POST /v1/responses`) over the chat pipeline, as vLLM and SGLang serve it:
the request's `input` items become chat messages (instructions a system turn, `function_call`
items an assistant's tool calls, `function_call_output` items tool turns), the answer is read by
the same parsers as chat (api/server/chat_tools.py), and comes back as output items: a
`reasoning` item, a `message` with `output_text`, one `function_call` item per call.

Streamed, the items open and close in the order the parsers settle them, with OpenAI's events
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each under an `event:`
line and with a `sequence_number`.

`reasoning.effort` "none" turns a thinking template's reasoning off (`enable_thinking: false`);
any effort is also given to the template as `reasoning_effort` (templates that read it, as
gpt-oss's does). With `store` (OpenAI's default), a finished response is kept in a bounded
in-memory map per server (`ResponseStore`: 1,024 responses and 256 MiB of their JSON at most, the
least recently used leaves first): `GET` and `DELETE /v1/responses/{id}` reach it, and
`previous_response_id` continues its conversation (its input and output items, not its
instructions, as OpenAI's does).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import orjson

from api.server.chat_tools import ChatPlan, ChoiceParser, Settled
from api.server.openai_response import Choice
from api.server.openai_schema import ApiError, ChatCompletionRequest, invalid, param_of
from runtime.stream import Delta

ItemKind = Literal["reasoning", "message", "function_call"]


class ResponseTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseTextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseText(msgspec.Struct, kw_only=True):
    format: ResponseTextFormat | None = None


class ReasoningOptions(msgspec.Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; the reasoning itself is returned


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: ResponseText | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    store: bool = True
    user: str | None = None
    seed: int | None = None  # vLLM's and SGLang's extras
    top_k: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Conversation:
    """The items an answer follows: the previous response's conversation, then this `input`."""

    history: tuple[dict[str, Any], ...]
    input: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, req: ResponsesRequest, store: ResponseStore) -> Conversation:
        items = ({"type": "message", "role": "user", "content": req.input},) if isinstance(req.input, str) else tuple(req.input)
        if req.previous_response_id is None:
            return cls((), items)
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise invalid(f"previous_response_id: no stored response {req.previous_response_id!r} (never stored, deleted, or no longer kept)", "previous_response_id")
        return cls(previous.items, items)


def chat_request(req: ResponsesRequest, talk: Conversation) -> ChatCompletionRequest:
    """The chat request a Responses request is served as; 400s name the field."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages += _messages([*talk.history, *talk.input], len(talk.history))
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "parallel_tool_calls": req.parallel_tool_calls,
        "chat_template_kwargs": _template_kwargs(req),
    }
    if req.tools:
        body["tools"] = [{"type": "function", "function": _function(t)} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        fmt = req.text.format
        body["response_format"] = {"type": fmt.type, "json_schema": {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}}
    # Through msgspec, so the chat request's own checks apply (a path in the chat's terms).
    try:
        return msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise invalid(f"invalid request: {exc}", param_of(str(exc))) from None


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """`reasoning.effort` for the chat template; the request's own kwargs win."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return req.chat_template_kwargs
    asked = {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}
    return {**asked, **(req.chat_template_kwargs or {})}


def _function(tool: ResponseTool) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters, "strict": tool.strict}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}", "tool_choice")


def _messages(items: list[dict[str, Any]], history: int) -> list[dict[str, Any]]:
    """Chat messages of the conversation's items (the first `history` of them stored, the rest
    `input`, which errors index); consecutive function calls are one assistant turn."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items, -history):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(item, i), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function", "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if messages and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else orjson.dumps(output).decode()
            messages.append({"role": "tool", "content": text, "tool_call_id": _string(item, "call_id", i)})
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again (as chat templates drop it)
            raise invalid(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, function_call_output, reasoning)", "input")
    if not messages:
        raise invalid("input must not be empty", "input")
    return messages


def _role(item: dict[str, Any], index: int) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid(f"input[{index}]: role must be user, assistant, system or developer, got {role!r}", "input")
    return "system" if role == "developer" else role


def _string(item: dict[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"input[{index}]: {name} must be a string", "input")
    return value


def _text(content: Any, index: int) -> str:
    """A message's content: a string, or parts of type input_text / output_text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"input[{index}]: content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"input[{index}]: content parts of type {kind!r} are not supported (input_text, output_text)", "input")
        texts.append(part["text"])
    return "".join(texts)


# --- output -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShell(msgspec.Struct, kw_only=True):
    """The fields every response object repeats from its request."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest

    def body(self, status: str, output: list[dict[str, Any]], choice: Choice | None) -> dict[str, Any]:
        req = self.req
        incomplete = choice is not None and choice.finish_reason == "length"
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [msgspec.to_builtins(t) for t in req.tools or []],
            "text": {"format": msgspec.to_builtins(req.text.format) if req.text and req.text.format else {"type": "text"}},
            "reasoning": msgspec.to_builtins(req.reasoning) if req.reasoning is not None else {"effort": None, "summary": None},
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "usage": _usage(choice) if choice is not None and choice.final is not None else None,
        }
        if status == "completed":
            body["completed_at"] = int(time.time())
        return body


def _usage(choice: Choice) -> dict[str, Any]:
    assert choice.final is not None
    prompt, output = choice.final.prompt_tokens, len(choice.output_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": choice.final.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    items: tuple[dict[str, Any], ...]  # its conversation: input items, then its output items
    size: int  # bytes of its items and body as JSON: what it costs the store's budget


class ResponseStore:
    """The responses stored on this server: at most `capacity` of them and `max_bytes` of their JSON
    (a conversation's history counts in each of its responses); the least recently used leave first."""

    def __init__(self, capacity: int = 1024, max_bytes: int = 256 * 2**20):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored

    def keep(self, req: ResponsesRequest, talk: Conversation, response: dict[str, Any]) -> None:
        """A finished response, where its request asked to store it (one larger than the whole
        budget is not kept)."""
        if not req.store or not response:
            return
        items = (*talk.history, *talk.input, *response["output"])
        stored = StoredResponse(response, items, len(orjson.dumps(items)) + len(orjson.dumps(response)))
        self._drop(response["id"])
        self._kept[response["id"]] = stored
        self.bytes += stored.size
        while len(self._kept) > self.capacity or self.bytes > self.max_bytes:
            self._drop(next(iter(self._kept)))

    def _drop(self, response_id: str) -> StoredResponse | None:
        stored = self._kept.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored

    def body(self, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}."""
        stored = self.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        """DELETE /v1/responses/{id}."""
        if self._drop(response_id) is None:
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response {response_id!r} (never stored, deleted, or no longer kept)", param="response_id", code="response_not_found")


def whole_response(shell: ResponseShell, choice: Choice, plan: ChatPlan) -> dict[str, Any]:
    """The non-streamed response: the answer's items, in the order the model wrote them."""
    events = ResponseEvents(shell, plan)
    events.feed(choice.text)
    events.finish(choice)
    return events.response


class ResponseEvents:
    """The streamed events of one answer; `response` is the whole response once finished."""

    def __init__(self, shell: ResponseShell, plan: ChatPlan):
        self.shell = shell
        self.parser: ChoiceParser = plan.choice_parser()
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.sequence = 0
        self.response: dict[str, Any] = {}

    def opening(self) -> list[dict[str, Any]]:
        body = self.shell.body("in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def chunks(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        """The events of one engine delta of the answer `choice` collects."""
        choice.add(delta)
        events = self.feed(delta.text)
        return events + self.finish(choice) if delta.finish_reason is not None else events

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._settle(self.parser.feed(text))

    def finish(self, choice: Choice) -> list[dict[str, Any]]:
        events = self._settle(self.parser.finish())
        events += self._close()
        self.response = self.shell.body("completed", self.output, choice)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.response)]

    def _settle(self, settled: Settled) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if settled.reasoning:
            events += self._text("reasoning", settled.reasoning)
        if settled.content:
            events += self._text("message", settled.content)
        for piece in settled.pieces:
            if piece.id is not None:
                events += self._close()
                item = {"type": "function_call", "id": new_id("fc"), "call_id": piece.id, "name": piece.name, "arguments": "", "status": "in_progress"}
                events += self._add(item)
            elif piece.arguments and self.open is not None:
                self.open["arguments"] += piece.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"], output_index=len(self.output), delta=piece.arguments))
        return events

    def _text(self, kind: ItemKind, delta: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                events += self._add({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []})
            else:
                events += self._add({"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
                events.append(self._event("response.content_part.added", item_id=self.open["id"], output_index=len(self.output), content_index=0, part=part))
        assert self.open is not None
        self.open.setdefault("_text", "")
        self.open["_text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=self.open["id"], output_index=len(self.output), content_index=0, delta=delta, **extra))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def _close(self) -> list[dict[str, Any]]:
        """The events that end the item being written, which joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, item_id = len(self.output), item["id"]
        events = []
        if item["type"] == "function_call":
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=item["arguments"]))
        else:
            text = item.pop("_text", "")
            if item["type"] == "reasoning":
                item["content"] = [{"type": "reasoning_text", "text": text}]
                events.append(self._event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text))
            else:
                part = {"type": "output_text", "text": text, "annotations": []}
                item["content"], item["status"] = [part], "completed"
                events.append(self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text, logprobs=[]))
                events.append(self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part))
        self.output.append(item)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}
