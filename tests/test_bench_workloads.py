"""The standard workloads: exact counts and lengths, determinism, W2's group structure."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.workloads import WORKLOADS, arrival_offsets, make_workload

VOCAB = 4096


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_workload(name: str) -> None:
    a = make_workload(name, VOCAB, seed=3, rate=4.0)
    b = make_workload(name, VOCAB, seed=3, rate=4.0)
    assert a == b
    c = make_workload(name, VOCAB, seed=4, rate=4.0)
    assert [r.input_ids for r in a.requests] != [r.input_ids for r in c.requests]


@pytest.mark.parametrize("name", WORKLOADS)
def test_ids_within_the_vocabulary_margin(name: str) -> None:
    wl = make_workload(name, VOCAB, rate=4.0)
    ids = [t for r in wl.requests for t in r.input_ids]
    ids += [t for c in wl.conversations for turn in c.user_turns for t in turn]
    assert min(ids) >= 10 and max(ids) < VOCAB - 10


@pytest.mark.parametrize(
    ("name", "count", "input_len", "output_len"),
    [
        ("W1-mixed", 256, (32, 512), (16, 256)),
        ("W1-mixed-64", 64, (32, 512), (16, 256)),
        ("W3-online", 256, (32, 512), (16, 256)),
        ("W5-priority-overload", 512, (32, 256), (16, 128)),
    ],
)
def test_mixed_counts_and_bounds(name: str, count: int, input_len: tuple[int, int], output_len: tuple[int, int]) -> None:
    wl = make_workload(name, VOCAB, rate=8.0)
    assert len(wl.requests) == count
    assert [r.index for r in wl.requests] == list(range(count))
    ins = [len(r.input_ids) for r in wl.requests]
    outs = [r.max_new_tokens for r in wl.requests]
    assert input_len[0] <= min(ins) and max(ins) <= input_len[1]
    assert output_len[0] <= min(outs) and max(outs) <= output_len[1]
    # Uniform over the whole range: with this many draws both ends are approached.
    span_in, span_out = input_len[1] - input_len[0], output_len[1] - output_len[0]
    assert min(ins) < input_len[0] + span_in / 10 and max(ins) > input_len[1] - span_in / 10
    assert min(outs) < output_len[0] + span_out / 10 and max(outs) > output_len[1] - span_out / 10


def test_w1_draw_order_is_input_length_output_length_then_ids() -> None:
    rng = np.random.default_rng(0)
    expected = []
    for _ in range(3):
        n = int(rng.integers(32, 513))
        out = int(rng.integers(16, 257))
        expected.append((rng.integers(10, VOCAB - 10, size=n).tolist(), out))
    wl = make_workload("W1-mixed", VOCAB, seed=0, num_requests=3)
    assert [(r.input_ids, r.max_new_tokens) for r in wl.requests] == expected


def test_w1_64_and_shrunk_workloads_are_prefixes() -> None:
    full = make_workload("W1-mixed", VOCAB)
    assert make_workload("W1-mixed-64", VOCAB).requests == full.requests[:64]
    assert make_workload("W1-mixed", VOCAB, num_requests=10).requests == full.requests[:10]
    w3 = make_workload("W3-online", VOCAB, rate=math.inf)
    assert [r.input_ids for r in w3.requests] == [r.input_ids for r in full.requests]


def test_w2_groups_share_their_system_prompt() -> None:
    wl = make_workload("W2-shared-prefix", VOCAB)
    assert len(wl.requests) == 256
    systems: dict[int, list[int]] = {}
    for i, r in enumerate(wl.requests):
        assert r.group == i % 16
        assert len(r.input_ids) == 512 + 64 and r.max_new_tokens == 64
        assert systems.setdefault(r.group, r.input_ids[:512]) == r.input_ids[:512]
    assert len({tuple(s) for s in systems.values()}) == 16
    assert len({tuple(r.input_ids[512:]) for r in wl.requests}) == 256
    # The system prompts are drawn before any question.
    rng = np.random.default_rng(0)
    first_systems = [rng.integers(10, VOCAB - 10, size=512).tolist() for _ in range(16)]
    assert [systems[g] for g in range(16)] == first_systems
    assert wl.requests[0].input_ids[512:] == rng.integers(10, VOCAB - 10, size=64).tolist()


def test_w3_arrivals_follow_the_rate() -> None:
    at_once = make_workload("W3-online", VOCAB, rate=math.inf)
    assert all(r.arrival_s == 0.0 for r in at_once.requests)
    slow = make_workload("W3-online", VOCAB, rate=2.0)
    fast = make_workload("W3-online", VOCAB, rate=8.0)
    times = [r.arrival_s for r in slow.requests]
    assert times[0] == 0.0 and times == sorted(times)
    assert 0.5 * 255 * 0.7 < times[-1] < 0.5 * 255 * 1.3  # 255 gaps of mean 1/rate
    # The rate only scales the gaps.
    assert [4 * r.arrival_s for r in fast.requests] == pytest.approx(times)
    assert [r.input_ids for r in slow.requests] == [r.input_ids for r in fast.requests]


def test_arrival_offsets_burstiness_keeps_the_mean_gap() -> None:
    rng = np.random.default_rng(1)
    times = arrival_offsets(rng, 4001, rate=10.0, burstiness=0.5)
    assert times[-1] / 4000 == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError, match="rate and burstiness must be positive, got 0.0, 1.0"):
        arrival_offsets(rng, 3, rate=0.0)
    with pytest.raises(ValueError, match="rate and burstiness must be positive, got 10.0, 0.0"):
        arrival_offsets(rng, 3, rate=10.0, burstiness=0.0)


def test_w4_conversations() -> None:
    wl = make_workload("W4-multi-turn", VOCAB)
    assert len(wl.conversations) == 32 and len(wl.requests) == 32
    for conv, first in zip(wl.conversations, wl.requests):
        assert [len(t) for t in conv.user_turns] == [256, 64, 64, 64]
        assert conv.max_new_tokens == 64
        assert first.input_ids == conv.user_turns[0] and first.group == conv.index
    conv = wl.conversations[0]
    history = conv.prompt(0, []) + [7, 8]
    assert conv.prompt(1, history) == conv.user_turns[0] + [7, 8] + conv.user_turns[1]


def test_w5_priorities_and_arrivals() -> None:
    wl = make_workload("W5-priority-overload", VOCAB, rate=20.0)
    priorities = [r.priority for r in wl.requests]
    assert priorities.count(10) == round(0.1 * 512) and priorities.count(0) == 512 - priorities.count(10)
    assert wl.requests[0].arrival_s == 0.0 and wl.requests[-1].arrival_s > 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("W9", VOCAB)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("W1-mixed-64", VOCAB, num_requests=65)
    with pytest.raises(ValueError, match="vocab_size"):
        make_workload("W1-mixed", 20)


def test_shared_prefix_generator_defaults_are_w2() -> None:
    from bench.workloads import shared_prefix_requests

    assert shared_prefix_requests(VOCAB) == make_workload("W2-shared-prefix", VOCAB).requests
    big = shared_prefix_requests(VOCAB, num_requests=1024, output_len=4)
    w2 = make_workload("W2-shared-prefix", VOCAB).requests
    assert len(big) == 1024 and [r.input_ids for r in big[:256]] == [r.input_ids for r in w2]
    assert all(r.max_new_tokens == 4 and r.group == r.index % 16 for r in big)
    assert len({tuple(r.input_ids[:512]) for r in big}) == 16
