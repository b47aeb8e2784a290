"""The model runner: weights, KV memory and attention for one device, one batch at a time.

It takes a `ForwardBatch` whose requests already hold KV slots (the Adder allocates them; the
runner only creates the pools) and returns logits, then sampled token ids.

Attention is `torch` (SDPA, any device) or `flashinfer` (CUDA, half precision); "auto" takes
flashinfer where it can run. On CUDA with flashinfer, decode batches go through CUDA graphs
(gpu/graph_runner.py) unless `disable_cuda_graph`; other batches, and every batch on a CPU, run
eagerly. `init_graph_runner(capture=False)` puts the same padded-bucket runner in front of decode
on any device without capturing (what the CPU tests use).

Under tensor parallelism (`tp`, gpu/tensor_parallel.py) every rank has a runner over its shard:
rank 0's `forward` first sends the batch to the others (gpu/tp_batch.py), which run `serve_ranks`;
the pool size in tokens is the smallest any rank can hold, so one allocator serves every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.attention import AttentionBackend, TorchAttention
from gpu.cpu_decode import CpuDecodeLayers
from gpu.cpu_ops import cpu_kernels
from gpu.flashinfer_backend import AttentionShape, FlashInferAttention, resolve_attention_backend
from gpu.forward_batch import ForwardBatch
from gpu.gguf_linear import GgufBlockSource
from gpu.graph_runner import DecodeGraphRunner, capture_batch_sizes, default_cuda_graph_max_bs
from gpu.kv_pool import KVBuffers, KVMove, ReqToTokenPool, TokenSlotAllocator
from gpu.kv_quant import row_width
from gpu.loader import dtype_name, load_model, resolve_dtype, resolve_model_dir
from gpu.model_config import ModelConfig
from gpu.packed_linear import can_pack, can_quantize, pack_for_cpu
from gpu.sampler import Sampler, SampleResult, SamplingInfo, TokenHistory
from gpu.tensor_parallel import TPGroup, TPLayout
from gpu.tp_batch import BatchChannel, HostMoves

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool size on a CPU when max_total_tokens is not given


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model_path: str | None = None  # None: the default SmolLM2 GGUF model
    dtype: str = "auto"
    device: str = "cpu"
    # "int8": Int8Linear layers (gpu/packed_linear.py); "gguf": GgufLinear layers from the model's
    # GGUF file (gpu/gguf_linear.py); CPU only.
    quantization: str | None = None
    # "int8": the KV pool holds 8-bit rows with their scales (gpu/kv_quant.py; CPU only); else the
    # model's dtype.
    kv_cache_dtype: str = "auto"
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from a memory budget
    max_running_requests: int = 64
    page_size: int = 1
    context_length: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"  # auto | torch | flashinfer
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # None: by GPU memory (SGLang's table), at most max_running_requests
    # On a CPU: attention and the elementwise chains by the compiled kernels (gpu/cpu_ops.py, when
    # they build), linear layers fused and packed for oneDNN (gpu/packed_linear.py). False keeps
    # the plain torch path.
    cpu_kernels: bool = True
    # SGLang's mem_fraction_static: the share of the memory available at start (the device's; RAM
    # on a CPU) that weights and KV pool may take together; None: the fixed budgets below.
    mem_fraction_static: float | None = None


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup = TPGroup()):
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        self.model_dir: Path = resolve_model_dir(config.model_path)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        unsplittable = TPLayout.check(self.model_config, tp.size)
        if unsplittable:
            raise ValueError(unsplittable)
        self.layout = TPLayout(self.model_config, tp.rank, tp.size)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        if config.quantization is not None and not can_quantize(self.device, config.quantization):
            raise ValueError(f"quantization {config.quantization} needs a CPU (and for int8 oneDNN's int8 matmul); device {self.device}")
        if config.kv_cache_dtype == "int8" and self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype int8 is read by the CPU kernels only; device {self.device}")
        available_at_start = available_memory_bytes(self.device) if config.mem_fraction_static is not None else 0
        # Before the weights load: a backend that cannot run here fails fast with the reason.
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device, self.dtype, self.model_config.head_dim)
        self.model = load_model(self.model_dir, self.dtype, self.device, tp)
        self.cpu_kernels = cpu_kernels() if config.cpu_kernels and self.device.type == "cpu" else None
        if config.quantization is not None:
            pack_for_cpu(self.model, config.quantization, self._gguf_blocks(config.quantization))
        elif config.cpu_kernels and can_pack(self.dtype, self.device):
            pack_for_cpu(self.model)
        if self.cpu_kernels is not None:
            self.model.use_cpu_kernels(self.cpu_kernels)
        self.context_len = self._context_len()
        pool_tokens = self._agreed(config.max_total_tokens or self._default_pool_tokens(available_at_start))
        self.allocator = TokenSlotAllocator(pool_tokens, config.page_size, self.device)
        self.req_to_token = ReqToTokenPool(config.max_running_requests, self.context_len, self.device, record_writes=tp.size > 1)
        self.kv = KVBuffers.allocate(
            self.model_config.num_layers, self.allocator.total_slots, self.layout.num_kv_heads, self.model_config.head_dim,
            self.dtype, self.device, int8_rows=config.kv_cache_dtype == "int8",
        )
        self.channel = BatchChannel(tp, self.req_to_token, self.device) if tp.size > 1 else None
        self.host_kv: KVBuffers | None = None  # the host tier's KV for this rank's heads: `host_buffers`
        self.attn: AttentionBackend = self._make_attention()
        self.model.cpu_decode = CpuDecodeLayers.build(self.model, self.attn)
        self.sampler = Sampler(self.cpu_kernels.argmax_rows if self.cpu_kernels is not None else None)
        self.graph_runner: DecodeGraphRunner | None = None
        if self.uses_cuda_graphs:
            self.init_graph_runner(capture=True)

    @property
    def dtype_name(self) -> str:
        """The resolved dtype's name ("bfloat16", never "auto"), as the `dtype` setting spells it."""
        return dtype_name(self.dtype)

    @property
    def uses_cuda_graphs(self) -> bool:
        """CUDA graphs need FlashInfer's fixed-address decode metadata; torch attention's
        metadata changes shape with the longest sequence, so it cannot be captured."""
        return self.device.type == "cuda" and self.attention_backend == "flashinfer" and not self.config.disable_cuda_graph

    def init_graph_runner(self, capture: bool) -> DecodeGraphRunner:
        buckets = capture_batch_sizes(self._cuda_graph_max_bs())
        self.graph_runner = DecodeGraphRunner(self.model, self.attn, buckets, device=self.device, capture=capture)
        return self.graph_runner

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits; for a decode batch on the graph runner, a view valid until the next forward."""
        if self.channel is not None:  # rank 0: the other ranks run the same batch alongside
            self.channel.send(batch)
        return self._forward(batch)

    def serve_ranks(self) -> None:
        """Rank > 0: run every batch (and make every host-tier move) rank 0 sends until it says stop."""
        assert self.channel is not None and self.tp.rank > 0
        while (msg := self.channel.receive()) is not None:
            if isinstance(msg, HostMoves):
                self.kv.move(msg.moves, self.host_buffers(msg.host_slots))
            else:
                self._forward(msg)

    def host_buffers(self, num_slots: int) -> KVBuffers:
        """The host tier's buffers for this rank's heads, allocated at the first call."""
        if self.host_kv is None:
            self.host_kv = self.kv.host_buffers(num_slots)
        return self.host_kv

    def send_moves(self, moves: list[KVMove]) -> None:
        """Rank 0, before its own moves: the other ranks make the same ones in their pools."""
        if self.channel is not None and moves:
            assert self.host_kv is not None
            self.channel.send_moves(HostMoves(moves, self.host_kv.k[0].shape[0]))

    def stop_ranks(self) -> None:
        """Rank 0: let the other ranks' `serve_ranks` return (call when no forward is running)."""
        if self.channel is not None:
            self.channel.send_stop()

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            if batch.layer_loads is not None:  # a captured graph does not go layer by layer
                batch.layer_loads.finish()
            return self.graph_runner.run(batch)
        return self.model(batch, self.attn)

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingInfo,
        *,
        output_ids: TokenHistory | None = None,
        prompt_ids: TokenHistory | None = None,
        steps: Sequence[int] | None = None,
    ) -> SampleResult:
        return self.sampler.sample(logits, info, output_ids=output_ids, prompt_ids=prompt_ids, steps=steps)

    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on this rank (its K/V heads only)."""
        mc = self.model_config
        row_bytes = row_width(mc.head_dim) if self.config.kv_cache_dtype == "int8" else mc.head_dim * torch.finfo(self.dtype).bits // 8
        return 2 * mc.num_layers * self.layout.num_kv_heads * row_bytes

    def _agreed(self, pool_tokens: int) -> int:
        """The pool size every rank can hold (the budget is per rank, the slots shared)."""
        if self.tp.size == 1:
            return pool_tokens
        value = torch.tensor([pool_tokens], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=self.tp.group)
        return int(value.item())

    def _make_attention(self) -> AttentionBackend:
        mc = self.model_config
        scale = mc.head_dim**-0.5
        if self.attention_backend == "torch":
            return TorchAttention(self.kv, self.req_to_token.table, scale=scale, kernels=self.cpu_kernels, dtype=self.dtype)
        shape = AttentionShape(self.layout.num_heads, self.layout.num_kv_heads, mc.head_dim, self.config.page_size, scale)
        return FlashInferAttention(self.kv, self.req_to_token.table, shape, self.context_len)

    def _cuda_graph_max_bs(self) -> int:
        wanted = self.config.cuda_graph_max_bs
        if wanted is None:
            wanted = default_cuda_graph_max_bs(torch.cuda.get_device_properties(self.device).total_memory) if self.device.type == "cuda" else 256
        if wanted < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {wanted}; use --disable-cuda-graph to turn graphs off")
        # A decode batch never has more rows than there are request rows.
        return min(wanted, self.config.max_running_requests)

    def _gguf_blocks(self, quantization: str) -> GgufBlockSource | None:
        if quantization != "gguf":
            return None
        from gpu.gguf_loader import default_model_path  # lazy: only GGUF users pay for importing gguf

        path = default_model_path() if self.config.model_path is None else Path(self.config.model_path).expanduser()
        if path.suffix != ".gguf" or self.tp.size != 1:
            raise ValueError(f"quantization gguf needs a .gguf model file and one rank (model {path}, {self.tp.size} ranks)")
        return GgufBlockSource(path)

    def _context_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        wanted = self.config.context_length or model_max
        if wanted > model_max:
            raise ValueError(f"context_length {wanted} exceeds the model's max_position_embeddings {model_max}")
        return wanted

    def _default_pool_tokens(self, available_at_start: int) -> int:
        budget = self._kv_budget_bytes(available_at_start)
        by_budget = budget // self.kv_bytes_per_token()
        if by_budget < self.config.page_size:
            fraction = self.config.mem_fraction_static
            cure = "free device memory or give max_total_tokens" if fraction is None else f"raise mem_fraction_static ({fraction})"
            raise ValueError(
                f"no room for the KV pool: {max(budget, 0) / 2**20:.1f} MiB left for it beside "
                f"{self.weight_bytes() / 2**30:.2f} GiB of weights; {cure}"
            )
        return min(by_budget, self.config.max_running_requests * self.context_len)

    def _kv_budget_bytes(self, available_at_start: int) -> int:
        """KV pool bytes. With mem_fraction_static f, SGLang's rule: what is available now, less
        the (1 - f) share of what was available at start; on a CPU, whose available RAM moves with
        every other process, now = at start - the weights' bytes, so the pool is f x start - weights."""
        fraction = self.config.mem_fraction_static
        if fraction is None:
            return int(torch.cuda.mem_get_info(self.device)[0] * 0.8) if self.device.type == "cuda" else CPU_KV_BUDGET_BYTES
        now = available_memory_bytes(self.device) if self.device.type == "cuda" else available_at_start - self.weight_bytes()
        return int(now - available_at_start * (1.0 - fraction))

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (and buffers) as loaded."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation can take: free device memory on CUDA; on a CPU, the kernel's
    MemAvailable (what SGLang reads there too, through psutil)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
