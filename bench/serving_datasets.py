"""Request sets of `bench.serving`: the standard workloads (bench/workloads.py) as benchmark
requests, and the datasets `random-ids`, `generated-shared-prefix`, `multi-turn`, `sharegpt`.

Token ids come from [10, vocab_size - 10) with numpy default_rng(seed). Datasets that draw no
arrival times of their own take them from default_rng([seed, 1]), a generator apart from the
prompts', so every request rate sends the same prompts.

`--tenants` and `--slo-classes` (a `Mix` each) give every request, or every conversation, a tenant
and a TTFT target drawn with the weights given, from default_rng([seed, 3]) and ([seed, 4]): the
prompts and arrivals stay those of a run without them.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from bench.workloads import ID_MARGIN, arrival_offsets, make_workload, shared_prefix_requests
from runtime.service import MAX_TENANT_CHARS, ServiceClass

T = TypeVar("T")
TENANT_SEED, SLO_SEED = 3, 4  # default_rng([seed, n]) streams apart from prompts (0), arrivals (1), warm-up (2)


# --- tenants and SLO classes ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mix(Generic[T]):
    """Values drawn with weights (`--tenants a=3,b=1`: a three times as often as b)."""

    values: tuple[T, ...]
    weights: tuple[float, ...]

    def draw(self, rng: np.random.Generator, n: int) -> list[T]:
        p = np.asarray(self.weights) / sum(self.weights)
        return [self.values[i] for i in rng.choice(len(self.values), size=n, p=p)]

    def as_dict(self) -> dict[str, float]:
        """For the JSON line: value -> weight, values as given on the command line."""
        return {_as_given(v): w for v, w in zip(self.values, self.weights)}


def _as_given(value: object) -> str:
    if value is None:
        return "none"  # an SLO class without a target
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True, slots=True)
class Service:
    """What a request tells the server about itself besides its priority. `slo_class` is the
    /metrics label of the target (`ttft<=500ms`, or `none` when the drawn class has no target);
    None when the run draws no SLO classes, so such requests are not split by it."""

    tenant: str | None = None
    slo_ttft_ms: float | None = None
    slo_class: str | None = None


NO_SERVICE = Service()


@dataclass(slots=True)
class BenchRequest:
    index: int
    output_len: int
    input_ids: list[int] | None = None
    text: str | None = None  # sharegpt prompts, and every prompt for openai-chat
    arrival_s: float = 0.0
    priority: int | None = None
    group: int | None = None
    service: Service = NO_SERVICE

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids) if self.input_ids is not None else 0


@dataclass(slots=True)
class MultiTurn:
    """One conversation: user turns sent one after the other, each with the history before it."""

    index: int
    turns: list[list[int]]
    output_len: int
    arrival_s: float = 0.0
    texts: list[str] | None = None  # the turns decoded, for openai-chat
    service: Service = NO_SERVICE


@dataclass(slots=True)
class Dataset:
    name: str
    requests: list[BenchRequest] = field(default_factory=list)
    conversations: list[MultiTurn] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.requests) + sum(len(c.turns) for c in self.conversations)


def _ids(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    return rng.integers(ID_MARGIN, vocab_size - ID_MARGIN, size=n).tolist()


def _arrivals(seed: int, n: int, rate: float, burstiness: float) -> list[float]:
    """Arrival offsets for datasets that draw none of their own: a generator apart from the
    prompts', so every rate sends the same prompts."""
    return arrival_offsets(np.random.default_rng([seed, 1]), n, rate, burstiness)


def random_ids_dataset(
    vocab_size: int, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
    rate: float = math.inf, burstiness: float = 1.0,
) -> Dataset:
    """Request by request: input length, output length (each uniform in [max(1, len * ratio), len]),
    then the ids."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(num_prompts):
        n_in = int(rng.integers(max(1, int(input_len * range_ratio)), input_len + 1))
        n_out = int(rng.integers(max(1, int(output_len * range_ratio)), output_len + 1))
        reqs.append(BenchRequest(i, n_out, input_ids=_ids(rng, vocab_size, n_in)))
    return Dataset("random-ids", _with_arrivals(reqs, _arrivals(seed, num_prompts, rate, burstiness)))


def gsp_dataset(
    vocab_size: int, num_groups: int, prompts_per_group: int, system_len: int, question_len: int, output_len: int,
    seed: int, num_prompts: int | None = None, rate: float = math.inf, burstiness: float = 1.0,
) -> Dataset:
    """bench.workloads' shared-prefix generator (W2 at 16 x 16, 512, 64, 64)."""
    total = num_groups * prompts_per_group
    n = total if num_prompts is None else min(num_prompts, total)
    reqs = shared_prefix_requests(
        vocab_size, seed, num_groups=num_groups, num_requests=n, system_len=system_len,
        question_len=question_len, output_len=output_len,
    )
    out = [BenchRequest(r.index, r.max_new_tokens, input_ids=r.input_ids, group=r.group) for r in reqs]
    return Dataset("generated-shared-prefix", _with_arrivals(out, _arrivals(seed, n, rate, burstiness)))


def multi_turn_dataset(
    vocab_size: int, num_conversations: int, turns: int, first_len: int, turn_len: int, output_len: int, seed: int,
    rate: float = math.inf, burstiness: float = 1.0,
) -> Dataset:
    """Conversation by conversation: the first user turn, then the later ones (W4's draw order, so
    the defaults reproduce W4-multi-turn). Conversations arrive at `rate`; turns follow answers."""
    rng = np.random.default_rng(seed)
    convs = []
    for c in range(num_conversations):
        user = [_ids(rng, vocab_size, first_len)] + [_ids(rng, vocab_size, turn_len) for _ in range(turns - 1)]
        convs.append(MultiTurn(c, user, output_len))
    for conv, t in zip(convs, _arrivals(seed, num_conversations, rate, burstiness)):
        conv.arrival_s = t
    return Dataset("multi-turn", conversations=convs)


def sharegpt_dataset(
    path: Path, tokenizer: Any, num_prompts: int, seed: int, fixed_output_len: int | None = None,
    context_len: int = 2048, rate: float = math.inf, burstiness: float = 1.0,
) -> Dataset:
    """SGLang's sharegpt sampling: conversations with two or more turns, shuffled with `seed`; the
    first turn is the prompt (sent as text), the second's token count the output length (or
    `fixed_output_len`). Prompts or answers under 2 tokens, prompts over 1024 and pairs over
    `context_len` are skipped."""
    data = json.loads(Path(path).read_text())
    pairs = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or item.get("messages") or []
        if len(conv) >= 2:
            pairs.append((_turn_text(conv[0]), _turn_text(conv[1])))
    random.Random(seed).shuffle(pairs)
    reqs: list[BenchRequest] = []
    for prompt, answer in pairs:
        if len(reqs) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        out_len = fixed_output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if prompt_len < 2 or out_len < 2 or prompt_len > 1024 or prompt_len + out_len > context_len:
            continue
        reqs.append(BenchRequest(len(reqs), out_len, text=prompt))
    if len(reqs) < num_prompts:
        print(f"sharegpt: only {len(reqs)} usable conversations in {path} (asked for {num_prompts})", file=sys.stderr)
    return Dataset("sharegpt", _with_arrivals(reqs, _arrivals(seed, len(reqs), rate, burstiness)))


def _turn_text(turn: Any) -> str:
    if isinstance(turn, str):
        return turn
    return str(turn.get("value", turn.get("content", "")))


def workload_dataset(name: str, vocab_size: int, seed: int, num_prompts: int | None, rate: float, burstiness: float) -> Dataset:
    """A standard workload. W3 and W5 arrive at `rate` by definition; W1, W2 and W4 arrive at once,
    so a finite rate for them is a deviation (announced by the caller)."""
    own_arrivals = name in ("W3-online", "W5-priority-overload")
    wl = make_workload(name, vocab_size, seed, num_requests=num_prompts, rate=rate if own_arrivals else math.inf, burstiness=burstiness)
    if wl.conversations:
        convs = [MultiTurn(c.index, list(c.user_turns), c.max_new_tokens) for c in wl.conversations]
        for conv, t in zip(convs, _arrivals(seed, len(convs), rate, burstiness)):
            conv.arrival_s = t
        return Dataset(name, conversations=convs)
    reqs = [BenchRequest(r.index, r.max_new_tokens, input_ids=r.input_ids, arrival_s=r.arrival_s, priority=r.priority, group=r.group) for r in wl.requests]
    if not own_arrivals:
        reqs = _with_arrivals(reqs, _arrivals(seed, len(reqs), rate, burstiness))
    return Dataset(name, reqs)


def _with_arrivals(reqs: list[BenchRequest], offsets: list[float]) -> list[BenchRequest]:
    return [replace(r, arrival_s=t) for r, t in zip(reqs, offsets)]


# --- drawing tenants and SLO classes -------------------------------------------------------------


def parse_mix(text: str, parse_value: Callable[[str], T]) -> Mix[T]:
    """`v1=w1,v2,...` (weight 1 when left out) -> Mix; ValueError naming the bad entry (the
    command line puts the flag's name before it)."""
    values: list[T] = []
    weights: list[float] = []
    for entry in text.split(","):
        name, sep, weight_text = entry.strip().partition("=")
        try:
            value = parse_value(name.strip())
        except ValueError as exc:
            raise ValueError(f"entry {entry!r}: {exc}") from None
        weight = _positive(weight_text) if sep else 1.0
        if weight is None:
            raise ValueError(f"entry {entry!r}: the weight must be a positive number")
        if value in values:
            raise ValueError(f"entry {entry!r}: {name.strip()} is given twice")
        values.append(value)
        weights.append(weight)
    return Mix(tuple(values), tuple(weights))


def _positive(text: str) -> float | None:
    """A positive finite number, or None."""
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) and x > 0 else None


def tenant_name(text: str) -> str:
    # The server's own limit (runtime.service): a longer name would be a 400 on every request.
    if not 0 < len(text) <= MAX_TENANT_CHARS:
        raise ValueError(f"a tenant is 1 to {MAX_TENANT_CHARS} characters")
    return text


def slo_target(text: str) -> float | None:
    """A TTFT target in ms, or None for `none` (requests of that class ask for no target)."""
    if text == "none":
        return None
    ms = _positive(text)
    if ms is None:
        raise ValueError("an SLO class is a TTFT target in ms (a positive number) or none")
    return ms


def parse_tenants(text: str) -> Mix[str]:
    return parse_mix(text, tenant_name)


def parse_slo_classes(text: str) -> Mix[float | None]:
    return parse_mix(text, slo_target)


def draw_services(n: int, seed: int, tenants: Mix[str] | None, slo_classes: Mix[float | None] | None) -> list[Service]:
    """One Service per request (or conversation); each mix from its own generator, so adding
    --slo-classes to a run does not change who its tenants are."""
    who: list[str | None] = tenants.draw(np.random.default_rng([seed, TENANT_SEED]), n) if tenants else [None] * n
    targets: list[float | None] = slo_classes.draw(np.random.default_rng([seed, SLO_SEED]), n) if slo_classes else [None] * n
    return [
        Service(tenant, ms, ServiceClass(slo_ttft_ms=ms).slo_class() if slo_classes else None)
        for tenant, ms in zip(who, targets)
    ]


def with_services(dataset: Dataset, seed: int, tenants: Mix[str] | None, slo_classes: Mix[float | None] | None) -> Dataset:
    """The dataset, in place, with a Service drawn for each request and each conversation (all
    its turns share it: a conversation is one user's); unchanged when neither mix is given."""
    if tenants is None and slo_classes is None:
        return dataset
    services = draw_services(len(dataset.requests) + len(dataset.conversations), seed, tenants, slo_classes)
    for item, service in zip([*dataset.requests, *dataset.conversations], services):
        item.service = service
    return dataset
