"""cache/prefix_set.py: the Policy's in-batch prefix check, against a brute-force longest common prefix."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import PrefixSet, token_array


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_prefix_is_shared_when_some_member_starts_with_it():
    s = PrefixSet()
    assert not s.shares_prefix([1, 2, 3], None, 1)  # empty
    s.insert([1, 2, 3, 4])
    s.insert([1, 2, 7])
    s.insert([5])
    assert s.shares_prefix([1, 2, 3, 9], None, 3) and not s.shares_prefix([1, 2, 3, 9], None, 4)
    assert s.shares_prefix([1, 2, 7, 8], None, 3) and not s.shares_prefix([1, 2, 7, 8], None, 4)
    assert s.shares_prefix([1, 9], None, 1) and not s.shares_prefix([1, 9], None, 2)
    assert s.shares_prefix([5, 5], None, 1) and not s.shares_prefix([6], None, 1)
    assert s.shares_prefix([1, 2, 3, 4, 5], None, 4)  # a member is a prefix of the query
    assert not s.shares_prefix([1, 2], None, 3)  # the query has fewer tokens than asked for
    assert s.shares_prefix([], None, 0) and s.shares_prefix([9], None, -1)  # nothing asked: always shared


def test_extra_keys_never_share():
    s = PrefixSet()
    s.insert([1, 2, 3], extra_key="lora-a")
    assert s.shares_prefix([1, 2, 3], "lora-a", 3)
    assert not s.shares_prefix([1, 2, 3], "lora-b", 1)
    assert not s.shares_prefix([1, 2, 3], None, 1)
    s.insert([1, 2, 3], extra_key="")
    assert not s.shares_prefix([1, 2, 3], None, 1)  # None and "" are different namespaces
    assert s.shares_prefix([1, 2], "", 2)


def test_only_whole_pages_are_shared():
    s = PrefixSet(page_size=2)
    s.insert([1, 2, 3, 4, 5])
    assert s.shares_prefix([1, 2, 3, 4, 5, 6], None, 4)
    assert not s.shares_prefix([1, 2, 3, 4, 5, 6], None, 5)  # the member's partial last page does not count
    assert s.shares_prefix([1, 2, 3, 9], None, 1)  # asking for 1 token asks for its whole page
    assert not s.shares_prefix([1, 2, 3, 9], None, 3)
    assert not s.shares_prefix([1, 2, 3], None, 3)  # nor does the query's partial page
    assert not s.shares_prefix([1], None, 1)


def test_reset_forgets_every_member():
    s = PrefixSet()
    s.insert([1, 2], extra_key="a")
    s.insert([1, 2])
    s.reset()
    assert not s.shares_prefix([1, 2], "a", 1) and not s.shares_prefix([1, 2], None, 1)


def test_token_arrays_and_lists_are_the_same_keys():
    s = PrefixSet()
    s.insert(token_array([1, 2, 3]))
    assert s.shares_prefix([1, 2, 3], None, 3)
    s.insert([4, 5, 6])
    assert s.shares_prefix(token_array([4, 5, 0]), None, 2) and not s.shares_prefix(token_array([4, 5, 0]), None, 3)
    assert s.shares_prefix(array("q", [4, 5, 6]), None, 3)  # another typecode is encoded as a list


def test_page_size_below_one_is_refused():
    with pytest.raises(ValueError, match="page_size"):
        PrefixSet(page_size=0)


# Few distinct ids so prefixes are shared; the extremes of int32 and ids whose bytes differ only in
# a high byte check that the byte order of the encoding never changes an answer.
TOKEN_IDS = st.sampled_from([0, 1, 2, -1, 256, 65536, 2**31 - 1, -(2**31)])
OPS = st.lists(
    st.tuples(st.sampled_from([None, "a", ""]), st.lists(TOKEN_IDS, max_size=12), st.booleans(), st.integers(-1, 13)),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(page_size=st.sampled_from([1, 2, 3, 4]), ops=OPS)
def test_answers_as_the_brute_force_longest_common_prefix(page_size: int, ops: list[tuple[str | None, list[int], bool, int]]) -> None:
    """Asking for min_tokens is asking whether the longest whole-page prefix shared with a member is that long."""
    s = PrefixSet(page_size)
    inserted: list[tuple[str | None, list[int]]] = []
    for extra_key, tokens, as_array, min_tokens in ops:
        key = token_array(tokens) if as_array else tokens
        longest = max((common_prefix(tokens, member) for k, member in inserted if k == extra_key), default=0)
        assert s.shares_prefix(key, extra_key, min_tokens) == (longest // page_size * page_size >= min_tokens)
        s.insert(key, extra_key)
        inserted.append((extra_key, tokens))
