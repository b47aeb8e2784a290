"""Sampler tests on crafted distributions: each checks a number that a wrong sampler would miss."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.sampler import Sampler, SamplingInfo, TokenSpans, apply_penalties, filtered_probs, greedy_ids, mix_seed
from runtime.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def info_for(params: list[SamplingParams], device: str = "cpu") -> SamplingInfo:
    return SamplingInfo.from_params(params, device)


def logits_of(probs: list[float], device: str = "cpu", rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs, device=device).log().expand(rows, -1).contiguous()


def kept(probs_row: torch.Tensor) -> list[int]:
    return torch.nonzero(probs_row > 0).flatten().tolist()


# --- greedy and the cheap paths ---------------------------------------------------------------


def test_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)).to(device)
    info = info_for([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 8, device)
    out = Sampler().sample(logits, info)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


def test_logit_bias_steers_rows_and_leaves_logprobs_raw(device: str) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(device)
    top = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0.0, logprobs=True, logit_bias={7: 100.0}),  # forced to 7
        SamplingParams(temperature=0.0, logprobs=True, logit_bias={top[1]: -100.0}),  # its argmax banned
        SamplingParams(temperature=0.0, logprobs=True),  # untouched
    ]
    out = Sampler().sample(logits, info_for(params, device))
    second = logits[1].clone()
    second[top[1]] -= 100.0
    assert out.token_ids.tolist() == [7, int(second.argmax()), top[2]]
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    assert info_for([SamplingParams()], device).logit_bias is None


def test_all_greedy_batch_draws_no_random_numbers() -> None:
    info = info_for([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)] * 4)
    # A greedy row's filters change nothing, so they must not switch the sorting path on.
    assert info.all_greedy and not (info.need_top_k or info.need_top_p or info.need_min_p)
    logits = torch.randn(4, 10)
    state = torch.get_rng_state()
    Sampler().sample(logits, info)
    assert torch.equal(state, torch.get_rng_state())


def test_flags_follow_sampled_rows() -> None:
    info = info_for([SamplingParams(top_k=5), SamplingParams(min_p=0.1), SamplingParams(seed=3, presence_penalty=0.5)])
    assert (info.need_top_k, info.need_top_p, info.need_min_p) == (True, False, True)
    assert info.freq_presence_rows == (2,) and info.repetition_rows == ()
    assert info.seeded_rows == (2,) and info.unseeded_rows == (0, 1)
    assert not info.return_logprobs and info.max_top_logprobs_num == 0


def test_empty_batch() -> None:
    out = Sampler().sample(torch.empty(0, 7), info_for([]))
    assert out.token_ids.shape == (0,)


# --- top-k, top-p, min-p -------------------------------------------------------------------------


def test_top_k_only_ever_samples_the_k_best(device: str) -> None:
    torch.manual_seed(1)
    row = torch.randn(50) * 0.5  # flat enough that all five survivors show up
    logits = row.to(device).expand(4000, -1).contiguous()
    out = Sampler().sample(logits, info_for([SamplingParams(top_k=5)] * 4000, device))
    assert set(out.token_ids.tolist()) == set(row.topk(5).indices.tolist())


def test_top_p_mask_on_known_distribution() -> None:
    top_ps = [0.8, 0.81, 0.3, 1.0]
    info = info_for([SamplingParams(top_p=p) for p in top_ps])
    probs = filtered_probs(logits_of([0.5, 0.3, 0.15, 0.05], rows=4), info)
    # 0.5 + 0.3 reaches 0.8 exactly: the smallest set that reaches top_p is the first two.
    assert [kept(r) for r in probs] == [[0, 1], [0, 1, 2], [0], [0, 1, 2, 3]]


def test_top_p_boundary_survives_float32_rounding() -> None:
    # 0.48 + 0.28 is exactly 0.76, but float32 softmax and cumsum land just under it: without
    # slack the third token would be kept although the first two already reach top_p.
    logits = logits_of([0.48, 0.28, 0.2, 0.04])
    assert kept(filtered_probs(logits, info_for([SamplingParams(top_p=0.76)]))[0]) == [0, 1]


def test_tiny_top_p_still_keeps_the_top_token() -> None:
    probs = filtered_probs(logits_of([0.2, 0.5, 0.3]), info_for([SamplingParams(top_p=1e-7)]))
    assert kept(probs[0]) == [1]


def test_top_p_samples_only_from_the_nucleus_in_proportion(device: str) -> None:
    torch.manual_seed(2)
    logits = logits_of([0.5, 0.3, 0.15, 0.05], device, rows=8000)
    tokens = Sampler().sample(logits, info_for([SamplingParams(top_p=0.8)] * 8000, device)).token_ids
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.5 / 0.8) < 0.02


def test_top_p_measures_mass_within_top_k() -> None:
    # After top-k=2 the distribution is [4/7, 3/7]: the first token alone reaches 0.5. Measured
    # against the unfiltered distribution (0.4 < 0.5) the second token would wrongly stay.
    info = info_for([SamplingParams(top_k=2, top_p=0.5)])
    assert kept(filtered_probs(logits_of([0.4, 0.3, 0.2, 0.1]), info)[0]) == [0]


def test_top_p_one_keeps_the_tail_when_other_rows_filter() -> None:
    logits = logits_of([0.6, 0.4 - 1e-7, 1e-7], rows=2)
    probs = filtered_probs(logits, info_for([SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)]))
    assert kept(probs[0]) == [0] and kept(probs[1]) == [0, 1, 2]


def test_min_p_mask_on_known_distribution() -> None:
    min_ps = [0.5, 0.2, 0.0, 0.9]
    logits = logits_of([0.15, 0.5, 0.05, 0.3], rows=4)  # unsorted on purpose
    expected = [[1, 3], [0, 1, 3], [0, 1, 2, 3], [1]]  # keep prob >= min_p * 0.5
    unsorted_path = filtered_probs(logits, info_for([SamplingParams(min_p=m) for m in min_ps]))
    assert [kept(r) for r in unsorted_path] == expected
    # The same mask when top-k switches on the sorted path (top_k=4 removes nothing here).
    sorted_path = filtered_probs(logits, info_for([SamplingParams(min_p=m, top_k=4) for m in min_ps]))
    assert [kept(r) for r in sorted_path] == expected


def test_filtered_probs_leave_kept_tokens_in_place() -> None:
    logits = logits_of([0.1, 0.6, 0.3])
    probs = filtered_probs(logits, info_for([SamplingParams(top_k=2)]))
    assert torch.allclose(probs[0], torch.tensor([0.0, 0.6, 0.3]))


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5), min_size=2, max_size=20),
    temperature=st.floats(0.05, 3.0),
    top_k=st.one_of(st.just(-1), st.integers(1, 25)),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_keep_a_most_likely_token_and_respect_top_k(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row = torch.tensor([logits])
    info = info_for([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)])
    probs = filtered_probs(row, info)[0]
    assert probs.max() == torch.softmax(row[0] / temperature, -1).max()
    assert top_k == -1 or len(kept(probs)) <= top_k
    token = Sampler().sample(row, info).token_ids.item()
    assert probs[token] > 0


# --- temperature -------------------------------------------------------------------------------


def test_temperature_sharpens_and_flattens(device: str) -> None:
    torch.manual_seed(3)
    n = 20000
    freqs = []
    for t in (0.5, 1.0, 2.0):
        info = info_for([SamplingParams(temperature=t)] * n, device)
        tokens = Sampler().sample(logits_of([0.6, 0.4], device, rows=n), info).token_ids
        freqs.append((tokens == 0).float().mean().item())
        expected = 0.6 ** (1 / t) / (0.6 ** (1 / t) + 0.4 ** (1 / t))
        assert abs(freqs[-1] - expected) < 0.015, (t, freqs[-1], expected)
    assert freqs[0] > freqs[1] > freqs[2]


# --- penalties ---------------------------------------------------------------------------------


def test_frequency_and_presence_penalties_exact(device: str) -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]] * 2, device=device)
    before = logits.clone()
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), SamplingParams()]
    out = apply_penalties(logits, info_for(params, device), output_ids=[[1, 1, 2], [1]], prompt_ids=[[3], [3]])
    # token 1: 0.5 * 2 + 0.25; token 2: 0.5 * 1 + 0.25; prompt token 3 is not penalised.
    expected = torch.tensor([1.0, 2.0 - 1.25, 3.0 - 0.75, 4.0, 5.0, 6.0], device=device)
    assert torch.allclose(out[0], expected)
    assert torch.equal(out[1], before[1])  # a row without penalties is untouched
    assert torch.equal(logits, before)  # and so is the caller's tensor


def test_repetition_penalty_exact(device: str) -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5]], device=device)
    info = info_for([SamplingParams(repetition_penalty=2.0)], device)
    out = apply_penalties(logits, info, output_ids=[[1]], prompt_ids=[[0, 0]])
    # Seen (prompt 0, output 1): positive halved, negative doubled; unseen tokens unchanged.
    assert torch.allclose(out[0], torch.tensor([1.0, -2.0, 3.0, -2.0, 0.5], device=device))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, frequency_penalty=0.2),
        SamplingParams(temperature=0.0, presence_penalty=0.2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ],
)
def test_each_penalty_flips_a_greedy_choice(params: SamplingParams, device: str) -> None:
    logits = torch.tensor([[1.0, 0.9, 0.1]], device=device)
    sampler = Sampler()
    assert sampler.sample(logits, info_for([SamplingParams(temperature=0.0)], device)).token_ids.item() == 0
    out = sampler.sample(logits, info_for([params], device), output_ids=[[0]], prompt_ids=[[2]])
    assert out.token_ids.item() == 1


def test_penalties_need_their_token_ids() -> None:
    logits = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="output_ids"):
        Sampler().sample(logits, info_for([SamplingParams(presence_penalty=0.5)]))
    with pytest.raises(ValueError, match="prompt_ids"):
        Sampler().sample(logits, info_for([SamplingParams(repetition_penalty=1.5)]), output_ids=[[]])



def _counts(seqs: list[list[int]], vocab: int) -> torch.Tensor:
    counts = torch.zeros(len(seqs), vocab)
    for row, seq in enumerate(seqs):
        for token, n in Counter(seq).items():
            counts[row, token] = n
    return counts


@pytest.mark.parametrize("trial", range(20))
def test_penalties_from_device_spans_equal_host_lists_and_a_reference(trial: int) -> None:
    """Spans of a token table (counted on the device) give bit-identical logits to host lists,
    and both to the penalty formulas over counts made with a Counter."""
    rng = random.Random(trial)
    bs, vocab = rng.randint(1, 6), rng.randint(2, 40)
    params = [
        SamplingParams(
            repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
            frequency_penalty=rng.choice([0.0, rng.uniform(-1.0, 1.0)]),
            presence_penalty=rng.choice([0.0, rng.uniform(-1.0, 1.0)]),
        )
        for _ in range(bs)
    ]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(bs)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(bs)]
    # A table whose other positions hold stale ids, as a reused token pool row does.
    table = torch.randint(0, vocab, (bs + 2, 30), generator=torch.Generator().manual_seed(trial))
    rows = rng.sample(range(bs + 2), bs)
    for seq_row, (prompt, output) in zip(rows, zip(prompts, outputs)):
        table[seq_row, : len(prompt) + len(output)] = torch.tensor(prompt + output, dtype=torch.int64)
    prompt_lens = [len(p) for p in prompts]
    ends = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(100 + trial))
    info = info_for(params)

    from_lists = apply_penalties(logits, info, output_ids=outputs, prompt_ids=prompts)
    spans = apply_penalties(
        logits, info, output_ids=TokenSpans(table, rows, prompt_lens, ends), prompt_ids=TokenSpans(table, rows, [0] * bs, prompt_lens)
    )
    expected = logits.clone()
    rep = torch.tensor(info.repetition_rows, dtype=torch.int64)
    if len(rep):
        seen = _counts([prompts[r] + outputs[r] for r in info.repetition_rows], vocab) > 0
        sub, penalty = logits[rep], info.repetition_penalties[rep].unsqueeze(1)
        expected[rep] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    fp = torch.tensor(info.freq_presence_rows, dtype=torch.int64)
    if len(fp):
        counts = _counts([outputs[r] for r in info.freq_presence_rows], vocab)
        freq, pres = info.frequency_penalties[fp].unsqueeze(1), info.presence_penalties[fp].unsqueeze(1)
        expected[fp] = expected[fp] - freq * counts - pres * (counts > 0).float()
    assert torch.equal(from_lists, expected)
    assert torch.equal(spans, expected)


def test_sampling_reads_nothing_back_from_the_device() -> None:
    """On `meta` every device-to-host read raises: building the batch's tensors, penalties over
    device spans, filters, the draw and logprobs must all stay on the device (on CUDA such a read
    would wait for the step in flight)."""
    meta = torch.device("meta")
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(top_k=3, top_p=0.5, min_p=0.1, frequency_penalty=0.5, presence_penalty=0.2, top_logprobs_num=2),
        SamplingParams(logprobs=True),
    ]
    info = info_for(params, meta)
    table = torch.empty(5, 20, dtype=torch.int64, device=meta)
    out = Sampler().sample(
        torch.empty(3, 30, device=meta),
        info,
        output_ids=TokenSpans(table, [1, 2, 3], [4, 5, 6], [8, 9, 10]),
        prompt_ids=TokenSpans(table, [1, 2, 3], [0, 0, 0], [4, 5, 6]),
    )
    assert out.token_ids.shape == (3,) and out.top_logprobs is not None and out.top_logprobs[1].shape == (3, 2)


def test_row_index_tensors_match_the_row_tuples() -> None:
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(seed=1), SamplingParams(presence_penalty=0.1), SamplingParams()]
    info = info_for(params)
    assert info.repetition_index.tolist() == list(info.repetition_rows) == [0]
    assert info.freq_presence_index.tolist() == list(info.freq_presence_rows) == [2]
    assert info.unseeded_index.tolist() == list(info.unseeded_rows) == [0, 2, 3]
    assert info.top_ks.shape == (4,) and info.top_ks.dtype == torch.int64

# --- seeds -------------------------------------------------------------------------------------


def _flat_logits(vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 0.1


def test_seeded_token_ignores_batch_position_and_neighbours(device: str) -> None:
    target = _flat_logits().to(device)
    seeded = SamplingParams(seed=1234, top_p=0.9)
    sampler = Sampler()
    alone = sampler.sample(target[None], info_for([seeded], device), steps=[7]).token_ids.item()

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(seed=99, top_k=3),
        SamplingParams(temperature=0.5),
    ]
    params = others[:2] + [seeded] + others[2:]
    noise_rows = torch.randn(4, target.numel(), device=device)
    logits = torch.cat([noise_rows[:2], target[None], noise_rows[2:]])
    torch.manual_seed(12345)  # a different global RNG state must not matter either
    crowded = sampler.sample(logits, info_for(params, device), steps=[0, 3, 7, 9, 1]).token_ids[2].item()
    assert crowded == alone


def test_seeded_draws_vary_with_step_and_seed() -> None:
    logits = _flat_logits()[None]
    sampler = Sampler()

    def draws(seed: int) -> list[int]:
        info = info_for([SamplingParams(seed=seed)])
        return [sampler.sample(logits, info, steps=[n]).token_ids.item() for n in range(40)]

    a, a_again, b = draws(1), draws(1), draws(2)
    assert a == a_again
    assert len(set(a)) > 1  # the step moves the stream on
    assert a != b
    assert mix_seed(1, 0) != mix_seed(0, 1)


def test_seeded_draws_follow_the_distribution() -> None:
    n = 4000
    logits = logits_of([0.7, 0.3], rows=n)
    info = info_for([SamplingParams(seed=s) for s in range(n)])
    tokens = Sampler().sample(logits, info, steps=[0] * n).token_ids
    assert abs((tokens == 0).float().mean().item() - 0.7) < 0.03


def test_unseeded_rows_follow_the_global_rng() -> None:
    logits = _flat_logits()[None].expand(16, -1)
    info = info_for([SamplingParams()] * 16)
    torch.manual_seed(5)
    first = Sampler().sample(logits, info).token_ids
    torch.manual_seed(5)
    assert torch.equal(first, Sampler().sample(logits, info).token_ids)


def test_seeded_rows_need_steps() -> None:
    with pytest.raises(ValueError, match="steps"):
        Sampler().sample(torch.zeros(1, 4), info_for([SamplingParams(seed=1)]))


# --- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_the_chosen_token(device: str) -> None:
    torch.manual_seed(4)
    logits = torch.randn(6, 30, device=device)
    params = [
        SamplingParams(logprobs=True, temperature=0.0, repetition_penalty=1.8),
        SamplingParams(logprobs=True, temperature=0.7, top_k=4, presence_penalty=1.0),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(logprobs=True, min_p=0.3, seed=8),
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=True, frequency_penalty=2.0),
    ]
    ids = [[int(t) for t in torch.randint(0, 30, (5,))] for _ in params]
    out = Sampler().sample(logits, info_for(params, device), output_ids=ids, prompt_ids=ids, steps=[2] * 6)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is None
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))


def test_top_logprobs_are_sorted_top_k_of_raw_log_softmax(device: str) -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 40, device=device)
    params = [SamplingParams(top_logprobs_num=3), SamplingParams(top_logprobs_num=5, temperature=0.0), SamplingParams()]
    out = Sampler().sample(logits, info_for(params, device))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs is not None and out.logprobs is not None
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (3, 5)
    assert torch.all(values[:, :-1] >= values[:, 1:])
    assert torch.allclose(values, raw.gather(1, ids))
    assert torch.allclose(values, raw.topk(5, dim=-1).values)


def test_top_logprobs_cap_at_vocab() -> None:
    out = Sampler().sample(torch.randn(1, 3), info_for([SamplingParams(top_logprobs_num=10)]))
    assert out.top_logprobs is not None and out.top_logprobs[0].shape == (1, 3)


# --- mixed batches and dtypes --------------------------------------------------------------------


def test_mixed_batch_of_greedy_and_sampled_rows(device: str) -> None:
    torch.manual_seed(6)
    n = 600
    row = torch.randn(20, device=device) * 0.3
    logits = row.expand(n, -1).contiguous()
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(top_k=3) for i in range(n)]
    tokens = Sampler().sample(logits, info_for(params, device)).token_ids
    greedy, sampled = tokens[0::2], tokens[1::2]
    assert torch.all(greedy == row.argmax())
    assert set(sampled.tolist()) == set(row.topk(3).indices.tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(dtype: torch.dtype, device: str) -> None:
    torch.manual_seed(7)
    logits = (torch.randn(4, 64, device=device) * 3).to(dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(top_k=2, top_logprobs_num=2),
        SamplingParams(top_p=0.5, seed=3, presence_penalty=0.5),
        SamplingParams(min_p=0.5),
    ]
    out = Sampler().sample(logits, info_for(params, device), output_ids=[[1]] * 4, steps=[0] * 4)
    wide = logits.float()
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids[0] == wide[0].argmax()
    assert out.token_ids[1].item() in wide[1].topk(2).indices.tolist()
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert math.isfinite(out.logprobs.sum().item())
    assert torch.allclose(out.logprobs, torch.log_softmax(wide, -1).gather(1, out.token_ids[:, None]).squeeze(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_greedy_low_precision_logits_pick_the_float32_argmax(dtype: torch.dtype, device: str) -> None:
    """The all-greedy path takes the argmax of the logits as they are: the same ids as of their
    float32 copy, ties (first index) included; a logit_bias or a penalty still applies."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 4, (6, 300), generator=gen).to(dtype).to(device)  # many equal maxima
    out = Sampler().sample(logits, info_for([SamplingParams(temperature=0.0)] * 6, device))
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    biased = [SamplingParams(temperature=0.0, logit_bias={299: 100.0})] * 6
    assert Sampler().sample(logits, info_for(biased, device)).token_ids.tolist() == [299] * 6
    top = int(logits[0].float().argmax())
    penalised = Sampler().sample(logits[:1], info_for([SamplingParams(temperature=0.0, presence_penalty=2.0)], device), output_ids=[[top]])
    assert int(penalised.token_ids[0]) != top


def test_logits_shape_must_match_the_batch() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, 4), info_for([SamplingParams()]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_ids_pick_what_argmax_picks_with_ties_and_nan(dtype):
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randint(0, 3, (16, 4099), generator=gen).to(dtype)  # many equal maxima per row
        if trial % 2:
            logits[trial % 16, 77] = float("nan")
        assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
