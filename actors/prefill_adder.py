"""Admission rules of one prefill round, and the ratio, preemption and retraction choices around it.

Pure and synchronous: the Adder actor calls these, then allocates, frees and messages itself.
Behaviour follows reference/sglang-behaviour.md ("Constants", "PrefillAdder", "Scheduler step").

The caller allocates for every `admitted` entry, evicting first when short: the budgets guarantee
`free + evictable` covers the extends, and every admitted prefix is locked, so eviction never takes
an admitted request's prefix.
`add_one_req` sets `computed_len` to the matched length and leaves one lock on the matched node,
which the KV ledger's row takes over (actors/kv_ledger.py).

Where we differ from SGLang, on purpose:

- A request's generated count is `max(len(output_ids), launched_outputs)`: with overlap the
  Adder knows about launched tokens before their ids reach `output_ids`, and their KV is taken.
- `add_chunked_req` ends a cut chunk on a page boundary when that leaves a non-empty chunk, so
  the whole computed part can be cached and the next chunk starts on a fresh page (page 1: same
  numbers as SGLang). When mixed decode tokens leave no chunk budget at all, the chunked request
  still advances by one page instead of stalling.
- A candidate that would have to be cut while another request is chunked is refused (OTHER):
  the Adder keeps one chunked request at a time.
- The ignore_eos path (prefix cache disabled) also applies the input cap to a second request,
  like the normal path; SGLang's ignore_eos path skips it.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from actors.priority import PriorityRule
from cache import ChunkCache, MatchResult, PrefixCache, RadixNode
from cache.keys import token_array
from runtime.req import Req

CLIP_MAX_NEW_TOKENS = 4096  # cap on max_new_tokens in admission estimates only
IGNORE_EOS_RESERVE_TOKENS = 1  # per-request slack in the ignore_eos worst-case simulation
RETRACT_DECODE_STEPS = 20  # decode steps of KV reserved per request that stays after a retraction
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class PrefixLocks(Protocol):
    """Locks on cached prefixes, as an admission takes them (the KV ledger in the Adder)."""

    def inc_lock_ref(self, node: RadixNode) -> None: ...

    def dec_lock_ref(self, node: RadixNode) -> None: ...


class AddResult(enum.Enum):
    CONTINUE = "continue"  # budgets left: try the next candidate
    NO_TOKEN = "no_token"  # KV budget exhausted: the batch is full
    OTHER = "other"  # input or chunk budget exhausted, or this candidate cannot go now


def generated_tokens(req: Req) -> int:
    """Output tokens that hold (or will hold, once launched) KV."""
    return max(len(req.out.output_ids), req.sched.launched_outputs)


def remaining_new_tokens(req: Req) -> int:
    """Decode tokens still to come, clipped for estimates."""
    return min(max(req.max_new_tokens - generated_tokens(req), 0), CLIP_MAX_NEW_TOKENS)


def clipped_max_new_tokens(req: Req) -> int:
    return min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)


def match_key(req: Req) -> array:
    """All but the last token of the request, encoded for the cache's memcmp walk; only up to
    the first position whose logits give a wanted prompt logprob."""
    if req.input_logprobs_pending:
        return token_array(req.asked.input_ids[: max(req.asked.logprob_start_len - 1, 0)])
    if req.out.output_ids or req.prompt_key is None:
        key = token_array(req.fill_ids)
        if key:
            key.pop()
        return key
    return req.prompt_key[:-1]  # a memcpy; the Receiver encoded the prompt on arrival


def match_for_admission(cache: PrefixCache, req: Req) -> MatchResult:
    """The cached prefix of `req`, leaving at least one token to compute (its logits sample the next token)."""
    return cache.match_prefix(match_key(req), req.asked.extra_key)


def prefix_tokens(req: Req, length: int) -> Sequence[int]:
    """The request's first `length` tokens; inside the prompt, as the array('i') the cache reads
    without encoding."""
    if req.prompt_key is not None and length <= len(req.asked.input_ids):
        return req.prompt_key[:length]
    return req.fill_ids[:length]


class NewTokenRatio:
    """Share of their remaining max_new_tokens that running requests are assumed to still need:
    decays towards `min` per decode step, jumps back after a retraction, resets when idle."""

    __slots__ = ("init", "min", "decay_step", "value")

    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.init = min(1.0, INIT_NEW_TOKEN_RATIO * schedule_conservativeness)
        self.min = self.init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.decay_step = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def decay(self) -> None:
        self.value = max(self.value - self.decay_step, self.min)

    def reset(self) -> None:
        self.value = self.init

    def set(self, value: float) -> None:
        # Not floored at `min`: a retraction estimate below it is kept (as in SGLang).
        self.value = value

    def __repr__(self) -> str:
        return f"NewTokenRatio(value={self.value:.4f}, init={self.init}, min={self.min:.4f})"


def ratio_after_retraction(remaining: Sequence[Req], reserve_steps: int = RETRACT_DECODE_STEPS) -> float:
    """Estimate from the requests that stay: what they generated plus a reserve each, over what they may generate."""
    generated = sum(generated_tokens(r) for r in remaining)
    max_new = sum(r.max_new_tokens for r in remaining)
    return min(1.0, (generated + reserve_steps * len(remaining)) / (max_new + 1))



@dataclass(slots=True)
class Admission:
    """One request admitted this round: compute positions [prefix_len, prefix_len + extend_len).

    For a new admission (`match` is not None) the caller must take a request row, write
    `match.slots` into positions [0, prefix_len) (borrowed from the cache: not freed by the
    request), then allocate KV for the extend. For a chunk continuation (`match` is None) the
    request already has its row and its KV up to `prefix_len`; allocate the extend only.
    """

    req: Req
    prefix_len: int
    extend_len: int
    truncated: bool  # the prompt continues in a later round
    match: MatchResult | None


@dataclass(slots=True)
class _Candidate:
    extend: int  # tokens to compute if admitted whole
    paged: int  # extend rounded up to whole pages: what the input budgets are charged
    new_tokens: int  # clipped decode tokens still to come: what the admission test asks for
    charged_new: int  # clipped max_new_tokens, in full: what admission charges (SGLang charges a
    # re-admitted request as if it had generated nothing)


class PrefillAdder:
    """Budgets and admission decisions of one prefill round.

    Budgets (tokens):
    - rem_total_tokens = free + evictable - offset; offset = mixed decode tokens + what running
      requests are expected to still need (ratio-scaled) + what this round admitted (not scaled).
    - rem_input_tokens = max_prefill_tokens - mixed decode tokens.
    - rem_chunk_tokens = chunked_prefill_size - mixed decode tokens (None: chunking off).

    `evictable` is read from the cache on every check, because locking a prefix shrinks it.
    """

    def __init__(
        self,
        *,
        page_size: int,
        cache: PrefixCache,
        free_slots: int,
        running: Sequence[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        mixed_decode_tokens: int = 0,
        prefill_max_requests: int | None = None,
        locks: PrefixLocks | None = None,
    ) -> None:
        if page_size != cache.page_size:
            raise ValueError(f"page_size {page_size} differs from the cache's {cache.page_size}")
        self.page_size = page_size
        self.cache = cache
        # Who takes an admitted request's lock on its prefix: the Adder's KV ledger, which also
        # releases it when the request leaves (tests that drive a bare cache let it lock itself).
        self.locks: PrefixLocks = locks if locks is not None else cache
        self.free_slots = free_slots
        self.running = list(running)
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        chunking = chunked_prefill_size is not None and chunked_prefill_size > 0
        self.rem_chunk_tokens: int | None = chunked_prefill_size - mixed_decode_tokens if chunking else None
        self.total_offset = float(mixed_decode_tokens) + sum(self.reserved_tokens(r) for r in self.running)
        # What this round's extends take from the pool: the ignore_eos simulation's "free" is real
        # KV, without the running requests' estimates.
        self.extend_charged = mixed_decode_tokens
        self.prefill_max_requests = prefill_max_requests
        self.admitted: list[Admission] = []
        self.new_chunked_req: Req | None = None
        # Prefix caching off: ignore_eos requests get the worst-case simulation instead of the ratio.
        self.simulate_ignore_eos = isinstance(cache, ChunkCache)


    @property
    def rem_total_tokens(self) -> float:
        return self.free_slots + self.cache.evictable_size() - self.total_offset

    @property
    def can_run(self) -> list[Req]:
        return [a.req for a in self.admitted]

    def reserved_tokens(self, req: Req) -> float:
        """What a running request is expected to still need: its share of rem_total_token_offset."""
        return remaining_new_tokens(req) * self.new_token_ratio

    def budget_state(self) -> AddResult:
        if self.rem_total_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE

    def tokens_needed(self, req: Req, match: MatchResult) -> int:
        """What the admission test asks of the total budget for `req` (its extend, not rounded up
        to pages, plus its remaining decode tokens)."""
        cand = self._candidate(req, match)
        return cand.extend + cand.new_tokens

    def preemption_need(self, req: Req, match: MatchResult) -> float:
        """Tokens that preempted requests must give back before `req` fits (<= 0: it fits already):
        its extend plus its clipped max_new_tokens, as SGLang's `preempt_to_schedule` counts."""
        cand = self._candidate(req, match)
        return cand.extend + cand.charged_new - self.rem_total_tokens

    def remove_running(self, victims: Sequence[Req], freed_slots: int = 0) -> None:
        """Preempted `victims` stop counting; `freed_slots` is 0 when their release waits for an
        in-flight step (then the new request may not get its KV this round)."""
        for victim in victims:
            self.running.remove(victim)
            self.total_offset -= self.reserved_tokens(victim)
        self.free_slots += freed_slots

    def _charge(self, extend: int, new_tokens: int) -> None:
        paged = self._ceil_pages(extend)
        self.total_offset += paged + new_tokens
        self.extend_charged += paged
        self.rem_input_tokens -= paged
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= paged

    def _ceil_pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def _candidate(self, req: Req, match: MatchResult) -> _Candidate:
        extend = len(req.asked.input_ids) + len(req.out.output_ids) - match.length
        assert extend > 0, f"request {req.rid} has nothing to compute (match the prefix without its last token)"
        return _Candidate(extend, self._ceil_pages(extend), remaining_new_tokens(req), clipped_max_new_tokens(req))


    def add_chunked_req(self, req: Req) -> Req | None:
        """Admit the next chunk of `req` (before any new request); returns `req` while its prompt is still cut.

        Takes min(rem_chunk, rem_total) tokens; when the total budget is gone it takes rem_chunk
        anyway, so the request (which holds KV and a row) always advances instead of leaking.
        """
        assert self.rem_chunk_tokens is not None, "a chunked request needs chunked prefill"
        start = req.sched.computed_len
        left = len(req.asked.input_ids) + len(req.out.output_ids) - start
        assert left > 0, f"chunked request {req.rid} has nothing left to compute"
        take = min(self.rem_chunk_tokens, int(self.rem_total_tokens))
        if take <= 0:
            take = self.rem_chunk_tokens
        if take <= 0:
            take = self.page_size  # mixed decode tokens ate the whole chunk budget
        truncated = left > take
        extend = self._page_aligned_cut(start, take) if truncated else left
        self._charge(extend, 0 if truncated else clipped_max_new_tokens(req))
        self.admitted.append(Admission(req, start, extend, truncated, None))
        self.new_chunked_req = req if truncated else None
        return self.new_chunked_req

    def _page_aligned_cut(self, start: int, take: int) -> int:
        end = (start + take) // self.page_size * self.page_size
        return end - start if end > start else take


    def add_one_req(self, req: Req, match: MatchResult, has_chunked_req: bool) -> AddResult:
        """Admit `req` with its cached prefix `match`: on admission it holds a lock on
        `match.last_node`; on refusal nothing changed."""
        if self.prefill_max_requests is not None and len(self.admitted) >= self.prefill_max_requests:
            return AddResult.OTHER
        cand = self._candidate(req, match)
        refused = self._memory_refusal(req, cand)
        if refused is not None:
            return refused
        if self.admitted and cand.paged >= self.rem_input_tokens:
            return AddResult.OTHER  # only the first request of a batch may exceed the input cap
        # The lock moves the prefix out of evictable (it can no longer make room), so check again.
        self.locks.inc_lock_ref(match.last_node)
        refused = self._admit_locked(req, match, cand, has_chunked_req)
        if refused is not None:
            self.locks.dec_lock_ref(match.last_node)
            return refused
        return self.budget_state()

    def _memory_refusal(self, req: Req, cand: _Candidate) -> AddResult | None:
        if self.simulate_ignore_eos and req.asked.sampling.ignore_eos:
            cur_rem = self._current_rem_tokens()
            if cand.paged > min(cur_rem, self.rem_total_tokens) or not self._ignore_eos_safe(req, cur_rem - cand.paged):
                return AddResult.NO_TOKEN
            return None
        if cand.extend + cand.new_tokens >= self.rem_total_tokens:
            return AddResult.NO_TOKEN
        return None

    def _admit_locked(self, req: Req, match: MatchResult, cand: _Candidate, has_chunked_req: bool) -> AddResult | None:
        """Admit whole or cut to the chunk budget; None on success, else why not."""
        if not (self.simulate_ignore_eos and req.asked.sampling.ignore_eos):
            if cand.extend + cand.new_tokens >= self.rem_total_tokens:
                return AddResult.NO_TOKEN
        if self.rem_chunk_tokens is None or cand.paged <= self.rem_chunk_tokens:
            self._record_new(req, match, cand.extend, truncated=False)
            self._charge(cand.extend, cand.charged_new)
            return None
        if has_chunked_req or self.new_chunked_req is not None:
            return AddResult.OTHER  # one chunked request at a time
        # The prefix is page-aligned, so a page-multiple cut keeps the chunk end on a page boundary.
        cut = self.rem_chunk_tokens // self.page_size * self.page_size
        if cut <= 0:
            return AddResult.OTHER
        self._record_new(req, match, cut, truncated=True)
        self._charge(cut, 0)  # decode tokens are charged with the last chunk
        self.new_chunked_req = req
        return None

    def _record_new(self, req: Req, match: MatchResult, extend: int, truncated: bool) -> None:
        req.sched.computed_len = match.length
        self.admitted.append(Admission(req, match.length, extend, truncated, match))


    def _current_rem_tokens(self) -> float:
        """KV that is free or evictable now, minus what this round's extends take."""
        return self.free_slots + self.cache.evictable_size() - self.extend_charged

    def _ignore_eos_safe(self, req: Req, free: float) -> bool:
        """Would every request still fit if each generated to its (ratio-scaled) end?

        Requests finish in order of tokens left; while `bs` are still running, each of them needs
        `tokens_left` more slots, and every finished one has given back what it occupied.
        """
        states = sorted(self._ignore_eos_state(r) for r in [*self.running, *self.can_run, req])
        states = [s for s in states if s[0] > 0]
        freed = 0
        for i, (tokens_left, tokens_occupied) in enumerate(states):
            bs = len(states) - i
            if free + freed - tokens_left * bs <= IGNORE_EOS_RESERVE_TOKENS * bs:
                return False
            freed += tokens_occupied
        return True

    def _ignore_eos_state(self, req: Req) -> tuple[float, int]:
        ratio = 1.0 if req.asked.sampling.ignore_eos else self.new_token_ratio
        generated = generated_tokens(req)
        return req.max_new_tokens * ratio - generated, len(req.asked.input_ids) + generated



def select_preemption_victims(
    new_req: Req,
    running: Sequence[Req],
    need_tokens: float,
    rule: PriorityRule,
    reserved_tokens_of: Callable[[Req], float],
) -> list[Req] | None:
    """Running requests to preempt so that `new_req` fits, or None when preemption cannot help.

    Least important first, the newest in the queue first among equals; each victim gives back its own
    reserved tokens until `need_tokens` is covered; with `need_tokens <= 0` (the batch is full of
    requests, not of tokens) one victim is taken. The victims come back in `running`'s order, the
    order they leave in: SGLang releases them walking its batch, evicting for the survivors after
    each, so the order decides which cached prefixes are unlocked when an eviction runs.
    """
    # A stable sort: of equal priority and queue-entry time, the one admitted first goes first (SGLang).
    candidates = sorted(running, key=lambda r: (-rule.level(r.asked.priority), -r.sched.enqueue_time))
    victims: list[Req] = []
    for cand in candidates:
        if not rule.may_preempt(new_req.asked.priority, cand.asked.priority):
            break  # sorted: every later candidate is at least as important
        victims.append(cand)
        need_tokens -= reserved_tokens_of(cand)
        if need_tokens <= 0:
            break
    if not victims or need_tokens > 0:
        return None
    chosen = {id(r) for r in victims}
    return [r for r in running if id(r) in chosen]



def retraction_stack(running: Sequence[Req]) -> list[Req]:
    """The running requests with the next retraction victim last (pop() takes it): fewest
    generated tokens (least work lost), then the longest prompt, then the one admitted last. As
    SGLang: a stable sort in reverse, popped from the end."""
    return sorted(running, key=lambda r: (generated_tokens(r), -len(r.asked.input_ids)), reverse=True)


def select_retraction_victims(
    running: Sequence[Req],
    fits_after: Callable[[list[Req], list[Req]], bool],
    reserve_steps: int = RETRACT_DECODE_STEPS,
) -> tuple[list[Req], float]:
    """Requests to retract because decode memory is short, and the new new_token_ratio.

    SGLang's `retract_decode`: retract one, then one more while `fits_after(victims, stays)` says
    the next decode step of `stays` does not fit yet (the caller frees the newest victim's KV
    before answering). Never the last request: if it still does not fit, the caller aborts it.
    """
    stays = retraction_stack(running)
    victims: list[Req] = []
    while not victims or not fits_after(victims, stays):
        if len(stays) == 1:
            break
        victims.append(stays.pop())
    return victims, ratio_after_retraction(stays, reserve_steps)
