"""SGLang 0.5.7's own scheduling code, loaded without its package, for the differential test
(tests/test_sglang_differential.py).

`make setup` installs the wheel with `--no-deps`. Importing `sglang.srt.managers.schedule_policy`
the normal way would run package `__init__`s that need CUDA, triton and zmq, so `load()` executes
only the files that decide, under their own module names, with small stand-ins registered in
`sys.modules` while they load (and removed afterwards, so nothing else sees a fake `sglang`):

- whole files, unchanged: `mem_cache/cache_init_params.py`, `mem_cache/evict_policy.py`,
  `mem_cache/base_prefix_cache.py`, `mem_cache/radix_cache.py`, `managers/schedule_policy.py`
  (SchedulePolicy, PrefillAdder, RadixCache, TreeNode);
- single functions, compiled from their source text with `ast` (their modules import the GPU
  stack at import time): `Req.init_next_round_input`, `Req.set_extend_input_len`,
  `Req.reset_for_retract`, `Req.pop_committed_kv_cache`, `Req.pop_overallocated_kv_cache`,
  `ScheduleBatch.new_page_count_next_decode`, `check_decode_mem`, `retract_decode`,
  `release_req`, `_is_available_size_sufficient`, `batch_size`, `is_empty`, and
  `mem_cache/common.py`'s `evict_from_tree_cache` and `release_kv_cache`; they become methods
  of the slim `SglReq` and `SglBatch` below, which carry only the fields those functions read;
- `environ.py`'s defaults (SGLANG_RETRACT_DECODE_STEPS, the new_token_ratio settings), read
  from its source.

Re-stated, not SGLang's code (scheduler.py cannot be loaded: it is the whole server):
`SglBatch.filter_batch` (keeps the listed rows; the tensors it also filters do not exist here)
and, in the test, the scheduler's loop around `PrefillAdder` (`get_new_batch_prefill`), its
new_token_ratio arithmetic, and `alloc_for_extend`'s one eviction per batch.

The tree's clock: `radix_cache.time` is replaced by `LogicalClock`, so access times are counts,
not wall time (two calls in the same microsecond would otherwise tie at random).
"""

from __future__ import annotations

import __future__
import ast
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SGLANG_VERSION = "0.5.7"


def sglang_root() -> Path | None:
    """The installed `sglang` package directory, if it is version 0.5.7."""
    try:
        if importlib.metadata.version("sglang") != SGLANG_VERSION:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


class LogicalClock:
    """Stands in for the `time` module inside radix_cache.py: every reading is a later tick."""

    def __init__(self) -> None:
        self.now = 0

    def monotonic(self) -> int:
        self.now += 1
        return self.now

    def perf_counter(self) -> float:
        return 0.0  # eviction metrics only


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """The fields of SGLang's ServerArgs that the loaded functions read."""

    schedule_low_priority_values_first: bool = False
    page_size: int = 1
    speculative_algorithm: str | None = None
    speculative_eagle_topk: int | None = None
    disaggregation_mode: str = "null"


class _EnvValue:
    def __init__(self, value: int | float) -> None:
        self.value = value

    def get(self) -> int | float:
        return self.value


def env_defaults(srt: Path) -> dict[str, int | float]:
    """The `NAME = EnvInt(default)` / `EnvFloat(default)` settings of sglang/srt/environ.py."""
    out: dict[str, int | float] = {}
    for node in ast.walk(ast.parse((srt / "environ.py").read_text())):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id in ("EnvInt", "EnvFloat")
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
        ):
            out[node.targets[0].id] = node.value.args[0].value
    return out


def _envs(defaults: dict[str, int | float]) -> types.SimpleNamespace:
    """SGLang's `envs` object: each setting's `.get()` gives its default."""
    return types.SimpleNamespace(**{name: _EnvValue(value) for name, value in defaults.items()})


class _SpecAlgorithm:
    def is_none(self) -> bool:
        return True


@dataclass(slots=True)
class SglSamplingParams:
    max_new_tokens: int
    ignore_eos: bool = False


@dataclass(slots=True)
class _TimeStats:
    wait_queue_entry_time: float = 0.0


@dataclass(eq=False)
class SglReq:
    """SGLang's Req, with only what the loaded functions read; its methods are SGLang's own
    (attached by `load`)."""

    rid: str
    origin_input_ids: list[int]
    sampling_params: SglSamplingParams
    output_ids: list[int] = field(default_factory=list)
    priority: int = 0
    extra_key: str | None = None
    time_stats: _TimeStats = field(default_factory=_TimeStats)
    return_logprob: bool = False
    logprob_start_len: int = -1
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    last_host_node: Any = None
    host_hit_length: int = 0
    mamba_branching_seqlen: Any = None
    extend_input_len: int = 0
    extend_logprob_start_len: int = 0
    cache_protected_len: int = 0
    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    kv_committed_freed: bool = False
    kv_overallocated_freed: bool = False
    is_retracted: bool = False
    retracted_stain: bool = False
    retraction_count: int = 0
    multimodal_inputs: Any = None
    is_chunked: int = 0

    def is_dllm(self) -> bool:
        return False

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


class SglReqToTokenPool:
    """Rows of KV slot indices, as SGLang's ReqToTokenPool keeps them (`req_to_token[row, pos]`)."""

    def __init__(self, rows: int, context_len: int) -> None:
        self.req_to_token = torch.zeros(rows, context_len, dtype=torch.int64)
        self.freed: list[int] = []

    def write(self, index: tuple[int, slice], values: torch.Tensor) -> None:
        self.req_to_token[index] = values

    def free(self, row: int) -> None:
        self.freed.append(row)


@dataclass(eq=False)
class SglBatch:
    """SGLang's ScheduleBatch, with only what the retraction functions read; its methods are
    SGLang's own (attached by `load`), except `filter_batch`."""

    reqs: list[SglReq]
    tree_cache: Any
    token_to_kv_pool_allocator: Any
    req_to_token_pool: SglReqToTokenPool
    enable_overlap: bool = False
    is_hybrid_swa: bool = False
    spec_algorithm: _SpecAlgorithm = field(default_factory=_SpecAlgorithm)

    def filter_batch(self, keep_indices: list[int]) -> None:
        # Re-stated: SGLang's also filters the batch tensors, which this stand-in has none of.
        self.reqs = [self.reqs[i] for i in keep_indices]


@dataclass(frozen=True, slots=True)
class SGLang:
    """The loaded code: `schedule_policy` and `radix_cache` modules, the clock of the tree."""

    schedule_policy: types.ModuleType
    radix_cache: types.ModuleType
    clock: LogicalClock
    env: dict[str, int | float]  # environ.py's defaults, e.g. SGLANG_RETRACT_DECODE_STEPS
    evict_from_tree_cache: Any  # mem_cache/common.py's: what every allocation evicts first
    release_kv_cache: Any

    def radix_cache_of(self, allocator: Any, page_size: int, eviction_policy: str = "lru", disable: bool = False) -> Any:
        params = self.radix_cache.CacheInitParams(
            disable=disable,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            eviction_policy=eviction_policy,
        )
        return self.radix_cache.RadixCache(params)

    def key(self, token_ids: list[int], extra_key: str | None = None) -> Any:
        return self.radix_cache.RadixKey(token_ids=list(token_ids), extra_key=extra_key)


def _package(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package with no files: only what is registered can be imported
    return module


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _empty_class(name: str) -> type:
    return type(name, (), {})


def _unused(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError("a code path the differential test does not use (EAGLE, KV events, hybrid pools)")


def _stand_ins() -> dict[str, types.ModuleType]:
    packages = [
        "sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.mem_cache", "sglang.srt.layers",
        "sglang.srt.layers.attention", "sglang.srt.layers.attention.nsa", "sglang.srt.disaggregation",
        "sglang.srt.metrics",
    ]
    modules = {name: _package(name) for name in packages}
    stubs = [
        _stub("sglang.srt.mem_cache.utils", convert_to_bigram_key=_unused),
        _stub(
            "sglang.srt.disaggregation.kv_events",
            AllBlocksCleared=_unused, BlockRemoved=_unused, BlockStored=_unused,
        ),
        _stub("sglang.srt.mem_cache.hicache_storage", get_hash_str=_unused, hash_str_to_int64=_unused),
        _stub(
            "sglang.srt.mem_cache.allocator",
            BaseTokenToKVPoolAllocator=_empty_class("BaseTokenToKVPoolAllocator"),
            SWATokenToKVPoolAllocator=_empty_class("SWATokenToKVPoolAllocator"),
        ),
        _stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=SglReqToTokenPool),
        _stub("sglang.srt.metrics.collector", RadixCacheMetricsCollector=_unused),
        _stub("sglang.srt.layers.attention.nsa.utils", is_nsa_enable_prefill_cp=lambda: False),
        _stub("sglang.srt.managers.schedule_batch", Req=SglReq, ScheduleBatch=SglBatch),
        _stub("sglang.srt.mem_cache.mamba_radix_cache", MambaRadixCache=_empty_class("MambaRadixCache")),
        _stub("sglang.srt.server_args", ServerArgs=ServerArgs),
    ]
    modules.update((m.__name__, m) for m in stubs)
    return modules


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _functions(path: Path, owner: str | None, names: Iterable[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Compile the named functions of `path` (methods of class `owner`, or top-level ones when
    None) from their source text, with `namespace` as their globals."""
    wanted = set(names)
    tree = ast.parse(path.read_text(), filename=str(path))
    body = tree.body
    if owner is not None:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == owner).body
    defs = [node for node in body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    missing = wanted - {node.name for node in defs}
    assert not missing, f"{path.name} has no {sorted(missing)}: not SGLang {SGLANG_VERSION}?"
    for node in defs:
        node.decorator_list = []  # @property and the like are re-applied by the stand-in classes
    module = ast.Module(body=defs, type_ignores=[])
    flags = __future__.annotations.compiler_flag
    exec(compile(module, str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return {name: namespace[name] for name in wanted}


def load() -> SGLang | None:
    """SGLang's scheduling code, or None when the 0.5.7 wheel is not installed."""
    root = sglang_root()
    if root is None:
        return None
    srt = root / "srt"
    saved = {name: sys.modules.get(name) for name in list(sys.modules) if name == "sglang" or name.startswith("sglang.")}
    stand_ins = _stand_ins()
    sys.modules.update(stand_ins)
    loaded: list[str] = []
    try:
        for name in ("cache_init_params", "evict_policy", "base_prefix_cache", "radix_cache"):
            _exec_file(f"sglang.srt.mem_cache.{name}", srt / "mem_cache" / f"{name}.py")
            loaded.append(f"sglang.srt.mem_cache.{name}")
        radix_cache = sys.modules["sglang.srt.mem_cache.radix_cache"]
        policy = _exec_file("sglang.srt.managers.schedule_policy", srt / "managers" / "schedule_policy.py")
        loaded.append("sglang.srt.managers.schedule_policy")
    finally:
        for name in [*stand_ins, *loaded]:
            sys.modules.pop(name, None)
        sys.modules.update({name: module for name, module in saved.items() if module is not None})
    clock = LogicalClock()
    radix_cache.time = clock  # type: ignore[attr-defined]
    env = env_defaults(srt)
    common = _common_functions(srt, radix_cache)
    _attach_methods(srt, radix_cache, common, env)
    return SGLang(policy, radix_cache, clock, env, common["evict_from_tree_cache"], common["release_kv_cache"])


def _common_functions(srt: Path, radix_cache: types.ModuleType) -> dict[str, Any]:
    chunk_cache = _empty_class("ChunkCache")
    namespace: dict[str, Any] = {
        "torch": torch,
        "SWAChunkCache": chunk_cache,
        "ChunkCache": chunk_cache,
        "get_global_server_args": ServerArgs,  # no speculation: its defaults are what is read
        "ceil_align": lambda x, y: -(-x // y) * y,
        "BasePrefixCache": radix_cache.BasePrefixCache,
    }
    return _functions(srt / "mem_cache" / "common.py", None, ("evict_from_tree_cache", "release_kv_cache"), namespace)


def _attach_methods(srt: Path, radix_cache: types.ModuleType, common: dict[str, Any], env: dict[str, int | float]) -> None:
    path = srt / "managers" / "schedule_batch.py"
    namespace: dict[str, Any] = {
        "torch": torch,
        "RadixKey": radix_cache.RadixKey,
        "MambaRadixCache": _empty_class("MambaRadixCache"),
        "get_global_server_args": ServerArgs,
        "envs": _envs(env),
        "ServerArgs": ServerArgs,
        **common,
    }
    req_methods = (
        "init_next_round_input", "set_extend_input_len", "reset_for_retract",
        "pop_committed_kv_cache", "pop_overallocated_kv_cache",
    )
    for name, fn in _functions(path, "Req", req_methods, dict(namespace)).items():
        setattr(SglReq, name, fn)
    batch_methods = (
        "new_page_count_next_decode", "check_decode_mem", "retract_decode", "release_req",
        "_is_available_size_sufficient", "batch_size", "is_empty",
    )
    for name, fn in _functions(path, "ScheduleBatch", batch_methods, dict(namespace)).items():
        setattr(SglBatch, name, fn)
