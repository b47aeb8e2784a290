"""Token sampling for one batch: penalties, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Order, per row (the same as vLLM's and SGLang's samplers):

1. penalties on the logits: repetition (prompt + output tokens), then frequency and presence
   (output tokens only);
2. greedy rows (temperature < 1e-6) take the argmax of the penalised logits;
3. the other rows: temperature, softmax, top-k, top-p, min-p, then one draw.

Each filter acts on what the previous one kept, so top-p measures mass within the top-k tokens.
None of them ever removes the most likely token, so a row always has something to sample.

The draw is an exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with
probability p_i (normalisation is not needed). It is one vectorised op for the whole batch, and a
seeded row only has to draw its own noise from its own generator, so its token depends on
(seed, step, its own distribution) and on nothing else in the batch. Seeded streams are
reproducible per device type: the CPU and CUDA generators produce different noise.

Logprobs are the model's raw distribution: log_softmax of the logits before penalties,
temperature and filters (vLLM's default "raw_logprobs"). They say what the model thought of a
token, which is what clients comparing models or scoring text want; the processed distribution
would report -inf for tokens a filter removed and change with the sampling knobs.

Nothing here reads a device tensor back to the host, and host values reach the device through
`host_to_device`: on CUDA the sampler runs in the launch of a step on the forward stream, where
either would wait for the step in flight (gpu/cuda_streams.py). Penalty token histories may be
host lists or `TokenSpans` of a device token table, which are counted where they lie.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import Tensor

from gpu.cuda_streams import host_to_device
from runtime.sampling_params import SamplingParams

# Stands for top_k = -1: a rank no vocabulary reaches, so the top-k mask keeps everything.
_NO_TOP_K = 1 << 62
# float32 cumulative sums land a hair either side of an exact top_p boundary (0.5 + 0.3 vs 0.8);
# treat "within this much of top_p" as having reached it, so such boundaries behave as written.
_TOP_P_SLACK = 1e-6
_U64 = (1 << 64) - 1


@dataclass(slots=True, frozen=True)
class SamplingInfo:
    """Per-row sampling tensors of one batch, on the logits' device, plus flags for cheap paths."""

    temperatures: Tensor  # [bs, 1] float32; 1.0 on greedy rows, whose result is the argmax anyway
    top_ps: Tensor  # [bs] float32
    top_ks: Tensor  # [bs] int64; _NO_TOP_K where top_k is -1
    min_ps: Tensor  # [bs] float32
    frequency_penalties: Tensor  # [bs] float32
    presence_penalties: Tensor  # [bs] float32
    repetition_penalties: Tensor  # [bs] float32
    greedy: Tensor  # [bs] bool
    # The row tuples below as int64 index tensors on the device, copied once per batch.
    repetition_index: Tensor
    freq_presence_index: Tensor
    unseeded_index: Tensor
    seeds: tuple[int | None, ...]
    all_greedy: bool
    any_greedy: bool
    # The filter flags only count sampled rows: a greedy row's top_k changes nothing.
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    freq_presence_rows: tuple[int, ...]  # rows with a nonzero frequency or presence penalty
    repetition_rows: tuple[int, ...]  # rows with repetition_penalty != 1
    seeded_rows: tuple[int, ...]  # sampled rows with a seed
    unseeded_rows: tuple[int, ...]  # sampled rows without one (greedy rows are in neither)
    return_logprobs: bool  # some row asked for logprobs or top logprobs
    max_top_logprobs_num: int
    # logit_bias of every row as (rows, token ids, values) on the device; None when no row has one.
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seeds)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: str | torch.device) -> SamplingInfo:
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]
        freq_presence = tuple(i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty)
        repetition = tuple(i for i, p in enumerate(params) if p.repetition_penalty != 1.0)
        seeded = tuple(i for i, (p, g) in enumerate(zip(params, greedy)) if not g and p.seed is not None)
        unseeded = tuple(i for i, (p, g) in enumerate(zip(params, greedy)) if not g and p.seed is None)
        # Two host-to-device copies (float and int64 columns) instead of one per column.
        floats = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.repetition_penalty for p in params],
                [float(g) for g in greedy],
            ],
            dtype=torch.float32,
        ).reshape(7, len(params))
        floats = host_to_device(floats, device)
        top_ks = [_NO_TOP_K if p.top_k < 0 else p.top_k for p in params]
        ints = host_to_device(torch.tensor([*top_ks, *repetition, *freq_presence, *unseeded], dtype=torch.int64), device)
        sizes = [len(params), len(repetition), len(freq_presence), len(unseeded)]
        top_ks_t, repetition_t, freq_presence_t, unseeded_t = ints.split(sizes)
        max_top = max((p.top_logprobs_num for p in params), default=0)
        return cls(
            temperatures=floats[0].unsqueeze(1),
            top_ps=floats[1],
            top_ks=top_ks_t,
            min_ps=floats[2],
            frequency_penalties=floats[3],
            presence_penalties=floats[4],
            repetition_penalties=floats[5],
            greedy=floats[6] > 0.5,
            repetition_index=repetition_t,
            freq_presence_index=freq_presence_t,
            unseeded_index=unseeded_t,
            seeds=tuple(p.seed for p in params),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_k=any(p.top_k >= 0 for p in sampled),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            freq_presence_rows=freq_presence,
            repetition_rows=repetition,
            seeded_rows=seeded,
            unseeded_rows=unseeded,
            return_logprobs=any(p.logprobs or p.top_logprobs_num > 0 for p in params),
            max_top_logprobs_num=max_top,
            logit_bias=_logit_bias(params, device),
        )


def _logit_bias(params: Sequence[SamplingParams], device: torch.device) -> tuple[Tensor, Tensor, Tensor] | None:
    entries = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias.items()]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    index = host_to_device(torch.tensor([rows, tokens], dtype=torch.int64), device)
    return index[0], index[1], host_to_device(torch.tensor(values, dtype=torch.float32), device)


@dataclass(slots=True, frozen=True)
class SampleResult:
    token_ids: Tensor  # [bs] int64
    logprobs: Tensor | None  # [bs] float32: raw log-prob of the chosen token
    # ([bs, k] float32 raw log-probs sorted descending, [bs, k] int64 token ids); k is the batch's
    # largest top_logprobs_num (capped at the vocabulary), so each row keeps its own first n.
    top_logprobs: tuple[Tensor, Tensor] | None


@dataclass(frozen=True, slots=True)
class TokenSpans:
    """Each batch row's tokens as a span of a device token table: `table[rows[i], starts[i]:ends[i]]`.

    The token history of a running request lives on the device (the Executor's token pool);
    counting it there spares the step a device-to-host read of it, which on CUDA would wait for
    the step in flight. Spans past the table's width are cut to it.
    """

    table: Tensor  # [table rows, positions] int64
    rows: Sequence[int]
    starts: Sequence[int]
    ends: Sequence[int]

    def padded(self, batch_rows: Sequence[int]) -> Tensor:
        """[len(batch_rows), width] int64 on the table's device: each span's tokens at their
        table positions, -1 elsewhere."""
        spans = [[self.rows[r] for r in batch_rows], [self.starts[r] for r in batch_rows], [self.ends[r] for r in batch_rows]]
        rows, starts, ends = host_to_device(torch.tensor(spans, dtype=torch.int64), self.table.device)
        width = min(max(spans[2], default=0), self.table.shape[1])
        tokens = self.table[:, :width].index_select(0, rows)
        positions = torch.arange(width, device=self.table.device)
        inside = (positions >= starts.unsqueeze(1)) & (positions < ends.unsqueeze(1))
        return tokens.masked_fill(~inside, -1)


# Per batch row, the token ids of a penalty's history: host lists, or spans of a device table.
TokenHistory: TypeAlias = Sequence[Sequence[int]] | TokenSpans


def apply_penalties(
    logits: Tensor,
    info: SamplingInfo,
    output_ids: TokenHistory | None,
    prompt_ids: TokenHistory | None,
) -> Tensor:
    """Float32 logits with repetition, then frequency and presence penalties; the input is not changed.

    Repetition (HF/vLLM): for every token seen in the prompt or the output, a positive logit is
    divided by the penalty and a negative one multiplied, so > 1 always discourages.
    Frequency and presence (OpenAI): logit -= frequency * count + presence * (count > 0), with
    counts over the output only. Only the rows that set a penalty are counted or touched.
    """
    logits = logits.float()
    if not info.repetition_rows and not info.freq_presence_rows:
        return logits
    logits = logits.clone()  # .float() returns the caller's tensor when it is float32 already
    vocab, device = logits.shape[-1], logits.device
    if info.repetition_rows:
        outputs = _require(output_ids, "output_ids", "repetition_penalty")
        prompts = _require(prompt_ids, "prompt_ids", "repetition_penalty")
        rows = info.repetition_rows
        tokens = torch.cat([_padded(prompts, rows, device), _padded(outputs, rows, device)], dim=1)
        _apply_repetition(logits, info, _token_counts(tokens, vocab) > 0)
    if info.freq_presence_rows:
        outputs = _require(output_ids, "output_ids", "frequency_penalty/presence_penalty")
        _apply_frequency_presence(logits, info, _token_counts(_padded(outputs, info.freq_presence_rows, device), vocab))
    return logits


def _require(seqs: TokenHistory | None, name: str, why: str) -> TokenHistory:
    # Skipping a requested penalty silently would be a wrong answer, not a fast one.
    if seqs is None:
        raise ValueError(f"{name} is required when a request sets {why}")
    return seqs


def _padded(history: TokenHistory, batch_rows: Sequence[int], device: torch.device) -> Tensor:
    """[len(batch_rows), width] int64 token ids of those rows on `device`, -1 for no token."""
    if isinstance(history, TokenSpans):
        return history.padded(batch_rows)
    seqs = [history[r] for r in batch_rows]
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    padded = torch.full((len(seqs), max(len(s) for s in seqs)), -1, dtype=torch.int64)
    # Boolean-mask assignment fills row by row, in order: each row's ids, then its padding.
    ids = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    padded[torch.arange(padded.shape[1]) < lengths.unsqueeze(1)] = ids
    return host_to_device(padded, device)


def _token_counts(padded: Tensor, vocab: int) -> Tensor:
    """[rows, vocab] float32 occurrence counts of the ids in `padded` (-1: none), with one scatter
    on its device (exact: counts are small integers, whatever order the adds run in)."""
    present = padded >= 0
    counts = torch.zeros(padded.shape[0], vocab, dtype=torch.float32, device=padded.device)
    return counts.scatter_add_(1, padded.clamp_min(0), present.float())


def _apply_repetition(logits: Tensor, info: SamplingInfo, seen: Tensor) -> None:
    rows = info.repetition_index
    sub = logits.index_select(0, rows)
    penalty = info.repetition_penalties.index_select(0, rows).unsqueeze(1)
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits.index_copy_(0, rows, torch.where(seen, penalised, sub))


def _apply_frequency_presence(logits: Tensor, info: SamplingInfo, counts: Tensor) -> None:
    rows = info.freq_presence_index
    freq = info.frequency_penalties.index_select(0, rows).unsqueeze(1)
    pres = info.presence_penalties.index_select(0, rows).unsqueeze(1)
    sub = logits.index_select(0, rows) - freq * counts - pres * (counts > 0).float()
    logits.index_copy_(0, rows, sub)


def filtered_probs(logits: Tensor, info: SamplingInfo) -> Tensor:
    """[bs, vocab] probabilities after temperature, top-k, top-p and min-p, in vocabulary order.

    Removed tokens are exactly 0; the rest are not renormalised (the draw does not need it).
    """
    probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
    if info.need_top_k or info.need_top_p:
        return _filter_sorted(probs, info)
    if info.need_min_p:
        return _min_p(probs, probs.amax(dim=-1, keepdim=True), info.min_ps)
    return probs


def _filter_sorted(probs: Tensor, info: SamplingInfo) -> Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if info.need_top_k:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        sorted_probs = sorted_probs.masked_fill(ranks >= info.top_ks.unsqueeze(1), 0.0)
    if info.need_top_p:
        sorted_probs = _top_p_sorted(sorted_probs, info.top_ps)
    if info.need_min_p:
        sorted_probs = _min_p(sorted_probs, sorted_probs[:, :1], info.min_ps)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _top_p_sorted(sorted_probs: Tensor, top_ps: Tensor) -> Tensor:
    """Keep the smallest prefix whose mass reaches top_p of the mass still kept."""
    cumulative = sorted_probs.cumsum(dim=-1)
    better = cumulative - sorted_probs  # mass of the tokens ranked above each one
    limit = top_ps.unsqueeze(1) * cumulative[:, -1:] - _TOP_P_SLACK
    # top_p = 1 must be a no-op even when other rows in the batch filter.
    drop = (better >= limit) & (top_ps < 1.0).unsqueeze(1)
    drop[:, 0] = False
    return sorted_probs.masked_fill(drop, 0.0)


def _min_p(probs: Tensor, max_probs: Tensor, min_ps: Tensor) -> Tensor:
    return probs.masked_fill(probs < min_ps.unsqueeze(1) * max_probs, 0.0)


def mix_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, step): nearby seeds and steps land far apart."""
    return _splitmix64(_splitmix64(seed & _U64) ^ (step & _U64))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def greedy_ids(logits: Tensor) -> Tensor:
    """The argmax of each row. `max(dim)` picks the same index as `argmax` (the first of equal
    maxima, NaN first) and on a CPU is 4x faster on bfloat16, whose argmax is not vectorised
    (5.7 ms against 1.4 ms for 64 rows of 49,152)."""
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, cpu_argmax: Callable[[Tensor], Tensor] | None = None) -> None:
        # One generator per device, reseeded per seeded row: reseeding is cheap, creating is not.
        self._generators: dict[torch.device, torch.Generator] = {}
        self._cpu_argmax = cpu_argmax  # gpu/cpu_ops.py's argmax_rows: greedy_ids' result, faster

    def greedy(self, logits: Tensor) -> Tensor:
        """greedy_ids(logits), on a CPU by the compiled kernel where there is one."""
        if self._cpu_argmax is not None and logits.device.type == "cpu" and logits.is_contiguous() and logits.shape[-1] > 0:
            return self._cpu_argmax(logits)
        return greedy_ids(logits)

    def sample(
        self,
        logits: Tensor,
        info: SamplingInfo,
        *,
        output_ids: TokenHistory | None = None,
        prompt_ids: TokenHistory | None = None,
        steps: Sequence[int] | None = None,
    ) -> SampleResult:
        """Sample one token per row of `logits` [bs, vocab] (any float dtype; math in float32).

        `output_ids` / `prompt_ids` are each request's generated / prompt tokens (host lists or
        spans of a device token table), needed only when a row sets a penalty; `steps[i]` is how
        many tokens request i has generated, needed only when a sampled row has a seed.
        """
        if logits.dim() != 2 or logits.shape[0] != info.batch_size:
            raise ValueError(f"logits must be [{info.batch_size}, vocab], got {list(logits.shape)}")
        if info.all_greedy and info.logit_bias is None and not (info.repetition_rows or info.freq_presence_rows):
            # Nothing changes a logit: the argmax of the logits as they are (widening bfloat16 or
            # float16 to float32 is exact, so a float32 copy would pick the same ids).
            return _with_logprobs(logits, self.greedy(logits), info)
        penalised = apply_penalties(logits, info, output_ids, prompt_ids)
        if info.logit_bias is not None:
            rows, tokens, values = info.logit_bias
            # Out of place: `penalised` may be the caller's logits, which the logprobs read raw.
            penalised = penalised.float().index_put((rows, tokens), values, accumulate=True)
        if info.all_greedy:
            token_ids = self.greedy(penalised)
        else:
            token_ids = self._draw(filtered_probs(penalised, info), info, steps)
            if info.any_greedy:
                token_ids = torch.where(info.greedy, self.greedy(penalised), token_ids)
        return _with_logprobs(logits, token_ids, info)

    def _draw(self, probs: Tensor, info: SamplingInfo, steps: Sequence[int] | None) -> Tensor:
        if not info.seeded_rows:
            noise = torch.empty_like(probs).exponential_()  # greedy rows draw too: one op beats indexing
        else:
            if steps is None:
                raise ValueError("steps is required when a sampled request sets a seed")
            noise = torch.ones_like(probs)  # greedy rows: any finite noise, their argmax replaces the draw
            if info.unseeded_rows:
                drawn = torch.empty(len(info.unseeded_rows), probs.shape[-1], device=probs.device).exponential_()
                noise.index_copy_(0, info.unseeded_index, drawn)
            generator = self._generator(probs.device)
            for row in info.seeded_rows:  # one generator state per row: a loop is unavoidable
                generator.manual_seed(mix_seed(info.seeds[row], steps[row]))  # type: ignore[arg-type]
                noise[row].exponential_(generator=generator)
        # Exp(1) can round to 0; 0/0 would be NaN, which argmax would pick.
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def _with_logprobs(logits: Tensor, token_ids: Tensor, info: SamplingInfo) -> SampleResult:
    if not info.return_logprobs:
        return SampleResult(token_ids=token_ids, logprobs=None, top_logprobs=None)
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(-1, token_ids.unsqueeze(1)).squeeze(1)
    k = min(info.max_top_logprobs_num, raw.shape[-1])
    top = None
    if k > 0:
        values, ids = raw.topk(k, dim=-1, sorted=True)
        top = (values, ids)
    return SampleResult(token_ids=token_ids, logprobs=chosen, top_logprobs=top)
