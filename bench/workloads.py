"""The standard benchmark workloads of /work/shared/bench-workloads.md, as plain data.

    from bench.workloads import make_workload
    wl = make_workload("W1-mixed", vocab_size=4096, seed=0)
    for r in wl.requests: r.input_ids, r.max_new_tokens, r.arrival_s, r.priority, r.group

Every draw comes from one `numpy.random.default_rng(seed)`, in a fixed order, so a (workload,
seed, vocab_size) triple names the same token ids on every machine:

- W1-mixed: request by request, input length in [32, 512], output length in [16, 256] (both
  inclusive), then the input ids from [10, vocab_size - 10). W1-mixed-64 is W1-mixed's first 64
  requests (the same draws), for models over 100M parameters.
- W2-shared-prefix: the 16 system prompts (512 ids each) first, then the 256 questions (64 ids
  each) in request order; request i belongs to group i % 16 and gets 64 output tokens.
- W3-online: W1-mixed's draws, then one inter-arrival gap per request from the same generator:
  gamma(shape=burstiness, scale=1 / (rate * burstiness)), Poisson for burstiness 1. The first
  request arrives at 0 and request i after the first i gaps. The rate only scales the gaps, so
  every rate of a sweep sends the same prompts in the same order.
- W4-multi-turn: conversation by conversation, the 256-id first user turn, then three 64-id later
  user turns; 64 output tokens per turn. Later prompts carry the history (the previous prompt, the
  model's answer, the new user turn), which only exists at run time: see `Conversation.prompt`.
- W5-priority-overload: request by request, input length in [32, 256], output length in
  [16, 128], then the ids; then one permutation of the requests whose first 10% (rounded) get
  priority 10, the rest 0; then the arrival gaps as in W3 (the rate is 2x the capacity measured
  on the machine at hand, so the caller passes it).

`num_requests` keeps the first N requests (conversations for W4) of the full draw order, so a
shrunk workload is a prefix of the full one. Arrival times are offsets in seconds from the start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

WORKLOADS = ("W1-mixed", "W1-mixed-64", "W2-shared-prefix", "W3-online", "W4-multi-turn", "W5-priority-overload")
ID_MARGIN = 10  # ids come from [10, vocab_size - 10): clear of special ids at both ends

W2_GROUPS = 16
W2_PROMPTS_PER_GROUP = 16
W2_SYSTEM_LEN = 512
W2_QUESTION_LEN = 64
W2_OUTPUT_LEN = 64

W4_CONVERSATIONS = 32
W4_TURNS = 4
W4_FIRST_TURN_LEN = 256
W4_LATER_TURN_LEN = 64
W4_OUTPUT_LEN = 64

W5_REQUESTS = 512
W5_HIGH_PRIORITY = 10
W5_HIGH_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    input_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run
    priority: int | None = None
    group: int | None = None  # W2: the shared system prompt; W4: the conversation


@dataclass(frozen=True, slots=True)
class Conversation:
    """W4: user turns sent one after the other, each once the previous answer has arrived."""

    index: int
    user_turns: list[list[int]]
    max_new_tokens: int

    def prompt(self, turn: int, history: list[int]) -> list[int]:
        """The prompt of `turn`: `history` (the previous prompt followed by its answer; empty for
        turn 0) then this turn's user ids."""
        return history + self.user_turns[turn]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    seed: int
    vocab_size: int
    requests: list[Request]  # W4: the first turn of every conversation
    conversations: list[Conversation] = field(default_factory=list)  # W4 only

    @property
    def output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)


def make_workload(
    name: str,
    vocab_size: int,
    seed: int = 0,
    *,
    num_requests: int | None = None,
    rate: float = math.inf,
    burstiness: float = 1.0,
) -> Workload:
    """The workload `name`; `rate` (requests/s) and `burstiness` matter for W3 and W5 only."""
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    if name in ("W1-mixed", "W1-mixed-64"):
        n = _count(num_requests, 256 if name == "W1-mixed" else 64)
        return Workload(name, seed, vocab_size, _mixed(rng, vocab_size, n, (32, 512), (16, 256)))
    if name == "W2-shared-prefix":
        return Workload(name, seed, vocab_size, _shared_prefix(rng, vocab_size, _count(num_requests, W2_GROUPS * W2_PROMPTS_PER_GROUP)))
    if name == "W3-online":
        n = _count(num_requests, 256)
        reqs = _mixed(rng, vocab_size, n, (32, 512), (16, 256))
        return Workload(name, seed, vocab_size, _with_arrivals(reqs, arrival_offsets(rng, n, rate, burstiness)))
    if name == "W4-multi-turn":
        convs = _conversations(rng, vocab_size, _count(num_requests, W4_CONVERSATIONS))
        firsts = [Request(c.index, c.prompt(0, []), c.max_new_tokens, group=c.index) for c in convs]
        return Workload(name, seed, vocab_size, firsts, convs)
    if name == "W5-priority-overload":
        n = _count(num_requests, W5_REQUESTS)
        reqs = _with_priorities(_mixed(rng, vocab_size, n, (32, 256), (16, 128)), rng)
        return Workload(name, seed, vocab_size, _with_arrivals(reqs, arrival_offsets(rng, n, rate, burstiness)))
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def arrival_offsets(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> list[float]:
    """Start offsets (s) of `n` requests at `rate` requests/s; rate inf sends all at 0.

    Gaps are gamma(burstiness, 1 / (rate * burstiness)): the mean gap is 1 / rate whatever the
    burstiness, and burstiness 1 is a Poisson process (as in SGLang's bench_serving).
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    # Request i waits for the gaps before it: the first starts at once.
    return [0.0, *np.cumsum(gaps[: n - 1]).tolist()] if n else []


# --- the draws ---------------------------------------------------------------------------------


def _ids(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    return rng.integers(ID_MARGIN, vocab_size - ID_MARGIN, size=n).tolist()


def _length(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))  # inclusive of the upper bound


def _mixed(rng: np.random.Generator, vocab_size: int, n: int, input_len: tuple[int, int], output_len: tuple[int, int]) -> list[Request]:
    out = []
    for i in range(n):
        in_len = _length(rng, input_len)
        out_len = _length(rng, output_len)
        out.append(Request(i, _ids(rng, vocab_size, in_len), out_len))
    return out


def shared_prefix_requests(
    vocab_size: int,
    seed: int = 0,
    *,
    num_groups: int = W2_GROUPS,
    num_requests: int = W2_GROUPS * W2_PROMPTS_PER_GROUP,
    system_len: int = W2_SYSTEM_LEN,
    question_len: int = W2_QUESTION_LEN,
    output_len: int = W2_OUTPUT_LEN,
) -> list[Request]:
    """W2's generator with other sizes (the defaults are W2): request i is group i % num_groups."""
    _check_vocab(vocab_size)
    return _shared_prefix(np.random.default_rng(seed), vocab_size, num_requests, num_groups, system_len, question_len, output_len)


def _shared_prefix(
    rng: np.random.Generator,
    vocab_size: int,
    n: int,
    num_groups: int = W2_GROUPS,
    system_len: int = W2_SYSTEM_LEN,
    question_len: int = W2_QUESTION_LEN,
    output_len: int = W2_OUTPUT_LEN,
) -> list[Request]:
    systems = [_ids(rng, vocab_size, system_len) for _ in range(num_groups)]
    out = []
    for i in range(n):
        group = i % num_groups
        out.append(Request(i, systems[group] + _ids(rng, vocab_size, question_len), output_len, group=group))
    return out


def _conversations(rng: np.random.Generator, vocab_size: int, n: int) -> list[Conversation]:
    out = []
    for c in range(n):
        turns = [_ids(rng, vocab_size, W4_FIRST_TURN_LEN)]
        turns += [_ids(rng, vocab_size, W4_LATER_TURN_LEN) for _ in range(W4_TURNS - 1)]
        out.append(Conversation(c, turns, W4_OUTPUT_LEN))
    return out


def _with_priorities(reqs: list[Request], rng: np.random.Generator) -> list[Request]:
    high = set(rng.permutation(len(reqs))[: round(W5_HIGH_SHARE * len(reqs))].tolist())
    return [replace(r, priority=W5_HIGH_PRIORITY if r.index in high else 0) for r in reqs]


def _with_arrivals(reqs: list[Request], offsets: list[float]) -> list[Request]:
    return [replace(r, arrival_s=t) for r, t in zip(reqs, offsets)]


def _count(num_requests: int | None, full: int) -> int:
    if num_requests is None:
        return full
    if not 0 < num_requests <= full:
        raise ValueError(f"num_requests must be in 1..{full}, got {num_requests}")
    return num_requests


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= 2 * ID_MARGIN:
        raise ValueError(f"vocab_size must exceed {2 * ID_MARGIN}, got {vocab_size}")
