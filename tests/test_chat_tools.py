"""Tools, reasoning and the chat conformance points (issue 31) over HTTP with the official `openai`
client, on a tiny random-weight Qwen3 served with a Qwen-style tool template.

Two servers: one whose "model" is a scripted device that answers each chat with the text of its
last user message (token by token, as the tokenizer splits it), so the parsers see exactly the
output a test wants; and the real random-weight model, where `tool_choice` required / named must
give calls that validate against the tool's schema whatever the weights say.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest

from api.server.chat_tools import ChatParsers, plan_chat
from api.server.openai_schema import ApiError, ChatCompletionRequest, decode
from api.server.responses_api import ResponsesRequest
from api.server.app import ServerSettings
from gpu.tiny_model import CHAT_TEMPLATE
from runtime.messages import Batch, StepOut
from tests.engine_helpers import assert_idle_invariants
from tests.test_server import ServerThread

IM_START, IM_END = 1, 2  # the tiny tokenizer's ids (gpu/tiny_model.py)

# A Qwen3-style template (the shape of Qwen3's own): tools in the system turn, assistant
# tool_calls as <tool_call> JSON, tool results as <tool_response>, enable_thinking honoured.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{% for message in messages %}{% if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "unit": "c"}}\n</tool_call>'


class EchoDevice:
    """A StepRunner that answers a chat with its last user message's tokens, then <|im_end|>;
    `header`: how many tokens "user\n" is after <|im_start|>."""

    def __init__(self, header: int):
        self.header = header

    def run(self, batch: Batch) -> StepOut:
        tokens = []
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            script = last_user_message(req.asked.input_ids, self.header)
            generated = prefix + extend - len(req.asked.input_ids)
            tokens.append(script[generated] if generated < len(script) else IM_END)
        return StepOut(batch=batch, token_ids=tokens, logprobs=None, top_logprobs=None, forward_s=0.0)

    def close(self) -> None:
        pass


def last_user_message(prompt: list[int], header: int) -> list[int]:
    starts = [i for i, t in enumerate(prompt) if t == IM_START]
    begin = starts[-2] + 1 + header  # the turn before the assistant's header
    return prompt[begin : prompt.index(IM_END, begin) + 1]


def echo_device(runner: Any, header: int) -> EchoDevice:
    """CoreSetup step runner."""
    return EchoDevice(header)


@pytest.fixture(scope="module")
def tool_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "qwen3_tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    return path


def serve(model: Path, template: Path, tool_call_parser: str | None = None, **engine: Any) -> ServerThread:
    kwargs = {"model_path": str(model), "chat_template": str(template), "inline_core": True, "max_running_requests": 8, **engine}
    return ServerThread(kwargs, ServerSettings(served_model_names=("tiny",), tool_call_parser=tool_call_parser))


def echo_server(model: Path, template: Path, tool_call_parser: str | None = None) -> ServerThread:
    from api.core.engine_core import CoreSetup
    from gpu.loader import load_tokenizer

    header = len(load_tokenizer(model).encode("user\n", add_special_tokens=False))
    setup = CoreSetup(step_runner="tests.test_chat_tools:echo_device", step_runner_kwargs={"header": header})
    return serve(model, template, tool_call_parser, core_setup=setup)


@pytest.fixture(scope="module")
def echo(tiny_qwen3: Path, tool_template: Path) -> Iterator[ServerThread]:
    with echo_server(tiny_qwen3, tool_template) as s:
        yield s
        s.run(assert_idle_invariants(s.engine))


@pytest.fixture(scope="module")
def model(tiny_qwen3: Path, tool_template: Path) -> Iterator[ServerThread]:
    with serve(tiny_qwen3, tool_template) as s:
        yield s
        s.run(assert_idle_invariants(s.engine))


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def said(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def stream_of(server: ServerThread, **kwargs: Any) -> list[Any]:
    return list(client(server).chat.completions.create(model="tiny", stream=True, **kwargs))


def argument_chunks(chunks: list[Any]) -> dict[int, list[str]]:
    """Each call index's non-empty `arguments` deltas, in order."""
    pieces: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if call.function.arguments:
                pieces.setdefault(call.index, []).append(call.function.arguments)
    return pieces


def joined_calls(chunks: list[Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call index, checking OpenAI's delta shape on the way."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function" and call.function.name
                    assert not call.function.arguments  # the header goes first, on its own
                    calls[call.index] = [call.id, call.function.name, ""]
                else:
                    assert call.function.name is None
                calls[call.index][2] += call.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def finish_chunks(chunks: list[Any]) -> list[Any]:
    return [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]


def text_of(chunks: list[Any], field: str) -> str:
    return "".join(getattr(c.choices[0].delta, field, None) or "" for c in chunks if c.choices)


# --- auto: the parsers on scripted outputs ------------------------------------------------------
@pytest.mark.parametrize("before", ["", "Let me look that up.\n"])
def test_a_call_whole_and_streamed(echo: ServerThread, before: str) -> None:
    whole = client(echo).chat.completions.create(model="tiny", messages=said(before + CALL), tools=[WEATHER])
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == (before.strip() or None)
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2, "unit": "c"}

    chunks = stream_of(echo, messages=said(before + CALL), tools=[WEATHER])
    assert text_of(chunks, "content") == before.strip()
    [(_, name, arguments)] = joined_calls(chunks)
    assert (name, arguments) == (call.function.name, call.function.arguments)
    assert len(argument_chunks(chunks)[0]) > 1  # the arguments stream as the model writes them
    [final] = finish_chunks(chunks)
    assert final.finish_reason == "tool_calls" and final.delta.content is None and not final.delta.tool_calls
    assert chunks[-1].choices[0] is final  # nothing after the finish chunk


def test_parallel_calls_get_their_own_indices(echo: ServerThread) -> None:
    second = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    chunks = stream_of(echo, messages=said(CALL + "\n" + second), tools=[WEATHER, TIME])
    calls = joined_calls(chunks)
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris", "days": 2, "unit": "c"}), ("get_time", {"zone": "utc"})]
    assert len({i for i, _, _ in calls}) == 2
    assert text_of(chunks, "content") == ""
    one = client(echo).chat.completions.create(model="tiny", messages=said(CALL + "\n" + second), tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]


LLAMA3_CALLS = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2, "unit": "c"}}; {"name": "get_time", "parameters": {"zone": "utc"}}'


def test_llama3_json_calls_stream_their_arguments(tiny_qwen3: Path, tool_template: Path) -> None:
    with echo_server(tiny_qwen3, tool_template, tool_call_parser="llama3") as server:
        whole = client(server).chat.completions.create(model="tiny", messages=said(LLAMA3_CALLS), tools=[WEATHER, TIME])
        [choice] = whole.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert expected == [("get_weather", '{"city": "Paris", "days": 2, "unit": "c"}'), ("get_time", '{"zone": "utc"}')]
        chunks = stream_of(server, messages=said(LLAMA3_CALLS), tools=[WEATHER, TIME])
        assert [(n, a) for _, n, a in joined_calls(chunks)] == expected
        assert all(len(pieces) > 1 for pieces in argument_chunks(chunks).values())
        assert text_of(chunks, "content") == ""
        [final] = finish_chunks(chunks)
        assert final.finish_reason == "tool_calls" and chunks[-1].choices[0] is final and not final.delta.tool_calls
        server.run(assert_idle_invariants(server.engine))


def test_no_tools_or_tool_choice_none_leaves_the_text_alone(echo: ServerThread) -> None:
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        out = client(echo).chat.completions.create(model="tiny", messages=said(CALL), **extra)
        assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"


def test_reasoning_is_separate_and_enable_thinking_false_turns_it_off(echo: ServerThread) -> None:
    text = "<think>\nThe user wants weather.\n</think>\n\n" + CALL
    out = client(echo).chat.completions.create(model="tiny", messages=said(text), tools=[WEATHER])
    msg = out.choices[0].message
    assert msg.reasoning_content == "The user wants weather." and msg.content is None
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    chunks = stream_of(echo, messages=said(text), tools=[WEATHER])
    assert text_of(chunks, "reasoning_content") == "The user wants weather."
    assert text_of(chunks, "content") == ""
    assert [n for _, n, _ in joined_calls(chunks)] == ["get_weather"]

    plain = "<think>\nhm\n</think>\n\nHello."
    off = client(echo).chat.completions.create(model="tiny", messages=said(plain), extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == plain and getattr(off.choices[0].message, "reasoning_content", None) is None
    on = client(echo).chat.completions.create(model="tiny", messages=said(plain))
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == ("hm", "Hello.")


def test_a_history_with_tool_calls_and_results_is_rendered(echo: ServerThread, tiny_qwen3: Path) -> None:
    from gpu.loader import load_tokenizer

    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1, "unit": "c"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
        {"role": "user", "content": "Thanks, and now?"},
    ]
    out = client(echo).chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert out.choices[0].message.content == "Thanks, and now?"
    tokenizer = load_tokenizer(tiny_qwen3)
    tokenizer.chat_template = TOOL_TEMPLATE
    as_template_reads = [*history[:2], {**history[2], "tool_calls": [{**history[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 1, "unit": "c"}}}]}, *history[3:]]
    rendered = tokenizer.apply_chat_template(as_template_reads, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Paris", "days": 1, "unit": "c"}' in rendered and "<tool_response>\nsunny, 21" in rendered
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


# --- required / named: the grammar on the real random-weight model ------------------------------
def validated(out: Any) -> list[str]:
    """The names of a forced answer's calls, each checked against its tool's schema."""
    [c] = out.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [call.function.name for call in c.message.tool_calls]


def test_forced_calls_validate_against_the_schema(model: ServerThread) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(20):
        ask = {"model": "tiny", "messages": said("Weather?"), "tools": [WEATHER, TIME], "temperature": 1.0, "seed": seed, "max_tokens": 200}
        assert validated(client(model).chat.completions.create(**ask, tool_choice=named)) == ["get_weather"]
        # one call: a random model's array of calls goes on for hundreds of tokens
        assert len(validated(client(model).chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False))) == 1


def test_required_calls_may_be_parallel(model: ServerThread) -> None:
    counts = []
    # Seeds whose arrays end within 200 tokens on this random model (others run for 700+).
    for seed in (0, 5, 7):
        ask = {"model": "tiny", "messages": said("Weather?"), "tools": [WEATHER, TIME], "temperature": 1.0, "seed": seed, "max_tokens": 1000}
        counts.append(len(validated(client(model).chat.completions.create(**ask, tool_choice="required"))))
    assert max(counts) > 1, counts


def test_a_forced_call_streams_as_it_is_answered_whole(model: ServerThread) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        args = {"messages": said("Time?"), "tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": False, "seed": 7, "max_tokens": 200}
        whole = client(model).chat.completions.create(model="tiny", **args)
        chunks = stream_of(model, **args)
        assert [(n, a) for _, n, a in joined_calls(chunks)] == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
        assert [f.finish_reason for f in finish_chunks(chunks)] == ["tool_calls"]


# --- conformance ------------------------------------------------------------------------------
def test_n_streams_give_each_index_one_finish_chunk_and_usage_last(model: ServerThread) -> None:
    chunks = stream_of(model, messages=said("Hi"), n=3, max_completion_tokens=5, seed=1, stream_options={"include_usage": True})
    finals = finish_chunks(chunks)
    assert sorted(f.index for f in finals) == [0, 1, 2]
    assert all(f.finish_reason == "length" and f.delta.content is None for f in finals)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens_is_honoured(model: ServerThread) -> None:
    out = client(model).chat.completions.create(model="tiny", messages=said("Hi"), max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


async def _post(server: ServerThread, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("include_usage without stream", {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ("top_logprobs below 0", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs"),
    ("a tool that is no function", {"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools", "tools[0].type"),
    ("a tool without a name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
    ("a bad function name", {"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools", "tools[0].function.name"),
    ("parameters that are no object schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools", "tools[0].function.parameters"),
    ("parameters that are no JSON object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "tools[0].function.parameters"),
    ("two tools of one name", {"tools": [WEATHER, WEATHER]}, "tools", "tools[1].function.name"),
    ("tool_choice naming no tool", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice", "tools"),
    ("an unknown tool_choice", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ("a forced call with response_format", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),

    ("parameters no grammar can follow", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools", "nonsense"),
    ("a pattern with bounds", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "a+", "maxLength": 3}}}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "maxLength"),
]


@pytest.mark.parametrize(("body", "param", "named"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
async def test_bad_requests_get_a_400_naming_the_field(echo: ServerThread, body: dict[str, Any], param: str, named: str) -> None:
    status, answer = await _post(echo, {"model": "tiny", "messages": said("Hi"), **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param and named in answer["error"]["message"], answer


async def test_history_arguments_that_are_not_json_are_a_400(echo: ServerThread) -> None:
    bad_call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    body = {"model": "tiny", "messages": [{"role": "assistant", "content": "", "tool_calls": [bad_call]}, *said("Hi")]}
    status, answer = await _post(echo, body)
    assert status == 400 and answer["error"]["param"] == "messages" and "messages[0]" in answer["error"]["message"]


def _plan(body: dict[str, Any], parsers: ChatParsers) -> None:
    plan_chat(decode(json.dumps({"messages": said("Hi"), **body}).encode(), ChatCompletionRequest), parsers)


def test_tools_to_a_model_that_cannot_take_them_name_the_flag() -> None:
    no_tools = ChatParsers.resolve(None, None, CHAT_TEMPLATE)
    with pytest.raises(ApiError, match="--chat-template") as error:
        _plan({"tools": [WEATHER]}, no_tools)
    assert error.value.param == "tools"
    unread = ChatParsers.resolve(None, None, "{% if tools %}{{ tools | tojson }}{% endif %}")
    with pytest.raises(ApiError, match="--tool-call-parser"):
        _plan({"tools": [WEATHER]}, unread)
    _plan({"tools": [WEATHER], "tool_choice": "none"}, no_tools)  # nothing is asked of the template
    assert ChatParsers.resolve("llama3", None, TOOL_TEMPLATE).tool_call_parser == "llama3"  # the flag wins
    assert ChatParsers.resolve(None, None, TOOL_TEMPLATE).reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ChatParsers.resolve(None, "nope", TOOL_TEMPLATE)


async def test_a_stop_string_split_across_tokens_never_leaks_its_prefix(echo: ServerThread) -> None:
    chunks = stream_of(echo, messages=said("abc STOP here, then more"), stop=["STOP here"])
    assert text_of(chunks, "content") == "abc "
    assert [f.finish_reason for f in finish_chunks(chunks)] == ["stop"]


async def test_a_seeded_request_is_the_same_alone_and_batched_with_unseeded_ones(model: ServerThread) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{model.url}/v1", api_key="none", max_retries=0, timeout=60)
    ask = {"model": "tiny", "messages": said("Tell me"), "max_tokens": 24, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    alone = await aclient.chat.completions.create(**ask, seed=1234)
    crowd = [aclient.chat.completions.create(**{**ask, "messages": said(f"Other {i}")}) for i in range(3)]
    batched, *_ = await asyncio.gather(aclient.chat.completions.create(**ask, seed=1234), *crowd)
    assert batched.choices[0].message.content == alone.choices[0].message.content
    await aclient.close()


# --- /tokenize, /detokenize -------------------------------------------------------------------
async def _post_to(server: ServerThread, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(f"{server.url}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def test_tokenize_and_detokenize_round_trip(echo: ServerThread, tiny_qwen3: Path) -> None:
    from gpu.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_qwen3)
    text = "The quick brown fox <|im_end|>"
    for path in ("/tokenize", "/v1/tokenize"):
        status, body = await _post_to(echo, path, {"model": "tiny", "prompt": text})
        assert status == 200 and body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == echo.engine.config.context_length
    status, batch = await _post_to(echo, "/tokenize", {"prompt": ["a b", "c"], "add_special_tokens": False})
    assert batch["tokens"] == [tokenizer.encode("a b", add_special_tokens=False), tokenizer.encode("c", add_special_tokens=False)]
    assert batch["count"] == sum(map(len, batch["tokens"]))
    ids = tokenizer.encode(text)
    assert await _post_to(echo, "/detokenize", {"tokens": ids}) == (200, {"text": text})
    assert await _post_to(echo, "/v1/detokenize", {"tokens": ids, "skip_special_tokens": True}) == (200, {"text": "The quick brown fox "})
    assert await _post_to(echo, "/detokenize", {"tokens": [ids, ids[:2]]}) == (200, {"text": [text, tokenizer.decode(ids[:2])]})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [[1], 2]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
    ],
)
async def test_bad_tokenize_requests_are_400s(echo: ServerThread, path: str, body: dict[str, Any], param: str) -> None:
    status, answer = await _post_to(echo, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


# --- the Responses API ----------------------------------------------------------------------------
RESPONSE_WEATHER = {"type": "function", **WEATHER["function"]}


def test_a_response_in_text(echo: ServerThread) -> None:
    out = client(echo).responses.create(model="tiny", input="Hello there", instructions="Be brief.")
    assert out.status == "completed" and out.output_text == "Hello there"
    [item] = out.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert out.usage.output_tokens > 0 and out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


def test_a_response_with_reasoning_and_a_call_whole_and_streamed(echo: ServerThread) -> None:
    text = "<think>\nplan it\n</think>\n\nOn it." + CALL
    whole = client(echo).responses.create(model="tiny", input=text, tools=[RESPONSE_WEATHER])
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "plan it" and whole.output_text == "On it."
    call = whole.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2, "unit": "c"}
    assert call.call_id.startswith("call_") and call.status == "completed"

    events = list(client(echo).responses.create(model="tiny", input=text, tools=[RESPONSE_WEATHER], stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan it"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "On it."
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert added == [d.item.type for d in done] == ["reasoning", "message", "function_call"]
    assert [d.output_index for d in done] == [0, 1, 2]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"] and final.output[2].arguments == call.arguments


def test_a_response_takes_earlier_calls_and_their_outputs(echo: ServerThread) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1, "unit": "c"}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "snow"},
    ]
    out = client(echo).responses.create(model="tiny", input=items, tools=[RESPONSE_WEATHER])
    assert out.output_text == "<tool_response>\nsnow\n</tool_response>"  # the echo of the last turn, as the template wrote it


def test_a_forced_response_call_validates_and_a_short_one_is_incomplete(model: ServerThread) -> None:
    out = client(model).responses.create(
        model="tiny", input="Weather?", tools=[RESPONSE_WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200, extra_body={"seed": 3},
    )
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    short = client(model).responses.create(model="tiny", input="Hi", max_output_tokens=2, extra_body={"seed": 0})
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": []}, "input"),
    ],
)
async def test_bad_responses_requests_are_400s(echo: ServerThread, body: dict[str, Any], param: str) -> None:
    status, answer = await _post_to(echo, "/v1/responses", {"model": "tiny", "input": "Hi", **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_serve_takes_the_parser_flags_by_sglang_names(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from api.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen25", "deepseek-r1")
    assert ChatParsers.resolve(args.tool_call_parser, args.reasoning_parser, CHAT_TEMPLATE).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "mistral"])
    assert "argument --tool-call-parser: invalid choice: 'mistral'" in capsys.readouterr().err


def test_a_response_text_format_constrains_the_output(model: ServerThread) -> None:
    schema = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
    out = client(model).responses.create(
        model="tiny", input="Zone?", max_output_tokens=100, text={"format": {"type": "json_schema", "name": "zone", "schema": schema, "strict": True}},
    )
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)


async def _sse_events(server: ServerThread, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(the `event:` line, the data object) of each server-sent event, read raw; no [DONE]."""
    async with aiohttp.ClientSession() as session, session.post(f"{server.url}/v1/responses", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = []
    for block in raw.split("\n\n")[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), block
        events.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    return events


async def test_a_streamed_response_names_each_event_as_openai_does(echo: ServerThread) -> None:
    events = await _sse_events(echo, {"model": "tiny", "input": "<think>\nhm\n</think>\n\nOn it." + CALL, "tools": [RESPONSE_WEATHER], "stream": True})
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"] and names[-1] == "response.completed"
    assert {"response.reasoning_text.delta", "response.output_text.delta", "response.function_call_arguments.delta", "response.output_item.done"} <= set(names)
    arguments = [data["delta"] for name, data in events if name == "response.function_call_arguments.delta"]
    assert len(arguments) > 1 and json.loads("".join(arguments)) == {"city": "Paris", "days": 2, "unit": "c"}


def test_the_openai_clients_stream_helper_rebuilds_the_whole_response(echo: ServerThread) -> None:
    text = "<think>\nplan\n</think>\n\nOn it." + CALL
    whole = client(echo).responses.create(model="tiny", input=text, tools=[RESPONSE_WEATHER])
    with client(echo).responses.stream(model="tiny", input=text, tools=[RESPONSE_WEATHER]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert final.output_text == whole.output_text == "On it."
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [(i.type, getattr(i, "arguments", None)) for i in whole.output]


def test_stored_responses_are_retrieved_continued_and_deleted(echo: ServerThread, tiny_qwen3: Path) -> None:
    from gpu.loader import load_tokenizer

    first = client(echo).responses.create(model="tiny", input=CALL, instructions="Be brief.", tools=[RESPONSE_WEATHER])
    assert first.store and [i.type for i in first.output] == ["function_call"]
    assert client(echo).responses.retrieve(first.id).model_dump() == first.model_dump()
    call = first.output[0]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client(echo).responses.create(model="tiny", input=[output], previous_response_id=first.id, tools=[RESPONSE_WEATHER])
    assert second.previous_response_id == first.id
    assert second.output_text == "<tool_response>\nsunny\n</tool_response>"
    # the prompt is the whole conversation (not the first's instructions), as the template renders it
    tokenizer = load_tokenizer(tiny_qwen3)
    tokenizer.chat_template = TOOL_TEMPLATE
    history = [
        {"role": "user", "content": CALL},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    rendered = tokenizer.apply_chat_template(history, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert second.usage.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))

    client(echo).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client(echo).responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client(echo).responses.delete(first.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client(echo).responses.create(model="tiny", input="Hi", previous_response_id=first.id)
    unstored = client(echo).responses.create(model="tiny", input="Hi", store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client(echo).responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_once_finished(echo: ServerThread) -> None:
    events = list(client(echo).responses.create(model="tiny", input="Hello there", stream=True))
    final = events[-1].response
    assert client(echo).responses.retrieve(final.id).model_dump() == final.model_dump()


def test_reasoning_effort_none_turns_thinking_off(echo: ServerThread) -> None:
    text = "<think>\nhm\n</think>\n\nHello."
    on = client(echo).responses.create(model="tiny", input=text, reasoning={"effort": "low"})
    assert [i.type for i in on.output] == ["reasoning", "message"] and on.output[0].content[0].text == "hm"
    assert on.output_text == "Hello." and on.reasoning.effort == "low"
    off = client(echo).responses.create(model="tiny", input=text, reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"] and off.output_text == text


def test_the_response_store_keeps_the_most_recently_used() -> None:
    from api.server.responses_api import Conversation, ResponseStore

    store = ResponseStore(capacity=2)
    req = decode(b'{"input": "Hi"}', ResponsesRequest)
    talk = Conversation.of(req, store)
    for name in ("a", "b"):
        store.keep(req, talk, {"id": name, "output": []})
    assert store.get("a") is not None  # "a" is now the most recently used
    store.keep(req, talk, {"id": "c", "output": []})
    assert (store.get("b"), len(store)) == (None, 2) and store.get("a") is not None
    unstored = decode(b'{"input": "Hi", "store": false}', ResponsesRequest)
    store.keep(unstored, talk, {"id": "d", "output": []})
    assert store.get("d") is None
    one = ResponseStore()
    one.keep(req, talk, {"id": "a", "output": [{"type": "message", "content": "x" * 100}]})
    budget = ResponseStore(capacity=10, max_bytes=5 * one.bytes // 2)  # room for two
    for name in ("a", "b", "c"):
        budget.keep(req, talk, {"id": name, "output": [{"type": "message", "content": "x" * 100}]})
    assert [budget.get(n) is not None for n in "abc"] == [False, True, True] and budget.bytes == 2 * one.bytes
    budget.keep(req, talk, {"id": "huge", "output": [{"type": "message", "content": "x" * 3 * one.bytes}]})
    assert len(budget) == 0 and budget.bytes == 0  # more than the whole budget: not kept, and nothing else either
    budget.keep(req, talk, {"id": "a", "output": []})
    budget.delete("a")
    assert (len(budget), budget.bytes) == (0, 0)


async def test_an_error_in_a_responses_stream_is_an_error_event() -> None:
    from api.server.app import _send_event
    from api.server.openai_schema import error_body

    class Sink:
        def __init__(self) -> None:
            self.data = b""

        async def write(self, data: bytes) -> None:
            self.data += data

    sink = Sink()
    await _send_event(sink, error_body(503, "the engine stopped", code="engine_stopped"))  # type: ignore[arg-type]
    event, data = sink.data.decode().removesuffix("\n\n").split("\n")
    assert event == "event: error"
    body = json.loads(data.removeprefix("data: "))
    assert body["type"] == "error" and body["error"]["message"] == "the engine stopped"  # the openai client raises on "error"
