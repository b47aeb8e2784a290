"""Whatever a client sends, the answer is never a 5xx: random bytes, random JSON values and
plausible bodies with random field types go to every endpoint; afterwards the server is healthy
and every KV slot is back in the pool."""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.server.app import ServerSettings
from tests.engine_helpers import assert_idle_invariants
from tests.test_server import ServerThread

POSTS = ["/v1/completions", "/v1/chat/completions", "/generate", "/abort_request", "/flush_cache"]
GETS = ["/v1/models", "/health", "/get_server_info", "/get_model_info", "/metrics", "/flush_cache"]
POST_STATUSES: Counter[int] = Counter()  # what the fuzzing got back, to check it reached the engine
BAD_UTF8 = b'{"rid": "\xed\xb3\xbf", "prompt": "\xed\xb3\xbf", "text": "\xed\xb3\xbf", "messages": [{"role": "user", "content": "\xed\xb3\xbf"}]}'


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerThread]:
    with ServerThread({"model_path": str(tiny_llama), "max_running_requests": 4}, ServerSettings()) as s:
        yield s


def _request(server: ServerThread, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"])
def test_invalid_utf8_in_a_string_is_invalid_json(server: ServerThread, path: str) -> None:
    status, raw = _request(server, "POST", path, BAD_UTF8)
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["code"] == "invalid_json", raw


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
small = st.integers(-3, 3) | st.none() | st.booleans() | st.floats(-3, 3) | st.text(max_size=5)
FIELDS = {
    "model": st.sampled_from(["default", "nope", ""]) | small,
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 70000), max_size=5) | st.lists(st.lists(st.integers(-1, 600), max_size=3), max_size=3) | small,
    "text": st.text(max_size=20) | st.lists(st.text(max_size=5), max_size=3) | small,
    "input_ids": st.lists(st.integers(-5, 70000), max_size=5) | st.lists(st.lists(st.integers(0, 600), max_size=3), max_size=3) | small,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | small, "content": st.text(max_size=10) | small | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5) | small}), max_size=2)}), max_size=3) | small,
    "max_tokens": st.integers(-2, 6) | st.just(10**12) | small,
    "max_completion_tokens": st.integers(-2, 6) | small,
    "sampling_params": st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-2, 6) | small, "temperature": small, "top_p": small, "top_k": small, "stop": small | st.lists(st.text(max_size=3), max_size=2), "logit_bias": st.dictionaries(st.text(max_size=6), small, max_size=2), "stop_token_ids": st.lists(st.integers(-2, 70000), max_size=2), "bogus": small}) | st.lists(st.dictionaries(st.text(max_size=4), small, max_size=2), max_size=3) | small,
    "n": st.integers(-1, 4) | small,
    "stream": st.booleans() | small,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | small}) | small,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | small,
    "logprobs": st.integers(-1, 25) | st.booleans() | small,
    "top_logprobs": st.integers(-1, 25) | small,
    "logit_bias": st.dictionaries(st.text(max_size=6) | st.integers(-5, 70000).map(str), st.floats(-200, 200) | small, max_size=3) | small,
    "echo": st.booleans() | small,
    "seed": st.integers(-(2**70), 2**70) | small,
    "priority": small | st.integers(-(2**70), 2**70),
    "rid": st.text(max_size=6) | st.lists(st.text(max_size=4), max_size=3) | small,
    "return_logprob": st.booleans() | small,
    "logprob_start_len": st.integers(-3, 10) | small,
    "top_logprobs_num": st.integers(-1, 30) | small,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"]) | small}) | small,
    "chat_template_kwargs": st.dictionaries(st.text(max_size=6), json_values, max_size=2) | small,
    "temperature": small | st.floats(allow_nan=False),
    "abort_all": st.booleans() | small,
    "min_tokens": st.integers(-2, 8) | small,
    "repetition_penalty": small,
    "tools": st.lists(json_values, max_size=2) | small,
}
plausible = st.fixed_dictionaries({}, optional=FIELDS)
bodies = st.one_of(
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
    plausible.map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(POSTS), body=bodies)
def test_random_posts_are_never_5xx(server: ServerThread, path: str, body: bytes) -> None:
    status, raw = _request(server, "POST", path, body)
    POST_STATUSES[status] += 1
    assert status < 500, (status, raw[:500])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(GETS), query=st.text(max_size=12), body=st.binary(max_size=16))
def test_random_gets_are_never_5xx(server: ServerThread, path: str, query: str, body: bytes) -> None:
    from urllib.parse import quote

    status, raw = _request(server, "GET", f"{path}?{quote(query)}", body)
    assert status < 500, (status, raw[:500])


def test_after_the_fuzzing_the_server_is_healthy_and_idle(server: ServerThread) -> None:
    if POST_STATUSES:  # after the fuzzing (not when this test runs alone): some bodies generated
        assert POST_STATUSES[200] > 0 and POST_STATUSES[400] > 0, POST_STATUSES
    assert _request(server, "GET", "/health")[0] == 200
    server.run(assert_idle_invariants(server.engine))
    stats = server.run(server.engine.current_stats())
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_pool_size"]
