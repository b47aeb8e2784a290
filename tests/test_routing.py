"""The router's policies and its approximate prefix tree (api/router/routing.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.router.routing import NoHealthyReplica, PrefixTree, Router, RouterConfig

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=40)


def _naive_match(inserted: list[list[int]], tokens: list[int]) -> int:
    best = 0
    for p in inserted:
        n = 0
        while n < min(len(p), len(tokens)) and p[n] == tokens[n]:
            n += 1
        best = max(best, n)
    return best


@pytest.mark.parametrize("kind", [list, bytes])  # token ids in the frontend, JSON bytes in the HTTP router
@settings(max_examples=300, deadline=None)
@given(inserts=st.lists(st.tuples(prompts, st.integers(0, 2)), max_size=30), queries=st.lists(prompts, min_size=1, max_size=5))
def test_tree_matches_the_longest_prefix_sent_to_each_replica(kind, inserts, queries):
    tree = PrefixTree(3, max_tokens=10**9)
    sent: list[list[list[int]]] = [[], [], []]
    for tokens, replica in inserts:
        tree.insert(kind(tokens), replica)
        sent[replica].append(tokens)
    for replica in range(3):
        assert tree.size[replica] == _distinct_prefix_tokens(sent[replica])
    for q in queries + [t for t, _ in inserts]:
        assert tree.match(kind(q)) == [_naive_match(sent[r], q) for r in range(3)]


def _distinct_prefix_tokens(sent: list[list[int]]) -> int:
    """Tokens a trie of these prompts holds: its distinct non-empty prefixes."""
    return len({tuple(p[: i + 1]) for p in sent for i in range(len(p))})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(prompts, st.integers(0, 1)), max_size=40), st.integers(1, 20))
def test_tree_stays_within_its_size_and_keeps_the_newest_prompt(inserts, max_tokens):
    tree = PrefixTree(2, max_tokens=max_tokens)
    sent: list[list[list[int]]] = [[], []]
    for tokens, replica in inserts:
        tree.insert(tokens, replica)
        sent[replica].append(tokens)
        assert tree.size[replica] <= max_tokens
        if len(tokens) <= max_tokens:  # the newest prompt is the last thing it drops
            assert tree.match(tokens)[replica] == len(tokens)
        for r in range(2):  # eviction only forgets: never a match that was not sent
            assert tree.match(tokens)[r] <= _naive_match(sent[r], tokens)
        assert tree.size[replica] == _held_tokens(tree, replica)


def _held_tokens(tree: PrefixTree, replica: int) -> int:
    total, stack = 0, list(tree.root.children.values())
    while stack:
        node = stack.pop()
        if replica in node.last_used:
            total += len(node.key)
            stack.extend(node.children.values())
        else:
            assert not any(replica in c.last_used for c in node.children.values()), "a hole in a replica's path"
    return total


def test_cache_aware_keeps_a_shared_prefix_on_one_replica_and_spreads_the_rest():
    router = Router(RouterConfig(policy="cache_aware"), 2)
    system = list(range(100, 164))
    first = router.choose(system + [1, 2])
    router.started(first, 66)
    for i in range(10):  # every later request of the group matches 64/66 of its prompt
        assert router.choose(system + [i, i]) == first
    other = router.choose(list(range(500, 560)))  # no match: the replica with the smaller tree
    assert other != first


def test_cache_aware_gives_way_to_balance_when_the_load_is_lopsided():
    router = Router(RouterConfig(policy="cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5), 2)
    prompt = list(range(50))
    home = router.choose(prompt)
    for _ in range(4):
        router.started(home, 50)
    assert router.choose(prompt) == home  # 4 apart: not more than the absolute threshold
    router.started(home, 50)
    assert router.choose(prompt) == 1 - home  # 5 apart and 5 > 0 * 1.5: the idlest
    assert router.tree.match(prompt) == [50, 50]  # the idlest will hold it too
    for _ in range(6):
        router.started(1 - home, 50)
    assert router.choose(prompt) == home  # 5 vs 6: both match it all, the less loaded wins


def test_round_robin_and_shortest_queue_skip_a_replica_that_is_down():
    rr = Router(RouterConfig(policy="round_robin"), 3)
    assert [rr.choose([1]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    rr.set_healthy(1, False)
    assert set(rr.choose([1]) for _ in range(6)) == {0, 2}
    sq = Router(RouterConfig(policy="shortest_queue"), 3)
    sq.started(0, 100)
    sq.started(1, 10)
    assert sq.choose([1]) == 2
    sq.started(2, 50)
    assert sq.choose([1]) == 1
    sq.progressed(1, 60)  # 70 outstanding now
    assert sq.choose([1]) == 2
    sq.finished(0, 100)
    assert sq.choose([1]) == 0
    for replica in range(3):
        sq.set_healthy(replica, False)
    with pytest.raises(NoHealthyReplica):
        sq.choose([1])


def test_routing_key_is_sticky_and_only_a_dead_replicas_keys_move():
    router = Router(RouterConfig(policy="routing_key"), 3)
    keys = [f"user-{i}" for i in range(60)]
    home = {k: router.choose([1], routing_key=k) for k in keys}
    assert len(set(home.values())) == 3  # the keys spread
    assert all(router.choose([7, 8], routing_key=k) == home[k] for k in keys)  # sticky
    router.set_healthy(0, False)
    moved = {k: router.choose([1], routing_key=k) for k in keys}
    assert all(moved[k] == home[k] for k in keys if home[k] != 0)
    assert all(moved[k] != 0 for k in keys)
    router.set_healthy(0, True)
    assert {k: router.choose([1], routing_key=k) for k in keys} == home


def test_bad_router_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="router_policy 'nearest' is unknown"):
        RouterConfig(policy="nearest")
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterConfig(cache_threshold=1.5)
