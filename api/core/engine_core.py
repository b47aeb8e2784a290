"""The engine core: Policy, Adder, Executor and OutputProcessor over one ModelRunner.

Built the same way in the caller's process (`Engine(inline_core=True)`) and in a process of its
own (api/core/process.py). Its peers reach it through the Policy's and the Adder's mailboxes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from actors.adder import Adder
from actors.executor import Executor, ModelStepRunner, StepRunner
from actors.grammar import GrammarCompiler
from actors.output import OutputProcessor
from actors.policy import Policy
from api.frontend.receiver import ModelLimits
from api.launch import check_load_format, load_tokenizer
from cache import ChunkCache, PrefixCache, RadixCache
from cache.host_tier import HostTier
from cache.storage_tier import KVLayout, StorageTier
from gpu.loader import resolve_model_dir
from gpu.model_config import ModelConfig
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.tensor_parallel import TPLayout
from gpu.torch_threads import TorchThreads, yield_cores_to_serving
from gpu.tp_ranks import Rendezvous, TPRanks
from runtime.actor import Actor, Mailbox
from runtime.config import CoreConfig
from runtime.messages import AdderMsg, Batch, PolicyMsg, StepOut
from runtime.stats import CoreStats
from runtime.stream import StepOutbox

DEFAULT_MAX_RUNNING_REQUESTS = 256


@dataclass(slots=True)
class Core:
    config: CoreConfig  # resolved against the model: no "auto", no None sizes
    runner: ModelRunner
    tokenizer: Any
    prefix_cache: PrefixCache
    policy: Policy
    adder: Adder
    executor: Executor
    output: OutputProcessor
    tp_ranks: TPRanks | None = None  # tensor parallelism: ranks 1.. beside this one (rank 0)

    @property
    def actors(self) -> list[Actor]:
        return [self.policy, self.adder, self.executor, self.output]

    @property
    def limits(self) -> ModelLimits:
        runner = self.runner
        return ModelLimits(runner.context_len, runner.vocab_size, runner.allocator.size, self.config.page_size)

    def stats(self) -> CoreStats:
        adder = self.adder.stats()
        aborted = adder.pop("aborted") + self.policy.aborted
        return CoreStats(
            **adder,
            aborted=aborted,
            num_waiting=len(self.policy.waiting),
            num_compiling=len(self.policy.compiling),
            rejected=self.policy.rejected,
            queue_timeouts=self.policy.timed_out,
            deadline_infeasible=self.policy.infeasible,
            tenant_service=dict(self.policy.fairness.counters) if self.policy.fairness is not None else {},
            generated_tokens=self.output.generated_tokens,
            forward_steps=self.executor.steps,
            forward_s=self.executor.forward_s,
            loop_cpu_s=time.thread_time(),
            time=time.monotonic(),
            actor_cpu_s={actor.name: actor.cpu_s for actor in self.actors},
        )


class CoreSetup(msgspec.Struct, frozen=True):
    """How a benchmark or a test changes the core, in the process that holds it (plain data: it
    crosses to a core process). Functions are named "module:name". `step_runner` is called as
    step_runner(model_runner, **step_runner_kwargs) for the Executor's StepRunner in place of the
    model (a simulated device, a test double); `function` as function(core, **kwargs) on the
    wired core, before its actors start. The storage tier's writes are the step runner's: a
    `step_runner` that takes `storage=` (the tier, or None), writes its blocks and closes it says
    so with `step_runner_storage`; under any other, no storage tier is built."""

    function: str | None = None
    kwargs: dict[str, Any] = {}
    step_runner: str | None = None
    step_runner_kwargs: dict[str, Any] = {}
    step_runner_storage: bool = False

    def writes_storage(self) -> bool:
        return self.step_runner is None or self.step_runner_storage

    def make_step_runner(self, runner: ModelRunner, storage: StorageTier | None = None) -> StepRunner | None:
        if self.step_runner is None:
            return None
        tiers = {"storage": storage} if self.step_runner_storage else {}
        return _named(self.step_runner)(runner, **tiers, **self.step_runner_kwargs)

    def apply(self, core: Core) -> None:
        if self.function is not None:
            _named(self.function)(core, **self.kwargs)


def _named(function: str) -> Any:
    module, name = function.split(":", 1)
    return getattr(importlib.import_module(module), name)


async def load_core(config: CoreConfig, outbox: StepOutbox | None = None, setup: CoreSetup | None = None) -> Core:
    """Load the model (in a thread: it takes seconds) and wire the core's actors (not started).
    `outbox`: in a process of its own, where the core's outputs go to the frontend."""
    check_load_format(config.load_format, config.model_path)
    if config.random_seed is not None:
        torch.manual_seed(config.random_seed)  # requests without a seed draw from torch's generator
    threads = TorchThreads.current(config.core_threads)
    # The forward's one thread loads the model too: no other thread's torch ops (gpu/torch_threads.py).
    forward = ThreadPoolExecutor(1, thread_name_prefix="actorserve-forward")
    if config.tp_size == 1:
        runner, tp_ranks = await asyncio.get_running_loop().run_in_executor(forward, _load_runner, config, threads), None
    else:
        runner, tp_ranks = await _load_tensor_parallel(config)
    tokenizer = await asyncio.to_thread(load_tokenizer, config, runner.model_dir)
    cfg = msgspec.structs.replace(
        config, dtype=runner.dtype_name, context_length=runner.context_len, max_total_tokens=runner.allocator.size,
        max_running_requests=runner.req_to_token.max_requests,
    )
    prefix_cache = _prefix_cache(cfg, runner)
    tiered = isinstance(prefix_cache, RadixCache) and prefix_cache.host_tier is not None
    storage = _storage_tier(cfg, runner) if tiered and (setup is None or setup.writes_storage()) else None
    chosen = setup.make_step_runner(runner, storage) if setup is not None else None
    if storage is not None:
        prefix_cache.host_tier.persist = True  # type: ignore[union-attr]
    grammars = GrammarCompiler(tokenizer, runner.vocab_size, runner.model_config.eos_token_ids)
    # Every edge of the core, in one place (the README's diagram shows the messages on them):
    #   Policy -Ranked-> Adder -Batch-> Executor -StepOut-> OutputProcessor -StepDone-> Adder
    #   Adder -Pull/Requeue/Served-> Policy; the Receiver (or the core-process link) -Enqueue/Wake-> both
    to_policy: Mailbox[PolicyMsg] = Mailbox()
    to_adder: Mailbox[AdderMsg] = Mailbox()
    to_executor: Mailbox[Batch] = Mailbox()
    to_output: Mailbox[StepOut] = Mailbox()
    policy = Policy(cfg, prefix_cache, grammars, inbox=to_policy, adder=to_adder, storage=storage)
    adder = Adder(cfg, runner, prefix_cache, inbox=to_adder, policy=to_policy, executor=to_executor, storage=storage)
    host_slots = prefix_cache.host_tier.allocator.total_slots if isinstance(prefix_cache, RadixCache) and prefix_cache.host_tier else 0
    step_runner = ModelStepRunner(runner, host_slots, storage, threads) if chosen is None else chosen
    executor = Executor(step_runner, inbox=to_executor, output=to_output, worker=forward)
    # Inline, the core streams text; in a process of its own, token ids the frontend detokenizes.
    output = OutputProcessor(
        tokenizer, runner.model_config.eos_token_ids, cfg.stream_interval, outbox, inbox=to_output, adder=to_adder,
    )
    core = Core(cfg, runner, tokenizer, prefix_cache, policy, adder, executor, output, tp_ranks)
    if setup is not None:
        setup.apply(core)
    return core


def _load_runner(config: CoreConfig, threads: TorchThreads) -> ModelRunner:
    if torch.device(config.device).type == "cpu":
        yield_cores_to_serving()
    threads.claim()
    return ModelRunner(runner_config(config))


async def _load_tensor_parallel(config: CoreConfig) -> tuple[ModelRunner, TPRanks]:
    """Start ranks 1.. and load rank 0's shard; a rank that dies meanwhile fails the start at once."""
    model_dir = await asyncio.to_thread(resolve_model_dir, config.model_path)  # a GGUF file converts once, here
    unsplittable = TPLayout.check(ModelConfig.from_dir(model_dir), config.tp_size)
    if unsplittable:
        raise ValueError(unsplittable)
    rendezvous = Rendezvous.choose(config.dist_init_addr, config.tp_size, config.device, config.dist_timeout_s)
    ranks = TPRanks(rendezvous, dataclasses.replace(runner_config(config), model_path=str(model_dir)), config.core_threads)
    loop = asyncio.get_running_loop()
    # Not the loop's default executor: if a rank dies, rank 0 stays blocked joining the group,
    # and the default executor's threads are joined when the loop closes.
    pool = ThreadPoolExecutor(1, thread_name_prefix="actorserve-tp-load")
    loading = loop.run_in_executor(pool, ranks.load)
    pool.shutdown(wait=False)  # its one task runs on; the thread ends with it
    exited = asyncio.ensure_future(ranks.wait_exit())
    await asyncio.wait([loading, exited], return_when=asyncio.FIRST_COMPLETED)
    if exited.done():
        ranks.close(graceful=False)
        raise RuntimeError(f"{exited.result()} while the model was loading (its error is in the log above)")
    exited.cancel()
    try:
        return loading.result(), ranks
    except BaseException:
        ranks.close(graceful=False)
        raise


def runner_config(cfg: CoreConfig) -> RunnerConfig:
    return RunnerConfig(
        model_path=cfg.model_path,
        dtype=cfg.dtype,
        device=cfg.device,
        quantization=cfg.quantization,
        kv_cache_dtype="int8" if cfg.kv_cache_dtype == "int8" else "auto",
        max_total_tokens=cfg.max_total_tokens,
        max_running_requests=cfg.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        page_size=cfg.page_size,
        context_length=cfg.context_length,
        attention_backend=cfg.attention_backend,
        disable_cuda_graph=cfg.disable_cuda_graph,
        cuda_graph_max_bs=cfg.cuda_graph_max_bs,
        mem_fraction_static=cfg.mem_fraction_static,
    )


def _storage_tier(cfg: CoreConfig, runner: ModelRunner) -> StorageTier | None:
    """SGLang's HiCache L3 over files; its directory is per model identity (the model's files,
    dtype and KV layout), so another model never reads these blocks."""
    if cfg.hicache_storage_backend is None:
        return None
    model_dir = runner.model_dir.resolve()
    files = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json", ".bin", ".gguf")
    )
    kv = runner.kv
    layout = KVLayout(len(kv.k), kv.k[0].shape[1], kv.k[0].shape[2], kv.k[0].dtype)
    identity = {"model": str(model_dir), "files": files, "dtype": runner.dtype_name}
    return StorageTier(
        cfg.hicache_storage_dir, identity, layout, cfg.hicache_block_tokens,
        cfg.hicache_storage_prefetch_policy, cfg.hicache_storage_prefetch_timeout_s,
        capacity_bytes=None if cfg.hicache_storage_capacity_gb is None else int(cfg.hicache_storage_capacity_gb * 1e9),
    )


def _prefix_cache(cfg: CoreConfig, runner: ModelRunner) -> PrefixCache:
    if cfg.disable_radix_cache:
        return ChunkCache(runner.allocator)
    host_tier = None
    if cfg.enable_hierarchical_cache:
        host_tier = HostTier(int(runner.allocator.size * cfg.hicache_ratio), cfg.hicache_block_tokens, cfg.page_size, cfg.hicache_write_policy)
    return RadixCache(runner.allocator, page_size=cfg.page_size, eviction_policy=cfg.radix_eviction_policy, host_tier=host_tier)
