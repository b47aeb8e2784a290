"""The model runner: weights, KV memory and attention for one device, one batch at a time.

It takes a `ForwardBatch` whose requests already hold KV slots (the Adder allocates them; the
runner only creates the pools) and returns logits, then sampled token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.attention import AttentionBackend, TorchAttention
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVBuffers, ReqToTokenPool, TokenSlotAllocator
from gpu.loader import load_model, resolve_dtype, resolve_model_dir
from gpu.model_config import ModelConfig
from gpu.sampler import Sampler, SampleResult, SamplingInfo

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool size on a CPU when max_total_tokens is not given


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model_path: str | None = None  # None: the default SmolLM2 GGUF model
    dtype: str = "auto"
    device: str = "cpu"
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from a memory budget
    max_running_requests: int = 64
    page_size: int = 1
    context_length: int | None = None  # None: the model's max_position_embeddings


class ModelRunner:
    def __init__(self, config: RunnerConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.model_dir: Path = resolve_model_dir(config.model_path)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.model = load_model(self.model_dir, self.dtype, self.device)
        self.context_len = self._context_len()
        pool_tokens = config.max_total_tokens or self._default_pool_tokens()
        self.allocator = TokenSlotAllocator(pool_tokens, config.page_size, self.device)
        self.req_to_token = ReqToTokenPool(config.max_running_requests, self.context_len, self.device)
        mc = self.model_config
        self.kv = KVBuffers.allocate(
            mc.num_layers, self.allocator.total_slots, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )
        self.attn: AttentionBackend = TorchAttention(self.kv, self.req_to_token.table, scale=mc.head_dim**-0.5)
        self.sampler = Sampler()

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.attn)

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingInfo,
        *,
        output_ids: Sequence[Sequence[int]] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        steps: Sequence[int] | None = None,
    ) -> SampleResult:
        return self.sampler.sample(logits, info, output_ids=output_ids, prompt_ids=prompt_ids, steps=steps)

    def kv_bytes_per_token(self) -> int:
        mc = self.model_config
        return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * torch.finfo(self.dtype).bits // 8

    def _context_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        wanted = self.config.context_length or model_max
        if wanted > model_max:
            raise ValueError(f"context_length {wanted} exceeds the model's max_position_embeddings {model_max}")
        return wanted

    def _default_pool_tokens(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.8)
        else:
            budget = CPU_KV_BUDGET_BYTES
        by_budget = budget // self.kv_bytes_per_token()
        return max(self.config.page_size, min(by_budget, self.config.max_running_requests * self.context_len))
