"""Crafted states for actors/prefill_adder.py, against reference/sglang-behaviour.md ("PrefillAdder", "Scheduler step")."""

from __future__ import annotations

import itertools

import pytest
import torch

from actors.prefill_adder import (
    CLIP_MAX_NEW_TOKENS,
    AddResult,
    NewTokenRatio,
    PrefillAdder,
    match_for_admission,
    ratio_after_retraction,
    retraction_stack,
    select_preemption_victims,
    select_retraction_victims,
)
from cache import ChunkCache, PrefixCache, RadixCache
from gpu.kv_pool import TokenSlotAllocator
from actors.priority import PriorityRule
from runtime.req import OutputState, CallerRequest, Req, SchedState
from runtime.sampling_params import SamplingParams

_ids = itertools.count()


def req(
    prompt: int | list[int],
    max_new: int = 16,
    output: int = 0,
    priority: int = 0,
    enqueue: float = 0.0,
    ignore_eos: bool = False,
) -> Req:
    """A request with a prompt of unique tokens (no accidental cache hits) or the given tokens."""
    n = next(_ids)
    tokens = prompt if isinstance(prompt, list) else [10_000 * (n + 1) + i for i in range(prompt)]
    r = Req(CallerRequest(rid=f"r{n}", input_ids=tokens, sampling=SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos), priority=priority), sched=SchedState(enqueue_time=enqueue), out=OutputState(output_ids=[7] * output))
    return r


def radix(size: int = 256, page_size: int = 1) -> tuple[RadixCache, TokenSlotAllocator]:
    alloc = TokenSlotAllocator(size, page_size)
    return RadixCache(alloc), alloc


def cache_tokens(cache: RadixCache, alloc: TokenSlotAllocator, tokens: list[int]) -> None:
    """Put `tokens` in the cache as a finished request would leave them (evictable)."""
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    present = cache.insert(tokens, slots)
    aligned = len(tokens) // cache.page_size * cache.page_size
    alloc.free(torch.cat([slots[:present], slots[aligned:]]))


def adder(
    cache: PrefixCache,
    free: int,
    running: list[Req] | None = None,
    ratio: float = 0.5,
    max_prefill: int = 1000,
    chunk: int | None = None,
    mixed: int = 0,
    prefill_max_requests: int | None = None,
) -> PrefillAdder:
    return PrefillAdder(
        prefill_max_requests=prefill_max_requests,
        page_size=cache.page_size,
        cache=cache,
        free_slots=free,
        running=running or [],
        new_token_ratio=ratio,
        max_prefill_tokens=max_prefill,
        chunked_prefill_size=chunk,
        mixed_decode_tokens=mixed,
    )


def add(a: PrefillAdder, r: Req, has_chunked_req: bool = False) -> AddResult:
    return a.add_one_req(r, match_for_admission(a.cache, r), has_chunked_req)


def launch(a: PrefillAdder) -> None:
    """What the Adder does when it launches the batch: advance each request past its extend."""
    for adm in a.admitted:
        adm.req.sched.computed_len = adm.prefix_len + adm.extend_len


# --- budgets ---------------------------------------------------------------------------------


def test_budgets_at_construction():
    cache, alloc = radix()
    cache_tokens(cache, alloc, list(range(10)))
    running = [req(5, max_new=30, output=10), req(5, max_new=10 * CLIP_MAX_NEW_TOKENS)]
    a = adder(cache, free=100, running=running, ratio=0.5, max_prefill=64, chunk=32, mixed=2)
    # 100 free + 10 evictable - (2 mixed + 20 * 0.5 + CLIP * 0.5)
    assert a.rem_total_tokens == 100 + 10 - (2 + 10 + CLIP_MAX_NEW_TOKENS * 0.5)
    assert a.rem_input_tokens == 62 and a.rem_chunk_tokens == 30
    assert adder(cache, 100, chunk=None).rem_chunk_tokens is None
    assert adder(cache, 100, chunk=-1).rem_chunk_tokens is None


def test_budget_state_continue_no_token_other():
    cache, _ = radix()
    assert adder(cache, free=100).budget_state() is AddResult.CONTINUE
    # A running request expected to take all free KV: 200 * 0.5 == 100.
    assert adder(cache, free=100, running=[req(4, max_new=200)]).budget_state() is AddResult.NO_TOKEN
    assert adder(cache, free=101, running=[req(4, max_new=200)]).budget_state() is AddResult.CONTINUE
    # Mixed decode tokens use up the input budget, or the chunk budget.
    assert adder(cache, free=100, max_prefill=4, mixed=4).budget_state() is AddResult.OTHER
    assert adder(cache, free=100, chunk=8, mixed=8).budget_state() is AddResult.OTHER
    # NO_TOKEN wins over OTHER.
    assert adder(cache, free=3, max_prefill=4, mixed=4).budget_state() is AddResult.NO_TOKEN


def test_no_token_when_needs_reach_the_total_budget():
    cache, _ = radix()
    a = adder(cache, free=50)
    assert add(a, req(20, max_new=30)) is AddResult.NO_TOKEN  # 20 + 30 >= 50
    assert a.admitted == []
    r = req(20, max_new=29)
    assert add(a, r) is AddResult.CONTINUE  # 49 < 50
    assert a.can_run == [r] and a.rem_total_tokens == 1


def test_new_requests_are_charged_without_the_ratio_and_decode_clipped():
    cache, _ = radix()
    a = adder(cache, free=100_000, ratio=0.1)
    add(a, req(10, max_new=100))
    add(a, req(10, max_new=2 * CLIP_MAX_NEW_TOKENS))
    assert a.total_offset == (10 + 100) + (10 + CLIP_MAX_NEW_TOKENS)


def test_readmitted_request_is_tested_on_what_remains_but_charged_its_full_max_new_tokens():
    """SGLang's add_one_req tests extend + (max_new - generated) but its _update_prefill_budget
    charges min(max_new, CLIP) whole, as if the request had generated nothing."""
    cache, _ = radix()
    a = adder(cache, free=100)
    r = req(20, max_new=100, output=40)  # re-prefills 60 tokens and may decode 60 more
    assert a.tokens_needed(r, match_for_admission(cache, r)) == 120
    assert add(a, r) is AddResult.NO_TOKEN and a.can_run == []
    a = adder(cache, free=121)
    add(a, r)
    assert a.can_run == [r]
    assert a.total_offset == 60 + 100


def test_admission_test_does_not_round_the_extend_up_to_pages():
    """SGLang's add_one_req compares extend + new tokens, unrounded, with the budget (it charges
    whole pages once admitted): 70 + 50 < 128 fits a pool of 128 with pages of 16."""
    cache, _ = radix(page_size=16)
    a = adder(cache, free=128)
    r = req(70, max_new=50)
    assert add(a, r) is AddResult.NO_TOKEN  # admitted; 80 + 50 charged leave nothing
    assert a.can_run == [r] and a.total_offset == 80 + 50


def test_prefill_max_requests_caps_one_batch():
    cache, _ = radix()
    a = adder(cache, free=1000, prefill_max_requests=2)
    assert [add(a, req(5)) for _ in range(3)] == [AddResult.CONTINUE, AddResult.CONTINUE, AddResult.OTHER]
    assert len(a.can_run) == 2


def test_first_request_may_exceed_the_input_cap_but_a_second_may_not():
    cache, _ = radix()
    a = adder(cache, free=1000, max_prefill=10)
    first = req(30)
    assert add(a, first) is AddResult.OTHER  # admitted; the input budget is now spent
    assert a.can_run == [first] and a.rem_input_tokens == -20

    a = adder(cache, free=1000, max_prefill=50)
    assert add(a, req(30)) is AddResult.CONTINUE
    assert add(a, req(20)) is AddResult.OTHER  # 20 >= the 20 left
    assert len(a.admitted) == 1
    assert add(a, req(19)) is AddResult.CONTINUE
    assert len(a.admitted) == 2


def test_mixed_decode_tokens_shrink_every_budget():
    cache, _ = radix()
    a = adder(cache, free=60, mixed=10, max_prefill=40, chunk=30)
    assert (a.rem_total_tokens, a.rem_input_tokens, a.rem_chunk_tokens) == (50, 30, 20)
    assert add(a, req(20, max_new=30)) is AddResult.NO_TOKEN  # 50 >= 50


# --- chunked prefill -------------------------------------------------------------------------------


def test_truncation_to_the_chunk_budget_page_1():
    cache, _ = radix()
    a = adder(cache, free=1000, chunk=16)
    r = req(40, max_new=100)
    assert add(a, r) is AddResult.OTHER  # chunk budget spent
    (adm,) = a.admitted
    assert (adm.prefix_len, adm.extend_len, adm.truncated) == (0, 16, True)
    assert a.new_chunked_req is r and r.sched.computed_len == 0
    assert a.total_offset == 16  # no decode tokens charged while the prompt is cut


def test_truncation_to_a_page_multiple_page_4():
    cache, alloc = radix(page_size=4)
    prompt = list(range(1, 41))
    cache_tokens(cache, alloc, prompt[:8])
    a = adder(cache, free=1000, chunk=18)
    r = req(prompt)
    assert add(a, r) is AddResult.CONTINUE  # 2 chunk tokens left: a whole small request still fits
    (adm,) = a.admitted
    assert (adm.prefix_len, adm.extend_len) == (8, 16)  # 18 // 4 * 4
    assert r.sched.computed_len == 8 and adm.truncated
    assert a.rem_chunk_tokens == 2
    # The next cut would be 2 // 4 * 4 == 0 tokens anyway, but only one request may be chunked.
    assert add(a, req(list(range(100, 140)))) is AddResult.OTHER and len(a.admitted) == 1


def test_truncation_below_one_page_is_refused_and_unlocked():
    cache, alloc = radix(page_size=4)
    prompt = list(range(1, 21))
    cache_tokens(cache, alloc, prompt[:8])
    a = adder(cache, free=1000, chunk=8, mixed=5)  # 3 chunk tokens left: less than a page
    assert a.budget_state() is AddResult.CONTINUE
    r = req(prompt)
    assert add(a, r) is AddResult.OTHER
    assert a.admitted == [] and cache.protected_size() == 0
    assert cache.protected_size() == 0 and cache.evictable_size() == 8


def test_extend_is_charged_in_whole_pages():
    cache, _ = radix(page_size=4)
    a = adder(cache, free=1000, max_prefill=100)
    add(a, req(5, max_new=3))  # extend 5 costs two pages
    assert a.rem_input_tokens == 92 and a.total_offset == 8 + 3


def test_no_second_chunked_request():
    cache, _ = radix()
    a = adder(cache, free=1000, chunk=100)
    assert add(a, req(200), has_chunked_req=True) is AddResult.OTHER
    assert a.admitted == []
    assert add(a, req(50), has_chunked_req=True) is AddResult.CONTINUE  # fits whole: fine


def test_add_chunked_req_continues_over_rounds():
    cache, _ = radix()
    r = req(40, max_new=100)
    a = adder(cache, free=1000, chunk=16)
    add(a, r)
    launch(a)
    rounds = []
    chunked: Req | None = r
    while chunked is not None:
        a = adder(cache, free=1000, chunk=16)
        chunked = a.add_chunked_req(chunked)
        (adm,) = a.admitted
        rounds.append((adm.prefix_len, adm.extend_len, adm.truncated, adm.prefix_len + adm.extend_len if adm.truncated else None, a.total_offset))
        launch(a)
    assert rounds == [(16, 16, True, 32, 16), (32, 8, False, None, 8 + 100)]
    assert r.sched.computed_len == 40


def test_add_chunked_req_takes_the_total_budget_when_smaller():
    cache, _ = radix()
    r = req(100)
    r.sched.computed_len = 16
    a = adder(cache, free=10, chunk=64)
    assert a.add_chunked_req(r) is r
    assert a.admitted[0].extend_len == 10 and a.admitted[0].truncated
    assert a.budget_state() is AddResult.NO_TOKEN


def test_add_chunked_req_takes_the_chunk_budget_when_memory_is_gone():
    cache, _ = radix()
    r = req(100)
    r.sched.computed_len = 16
    a = adder(cache, free=50, running=[req(4, max_new=200)], chunk=64)  # rem_total = -50
    assert a.add_chunked_req(r) is r
    assert a.admitted[0].extend_len == 64


def test_add_chunked_req_still_advances_when_mixed_tokens_ate_the_chunk():
    cache, _ = radix(page_size=4)
    r = req(100)
    r.sched.computed_len = 16
    a = adder(cache, free=1000, chunk=8, mixed=8)
    a.add_chunked_req(r)
    assert a.admitted[0].extend_len == 4


def test_add_chunked_req_cut_ends_on_a_page_boundary():
    cache, _ = radix(page_size=4)
    r = req(100)
    r.sched.computed_len = 16
    a = adder(cache, free=10, chunk=64)  # takes 10 -> end 26 -> 24
    a.add_chunked_req(r)
    assert a.admitted[0].extend_len == 8 and a.admitted[0].truncated


def test_new_request_after_a_finishing_chunk_shares_the_round():
    cache, _ = radix()
    r = req(40, max_new=10)
    r.sched.computed_len = 32
    a = adder(cache, free=1000, chunk=16)
    assert a.add_chunked_req(r) is None
    other = req(20, max_new=10)
    assert add(a, other) is AddResult.OTHER  # cut to the 8 chunk tokens left
    assert a.can_run == [r, other] and a.new_chunked_req is other and a.admitted[-1].extend_len == 8


# --- prefix locks ----------------------------------------------------------------------------------


def test_lock_then_recheck_refuses_when_the_prefix_was_counted_as_evictable():
    cache, alloc = radix(size=64)
    prefix = list(range(1, 41))
    cache_tokens(cache, alloc, prefix)
    free = alloc.available_size()
    assert (free, cache.evictable_size()) == (24, 40)
    # Needs 1 + 30 = 31: below 24 + 40 before the lock, not below 24 after it.
    sharer = req(prefix + [99], max_new=30)
    a = adder(cache, free=free)
    assert add(a, sharer) is AddResult.NO_TOKEN
    assert a.admitted == [] and cache.protected_size() == 0
    assert cache.evictable_size() == 40 and cache.protected_size() == 0  # the re-check lock is undone
    # The same need without a shared prefix fits: evicting the cached prefix makes room.
    assert add(a, req(1, max_new=30)) is AddResult.CONTINUE


def test_admitted_request_keeps_its_lock_and_fields():
    cache, alloc = radix(size=64)
    prefix = list(range(1, 41))
    cache_tokens(cache, alloc, prefix)
    r = req(prefix + [99, 98], max_new=10)
    a = adder(cache, free=alloc.available_size())
    match = match_for_admission(cache, r)
    assert a.add_one_req(r, match, has_chunked_req=False) is AddResult.CONTINUE
    assert cache.protected_size() == 40 and cache.evictable_size() == 0
    assert match.last_node.lock_ref == 1
    assert r.sched.computed_len == 40 and not a.admitted[0].truncated
    (adm,) = a.admitted
    assert (adm.prefix_len, adm.extend_len, adm.match) == (40, 2, match)
    assert a.rem_total_tokens == 24 - (2 + 10)


# --- ignore_eos worst case -------------------------------------------------------------------------


def _ignore_eos_case(cache: PrefixCache, new_max_new: int, ignore_eos: bool = True) -> tuple[PrefillAdder, AddResult]:
    running = [req(10, max_new=50, ignore_eos=True)]
    a = adder(cache, free=100, running=running, ratio=0.5)
    return a, add(a, req(20, max_new=new_max_new, ignore_eos=ignore_eos))


def test_ignore_eos_simulation_refuses_an_unsafe_admission():
    # free for the simulation: 100 - 20 (the new prompt) = 80. States sorted by tokens left:
    # (39, 20), (50, 10). With both running: 80 - 39 * 2 = 2 <= 1 * 2 -> NO_TOKEN.
    a, result = _ignore_eos_case(ChunkCache(TokenSlotAllocator(256)), new_max_new=39)
    assert result is AddResult.NO_TOKEN and a.admitted == []


def test_ignore_eos_simulation_accepts_a_safe_admission():
    # (38, 20), (50, 10): 80 - 76 = 4 > 2; then the first frees 20: 80 + 20 - 50 = 50 > 1.
    a, result = _ignore_eos_case(ChunkCache(TokenSlotAllocator(256)), new_max_new=38)
    assert result is AddResult.CONTINUE and len(a.admitted) == 1


def test_ignore_eos_simulation_only_with_prefix_caching_off():
    # The ratio estimate admits what the simulation refuses: 20 + 39 < 100 - 50 * 0.5.
    cache, _ = radix()
    assert _ignore_eos_case(cache, new_max_new=39)[1] is AddResult.CONTINUE
    assert _ignore_eos_case(ChunkCache(TokenSlotAllocator(256)), 39, ignore_eos=False)[1] is AddResult.CONTINUE


def test_ignore_eos_simulation_scales_other_requests_by_the_ratio():
    chunk_cache = ChunkCache(TokenSlotAllocator(256))
    # A running request without ignore_eos leaves 100 * 0.5 = 50 tokens: the same states as above.
    a = adder(chunk_cache, free=100, running=[req(10, max_new=100)], ratio=0.5)
    assert add(a, req(20, max_new=39, ignore_eos=True)) is AddResult.NO_TOKEN
    assert a.admitted == []
    safe = req(20, max_new=38, ignore_eos=True)
    # Admitted; the ratio budget (100 - 50 - 20 - 38) is now spent, which only stops the round.
    assert add(a, safe) is AddResult.NO_TOKEN
    assert a.can_run == [safe]


def test_ignore_eos_simulation_counts_requests_admitted_this_round():
    a = adder(ChunkCache(TokenSlotAllocator(256)), free=200, ratio=0.5)
    assert add(a, req(20, max_new=80, ignore_eos=True)) is AddResult.CONTINUE
    # free 200 - 20 - 20 = 160; states (75, 20), (80, 20): 160 - 150 = 10 > 2; 180 - 80 > 1.
    assert add(a, req(20, max_new=75, ignore_eos=True)) is AddResult.CONTINUE
    # free 140; states (70, 20), (75, 20), (80, 20): 140 - 210 < 3.
    assert add(a, req(20, max_new=70, ignore_eos=True)) is AddResult.NO_TOKEN
    assert len(a.admitted) == 2


# --- priority preemption ---------------------------------------------------------------------------


def _reserved(table: dict[str, float]):
    return lambda r: table[r.rid]


def test_preemption_needs_a_difference_strictly_greater_than_the_threshold():
    new = req(4, priority=20)
    equal = req(4, priority=10)  # 20 - 10 == threshold
    assert select_preemption_victims(new, [equal], 5, PriorityRule(False, 10), reserved_tokens_of=_reserved({equal.rid: 100})) is None
    below = req(4, priority=9)
    assert select_preemption_victims(new, [below], 5, PriorityRule(False, 10), _reserved({below.rid: 100})) == [below]


def test_preemption_victims_chosen_least_important_then_newest_and_listed_in_running_order():
    new = req(4, priority=20)
    old0, new0, five = req(4, priority=0, enqueue=1.0), req(4, priority=0, enqueue=2.0), req(4, priority=5, enqueue=3.0)
    reserved = _reserved({old0.rid: 10, new0.rid: 10, five.rid: 10})
    running = [five, old0, new0]
    assert select_preemption_victims(new, running, 15, PriorityRule(False, 10), reserved) == [old0, new0]
    assert select_preemption_victims(new, running, 25, PriorityRule(False, 10), reserved) == [five, old0, new0]
    assert select_preemption_victims(new, running, 31, PriorityRule(False, 10), reserved) is None  # still short
    assert select_preemption_victims(new, running, 0, PriorityRule(False, 10), reserved) == [new0]  # full by count


def test_preemption_with_low_values_first():
    new = req(4, priority=0)
    worst, close = req(4, priority=20), req(4, priority=10)
    reserved = _reserved({worst.rid: 5, close.rid: 50})
    assert select_preemption_victims(new, [close, worst], 5, PriorityRule(True, 5), reserved_tokens_of=reserved) == [worst]
    # `close` differs by exactly 10: not eligible at threshold 10, so 6 tokens cannot be found.
    assert select_preemption_victims(new, [close, worst], 6, PriorityRule(True, 10), reserved) is None


def test_preemption_subtracts_each_victims_own_reservation():
    new = req(4, priority=50)
    big, small = req(4, priority=0, enqueue=2.0), req(4, priority=0, enqueue=1.0)
    # big goes first (newest) and covers 20 alone; charging small's 1 instead would take both.
    assert select_preemption_victims(new, [small, big], 20, PriorityRule(False, 10), _reserved({big.rid: 30, small.rid: 1})) == [big]


def test_preemption_with_the_adder_budget():
    cache, _ = radix()
    low = req(10, max_new=100, priority=0)
    a = adder(cache, free=100, running=[low], ratio=0.5)  # rem_total 50
    urgent = req(30, max_new=40, priority=20)
    match = match_for_admission(cache, urgent)
    assert a.add_one_req(urgent, match, False) is AddResult.NO_TOKEN
    need = a.preemption_need(urgent, match)
    assert need == 70 - 50
    victims = select_preemption_victims(urgent, a.running, need, PriorityRule(False, 10), a.reserved_tokens)
    assert victims == [low]
    a.remove_running(victims)
    assert a.rem_total_tokens == 100
    assert a.add_one_req(urgent, match, False) is AddResult.CONTINUE


# --- retraction ----------------------------------------------------------------------------------


def test_retraction_order_fewest_generated_then_longest_prompt():
    a, b, c, d = req(10, output=5), req(10, output=2), req(30, output=2), req(1, output=9)
    assert retraction_stack([a, b, c, d])[::-1] == [c, b, a, d]


def test_retraction_tie_goes_to_the_request_admitted_last():
    """SGLang sorts stably in reverse and pops from the end: of equal progress and prompt, the
    request admitted last is retracted first."""
    first, second, third = req(10, output=2), req(10, output=2), req(10, output=2)
    assert retraction_stack([first, second, third])[-1] is third
    victims, _ = select_retraction_victims([first, second, third], lambda vs, stays: True)
    assert victims == [third]


def test_retraction_stops_as_soon_as_the_next_decode_fits():
    """SGLang's retract_decode asks check_decode_mem after each victim; no 20-token reserve per
    survivor: one victim whose KV covers the next step is enough."""
    a, b, c, d = req(10, max_new=100, output=5), req(10, output=2), req(30, output=2), req(1, max_new=100, output=9)
    freed = 0

    def fits_after(victims, stays):
        nonlocal freed
        freed += victims[-1].seq_len  # the newest victim gives its KV back
        return freed >= len(stays)  # one slot per surviving request

    victims, ratio = select_retraction_victims([a, b, c, d], fits_after)
    assert victims == [c]
    assert ratio == pytest.approx((5 + 2 + 9 + 20 * 3) / (100 + 16 + 100 + 1))


def test_retraction_never_takes_the_last_request():
    reqs = [req(10, max_new=100, output=i) for i in range(4)]
    victims, ratio = select_retraction_victims(reqs, lambda vs, stays: False)
    assert victims == reqs[:3]
    assert ratio == pytest.approx((3 + 20) / (100 + 1))
    assert select_retraction_victims(reqs[:1], lambda vs, stays: False)[0] == []


def test_retraction_takes_at_least_one_when_called():
    reqs = [req(10, output=1), req(10, output=2)]
    assert select_retraction_victims(reqs, lambda vs, stays: True)[0] == [reqs[0]]


def test_ratio_after_retraction_formula():
    remaining = [req(4, max_new=100, output=10), req(4, max_new=200, output=30)]
    assert ratio_after_retraction(remaining) == pytest.approx((40 + 20 * 2) / 301)
    assert ratio_after_retraction([req(4, max_new=100, output=100)]) == 1.0
    assert ratio_after_retraction([]) == 0.0


# --- new_token_ratio ----------------------------------------------------------------------------


def test_new_token_ratio_decay_min_reset():
    r = NewTokenRatio(1.0)
    assert (r.init, r.value) == (0.7, 0.7)
    assert r.min == pytest.approx(0.098)
    assert r.decay_step == pytest.approx((0.7 - 0.098) / 600)
    r.decay()
    assert r.value == pytest.approx(0.7 - 0.602 / 600)
    for _ in range(598):
        r.decay()
    assert r.value == pytest.approx(0.098 + 0.602 / 600)
    for _ in range(10):
        r.decay()
    assert r.value == r.min  # never below min
    r.reset()
    assert r.value == 0.7


def test_new_token_ratio_conservativeness_and_retraction():
    assert NewTokenRatio(2.0).init == 1.0  # capped at 1
    assert NewTokenRatio(2.0).min == pytest.approx(0.14)
    half = NewTokenRatio(0.5)
    assert half.init == pytest.approx(0.35) and half.min == pytest.approx(0.049)
    r = NewTokenRatio()
    r.set(0.05)  # a retraction estimate below min is kept ...
    assert r.value == 0.05
    r.decay()  # ... until the next decay lifts it to min
    assert r.value == pytest.approx(0.098)


@pytest.mark.parametrize("low_first", [False, True])
def test_the_priority_rule_is_one_direction_for_order_and_preemption(low_first):
    rule = PriorityRule(low_first, preemption_threshold=2)
    better, worse = (1, 5) if low_first else (5, 1)
    assert rule.level(better) < rule.level(worse)
    assert rule.may_preempt(better, worse) and not rule.may_preempt(worse, better)
    edge = worse - 2 if low_first else worse + 2  # exactly the threshold apart: not enough
    assert not rule.may_preempt(edge, worse)
