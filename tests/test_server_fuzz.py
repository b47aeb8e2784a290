"""No client input gets a 5xx (issue 11): a 5xx means the server blamed itself for what the client
sent, and some of these inputs used to crash an engine actor, failing every later request too.

Regressions first (each 5xx path found, one test each), then a hypothesis property test that sends
random bytes, random JSON values and plausible bodies (the schemas' real field names with values
of random types, extremes included) to every route the server has, and then checks that the
server is healthy, idle, and has every KV slot back in its pool.
"""

from __future__ import annotations

import gzip
import http.client
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote_from_bytes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi

from api.server.openai_schema import (
    ERROR_TYPES,
    AbortRequestBody,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
)
from api.server.app import Server, ServerSettings
from runtime.sampling_params import SamplingParams
from tests.engine_helpers import assert_idle_invariants
from tests.test_server import ServerThread

API_KEY = "sk-fuzz"
BAD_UTF8 = b"\xed\xb3\xbf"  # a lone surrogate (U+DCFF) encoded as UTF-8 bytes: not valid UTF-8
BAD_MARK = "~bad-utf8~"  # a JSON string that the bodies below turn into BAD_UTF8 after encoding
CHAT = [{"role": "user", "content": "hi"}]
# A valid, short request per POST route: plausible bodies start from these.
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/abort_request": {"rid": "nothing-by-this-name"},
    "/flush_cache": {},
}
SCHEMAS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/generate": GenerateRequest,
    "/abort_request": AbortRequestBody,
}


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerThread]:
    # Priority scheduling on, so that priorities reach the policy instead of being ignored.
    engine = {"model_path": str(tiny_llama), "max_running_requests": 4, "enable_priority_scheduling": True}
    with ServerThread(engine, ServerSettings()) as s:
        yield s
        s.run(assert_idle_invariants(s.engine))


def _request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _post(server: ServerThread, path: str, body: Any) -> tuple[int, Any]:
    status, raw = _request(server.port, "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())
    return status, json.loads(raw)


def _error(status: int, body: Any, expected: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert status == expected, body
    error = body["error"]
    assert error["type"] == ERROR_TYPES[expected], error
    assert (param is None or error["param"] == param) and (code is None or error["code"] == code), error
    return error


def _assert_healthy(server: ServerThread) -> None:
    """An engine actor that crashed fails every later request: /health tells."""
    status, raw = _request(server.port, "GET", "/health")
    assert status == 200, raw


# --- regressions: each 5xx path found ----------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": BAD_MARK, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD_MARK}], "max_tokens": 2}),
        ("/generate", {"text": BAD_MARK, "sampling_params": {"max_new_tokens": 2}}),
        ("/abort_request", {"rid": BAD_MARK}),
    ],
    ids=["completions", "chat", "generate", "abort"],
)
def test_invalid_utf8_inside_a_string_is_invalid_json(server: ServerThread, path: str, body: dict[str, Any]) -> None:
    """The issue's body: bytes ED B3 BF (a lone surrogate) inside a string."""
    _error(*_post(server, path, _encode(body)), 400, code="invalid_json")


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": ["\xed\xb3\xbf"]}',  # inside list[Any]: decoded by msgspec's untyped path
        b'{"prompt": "x", "logit_bias": {"\xed\xb3\xbf": 1}}',  # an object key
        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # nested past msgspec's recursion guard
        b'{"prompt": "x", "bogus": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # an unknown field, skipped
    ],
    ids=["utf8-in-any", "utf8-in-key", "deep-5k", "deep-unknown-field"],
)
def test_undecodable_bodies_are_invalid_json(server: ServerThread, body: bytes) -> None:
    _error(*_post(server, "/v1/completions", body), 400, code="invalid_json")


@pytest.mark.parametrize("prompt", [[2**70], [-1], [[5], [2**64 - 1]]], ids=["huge", "negative", "batch"])
def test_echo_of_token_ids_outside_the_vocabulary_is_400(server: ServerThread, prompt: list[Any]) -> None:
    """Echo decodes the prompt's ids before the engine checks them; the tokenizer overflowed."""
    body = {"prompt": prompt, "max_tokens": 1, "echo": True}
    assert "outside the vocabulary" in _error(*_post(server, "/v1/completions", body), 400, param="prompt")["message"]
    _assert_healthy(server)


@pytest.mark.parametrize("top_k", [2**63, 2**64 - 1, 2**70])
def test_top_k_past_int64_means_the_whole_vocabulary(server: ServerThread, top_k: int) -> None:
    """Used to crash the executor (an int64 tensor overflow) and with it every later request."""
    status, out = _post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": top_k, "ignore_eos": True}})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out
    status, out = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": top_k})
    assert status == 200, out
    _assert_healthy(server)


@pytest.mark.parametrize("top", [600, 2**63, 2**70])
def test_prompt_top_logprobs_past_the_vocabulary_are_capped(server: ServerThread, top: int) -> None:
    """Prompt scoring asked torch.topk for more than the vocabulary: the executor crashed.
    Capped like the output tokens' top logprobs already were."""
    vocab = server.engine.receiver.limits.vocab_size
    logprobs = {"return_logprob": True, "top_logprobs_num": top, "logprob_start_len": 0}
    status, out = _post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, **logprobs})
    assert status == 200, out
    meta = out["meta_info"]
    assert [len(row) for row in meta["input_top_logprobs"][1:]] == [vocab, vocab]
    assert [len(row) for row in meta["output_top_logprobs"]] == [vocab]
    _assert_healthy(server)


def test_priority_past_int64_is_400(server: ServerThread) -> None:
    for value in (2**63, -(2**63) - 1, 2**70):
        _error(*_post(server, "/v1/completions", {**BASES["/v1/completions"], "priority": value}), 400, param="priority")
        _error(*_post(server, "/generate", {**BASES["/generate"], "priority": value}), 400, param="priority")
    for value in (2**63 - 1, -(2**63)):
        assert _post(server, "/generate", {**BASES["/generate"], "priority": value})[0] == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_body_is_read_as_sent(server: ServerThread, encoding: str) -> None:
    """aiohttp's request decompression answered a body that was not what its Content-Encoding
    said with a 500, or now and then never; bodies are now read as sent, as SGLang and vLLM do."""
    body = json.dumps(BASES["/abort_request"]).encode()
    for sent in (b"H", body, gzip.compress(body)):
        for _ in range(10):  # the lost answer came about one time in five
            status, raw = _request(server.port, "POST", "/abort_request", sent, {"Content-Encoding": encoding}, timeout=10)
            expected = 200 if sent == body else 400
            assert status == expected, raw
            if expected == 400:
                _error(status, json.loads(raw), 400, code="invalid_json")


def test_an_api_key_header_that_is_not_utf8_is_401(tiny_llama: Path) -> None:
    with ServerThread({"model_path": str(tiny_llama)}, ServerSettings(api_key=API_KEY)) as s:
        body = json.dumps(BASES["/v1/completions"]).encode()
        for header in ("Authorization", "X-API-Key"):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            conn.putrequest("POST", "/v1/completions")
            conn.putheader(header, b"Bearer \xff\xfe" if header == "Authorization" else BAD_UTF8)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            _error(response.status, json.loads(response.read()), 401, code="invalid_api_key")
            conn.close()
        status, _ = _request(s.port, "POST", "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
        assert status == 200


def test_big_ints_cross_to_a_core_process(tiny_llama: Path) -> None:
    """msgpack carries ints in [-2**63, 2**64): anything bigger crashed the core link, and with it
    the engine. Seeds are now sent modulo 2**64, which the sampler applied anyway: same tokens."""
    engine = {"model_path": str(tiny_llama), "inline_core": False, "enable_priority_scheduling": True}
    with ServerThread(engine, ServerSettings()) as s:

        def tokens(**sampling: Any) -> list[int]:
            body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, **sampling}}
            status, out = _post(s, "/generate", body)
            assert status == 200, out
            return out["output_ids"]

        assert tokens(seed=2**70 + 12345) == tokens(seed=12345)
        assert tokens(seed=-(2**70) - 1) == tokens(seed=2**64 - 1)
        assert len(tokens(top_k=2**70)) == 3
        body = {**BASES["/generate"], "top_logprobs_num": 2**70, "return_logprob": True, "logprob_start_len": 0}
        assert _post(s, "/generate", body)[0] == 200
        _error(*_post(s, "/generate", {**BASES["/generate"], "priority": 2**70}), 400, param="priority")
        _assert_healthy(s)


# --- the property test ------------------------------------------------------------------------
BIG_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -1, -(2**63), -(2**63) - 1, -(2**70)])
STRINGS = st.text(max_size=8) | st.sampled_from([BAD_MARK, "", "\x00", "\ud7ff\U0001f600", "{{ raise }}", "5", "-1"])
SCALARS = st.none() | st.booleans() | st.integers(-3, 600) | BIG_INTS | st.floats(allow_nan=False, allow_infinity=False) | STRINGS
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3), max_leaves=8)
# Fields that set how much is generated: small values or junk, never big ints nor None (which
# asks for up to the whole context), so that each example stays a few tokens long.
CAPS = st.integers(-1, 3) | st.sampled_from([2**63, 2**70, 1.5, "2", [2]])
SIZES = {"max_tokens", "max_completion_tokens", "max_new_tokens", "n", "best_of"}
NOT_INTS = JSON_VALUES.filter(lambda v: v is not None and not isinstance(v, int))
TOKEN_IDS = st.lists(st.integers(-2, 520) | BIG_INTS, min_size=1, max_size=4)
ROLES = st.sampled_from(["user", "system", "assistant", "tool"]) | STRINGS
# Where a field's declared type alone rarely makes a request the engine runs, a better guess.
TYPED: dict[str, st.SearchStrategy[Any]] = {
    **{name: CAPS for name in SIZES},
    "n": st.integers(-1, 3),
    "prompt": STRINGS | TOKEN_IDS | st.lists(STRINGS, max_size=3) | st.lists(TOKEN_IDS, max_size=3),
    "input_ids": TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3) | st.lists(st.lists(TOKEN_IDS, max_size=2), max_size=2),
    # Simple turns, or any of ChatMessage's fields (content parts, tool_calls, ...) typed at random.
    "messages": st.lists(
        st.fixed_dictionaries({"role": ROLES, "content": STRINGS}) | st.deferred(lambda: _of_type(mi.type_info(ChatMessage))),
        min_size=1, max_size=3,
    ),
    "sampling_params": st.deferred(lambda: SAMPLING_PARAMS | st.lists(SAMPLING_PARAMS, max_size=3)),
    "logit_bias": st.dictionaries(st.integers(-2, 600).map(str) | BIG_INTS.map(str) | STRINGS, st.floats(-200, 200), max_size=3),
    # Names the chat template or apply_chat_template itself reads, or any.
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["tools", "documents", "tokenize", "add_generation_prompt", "messages"]) | STRINGS, JSON_VALUES, max_size=2
    ),
    "model": st.sampled_from(["default", "nope"]) | STRINGS,
}
SCALAR_TYPES: dict[type, st.SearchStrategy[Any]] = {
    mi.IntType: st.integers(-3, 8) | BIG_INTS,
    mi.FloatType: st.floats(-3, 3) | st.sampled_from([0.0, 1e-300, 1e300, -1e300]),
    mi.BoolType: st.booleans(),
    mi.StrType: STRINGS,
    mi.NoneType: st.none(),
}


def _of_type(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of a schema field's declared type, extremes included."""
    if isinstance(t, mi.UnionType):
        return st.one_of([_of_type(u) for u in t.types])
    if isinstance(t, mi.ListType):
        return st.lists(_of_type(t.item_type), max_size=3)
    if isinstance(t, mi.DictType):
        return st.dictionaries(_of_type(t.key_type), _of_type(t.value_type), max_size=3)
    if isinstance(t, mi.StructType):
        return st.fixed_dictionaries({}, optional={f.encode_name: _of_type(f.type) for f in t.fields})
    return SCALAR_TYPES.get(type(t), JSON_VALUES)


def _value(name: str, declared: mi.Type) -> st.SearchStrategy[Any]:
    """Three times in four a value of the field's type, else anything."""
    typed = TYPED[name] if name in TYPED else _of_type(declared)
    junk = NOT_INTS if name in SIZES else JSON_VALUES
    return st.sampled_from([True, True, True, False]).flatmap(lambda well: typed if well else junk)


def _fields(schema: type) -> st.SearchStrategy[dict[str, Any]]:
    """A few of the schema's fields (and an unknown one), each with a value drawn for it."""
    declared = {f.encode_name: f.type for f in mi.type_info(schema).fields}
    declared["bogus"] = mi.AnyType()
    pair = st.sampled_from(sorted(declared)).flatmap(lambda k: st.tuples(st.just(k), _value(k, declared[k])))
    return st.lists(pair, max_size=3).map(dict)


# /generate's sampling_params: always a small cap (or junk in its place), plus a few more fields.
SAMPLING_PARAMS = st.builds(lambda cap, more: {"max_new_tokens": cap, **more}, CAPS, _fields(SamplingParams))


def _plausible(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """The route's valid base body with a few of its schema's fields set to random values."""
    schema = SCHEMAS.get(path)
    if schema is None:
        return st.just(BASES[path])
    return _fields(schema).map(lambda fields: {**BASES[path], **fields})


def _encode(value: Any) -> bytes:
    return json.dumps(value).encode().replace(json.dumps(BAD_MARK).encode(), b'"' + BAD_UTF8 + b'"')


def _deep(depth: int) -> bytes:
    return b'{"prompt": "x", "max_tokens": 1, "sampling_params": ' + b"[" * depth + b"]" * depth + b"}"


def _post_bodies(path: str) -> st.SearchStrategy[bytes]:
    plausible = _plausible(path).map(_encode)
    spliced = st.builds(lambda b, at, junk: b[:at] + junk + b[at:], plausible, st.integers(0, 80), st.binary(min_size=1, max_size=4))
    deep = st.sampled_from([10, 999, 1000, 20_000]).map(_deep)
    return st.one_of(st.binary(max_size=64), JSON_VALUES.map(_encode), spliced, deep, plausible, plausible, plausible)


def _routes(server: ServerThread) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, read from its router: a new route gets fuzzed too."""
    app = Server(server.engine, ServerSettings()).app  # a second app over the same engine, never served
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method in ("GET", "POST") and r.resource is not None}
    return sorted(routes)


@st.composite
def _requests(draw: st.DrawFn, routes: list[tuple[str, str]]) -> tuple[str, str, bytes, dict[str, str]]:
    # Every route, the ones with a request schema four times as often: they have the most to check.
    method, path = draw(st.sampled_from(routes + [r for r in routes if r[1] in SCHEMAS] * 3))
    encoding = draw(st.sampled_from([None] * 8 + ["gzip", "deflate"]))  # a body that is not what it says
    headers = {"Content-Encoding": encoding} if encoding else {}
    if method == "GET":
        query = quote_from_bytes(draw(st.binary(max_size=12)), safe=b"=&")
        return method, f"{path}?{query}", draw(st.binary(max_size=16)), headers
    body = draw(_post_bodies(path) if path in BASES else st.binary(max_size=32))
    return method, path, body, headers


def test_random_requests_are_never_5xx_and_leave_the_server_idle(server: ServerThread) -> None:
    routes = _routes(server)
    assert {p for _, p in routes} >= set(BASES) | {"/health", "/v1/models", "/get_server_info"}
    seen: Counter[tuple[str, int]] = Counter()

    @settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], database=None)
    @given(request=_requests(routes))
    def one(request: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, path, body, headers = request
        status, raw = _request(server.port, method, path, body, headers)
        seen[path.split("?")[0], status] += 1
        assert status < 500, (method, path, body[:300], status, raw[:500])

    one()
    # The fuzzing reached the engine (answers) and its checks (refusals) on every generating route.
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        assert seen[path, 200] >= 3 and seen[path, 400] >= 3, seen
    _assert_healthy(server)
    server.run(assert_idle_invariants(server.engine))
    # Nothing leaked: once the prefix cache lets go, every KV slot is free.
    assert _request(server.port, "POST", "/flush_cache")[0] == 200
    stats = server.run(server.engine.current_stats())
    assert stats["kv_free"] == stats["kv_pool_size"] and stats["failure"] is None, stats
