"""The engine's settings, by the side that uses them, with SGLang's argument names.

- `CoreConfig`: what the engine core needs (model, KV pool, caches, scheduling). It is all that
  crosses the process boundary: the frontend sends `config.core()` in `CoreStart`, and the core
  answers with it resolved against the model (no "auto", no None sizes).
- `EngineConfig(CoreConfig)`: the flat set the caller gives (`actorserve.Engine(**kwargs)`, the CLI
  flags: `schedule_policy` -> `--schedule-policy`): the core's fields plus the frontend's own
  (how cores are started, tokenization, request defaults) and the router's.
- `RouterConfig`: how the data-parallel router picks a replica (`config.router()`; the HTTP router
  program builds its own from its flags).

Each is validated where it is built, naming the flags; values that depend on the model or the
device are resolved by the core, which builds a new frozen config with `msgspec.structs.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgspec

from runtime.sampling_params import SamplingParams
from runtime.service import parse_tenant_weights

# Each fixed set is a Literal type (the field's annotation, the CLI flag's choices) and its tuple.
SchedulePolicy = Literal["fcfs", "lof", "random", "routing-key", "lpm", "dfs-weight", "sjf", "edf"]
EvictionPolicy = Literal["lru", "lfu", "fifo"]
AttentionBackend = Literal["auto", "torch", "flashinfer"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
RouterPolicy = Literal["cache_aware", "round_robin", "shortest_queue", "routing_key"]
SamplingDefaults = Literal["model", "openai"]
LoadFormat = Literal["auto", "safetensors", "gguf"]
Fairness = Literal["none", "vtc"]
Quantization = Literal["int8", "gguf"]
SCHEDULE_POLICIES: tuple[str, ...] = get_args(SchedulePolicy)
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
DTYPES: tuple[str, ...] = get_args(Dtype)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
SAMPLING_DEFAULTS: tuple[str, ...] = get_args(SamplingDefaults)
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)
# The kv_cache_dtype values the pools here can hold: SGLang's names of the model's dtype, and int8
# (8-bit rows with a scale each, gpu/kv_quant.py; CPU only), which SGLang lacks (its fp8/fp4 KV is
# for GPUs).
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "int8")
FAIRNESS: tuple[str, ...] = get_args(Fairness)
# sjf without --priority-aging-s ages at this rate: shortest-first alone starves long prompts.
SJF_DEFAULT_AGING_S = 5.0
DETERMINISTIC_SEED = 42  # the sampling seed of requests without one, in deterministic mode (SGLang's)


class CoreConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine core's settings: the model, the KV pool and caches, scheduling, streaming."""

    model_path: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    dtype: Dtype = "auto"  # auto: the checkpoint's dtype on CUDA; on a CPU bfloat16 if native, else float32
    # int8: linear layers with int8 weights and per-token int8 activations (oneDNN, CPU only;
    # gpu/packed_linear.py); gguf: a GGUF model's quantized blocks kept (Q4_K, Q5 and Q4/Q8 as
    # stored, others requantized to 8-bit blocks; CPU only; gpu/gguf_linear.py); None: the dtype's
    # own matmuls. SGLang's and vLLM's flag name.
    quantization: Quantization | None = None
    device: str = "cpu"
    context_length: int | None = None  # None: the model's max_position_embeddings
    attention_backend: AttentionBackend = "auto"
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    random_seed: int | None = None
    core_threads: int | None = None  # torch threads of the engine core; None: torch's default (every core)

    # tensor parallelism: the model split over tp_size ranks (processes started by the core, one
    # torch.distributed group: gloo on a CPU, nccl on CUDA); the scheduler runs once, on rank 0
    tp_size: int = 1
    dist_init_addr: str | None = None  # "host:port" of the group's rendezvous; None: a free loopback port
    dist_timeout_s: float = 120.0  # a rank that answers no collective this long fails the engine

    max_total_tokens: int | None = None  # KV pool size in tokens; None: from a memory budget
    max_running_requests: int | None = None  # None: min(256, what the pool holds)
    page_size: int = 1
    disable_radix_cache: bool = False
    radix_eviction_policy: EvictionPolicy = "lru"
    # SGLang's HiCache L2: pages evicted from the KV pool are kept in host memory (hicache_ratio
    # times the pool) and loaded back when a prompt matches them (cache/host_tier.py).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_write_policy: Literal["write_through", "write_back"] = "write_through"
    hicache_block_tokens: int = 64  # the host tier's unit (a multiple of page_size)
    # SGLang's HiCache L3 (cache/storage_tier.py): host-tier blocks also go to files, read back
    # (prefetched as a request is queued) by this engine or one started later on the directory.
    # SGLang's file backend reads the directory from SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR
    # (default /tmp/hicache); ours is a flag with that default.
    hicache_storage_backend: Literal["file"] | None = None
    hicache_storage_dir: str = "/tmp/hicache"
    hicache_storage_prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "best_effort"
    # timeout: a queued request waits at most this, plus 0.25 s per 1,024 tokens read (as SGLang's
    # prefetch_timeout_base and prefetch_timeout_per_ki_token)
    hicache_storage_prefetch_timeout_s: float = 1.0
    # The storage tier's files stay within this many GB (1e9 bytes), least recently used removed
    # first (SGLang's file backend: capacity_gb in --hicache-storage-backend-extra-config); None: no bound.
    hicache_storage_capacity_gb: float | None = None

    schedule_policy: SchedulePolicy = "fcfs"
    lpm_fallback_queue_len: int = 128  # lpm behaves as fcfs while the queue is longer than this
    max_prefill_tokens: int = 16384
    prefill_max_requests: int | None = None  # at most this many requests in one prefill batch
    chunked_prefill_size: int | None = 8192  # None or -1: no chunking
    enable_mixed_chunk: bool = False
    schedule_conservativeness: float = 1.0
    disable_overlap_schedule: bool = False

    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    max_queued_requests: int | None = None
    queue_timeout_s: float | None = None  # a request waiting longer than this is rejected
    # A waiting request gains one priority level per this many seconds waited, under any policy
    # (actors/policy_order.py states the wait bound this gives); None: no aging, as SGLang.
    priority_aging_s: float | None = None
    # lpm and dfs-weight: up to this share of admissions goes to the oldest cold requests (cached
    # prefix below cold_lane_threshold of the prompt), ahead of better cache matches
    # (actors/cold_lane.py states the bounds); None: no lane, as SGLang.
    cold_lane_share: float | None = None
    cold_lane_threshold: float = 0.5
    # Deadlines: a request's first token is due slo_ttft_ms (or deadline_ms) after arrival, else
    # this many ms after; edf orders by that, and reject_infeasible refuses (503
    # deadline_infeasible) a request the queue ahead of it would make late.
    default_slo_ttft_ms: float | None = None
    reject_infeasible: bool = False
    # Tenant fairness (actors/fairness.py): vtc hands the queue out least-served tenant first;
    # tenant_weights "a=2,b=1" gives tenant a twice b's share (1 for tenants not named).
    fairness: Fairness = "none"
    tenant_weights: str | None = None

    stream_interval: int = 1

    # The core loads the tokenizer too: grammars, stop strings and incremental detokenizing run there.
    tokenizer_path: str | None = None  # None: the model's directory
    trust_remote_code: bool = False  # let transformers run a tokenizer's own code
    chat_template: str | None = None  # a Jinja file or a known name (api/tokenizers.py); None: the tokenizer's
    skip_tokenizer_init: bool = False  # no tokenizer: requests give input_ids, answers carry output_ids
    # Share of the device's memory (RAM on a CPU) for weights + KV pool, as SGLang's; None: the
    # fixed budget (gpu/model_runner.py). max_total_tokens, when given, wins.
    mem_fraction_static: float | None = None
    kv_cache_dtype: str = "auto"  # auto: the KV pool holds the model's dtype; see KV_CACHE_DTYPES
    load_format: LoadFormat = "auto"

    def __post_init__(self) -> None:
        error = self.validation_error()
        if error:
            raise ValueError(error)

    @property
    def chunking_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    @property
    def overlap_depth(self) -> int:
        """Batches launched and not yet reported: the whole overlap switch."""
        return 1 if self.disable_overlap_schedule else 2

    @property
    def effective_aging_s(self) -> float | None:
        if self.priority_aging_s is None and self.schedule_policy == "sjf":
            return SJF_DEFAULT_AGING_S
        return self.priority_aging_s

    @property
    def effective_schedule_policy(self) -> str:
        """A cache-aware policy without a prefix cache is fcfs (as in SGLang)."""
        if self.disable_radix_cache and self.schedule_policy in CACHE_AWARE_POLICIES:
            return "fcfs"
        return self.schedule_policy

    def validation_error(self) -> str | None:
        for ok, message in self._core_checks():
            if not ok:
                return message
        return None

    def _core_checks(self) -> list[tuple[bool, str]]:
        weights_error = _weights_error(self.tenant_weights)
        return [
            (self.schedule_policy in SCHEDULE_POLICIES, f"schedule_policy {self.schedule_policy!r} is unknown; choose one of {', '.join(SCHEDULE_POLICIES)}"),
            (self.radix_eviction_policy in EVICTION_POLICIES, f"radix_eviction_policy {self.radix_eviction_policy!r} is unknown; choose one of {', '.join(EVICTION_POLICIES)}"),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend {self.attention_backend!r} is unknown; choose one of {', '.join(ATTENTION_BACKENDS)}"),
            (self.dtype in DTYPES, f"dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}"),
            (self.quantization in (None, *QUANTIZATIONS), f"quantization {self.quantization!r} is unknown; choose {', '.join(QUANTIZATIONS)} or leave it unset"),
            (self.quantization is None or self.device.startswith("cpu"), f"quantization {self.quantization} runs on a CPU only; drop it with device {self.device}"),
            (self.quantization != "gguf" or self.model_path is None or str(self.model_path).endswith(".gguf"), f"quantization gguf keeps a GGUF file's blocks; model_path {self.model_path} is not a .gguf file"),
            (self.quantization != "gguf" or self.tp_size == 1, "quantization gguf runs on one rank; drop tp_size or use --quantization int8"),
            (self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}"),
            (self.max_prefill_tokens >= 1, f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}"),
            (_positive_or_none(self.prefill_max_requests), f"prefill_max_requests must be positive, got {self.prefill_max_requests}"),
            (self.hicache_ratio > 0, f"hicache_ratio must be positive, got {self.hicache_ratio}"),
            (self.page_size < 1 or self.hicache_block_tokens >= 1 and self.hicache_block_tokens % self.page_size == 0, f"hicache_block_tokens ({self.hicache_block_tokens}) must be a positive multiple of page_size ({self.page_size})"),
            (not (self.enable_hierarchical_cache and self.disable_radix_cache), "enable_hierarchical_cache needs the radix cache: drop disable_radix_cache"),
            (
                not (self.hicache_storage_backend and self.tp_size > 1),
                "hicache_storage_backend is not supported with tp_size > 1 yet (the host tier is: drop the storage backend)",
            ),
            (self.hicache_storage_backend is None or self.enable_hierarchical_cache, "hicache_storage_backend needs the host tier: add enable_hierarchical_cache"),
            (self.hicache_storage_prefetch_timeout_s > 0, f"hicache_storage_prefetch_timeout_s must be positive, got {self.hicache_storage_prefetch_timeout_s}"),
            (self.hicache_storage_capacity_gb is None or self.hicache_storage_capacity_gb > 0, f"hicache_storage_capacity_gb must be positive, got {self.hicache_storage_capacity_gb}"),
            (_positive_or_none(self.max_total_tokens), f"max_total_tokens must be positive, got {self.max_total_tokens}"),
            (_positive_or_none(self.max_running_requests), f"max_running_requests must be positive, got {self.max_running_requests}"),
            (_positive_or_none(self.context_length), f"context_length must be positive, got {self.context_length}"),
            (self.max_queued_requests is None or self.max_queued_requests >= 0, f"max_queued_requests must be >= 0, got {self.max_queued_requests}"),
            (self.queue_timeout_s is None or self.queue_timeout_s > 0, f"queue_timeout_s must be positive, got {self.queue_timeout_s}"),
            (self.priority_aging_s is None or self.priority_aging_s > 0, f"priority_aging_s must be positive, got {self.priority_aging_s}"),
            (self.cold_lane_share is None or 0.0 < self.cold_lane_share <= 1.0, f"cold_lane_share must be in (0, 1], got {self.cold_lane_share}"),
            (0.0 < self.cold_lane_threshold <= 1.0, f"cold_lane_threshold must be in (0, 1], got {self.cold_lane_threshold}"),
            (
                self.cold_lane_share is None or self.schedule_policy in CACHE_AWARE_POLICIES,
                f"cold_lane_share reorders the cache-aware policies: use schedule_policy {' or '.join(CACHE_AWARE_POLICIES)} (got {self.schedule_policy!r})",
            ),
            (
                self.cold_lane_share is None or self.fairness == "none",
                "cold_lane_share cannot be combined with fairness vtc: VTC reorders the queue after the lane and would void its bounds",
            ),
            (self.default_slo_ttft_ms is None or self.default_slo_ttft_ms > 0, f"default_slo_ttft_ms must be positive, got {self.default_slo_ttft_ms}"),
            (not self.reject_infeasible or self.schedule_policy == "edf", "reject_infeasible estimates the wait in deadline order: use schedule_policy edf"),
            (self.fairness in FAIRNESS, f"fairness {self.fairness!r} is unknown; choose one of {', '.join(FAIRNESS)}"),
            (weights_error is None, str(weights_error)),
            (0.0 < self.schedule_conservativeness, f"schedule_conservativeness must be positive, got {self.schedule_conservativeness}"),
            (self.lpm_fallback_queue_len >= 0, f"lpm_fallback_queue_len must be >= 0, got {self.lpm_fallback_queue_len}"),
            (_positive_or_none(self.core_threads), f"core_threads must be positive, got {self.core_threads}"),
            (self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}"),
            (self.dist_timeout_s > 0, f"dist_timeout_s must be positive, got {self.dist_timeout_s}"),
            (self.dist_init_addr is None or _host_port(self.dist_init_addr), f"dist_init_addr must be host:port, got {self.dist_init_addr!r}"),
            (self.stream_interval >= 1, f"stream_interval must be >= 1, got {self.stream_interval}"),
            (
                self.mem_fraction_static is None or 0.0 < self.mem_fraction_static < 1.0,
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}",
            ),
            (self.kv_cache_dtype in ("auto", "int8") or self.kv_cache_dtype in KV_CACHE_DTYPES and self.dtype == "bfloat16", _kv_cache_dtype_error(self.kv_cache_dtype)),
            (self.kv_cache_dtype != "int8" or self.device.startswith("cpu"), f"kv_cache_dtype int8 runs on a CPU only; drop it with device {self.device}"),
            (self.load_format in LOAD_FORMATS, _load_format_error(self.load_format)),
            (
                not self.chunking_enabled or self.chunked_prefill_size >= self.page_size,
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be at least page_size ({self.page_size})",
            ),
            (
                not (self.enable_mixed_chunk and not self.chunking_enabled),
                "enable_mixed_chunk needs chunked prefill: set chunked_prefill_size to a positive value",
            ),
            (
                not (self.schedule_low_priority_values_first and not self.enable_priority_scheduling),
                "schedule_low_priority_values_first needs enable_priority_scheduling",
            ),
        ]


class EngineConfig(CoreConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting the caller gives: the core's (inherited) and the frontend's and router's own,
    which stay in the caller's process."""

    # False: the engine core (Policy, Adder, Executor, OutputProcessor) runs in its own process,
    # so tokenization, detokenization, streaming and HTTP never share its loop.
    inline_core: bool = False
    # Requests the core process holds beyond max_running_requests (+ max_queued_requests); later
    # ones wait in the frontend, in arrival order, so the core's queue (and its cost) stays bounded.
    core_backlog: int = 4096

    # data parallelism: dp_size engine cores, each a process with its own KV pool, prefix cache
    # and scheduler, behind this frontend's router (api/router/routing.py)
    dp_size: int = 1
    router_policy: RouterPolicy = "cache_aware"
    cache_threshold: float = 0.3  # cache_aware: the match share above which the cache decides
    balance_abs_threshold: int = 64  # cache_aware: imbalanced when the busiest has this many
    balance_rel_threshold: float = 1.5  # requests more than the idlest, and this many times as many

    tokenize_off_loop_chars: int = 4096  # prompts longer than this are tokenized in a thread
    abort_on_priority_when_disabled: bool = False
    # Sampling defaults of chat requests that leave them out: "model" reads generation_config.json
    # (SGLang's default), "openai" keeps temperature 1, top_p 1, ...
    sampling_defaults: SamplingDefaults = "model"
    preferred_sampling_params: dict[str, Any] | None = None  # under every request's own values, as SGLang's
    # The same request gives the same output whatever runs beside it. With no batch-invariant
    # kernels here, every batch holds one request (see `resolved_deterministic`); requests without
    # a seed sample with DETERMINISTIC_SEED, as SGLang's deterministic mode does.
    enable_deterministic_inference: bool = False

    def core(self) -> CoreConfig:
        """The settings that cross to the engine core."""
        return CoreConfig(**{name: getattr(self, name) for name in CoreConfig.__struct_fields__})

    def with_core(self, core: CoreConfig) -> EngineConfig:
        """This config with the core's settings as the core resolved them."""
        return msgspec.structs.replace(self, **msgspec.structs.asdict(core))

    def router(self) -> RouterConfig:
        return RouterConfig(self.router_policy, self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold)

    def resolved_deterministic(self) -> EngineConfig:
        """With enable_deterministic_inference: one request per batch, no prefix cache (a cached
        prefix would change how the rest of a prompt is computed), no mixed batches."""
        if not self.enable_deterministic_inference:
            return self
        return msgspec.structs.replace(self, max_running_requests=1, disable_radix_cache=True, enable_mixed_chunk=False)

    def validation_error(self) -> str | None:
        for ok, message in [*self._core_checks(), *self._frontend_checks()]:
            if not ok:
                return message
        return None

    def _frontend_checks(self) -> list[tuple[bool, str]]:
        preferred_error = _sampling_error(self.preferred_sampling_params)
        router_error = _router_error(self.router_policy, self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold)
        return [
            (self.core_backlog >= 1, f"core_backlog must be >= 1, got {self.core_backlog}"),
            (self.dp_size >= 1, f"dp_size must be >= 1, got {self.dp_size}"),
            (not (self.dp_size > 1 and self.inline_core), "dp_size > 1 runs each replica in its own core process: drop inline_core"),
            (not (self.tp_size > 1 and self.inline_core), "tp_size > 1 runs the ranks beside a core process: drop inline_core"),
            (router_error is None, str(router_error)),
            (self.sampling_defaults in SAMPLING_DEFAULTS, f"sampling_defaults {self.sampling_defaults!r} is unknown; choose one of {', '.join(SAMPLING_DEFAULTS)}"),
            (preferred_error is None, f"preferred_sampling_params: {preferred_error}"),
            (
                not self.enable_deterministic_inference or self.max_running_requests in (None, 1),
                f"enable_deterministic_inference runs one request per batch: drop max_running_requests (got {self.max_running_requests})",
            ),
            (not self.enable_deterministic_inference or not self.enable_mixed_chunk, "enable_deterministic_inference runs one request per batch: drop enable_mixed_chunk"),
        ]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the data-parallel router (api/router/routing.py) picks a replica."""

    policy: RouterPolicy = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 22  # per replica; least recently used prefixes are dropped beyond it

    def __post_init__(self) -> None:
        error = _router_error(self.policy, self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold)
        if error is None and self.max_tree_tokens < 1:
            error = f"router max_tree_tokens must be positive, got {self.max_tree_tokens}"
        if error is not None:
            raise ValueError(error)


def _router_error(policy: str, cache_threshold: float, balance_abs: int, balance_rel: float) -> str | None:
    if policy not in ROUTER_POLICIES:
        return f"router_policy {policy!r} is unknown; choose one of {', '.join(ROUTER_POLICIES)}"
    if not 0.0 <= cache_threshold <= 1.0:
        return f"cache_threshold must be in [0, 1], got {cache_threshold}"
    if balance_abs < 0:
        return f"balance_abs_threshold must be >= 0, got {balance_abs}"
    if balance_rel < 1.0:
        return f"balance_rel_threshold must be >= 1, got {balance_rel}"
    return None

def _kv_cache_dtype_error(name: str) -> str:
    if name in KV_CACHE_DTYPES:
        return f"kv_cache_dtype {name} needs dtype bfloat16: the KV cache holds the model's dtype or int8"
    return f"kv_cache_dtype {name!r} is not supported: the KV pools here hold the model's dtype or int8 rows, no fp8/fp4 KV (use auto or int8)"


def _load_format_error(name: str) -> str:
    return f"load_format {name!r} is not supported: actorserve loads safetensors checkpoint directories and GGUF files ({', '.join(LOAD_FORMATS)})"


def _sampling_error(params: dict[str, Any] | None) -> str | None:
    """Why these are not sampling params (unknown names, out of range), or None."""
    try:
        return msgspec.convert(params or {}, SamplingParams).validation_error()
    except msgspec.ValidationError as exc:
        return str(exc)


def _weights_error(text: str | None) -> str | None:
    try:
        parse_tenant_weights(text)
    except ValueError as exc:
        return str(exc)
    return None


def _positive_or_none(value: int | None) -> bool:
    return value is None or value > 0


def _host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
