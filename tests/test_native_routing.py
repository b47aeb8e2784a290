"""The compiled router (api/router/csrc/route.c) against the Python one: every choice, load and tree size
of api/router/routing.py's Router on byte prompts, and every prompt and routing key of
api/router/http_router.py's _routing_of."""

from __future__ import annotations

import ctypes

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.router.http_router import _routing_of
from api.router.native import native_library
from api.router.routing import NoHealthyReplica, Router, RouterConfig
from bench.workloads import make_workload
from runtime.config import ROUTER_POLICIES

lib = native_library()
pytestmark = pytest.mark.usefixtures("native_plane")  # skipped only without a C compiler (tests/conftest.py)

KEY_CAP = 4096  # what relay.c passes


class NativeRouter:
    """route.c's router behind Router's methods."""

    def __init__(self, config: RouterConfig, replicas: int):
        self.replicas = replicas
        self.handle = lib.route_new(
            ROUTER_POLICIES.index(config.policy), replicas, config.cache_threshold, config.balance_abs_threshold,
            config.balance_rel_threshold, config.max_tree_tokens,
        )
        assert self.handle

    def __enter__(self) -> NativeRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        lib.route_free(self.handle)

    def choose(self, prompt: bytes, routing_key: str | None) -> int:
        key = b"" if routing_key is None else routing_key.encode("utf-8", "surrogatepass")
        return lib.route_choose(self.handle, prompt, len(prompt), key, len(key), routing_key is not None)

    def started(self, replica: int, tokens: int) -> None:
        lib.route_started(self.handle, replica, tokens)

    def finished(self, replica: int, tokens: int) -> None:
        lib.route_finished(self.handle, replica, tokens)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        lib.route_set_healthy(self.handle, replica, healthy)

    def state(self) -> list[tuple[int, int, int]]:
        """Per replica: requests, tokens and tree size."""
        h = self.handle
        return [(lib.route_requests(h, i), lib.route_tokens(h, i), lib.route_tree_size(h, i)) for i in range(self.replicas)]


def python_choose(router: Router, prompt: bytes, routing_key: str | None) -> int:
    try:
        return router.choose(prompt, routing_key)
    except NoHealthyReplica:
        return -1


def python_state(router: Router) -> list[tuple[int, int, int]]:
    return [(load.requests, load.tokens, router.tree.size[i]) for i, load in enumerate(router.loads)]


# --- the router -----------------------------------------------------------------------------------
# Prompts over a few bytes, most behind one of a few shared heads, so that trees branch, split and share.
# A few of them fill a small tree (max_tree_tokens up to 40), so that eviction picks among leaves.
HEADS = [b"", b"aaaa", b"abab", b"\x00\xffa", b"b" * 12]
prompts = st.one_of(
    st.builds(lambda head, tail: head + bytes(tail), st.sampled_from(HEADS), st.lists(st.sampled_from(b"ab\x00\xff"), max_size=8)),
    st.binary(max_size=24),
)
# Lone surrogates included: the Python router must hash them too (as their three bytes).
any_text = st.lists(st.characters() | st.characters(categories=["Cs"]), max_size=12).map("".join)  # st.text drops surrogates
routing_keys = st.none() | st.sampled_from(["a", "b", "user-1", "user-2"]) | any_text


@st.composite
def operations(draw: st.DrawFn) -> list[tuple]:
    """Mostly prompts from a small pool: repeats touch leaves again, and prompts that the balance
    rule spread hold on several replicas tie on their match."""
    pool = draw(st.lists(prompts, min_size=1, max_size=4))
    prompt = st.integers(0, 3).flatmap(lambda k: prompts if k == 0 else st.sampled_from(pool))
    choose = st.tuples(st.just("choose"), prompt, routing_keys, st.booleans())  # the boolean: whether it starts
    finish = st.tuples(st.just("finish"), st.integers(0, 1000))
    health = st.tuples(st.just("health"), st.integers(0, 3), st.booleans())
    op = st.integers(0, 7).flatmap(lambda k: health if k == 0 else finish if k < 3 else choose)
    return draw(st.lists(op, max_size=60))


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
@settings(max_examples=300, deadline=None)
@given(
    replicas=st.integers(1, 4),
    max_tree_tokens=st.one_of(st.integers(1, 40), st.just(1 << 22)),  # small ones evict on most inserts
    cache_threshold=st.floats(0.0, 1.0),
    balance_abs_threshold=st.integers(0, 3),
    balance_rel_threshold=st.floats(1.0, 2.5),
    ops=operations(),
)
def test_every_choice_load_and_tree_size_equals_the_python_routers(
    policy, replicas, max_tree_tokens, cache_threshold, balance_abs_threshold, balance_rel_threshold, ops
):
    config = RouterConfig(policy, cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_tokens)
    python = Router(config, replicas)
    outstanding: list[tuple[int, int]] = []
    with NativeRouter(config, replicas) as native:
        for op in ops:
            if op[0] == "choose":
                _, prompt, key, start = op
                replica = python_choose(python, prompt, key)
                assert native.choose(prompt, key) == replica
                if start and replica >= 0:
                    outstanding.append((replica, len(prompt)))
                    for router in (python, native):
                        router.started(replica, len(prompt))
            elif op[0] == "finish" and outstanding:
                replica, tokens = outstanding.pop(op[1] % len(outstanding))
                for router in (python, native):
                    router.finished(replica, tokens)
            elif op[0] == "health":
                for router in (python, native):
                    router.set_healthy(op[1] % replicas, op[2])
            assert native.state() == python_state(python)


@pytest.mark.parametrize("max_tree_tokens", [20_000, 1 << 22])  # W2's 16 system prompts are ~2.4 KB each
def test_w2_prompts_route_as_in_python(max_tree_tokens):
    """Real ~3 KB JSON prompts on two replicas, with requests ending in a rolling window, some
    evicting."""
    bodies = _w2_bodies()
    config = RouterConfig("cache_aware", max_tree_tokens=max_tree_tokens, balance_abs_threshold=4)
    python = Router(config, 2)
    window: list[tuple[int, int]] = []
    with NativeRouter(config, 2) as native:
        for body in bodies:
            prompt, _ = _routing_of(body)
            replica = python.choose(prompt)
            assert native.choose(prompt, None) == replica
            window.append((replica, len(prompt)))
            for router in (python, native):
                router.started(replica, len(prompt))
            if len(window) > 12:
                done = window.pop(0)
                for router in (python, native):
                    router.finished(*done)
            assert native.state() == python_state(python)
        assert {r for r, _ in window} == {0, 1}  # the groups spread over both replicas


def _w2_bodies() -> list[bytes]:
    workload = make_workload("W2-shared-prefix", vocab_size=4096)
    return [orjson.dumps({"input_ids": list(r.input_ids), "sampling_params": {"max_new_tokens": 1}}) for r in workload.requests]


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(any_text, min_size=1, max_size=20), replicas=st.integers(1, 12))
def test_routing_keys_land_where_pythons_rendezvous_hashing_puts_them(keys, replicas):
    config = RouterConfig("routing_key")
    python = Router(config, replicas)
    with NativeRouter(config, replicas) as native:
        for key in keys:
            assert native.choose(b"", key) == python.choose(b"", key)


def test_a_routing_key_with_a_lone_surrogate_routes_without_raising():
    config = RouterConfig("routing_key")
    python = Router(config, 3)
    with NativeRouter(config, 3) as native:
        for key in ["\ud800", "a\udfffb", "\ud83d"]:
            assert native.choose(b"", key) == python.choose(b"", key)


def test_cache_aware_sends_equal_matches_to_the_fewer_requests_then_the_lower_index():
    config = RouterConfig("cache_aware", balance_abs_threshold=0, balance_rel_threshold=1.0)
    python = Router(config, 2)
    with NativeRouter(config, 2) as native:
        choices = []
        for _ in range(3):  # 0 (smaller tree, lower index), 1 (1 vs 0 requests: balance), 0 (a tie on all but the index)
            replica = python.choose(b"abc")
            assert native.choose(b"abc", None) == replica
            choices.append(replica)
            for router in (python, native):
                router.started(replica, 3)
        assert choices == [0, 1, 0]


def test_cache_aware_balances_only_beyond_the_absolute_threshold():
    config = RouterConfig("cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.0)
    python = Router(config, 2)
    with NativeRouter(config, 2) as native:
        for router in (python, native):
            assert router.choose(b"abc", None) == 0
            router.started(0, 3)
            router.started(0, 3)
        assert native.choose(b"abc", None) == python.choose(b"abc") == 0  # 2 apart: not more than 2
        for router in (python, native):
            router.started(0, 3)
        assert native.choose(b"abc", None) == python.choose(b"abc") == 1  # 3 apart: the idlest


def test_eviction_takes_the_least_recently_used_leaf_not_the_least_recently_added():
    config = RouterConfig("cache_aware", cache_threshold=0.0, balance_abs_threshold=100, max_tree_tokens=6)
    python = Router(config, 2)
    with NativeRouter(config, 2) as native:
        for router in (python, native):
            router.set_healthy(1, False)  # everything on replica 0
            for prompt in [b"aaa", b"bbb", b"aaa", b"ccc"]:  # "aaa" used again: "bbb" goes for "ccc"
                router.choose(prompt, None)
            router.set_healthy(1, True)
        assert native.state() == python_state(python)
        assert native.choose(b"aaa", None) == python.choose(b"aaa") == 0  # still held there
        assert native.choose(b"bbb", None) == python.choose(b"bbb") == 1  # held nowhere: the smaller tree


def test_no_live_replica_is_minus_one_and_round_robin_does_not_advance_on_it():
    python = Router(RouterConfig("round_robin"), 2)
    with NativeRouter(python.config, 2) as native:
        for router in (python, native):
            router.choose(b"x", None)
            router.set_healthy(0, False)
            router.set_healthy(1, False)
        assert native.choose(b"x", None) == -1
        for router in (python, native):
            router.set_healthy(1, True)
            router.set_healthy(0, True)
        assert [native.choose(b"x", None) for _ in range(3)] == [python.choose(b"x") for _ in range(3)]


def test_settings_out_of_range_give_no_router():
    good = (0, 2, 0.3, 64, 1.5, 100)
    for position, bad in [(0, 4), (0, -1), (1, 0), (2, 1.5), (2, float("nan")), (3, -1), (4, 0.5), (5, 0)]:
        args = list(good)
        args[position] = bad
        assert lib.route_new(*args) is None, args
    handle = lib.route_new(*good)
    assert handle
    lib.route_free(handle)


# --- route_fields ---------------------------------------------------------------------------------
def native_fields(body: bytes, key_cap: int = KEY_CAP) -> tuple[bytes, bytes | None]:
    prompt = ctypes.POINTER(ctypes.c_uint8)()
    prompt_len, key_len = ctypes.c_size_t(), ctypes.c_size_t()
    key = ctypes.create_string_buffer(max(key_cap, 1))
    has_key = lib.route_fields(body, len(body), ctypes.byref(prompt), ctypes.byref(prompt_len), key, key_cap, ctypes.byref(key_len))
    start = ctypes.cast(prompt, ctypes.c_void_p).value - ctypes.cast(ctypes.c_char_p(body), ctypes.c_void_p).value
    assert 0 <= start <= len(body)  # a slice of the body, not a copy
    return body[start : start + prompt_len.value], key.raw[: key_len.value] if has_key else None


def python_fields(body: bytes) -> tuple[bytes, bytes | None]:
    prompt, key = _routing_of(body)
    return prompt, None if key is None else key.encode()


def rarely(usual: st.SearchStrategy[bytes], odd: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """`odd` one time in 16: a single odd piece voids most bodies, which should mostly be valid."""
    return st.integers(0, 15).flatmap(lambda k: odd if k == 0 else usual)


whitespace = st.sampled_from([b"", b" ", b"\n", b"\t", b"\r\n  "])
valid_pieces = st.one_of(
    st.text(st.characters(exclude_characters='"\\', exclude_categories=("Cc", "Cs")), max_size=4).map(str.encode),
    st.sampled_from([rb"\n", rb"\"", rb"\\", rb"\/", rb"\b", rb"\f", rb"\r", rb"\t", rb"\u0041", rb"\u00E9", rb"\u20ac",
                     rb"\ud83d\ude00", rb"\uD834\uDD1E", rb"\u0000", b"\x7f", "\u00e9".encode()]),
)
# msgspec refuses lone surrogates, control bytes and unknown escapes; it passes bytes that are not
# UTF-8 (b"\xff", an encoded surrogate) while scanning, and only a decoded routing key fails on them.
odd_pieces = st.sampled_from([rb"\ud800", rb"\udc00", rb"\ud800\u0041", rb"\ud800x", rb"\x", rb"\u12", b"\x01", b"\t",
                              b"\xff", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"])
json_strings = st.lists(rarely(valid_pieces, odd_pieces), max_size=5).map(lambda parts: b'"' + b"".join(parts) + b'"')
numbers = rarely(
    st.integers(-(10**20), 10**20).map(lambda n: str(n).encode())
    | st.sampled_from([b"0", b"-0", b"-3.25", b"1e5", b"1E+2", b"2.5e-3", b"0.0E-0", b"1e400"]),
    st.sampled_from([b"01", b"1.", b"-", b".5", b"+1", b"NaN", b"1e", b"0x1", b"-01"]),  # not JSON
)
literals = rarely(st.sampled_from([b"null", b"true", b"false"]), st.sampled_from([b"nul", b"True", b"nulll"]))
PROMPT_KEYS = [b'"input_ids"', b'"prompt"', b'"text"', b'"messages"', rb'"\u0070rompt"', rb'"pro\u006dpt"', rb'"input\u005fids"',
               rb'"\u0074ext"']
ROUTING_KEY_KEYS = [b'"routing_key"', rb'"routing\u005Fkey"']
other_keys = st.sampled_from([b'"prompts"', b'"Prompt"', b'"sampling_params"', b'"routing_key "', b'"\xffprompt"', b'"text\x00"']) | json_strings


def _members(items: list[bytes], open_: bytes, close: bytes) -> st.SearchStrategy[bytes]:
    """`items` joined by commas, with whitespace around them."""
    ws = st.lists(whitespace, min_size=len(items) + 1, max_size=len(items) + 1)
    return ws.map(lambda ws: open_ + b",".join(w + item for w, item in zip(ws, items)) + ws[-1] + close)


def _member(keys: st.SearchStrategy[bytes], values: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.builds(lambda k, w1, w2, v: k + w1 + b":" + w2 + v, keys, whitespace, whitespace, values)


def _containers(children: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    arrays = st.lists(children, max_size=4).flatmap(lambda items: _members(items, b"[", b"]"))
    objects = st.lists(_member(st.sampled_from(PROMPT_KEYS) | other_keys, children), max_size=4)
    return arrays | objects.flatmap(lambda items: _members(items, b"{", b"}"))


json_values = st.recursive(json_strings | numbers | literals, _containers, max_leaves=10)
request_member = st.one_of(
    _member(st.sampled_from(PROMPT_KEYS), json_values),
    _member(st.sampled_from(ROUTING_KEY_KEYS), rarely(json_strings, json_values)),
    _member(other_keys, json_values),
)
requests = st.lists(request_member, max_size=6).flatmap(lambda items: _members(items, b"{", b"}"))
bodies = rarely(
    st.builds(lambda w1, obj, w2: w1 + obj + w2, whitespace, requests, whitespace),
    st.builds(lambda obj, tail: obj + tail, requests, st.sampled_from([b"x", b"{}", b",", b"\x00", b"]"]))
    | json_values,  # mostly not an object
)


@settings(max_examples=500, deadline=None)
@given(body=bodies)
def test_fields_equal_routing_of_on_generated_bodies(body):
    assert native_fields(body) == python_fields(body)


@settings(max_examples=500, deadline=None)
@given(body=bodies, data=st.data())
def test_fields_equal_routing_of_on_mutated_bodies(body, data):
    at = data.draw(st.integers(0, len(body)))
    change = data.draw(st.sampled_from(["cut", "drop", "insert", "replace"]))
    byte = data.draw(st.sampled_from(b'{}[]",:\\ 0a-.e\xff\x01/u'))
    if change == "cut":
        body = body[:at]
    elif change == "drop":
        body = body[:at] + body[at + 1 :]
    elif change == "insert":
        body = body[:at] + bytes([byte]) + body[at:]
    else:
        body = body[:at] + bytes([byte]) + body[at + 1 :]
    assert native_fields(body) == python_fields(body)


def test_a_field_given_twice_keeps_its_last_value():
    for body in [b'{"prompt":1,"prompt":[2]}', b'{"routing_key":"a","routing_key":5,"text":"t"}']:
        assert native_fields(body) == python_fields(body)
    assert native_fields(b'{"prompt":1,"prompt":[2]}')[0] == b"[2]"
    assert native_fields(b'{"routing_key":"a","routing_key":5}')[1] is None


def test_the_prompt_is_the_first_present_of_input_ids_prompt_text_messages_whatever_their_order():
    body = b'{"messages": [{"role":"user"}], "text" :"t", "prompt":null ,"input_ids":\t[1, 2]\n}'
    assert native_fields(body) == python_fields(body) == (b"[1, 2]", None)
    body = b'{"messages":[],"text":"t","prompt":null}'
    assert native_fields(body) == python_fields(body) == (b"null", None)  # a raw null is present


def test_field_names_match_once_their_escapes_are_decoded():
    body = rb'{"pr\u006fmpt":"p","routing\u005fkey":"k"}'
    assert native_fields(body) == python_fields(body) == (b'"p"', b"k")


def test_the_routing_key_is_decoded_to_utf8_and_a_lone_surrogate_voids_the_body():
    body = rb'{"text":"t","routing_key":"\ud83d\ude00\u00e9\n\u0000"}'
    assert native_fields(body) == python_fields(body) == (b'"t"', "\U0001f600\u00e9\n\x00".encode())
    for lone in [rb'"\ud800"', rb'"\udc00"', rb'"\ud800\u0041"']:
        body = b'{"text":"t","routing_key":' + lone + b"}"
        assert native_fields(body) == python_fields(body) == (b"", None)


def test_a_routing_key_that_msgspec_skips_but_cannot_decode_routes_without_a_key():
    """msgspec scans such a value as Raw, then decoding it fails: both route the body by its
    prompt, without a key."""
    for raw in [b'"\xff"', b'"\xed\xa0\x80"', b'"\xc0\x80"', b'"a\xe2\x82"', b"1e400", b'[{"\xff":1}]']:
        body = b'{"text":"t","routing_key":' + raw + b"}"
        assert native_fields(body) == python_fields(body) == (b'"t"', None)


def test_a_routing_key_longer_than_the_buffer_counts_as_none():
    body = b'{"input_ids":[1],"routing_key":"' + b"k" * 10 + b'"}'
    assert native_fields(body, key_cap=10) == (b"[1]", b"k" * 10)
    assert native_fields(body, key_cap=9) == (b"[1]", None)


def test_a_body_that_is_no_json_object_has_an_empty_prompt_and_no_key():
    for body in [b"", b"   ", b"[1]", b'"text"', b'{"text":"t"} x', b'{"text":"t",}', b'{"text" "t"}', b"\xef\xbb\xbf{}",
                 b'{"text":01}', b'{"text":"a\x01"}', b'{"text":"t"', b'{"routing_key":"k","a":[1,]}']:
        assert native_fields(body) == python_fields(body) == (b"", None), body


def test_nesting_deeper_than_the_scanner_allows_voids_the_body():
    """route.c's own limit (msgspec raises RecursionError near Python's recursion limit instead):
    1000 containers, the body's object included."""
    def nested(depth: int) -> bytes:
        inner = depth - 1  # the arrays inside the body's object
        return b'{"text":"t","x":' + b"[" * inner + b"]" * inner + b"}"

    assert native_fields(nested(1000)) == (b'"t"', None)
    assert native_fields(nested(1001)) == (b"", None)
    assert native_fields(nested(300)) == python_fields(nested(300))
