"""The HTTP server end to end, on a tiny random model on the CPU.

Servers run in a background thread with their own uvloop loop (as `actorserve serve` would in its
process), bound to 127.0.0.1 on a free port; tests talk to them over real sockets with the
official `openai` client and with raw aiohttp requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import openai
import orjson
import pytest
import torch
import uvloop

from api.frontend.engine import Engine
from api.server.app import Server, ServerSettings, start_site, stop_site
from tests.conftest import CORE_MODES
from tests.engine_helpers import assert_idle_invariants

API_KEY = "sk-test"
BODY_LIMIT = 256 * 1024
LONG = 1500  # max_tokens that keeps a request busy for well over a second on the tiny model
HANG_GUARD_S = 30.0  # waits for an event end a hung test after this; no test relies on it passing


class ServerThread:
    """One Engine + Server on its own loop in a daemon thread."""

    def __init__(self, engine_kwargs: dict[str, Any], settings: ServerSettings):
        self.engine_kwargs = engine_kwargs
        self.settings = settings
        self.port = 0
        self.engine: Engine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: Future[None] = Future()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: uvloop.run(self._main()), daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.result(timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the server's loop (to inspect the engine in place)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the server did not stop"

    async def _main(self) -> None:
        try:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.engine = Engine(**self.engine_kwargs)
            await self.engine.start()
            server = Server(self.engine, self.settings)
            runner, self.port = await start_site(server, "127.0.0.1", 0)
        except BaseException as exc:
            self._ready.set_exception(exc)
            raise
        self._ready.set_result(None)
        await self._stop.wait()
        await stop_site(runner, self.engine)


@pytest.fixture(scope="module", params=list(CORE_MODES))
def server(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[ServerThread]:
    """The same server with the core inline and in a process of its own: every test runs on both."""
    engine = {"model_path": str(tiny_llama), "enable_priority_scheduling": True, "max_running_requests": 16, **CORE_MODES[request.param]}
    settings = ServerSettings(api_key=API_KEY, max_body_bytes=BODY_LIMIT, served_model_names=("tiny", "tiny-alias"))
    with ServerThread(engine, settings) as s:
        yield s
        s.run(assert_idle_invariants(s.engine))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    from gpu.loader import load_tokenizer

    return load_tokenizer(tiny_llama)


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# --- the official client ----------------------------------------------------------------------
def test_completion_usage_equals_token_counts(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, **GREEDY)
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode("The quick brown fox"))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == "tiny" and out.object == "text_completion"


def test_completion_stream_matches_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=10, stream=True, stream_options={"include_usage": True}, **GREEDY,
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_renders_template_and_counts(client: openai.OpenAI, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert out.usage.completion_tokens == 8
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=8, stream=True, stream_options={"include_usage": True}, **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=30, **GREEDY).choices[0].text
    stop = full[8:11]
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=30, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]


def test_priority_and_sglang_extras_accepted(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, seed=3, temperature=0.8,
        extra_body={"priority": 5, "top_k": 20, "min_p": 0.05, "min_tokens": 4, "repetition_penalty": 1.1,
                    "stop_token_ids": [2], "rid": "extras-1", "cache_salt": "tenant-a", "routing_key": "k"},
    )
    assert out.id == "extras-1" and out.usage.completion_tokens == 4


def test_seed_reproduces(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "prompt": "seed", "max_tokens": 10, "temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_n_choices_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=3, logprobs=2, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    # Greedy: the chosen token is the most likely one.
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4) for c in content)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]


@pytest.mark.parametrize("name", ["tiny", "tiny-alias", "default"])
def test_every_served_name_and_default_are_accepted(client: openai.OpenAI, name: str) -> None:
    out = client.completions.create(model=name, prompt="x", max_tokens=2, **GREEDY)
    assert out.model == "tiny" and out.usage.completion_tokens == 2
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=2, **GREEDY)
    assert chat.model == "tiny"


def test_client_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    assert "'tiny', 'tiny-alias'" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{client.base_url}", api_key="wrong", max_retries=0).models.list()


PERSON = {
    "type": "object",
    "properties": {"name": {"enum": ["ann", "bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_constrains_chat_and_completions(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Who?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, seed=1, response_format=fmt)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, seed=2, response_format=fmt, stream=True))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=64, seed=3, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=32, seed=4, extra_body={"regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.choices[0].text)


def test_a_schema_that_does_not_compile_is_400(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8, response_format=bad, stream=stream)
            list(out) if stream else out
        assert "json_schema does not compile" in info.value.body["message"] and info.value.body["param"] == "json_schema"


async def test_generate_native_ebnf_and_two_constraints(server: ServerThread) -> None:
    params = {"max_new_tokens": 32, "temperature": 1.0, "seed": 5, "ebnf": 'root ::= ("yes" | "no") ("," ("yes" | "no")){0,3}'}
    status, out = await _post(f"{server.url}/generate", {"text": "Hello", "sampling_params": params})
    assert status == 200 and re.fullmatch(r"(yes|no)(,(yes|no)){0,3}", out["text"]), out
    status, out = await _post(f"{server.url}/generate", {"text": "Hello", "sampling_params": {**params, "regex": "a"}})
    assert status == 400 and "at most one of json_schema, regex, ebnf" in out["error"]["message"]


async def test_deadline_and_tenant_fields_are_taken_and_checked(server: ServerThread) -> None:
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "slo_ttft_ms": 5000, "deadline_ms": 9000}
    status, out = await _post(f"{server.url}/generate", body, {**AUTH, "X-Tenant": "team-a"})
    assert status == 200 and len(out["output_ids"]) == 2, out
    status, out = await _post(f"{server.url}/generate", {**body, "slo_ttft_ms": -1})
    assert status == 400 and out["error"]["param"] == "slo_ttft_ms", out
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tenant": ""}
    status, out = await _post(f"{server.url}/v1/chat/completions", chat)
    assert status == 400 and out["error"]["param"] == "tenant", out


# --- raw HTTP: /generate and the native endpoints ---------------------------------------------
async def _post(url: str, body: Any, headers: dict[str, str] = AUTH) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, data=orjson.dumps(body), headers=headers) as r:
        return r.status, orjson.loads(await r.read())


async def _get(url: str, headers: dict[str, str] = AUTH) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.read()


async def _sse(response: aiohttp.ClientResponse) -> list[Any]:
    """Every `data:` payload of an SSE response, `[DONE]` included as a string."""
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


async def test_generate_native(server: ServerThread) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}, "return_logprob": True}
    status, whole = await _post(f"{server.url}/generate", body)
    assert status == 200
    meta = whole["meta_info"]
    assert meta["completion_tokens"] == 6 == len(whole["output_ids"]) and meta["prompt_tokens"] > 0
    assert meta["finish_reason"] == {"type": "length", "length": 6} and len(meta["output_token_logprobs"]) == 6
    async with aiohttp.ClientSession() as s, s.post(f"{server.url}/generate", json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "streamed text must be cumulative"
    assert texts[-1] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


async def test_generate_native_prompt_logprobs(server: ServerThread) -> None:
    body = {
        "input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2, "return_text_in_logprobs": True,
    }
    status, out = await _post(f"{server.url}/generate", body)
    assert status == 200
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == [6, 7, 8, 9]
    assert all(lp < 0 and isinstance(text, str) for lp, _, text in meta["input_token_logprobs"])
    assert [len(row) for row in meta["input_top_logprobs"]] == [2, 2, 2, 2]
    status, out = await _post(f"{server.url}/generate", {**body, "logprob_start_len": 5})
    error = _assert_error(status, out, 400)
    assert error["param"] == "logprob_start_len" and "5-token prompt" in error["message"]


async def test_completion_echo_with_prompt_logprobs(server: ServerThread) -> None:
    """lm-eval style scoring: echo, logprobs and max_tokens 0 give the prompt's own logprobs."""
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    status, out = await _post(f"{server.url}/v1/completions", body)
    assert status == 200
    [choice] = out["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 4 and lp["token_logprobs"][0] is None and all(x < 0 for x in lp["token_logprobs"][1:])
    assert lp["top_logprobs"][0] is None and all(len(row) == 1 for row in lp["top_logprobs"][1:])
    assert choice["text"] == "".join(lp["tokens"]) and lp["text_offset"][0] == 0
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 4
    generated = {**body, "max_tokens": 3, "ignore_eos": True}
    status, whole = await _post(f"{server.url}/v1/completions", generated)
    [choice] = whole["choices"]
    assert choice["text"].startswith(out["choices"][0]["text"]) and len(choice["logprobs"]["tokens"]) == 7
    assert choice["logprobs"]["token_logprobs"][:4] == pytest.approx(lp["token_logprobs"][:4])
    async with aiohttp.ClientSession() as s, s.post(f"{server.url}/v1/completions", json={**generated, "stream": True}, headers=AUTH) as r:
        chunks = [e for e in await _sse(r) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    status, out = await _post(f"{server.url}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0})
    assert _assert_error(status, out, 400)["param"] == "max_tokens"  # 0 needs echo


async def test_generate_batch(server: ServerThread) -> None:
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    status, out = await _post(f"{server.url}/generate", body)
    assert status == 200 and [o["meta_info"]["prompt_tokens"] for o in out] == [3, 2]


async def test_info_endpoints(server: ServerThread) -> None:
    assert (await _get(f"{server.url}/health", headers={}))[0] == 200
    assert (await _get(f"{server.url}/health_generate", headers={}))[0] == 200
    status, raw = await _get(f"{server.url}/get_server_info")
    info = orjson.loads(raw)
    assert status == 200 and info["enable_priority_scheduling"] is True and info["served_model_name"] == "tiny"
    assert "api_key" not in info and {"kv_free", "kv_cached", "kv_pool_size", "num_running"} <= set(info["stats"])
    # The dtype the runner resolved `auto` to, not the setting.
    assert info["dtype"] in ("float32", "bfloat16") and info["dtype"] == server.engine.config.dtype
    if server.engine.runner is not None:  # inline: the runner itself is here to look at
        assert server.engine.runner.dtype == getattr(torch, info["dtype"])
    status, body = await _post(f"{server.url}/flush_cache", {})
    assert status == 200 and body["success"] is True
    assert (await _get(f"{server.url}/get_model_info"))[0] == 200
    # No storage tier here: nothing to clear, and the answer says so (tests/test_storage_tier.py clears one).
    status, body = await _post(f"{server.url}/clear_hicache_storage_backend", {})
    assert _assert_error(status, body, 400)["code"] == "no_storage_tier"


# --- errors -----------------------------------------------------------------------------------
def _assert_error(status: int, body: Any, expected: int, param: str | None = None) -> dict[str, Any]:
    assert status == expected, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}, None),
        ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}, "top_k"),
        ("/generate", {"input_ids": [10**6]}, "input_ids"),
    ],
)
async def test_invalid_input_is_400(server: ServerThread, path: str, body: Any, param: str | None) -> None:
    status, out = await _post(server.url + path, body)
    _assert_error(status, out, 400, param)
    # The same refusal on a streamed request keeps its status: headers wait for the first delta.
    if isinstance(body, dict) and path != "/v1/chat/completions":
        status, out = await _post(server.url + path, {**body, "stream": True})
        _assert_error(status, out, 400, param)


async def test_malformed_json_and_unknown_path(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.url}/v1/completions", data=b'{"prompt": ', headers=AUTH) as r:
            _assert_error(r.status, orjson.loads(await r.read()), 400)
        async with s.get(f"{server.url}/v2/nothing", headers=AUTH) as r:
            _assert_error(r.status, orjson.loads(await r.read()), 404)
        async with s.get(f"{server.url}/v1/completions", headers=AUTH) as r:
            _assert_error(r.status, orjson.loads(await r.read()), 405)


async def test_prompt_longer_than_context(server: ServerThread) -> None:
    context = server.engine.config.context_length
    status, out = await _post(f"{server.url}/v1/completions", {"prompt": [7] * (context + 10), "max_tokens": 2})
    err = _assert_error(status, out, 400)
    assert str(context + 10) in err["message"] and str(context) in err["message"]


async def test_prompt_plus_max_tokens_over_context_is_400(server: ServerThread, tokenizer: Any) -> None:
    context = server.engine.config.context_length
    huge = 1_000_000_000
    status, out = await _post(f"{server.url}/v1/completions", {"prompt": [7] * 10, "max_tokens": huge})
    err = _assert_error(status, out, 400)
    assert f"10 tokens and asks for {huge} new tokens" in err["message"] and f"context length of {context}" in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": huge}
    assert "context length" in _assert_error(*await _post(f"{server.url}/v1/chat/completions", chat), 400)["message"]
    native = {"input_ids": [7] * 10, "sampling_params": {"max_new_tokens": context - 9}}
    assert _assert_error(*await _post(f"{server.url}/generate", native), 400)["param"] == "max_new_tokens"
    # No limit: as many tokens as the context leaves (a prompt 3 tokens short of it gets 3).
    native = {"input_ids": [7] * (context - 3), "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
    status, out = await _post(f"{server.url}/generate", native)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3
    messages = [{"role": "user", "content": _words_for(tokenizer, context - 4)}]
    status, out = await _post(f"{server.url}/v1/chat/completions", {"messages": messages, "ignore_eos": True, "temperature": 0})
    assert status == 200 and out["usage"]["total_tokens"] == context
    assert out["usage"]["completion_tokens"] >= 1 and out["choices"][0]["finish_reason"] == "length"


def _words_for(tokenizer: Any, budget: int) -> str:
    """A user message whose rendered chat prompt has at most `budget` and nearly that many tokens."""
    def rendered(text: str) -> int:
        messages = [{"role": "user", "content": text}]
        return len(tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False))

    words = budget
    while rendered(" ".join(["a"] * words)) > budget:
        words -= max(1, (rendered(" ".join(["a"] * words)) - budget) // 2)
    return " ".join(["a"] * words)


async def test_api_key(server: ServerThread) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        status, out = await _post(f"{server.url}/v1/completions", body, headers=headers)
        _assert_error(status, out, 401)
    status, _ = await _post(f"{server.url}/v1/completions", body, headers={"Authorization": f"bearer {API_KEY}"})
    assert status == 200


async def test_body_over_limit_is_413(server: ServerThread) -> None:
    status, out = await _post(f"{server.url}/v1/completions", {"prompt": "x" * (BODY_LIMIT + 1)})
    assert _assert_error(status, out, 413)["code"] == "request_too_large"


async def test_full_queue_is_503(tiny_llama: Path) -> None:
    with ServerThread({"model_path": str(tiny_llama), "max_queued_requests": 0}, ServerSettings()) as s:
        for stream in (False, True):
            status, out = await _post(f"{s.url}/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": stream})
            error = _assert_error(status, out, 503)
            assert "queue" in error["message"] and error["code"] == "queue_full"
        status, out = await _post(f"{s.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        _assert_error(status, out, 503)
        metrics = (await _get(f"{s.url}/metrics"))[1].decode()
        assert _sample(metrics, "actorserve:num_rejected_requests_total") == 3


# --- disconnects and aborts -------------------------------------------------------------------
async def _server_info(server: ServerThread) -> dict[str, Any]:
    return orjson.loads((await _get(f"{server.url}/get_server_info"))[1])["stats"]


async def _wait_kv_idle(server: ServerThread, within: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        stats = await _server_info(server)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_free"] + stats["kv_cached"] == stats["kv_pool_size"]:
            return stats
        assert loop.time() < deadline, f"KV not back at idle accounting within {within} s: {stats}"
        await asyncio.sleep(0.02)


async def _aborted(server: ServerThread) -> float:
    return _sample((await _get(f"{server.url}/metrics"))[1].decode(), "actorserve:num_aborted_requests_total")


async def _wait_aborted(server: ServerThread, count: float) -> None:
    """Until the server has counted `count` aborts: whatever the abort's way across the core
    process takes (HANG_GUARD_S only ends a hung test)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_GUARD_S
    while (seen := await _aborted(server)) < count:
        assert loop.time() < deadline, f"{seen} aborts counted, {count} expected"
        await asyncio.sleep(0.02)


def _sample(metrics: str, name: str) -> float:
    """The family's value, summed over its labelled series (0 for a labelled family with none yet)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith((name + " ", name + "{"))]
    family = name.removesuffix("_count").removesuffix("_total")
    assert values or f"# TYPE {family} " in metrics, f"{name} not exposed"
    return sum(values)


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_disconnect_mid_stream_aborts(server: ServerThread, path: str) -> None:
    await _wait_kv_idle(server, 5)
    before = await _aborted(server)
    body = {"prompt": "tell me", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    if path == "/generate":
        body = {"text": "tell me", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(server.url + path, json=body, headers=AUTH)
        assert r.status == 200
        for _ in range(3):
            await r.content.readline()
        assert (await _server_info(server))["num_running"] == 1
        r.connection.transport.abort()  # the client vanishes, no goodbye
        r.release()
    await _wait_aborted(server, before + 1)
    await _wait_kv_idle(server, HANG_GUARD_S)
    assert await _aborted(server) == before + 1


async def test_disconnect_while_waiting_for_whole_answer(server: ServerThread) -> None:
    await _wait_kv_idle(server, 5)
    before = await _aborted(server)
    body = {"prompt": "tell me", "max_tokens": LONG, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        waiting = asyncio.create_task(s.post(f"{server.url}/v1/completions", json=body, headers=AUTH))
        while (await _server_info(server))["num_running"] == 0:  # the request is in: now the client leaves
            assert not waiting.done(), "the whole answer came before the client could leave"
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await _wait_aborted(server, before + 1)
    await _wait_kv_idle(server, HANG_GUARD_S)
    assert await _aborted(server) == before + 1


async def test_abort_request_endpoint(server: ServerThread) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}, "stream": True, "rid": "to-abort"}
    async with aiohttp.ClientSession() as s, s.post(f"{server.url}/generate", json=body, headers=AUTH) as r:
        await r.content.readline()
        status, out = await _post(f"{server.url}/abort_request", {"rid": "to-abort"})
        assert status == 200 and out["success"]
        events = await _sse(r)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events[-2]["output_ids"]) < LONG
    await _wait_kv_idle(server, HANG_GUARD_S)


# --- metrics ----------------------------------------------------------------------------------
FAMILIES = (
    "actorserve:num_running_reqs", "actorserve:num_queue_reqs", "actorserve:token_usage", "actorserve:cache_hit_rate",
    "actorserve:gen_throughput", "actorserve:prompt_tokens_total", "actorserve:generation_tokens_total",
    "actorserve:cached_tokens_total", "actorserve:num_aborted_requests_total", "actorserve:num_preemptions_total",
    "actorserve:num_retractions_total", "actorserve:time_to_first_token_seconds_count",
    "actorserve:inter_token_latency_seconds_count", "actorserve:e2e_request_latency_seconds_count",
    "actorserve:request_queue_time_seconds_count",
)


async def test_metrics_move(server: ServerThread) -> None:
    async def scrape() -> dict[str, float]:
        status, raw = await _get(f"{server.url}/metrics", headers={})  # open without the key
        assert status == 200
        return {name: _sample(raw.decode(), name) for name in FAMILIES}

    before = await scrape()
    prompt = "a shared prefix that the radix cache will keep " * 3
    for _ in range(2):
        status, _ = await _post(f"{server.url}/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
        assert status == 200
    after = await scrape()
    assert after["actorserve:generation_tokens_total"] == before["actorserve:generation_tokens_total"] + 10
    assert after["actorserve:prompt_tokens_total"] > before["actorserve:prompt_tokens_total"]
    assert after["actorserve:cached_tokens_total"] > before["actorserve:cached_tokens_total"]
    assert after["actorserve:cache_hit_rate"] > 0
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        key = f"actorserve:{name}_seconds_count"
        assert after[key] > before[key], key


async def test_metrics_split_by_class_and_count_slo_attainment(server: ServerThread) -> None:
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}, "priority": 7, "tenant": "t-metrics"}
    for slo in (60_000, 0.001):  # met; missed (no first token within a microsecond)
        status, _ = await _post(f"{server.url}/generate", {**body, "slo_ttft_ms": slo})
        assert status == 200
    _, raw = await _get(f"{server.url}/metrics", headers={})
    text = raw.decode()
    met = 'actorserve:slo_met_requests_total{priority="7",slo_class="ttft<=60000ms",tenant="t-metrics"} 1.0'
    missed = 'actorserve:slo_missed_requests_total{priority="7",slo_class="ttft<=0.001ms",tenant="t-metrics"} 1.0'
    goodput = 'actorserve:goodput_tokens_total{priority="7",slo_class="ttft<=60000ms",tenant="t-metrics"} 3.0'
    assert met in text and missed in text and goodput in text, text
    assert 'actorserve:time_per_output_token_seconds_count{priority="7",slo_class="ttft<=60000ms",tenant="t-metrics"} 1.0' in text


def test_class_labels_keep_a_bounded_number_of_values() -> None:
    from api.server.metrics import MAX_LABEL_VALUES, ServerMetrics
    from runtime.service import ServiceClass

    metrics = ServerMetrics(lambda: {"running": False})
    tenants = [metrics.tracker(ServiceClass(tenant=f"t{i}")).labels["tenant"] for i in range(MAX_LABEL_VALUES + 5)]
    assert tenants[:MAX_LABEL_VALUES] == [f"t{i}" for i in range(MAX_LABEL_VALUES)]
    assert tenants[MAX_LABEL_VALUES:] == ["other"] * 5
    assert metrics.tracker(ServiceClass(tenant="t3")).labels["tenant"] == "t3"  # a value already seen keeps its series


# --- shutdown ---------------------------------------------------------------------------------
async def test_shutdown_ends_streams_with_error_and_done(tiny_llama: Path) -> None:
    s = ServerThread({"model_path": str(tiny_llama)}, ServerSettings()).__enter__()
    body = {"prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(f"{s.url}/v1/completions", json=body) as r:
        await r.content.readline()
        stopping = asyncio.get_running_loop().run_in_executor(None, s.stop)
        events = await asyncio.wait_for(_sse(r), 10)
        await asyncio.wait_for(stopping, 30)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["code"] == "shutting_down"


async def test_priority_eviction_and_queue_timeout_are_503(tiny_llama: Path) -> None:
    engine = {
        "model_path": str(tiny_llama), "enable_priority_scheduling": True, "max_running_requests": 1,
        "max_queued_requests": 1, "queue_timeout_s": 1.0,
    }
    with ServerThread(engine, ServerSettings()) as s:
        long = {"text": "x", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}, "stream": True, "rid": "long", "priority": 5}
        async with aiohttp.ClientSession() as session, session.post(f"{s.url}/generate", json=long) as running:
            await running.content.readline()
            low = asyncio.create_task(_post(f"{s.url}/v1/completions", {"prompt": "b", "max_tokens": 2, "priority": 1, "stream": True}))
            while (await _server_info(s))["num_waiting"] == 0:
                await asyncio.sleep(0.01)
            high = asyncio.create_task(_post(f"{s.url}/v1/completions", {"prompt": "c", "max_tokens": 2, "priority": 5}))
            status, out = await low
            error = _assert_error(status, out, 503)
            assert "higher-priority" in error["message"] and error["code"] == "evicted"
            status, out = await high  # waits behind the running request until the queue timeout
            error = _assert_error(status, out, 503)
            assert "queue" in error["message"] and error["code"] == "queue_timeout"
            await _post(f"{s.url}/abort_request", {"rid": "long"})
        await _wait_kv_idle(s, HANG_GUARD_S)
