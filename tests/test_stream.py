"""runtime/stream.py: a delta a reader has not taken absorbs later ones exactly."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.stream import Delta, RequestStream

_LISTS = ("output_ids", "logprobs", "top_logprobs", "input_token_ids", "input_logprobs", "input_top_logprobs")
_LATEST = ("finish_reason", "matched_stop", "queue_time", "error", "param", "code", "status")
_OR_EARLIER = ("prompt_tokens", "cached_tokens")


def _maybe(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), values)


deltas = st.builds(
    Delta,
    rid=st.just("r"),
    text=st.text(max_size=3),
    output_ids=st.lists(st.integers(0, 9), max_size=2),
    logprobs=st.lists(st.floats(-5, 0), max_size=2),
    top_logprobs=st.lists(st.lists(st.tuples(st.integers(0, 9), st.floats(-5, 0)), max_size=1), max_size=1),
    input_token_ids=st.lists(st.integers(0, 9), max_size=1),
    input_logprobs=st.lists(_maybe(st.floats(-5, 0)), max_size=1),
    input_top_logprobs=st.lists(st.lists(st.tuples(st.integers(0, 9), st.floats(-5, 0)), max_size=1), max_size=1),
    finish_reason=_maybe(st.sampled_from(["stop", "length", "abort"])),
    matched_stop=_maybe(st.one_of(st.integers(0, 9), st.text(max_size=2))),
    prompt_tokens=st.integers(0, 3),
    completion_tokens=st.integers(0, 9),
    cached_tokens=st.integers(0, 3),
    queue_time=_maybe(st.floats(0, 1)),
    error=_maybe(st.text(max_size=2)),
    param=_maybe(st.text(max_size=2)),
    code=_maybe(st.text(max_size=2)),
    status=_maybe(st.sampled_from([400, 500, 503])),
)


def _expected(parts: list[Delta]) -> dict[str, Any]:
    """Field by field: text and lists joined, the latest set value, counts as the stream has them."""
    out: dict[str, Any] = {"text": "".join(p.text for p in parts)}
    out |= {name: [x for p in parts for x in getattr(p, name)] for name in _LISTS}
    out |= {name: next((getattr(p, name) for p in reversed(parts) if getattr(p, name) is not None), None) for name in _LATEST}
    out |= {name: next((getattr(p, name) for p in reversed(parts) if getattr(p, name)), getattr(parts[0], name)) for name in _OR_EARLIER}
    out["completion_tokens"] = parts[-1].completion_tokens
    return out


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(deltas, min_size=1, max_size=5))
def test_merged_delta_is_the_fields_of_every_delta_pushed(parts: list[Delta]) -> None:
    copies = [Delta(**{f: getattr(p, f) for f in p.__struct_fields__}) for p in parts]
    merged = copies[0]
    for later in copies[1:]:
        merged.merge(later)
    assert {name: getattr(merged, name) for name in _expected(parts)} == _expected(parts)


async def test_an_unread_stream_holds_one_delta_with_everything() -> None:
    stream = RequestStream("r")
    for i in range(5):
        stream.push(Delta(rid="r", text=str(i), output_ids=[i], completion_tokens=i + 1))
    stream.push(Delta(rid="r", finish_reason="length", completion_tokens=5))
    delta = await stream.next()
    assert (delta.text, delta.output_ids, delta.finish_reason, delta.completion_tokens) == ("01234", [0, 1, 2, 3, 4], "length", 5)
    assert await stream.next() is None
