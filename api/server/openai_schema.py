"""Request schemas of the HTTP faces (OpenAI-compatible and SGLang-native) and their conversion
into engine calls.

Decoding is strict about types (a wrong type is a 400 naming the field) and lenient about unknown
fields, as OpenAI-compatible servers are: clients send fields we have no use for (`user`,
...). Fields we cannot honour with a non-default value (`suffix`, `best_of`, ...) are refused with a clear 400 instead of being silently ignored.

One HTTP request becomes one or more `EngineCall`s: a batch of prompts times `n` choices, in
OpenAI's order (choice index = prompt index * n + j).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import orjson

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # prompts x n in one request: a bound on the fan-out one client can cause
MAX_TOP_LOGPROBS = 20
# Chat sampling fields a request may leave out, with OpenAI's values: the last resort after the
# model's generation_config.json defaults (SGLang's ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS).
OPENAI_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --- schemas ----------------------------------------------------------------------------------
class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None  # the schema is always enforced (constrained decoding), strict or not


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions, SGLang's extras included."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang's extra sampling fields
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    # SGLang's extra request fields
    priority: int | None = None
    rid: str | list[str] | None = None
    extra_key: str | None = None
    cache_salt: str | None = None
    routing_key: str | None = None
    # Scheduling: whose request (also the X-Tenant header) and when it is due
    tenant: str | None = None
    slo_ttft_ms: float | None = None
    deadline_ms: float | None = None
    # Constrained decoding: OpenAI's response_format (on completions too, as vLLM and SGLang
    # accept it), and SGLang's regex / ebnf extras
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None  # number of top logprobs per token; 0: only the chosen token's
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# OpenAI's rule for function names: what every client and template can carry.
FunctionName = Annotated[str, msgspec.Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDef(msgspec.Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls the grammar constrains (tool_choice required/named) always follow it


class ToolDef(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(msgspec.Struct, kw_only=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; some clients send the object


class AssistantToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    # None: left to the server (chat_calls puts in the model's defaults, else OpenAI's).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang's switch for --reasoning-parser, per request


class GenerateRequest(msgspec.Struct, kw_only=True):
    """SGLang's native /generate: one prompt, or a batch when `text` / `input_ids` is a list."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # list[int] (one prompt) or list[list[int]] (a batch)
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    priority: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from this position on (-1: none)
    return_text_in_logprobs: bool = False
    routing_key: str | None = None
    extra_key: str | None = None
    tenant: str | None = None
    slo_ttft_ms: float | None = None
    deadline_ms: float | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """/tokenize (SGLang's and vLLM's): one text, or a batch when `prompt` is a list."""

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int | list[int]]  # one sequence of ids, or a batch of them (detokenize_batch checks which)
    skip_special_tokens: bool = False


def detokenize_batch(req: DetokenizeRequest, vocab_size: int) -> tuple[list[list[int]], bool]:
    """The id sequences to decode, and whether the request was a batch; ids outside the
    vocabulary are a 400 (the tokenizer would overflow on them)."""
    tokens = req.tokens
    batch = bool(tokens) and all(isinstance(t, list) for t in tokens)
    if not batch and not all(isinstance(t, int) for t in tokens):
        raise invalid("tokens must be a list of token ids or a list of such lists", "tokens")
    seqs: list[list[int]] = tokens if batch else [tokens]  # type: ignore[assignment,list-item]
    bad = [t for seq in seqs for t in seq if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "tokens")
    return seqs, batch


class AbortRequestBody(msgspec.Struct, kw_only=True):
    rid: str = ""
    abort_all: bool = False


S = TypeVar("S", bound=msgspec.Struct)


def decode(body: bytes, schema: type[S]) -> S:
    """Decode a JSON body; malformed JSON and wrong types are 400s naming the field."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        return _raise(invalid(f"invalid request: {exc}", param_of(str(exc))))
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bad UTF-8 inside a string is the latter
        return _raise(invalid(f"the request body is not valid JSON: {exc}", code="invalid_json"))
    except RecursionError:  # msgspec's guard against nesting deeper than the interpreter's limit
        return _raise(invalid("the request body is not valid JSON: nested too deeply", code="invalid_json"))


def _raise(error: ApiError) -> Any:
    raise error


def param_of(message: str) -> str | None:
    """The field a msgspec error is about: "... - at `$.messages[0].role`" -> "messages"."""
    if "`$." in message:
        return message.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    if "field `" in message:
        return message.split("field `", 1)[1].split("`", 1)[0]
    return None


# --- conversion -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EngineCall:
    """The arguments of one `Engine.stream` call; `index` is the OpenAI choice index."""

    index: int
    prompt_index: int
    prompt: str | None
    input_ids: list[int] | None
    sampling: dict[str, Any]
    options: dict[str, Any]


Prompt = tuple[str | None, list[int] | None]  # (text, input_ids): exactly one is set


def completion_calls(req: CompletionRequest) -> tuple[str, list[EngineCall]]:
    """The response id and the engine calls."""
    _check_common(req, scoring=req.echo)
    _refuse_unsupported(suffix=req.suffix is not None, best_of=(req.best_of or req.n) > req.n)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", "logprobs")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sampling = _sampling(req, max_tokens)  # with echo, 0 only scores the prompt
    logprob = {"return_logprob": req.logprobs is not None, "top_logprobs_num": req.logprobs or 0}
    if req.echo and req.logprobs is not None:
        logprob["logprob_start_len"] = 0  # echoed prompt tokens come with their logprobs
    return _fan_out(completion_prompts(req.prompt), req, sampling, logprob)


def chat_calls(
    req: ChatCompletionRequest,
    input_ids: list[int],
    model_defaults: Mapping[str, Any] | None = None,
    tool_schema: str | None = None,
) -> tuple[str, list[EngineCall]]:
    """The response id and the engine calls; `input_ids`: the messages rendered by the chat
    template (see `chat_messages`); `model_defaults`: the model's sampling defaults
    (generation_config.json), for the fields of OPENAI_SAMPLING_DEFAULTS the request leaves out;
    `tool_schema`: the JSON schema a forced tool call is decoded under (api/server/chat_tools.py)."""
    _fill_sampling_defaults(req, model_defaults or {})
    _check_common(req)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _sampling(req, max_tokens)
    if tool_schema is not None:
        if sampling["json_schema"] or req.regex or req.ebnf:
            raise invalid("a forced tool call (tool_choice required or a named function) cannot be combined with response_format, regex or ebnf", "tool_choice")
        sampling["json_schema"] = tool_schema
    logprob = {"return_logprob": req.logprobs, "top_logprobs_num": req.top_logprobs or 0}
    return _fan_out([(None, input_ids)], req, sampling, logprob)


def _fill_sampling_defaults(req: ChatCompletionRequest, model_defaults: Mapping[str, Any]) -> None:
    """Request values win, then the model's defaults, then OpenAI's (SGLang's order)."""
    for name, openai_value in OPENAI_SAMPLING_DEFAULTS.items():
        if getattr(req, name) is None:
            setattr(req, name, model_defaults.get(name, openai_value))


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content as one string."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(req.messages):
        item: dict[str, Any] = {"role": msg.role, "content": _content_text(msg.content, i)}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(msg, name) is not None:
                item[name] = getattr(msg, name)
        if msg.tool_calls:
            item["tool_calls"] = [_template_tool_call(call, i) for call in msg.tool_calls]
        out.append(item)
    if not out:
        raise invalid("messages must not be empty", "messages")
    return out


def _template_tool_call(call: AssistantToolCall, index: int) -> dict[str, Any]:
    """An assistant's tool call as chat templates read it: arguments as an object (templates
    write them with `tojson`; a JSON string would come out quoted twice), as SGLang and vLLM do."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError:
            raise invalid(f"messages[{index}]: tool_calls arguments are not valid JSON: {args[:80]!r}", "messages") from None
        if not isinstance(args, dict):
            raise invalid(f"messages[{index}]: tool_calls arguments must be a JSON object", "messages")
    function = {"name": call.function.name, "arguments": args}
    return {"id": call.id, "type": call.type, "function": function}


def generate_calls(req: GenerateRequest) -> tuple[list[EngineCall], bool]:
    """The calls of a native request, and whether it was a batch (answered with a list)."""
    prompts, batch = _generate_prompts(req)
    params = req.sampling_params
    if isinstance(params, list) and len(params) != len(prompts):
        raise invalid(f"sampling_params has {len(params)} entries for {len(prompts)} prompts", "sampling_params")
    _, rids = _rids(req.rid, len(prompts))
    calls = []
    for i, (text, ids) in enumerate(prompts):
        sampling = dict(params[i] if isinstance(params, list) else params or {})
        options = _options(rids[i], req, req.extra_key)
        options.update(return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num, logprob_start_len=req.logprob_start_len)
        calls.append(EngineCall(i, i, text, ids, sampling, options))
    return calls, batch


def completion_prompts(prompt: str | list[Any]) -> list[Prompt]:
    """OpenAI's four prompt forms: a string, token ids, a list of strings, a list of id lists."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(_is_token(t) for t in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise invalid("prompt must be a string, a list of token ids, a list of strings or a list of token id lists", "prompt")


def _generate_prompts(req: GenerateRequest) -> tuple[list[Prompt], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise invalid("give exactly one of text and input_ids", "text")
    if isinstance(req.text, str):
        return [(req.text, None)], False
    if req.text is not None:
        if not req.text:
            raise invalid("text must not be an empty list", "text")
        return [(t, None) for t in req.text], True
    ids = req.input_ids or []
    if ids and all(_is_token(t) for t in ids):
        return [(None, list(ids))], False
    if ids and all(isinstance(p, list) and all(_is_token(t) for t in p) for p in ids):
        return [(None, list(p)) for p in ids], True
    raise invalid("input_ids must be a non-empty list of token ids or a list of such lists", "input_ids")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _content_text(content: str | list[ContentPart] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid(f"messages[{index}]: content parts of type {part.type!r} are not supported (text only)", "messages")
        texts.append(part.text)
    return "".join(texts)


def _check_common(req: _Common, scoring: bool = False) -> None:
    """`scoring`: an echo completion, which may ask for no new tokens (max_tokens 0)."""
    if not 1 <= req.n <= MAX_CHOICES:
        raise invalid(f"n must be in [1, {MAX_CHOICES}], got {req.n}", "n")
    if req.max_tokens is not None and req.max_tokens < (0 if scoring else 1):
        at_least = "0 (with echo)" if scoring else "1 (0 only with echo)"
        raise invalid(f"max_tokens must be at least {at_least}, got {req.max_tokens}", "max_tokens")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    limit = getattr(req, "max_completion_tokens", None)
    if limit is not None and limit <= 0:
        raise invalid(f"max_completion_tokens must be at least 1, got {limit}", "max_completion_tokens")


def _refuse_unsupported(**given: bool) -> None:
    for name, used in given.items():
        if used:
            raise invalid(f"{name} is not supported by this server", name, code="unsupported_parameter")


def _sampling(req: _Common, max_tokens: int | None) -> dict[str, Any]:
    """SGLang sampling params; range checks are the engine's (one place, one set of messages).
    No max_tokens (None) means "up to the context": the engine fills in what the prompt leaves."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return {
        "max_new_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "min_new_tokens": req.min_tokens,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "logit_bias": dict(req.logit_bias or {}),  # token id strings; the engine checks them
        "regex": req.regex,
        "ebnf": req.ebnf,
        "json_schema": _json_schema(req.response_format),
    }


def _json_schema(fmt: ResponseFormat | None) -> str | None:
    """The JSON schema text that response_format asks the output to follow (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.type != "json_schema":
        raise invalid(f"response_format type must be text, json_object or json_schema, got {fmt.type!r}", "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise invalid("response_format of type json_schema needs json_schema.schema", "response_format")
    return orjson.dumps(fmt.json_schema.schema).decode()


def _fan_out(
    prompts: Sequence[Prompt], req: _Common, sampling: dict[str, Any], logprob: dict[str, Any]
) -> tuple[str, list[EngineCall]]:
    total = len(prompts) * req.n
    if total > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts x n={req.n} is more than {MAX_CHOICES} choices", "n")
    response_id, rids = _rids(req.rid, total)
    extra_key = _join_keys(req.cache_salt, req.extra_key)
    calls = []
    for p, (text, ids) in enumerate(prompts):
        for j in range(req.n):
            index = p * req.n + j
            # Different seeds per choice: n identical samples would defeat the point of n.
            choice_sampling = sampling if req.seed is None or j == 0 else {**sampling, "seed": req.seed + j}
            options = {**_options(rids[index], req, extra_key), **logprob}
            calls.append(EngineCall(index, p, text, ids, choice_sampling, options))
    return response_id, calls


def _rids(rid: str | list[str] | None, count: int) -> tuple[str, list[str]]:
    """The response id and one engine rid per call. The server names every request, so that
    /abort_request can reach any of them and the response id is the request id (as in SGLang)."""
    if isinstance(rid, list):
        if len(rid) != count:
            raise invalid(f"rid has {len(rid)} entries for {count} requests", "rid")
        if not rid:
            raise invalid("rid must not be an empty list", "rid")
        return rid[0], list(rid)
    base = rid or uuid.uuid4().hex
    return base, [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


def _options(rid: str | None, req: _Common | GenerateRequest, extra_key: str | None) -> dict[str, Any]:
    """Engine.stream's per-request options from a request body's shared fields."""
    return {
        "rid": rid, "priority": req.priority, "routing_key": req.routing_key, "extra_key": extra_key,
        "tenant": req.tenant, "slo_ttft_ms": req.slo_ttft_ms, "deadline_ms": req.deadline_ms,
    }


def _join_keys(cache_salt: str | None, extra_key: str | None) -> str | None:
    # Both name a prefix-cache namespace; a request giving both gets the namespace of the pair.
    if cache_salt is None or extra_key is None:
        return cache_salt if extra_key is None else extra_key
    return f"{cache_salt}\x1f{extra_key}"

