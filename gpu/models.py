"""One decoder-only transformer for the Llama, Qwen2 and Qwen3 families.

The families differ only in switches read from `ModelConfig`: q/k/v biases (Qwen2, or Llama with
`attention_bias`), per-head q/k RMSNorm before RoPE (Qwen3), and tied embeddings. Parameter names
follow Hugging Face's, so a checkpoint's state dict loads as it is. Under tensor parallelism each
rank builds the same modules with its shard's shapes (`TPLayout`, gpu/tensor_parallel.py).

On a CPU the model runner fuses and packs the linear layers (gpu/packed_linear.py) and hands the
modules the compiled one-pass kernels (`use_cpu_kernels`, gpu/cpu_ops.py); each module keeps its
plain torch code, which is the reference path everywhere else.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention import AttentionBackend
from gpu.cpu_decode import CpuDecodeLayers
from gpu.cpu_ops import CpuKernels
from gpu.forward_batch import ForwardBatch
from gpu.model_config import ModelConfig, RopeConfig
from gpu.packed_linear import CpuLinear, linear
from gpu.tensor_parallel import TPGroup, TPLayout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: CpuKernels | None = None  # gpu/cpu_ops.py: the same math in one pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.is_contiguous():
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 like the reference implementation, then scale in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the middle band blended.
    original = rope.original_max_position_embeddings or 8192
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up per token (half-split rotation layout)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(rope, head_dim))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.kernels: CpuKernels | None = None  # gpu/cpu_ops.py: rotates q and k in place

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None:
            self.kernels.rope_(q, positions, self.cos, self.sin)
            self.kernels.rope_(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across ranks: each rank's partial product is
    all-reduced, then the bias (held whole by every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp
        self.packed: CpuLinear | None = None  # gpu/packed_linear.py; holds the bias when tp.size == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, self.packed)
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary slice; ids outside it contribute zeros, and
    the all-reduce sums the one rank that holds each id."""

    def __init__(self, layout: TPLayout, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_shard, hidden_size))
        self.start = layout.vocab_start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, layout: TPLayout, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(q_size, hidden, config.o_proj_bias, tp)
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv: CpuLinear | None = None  # q, k and v in one packed matmul (gpu/packed_linear.py)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: AttentionBackend
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(hidden).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = attn.forward(q, k, v, self.layer_id)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup):
        super().__init__()
        inter = layout.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, tp)
        self.gate_up: CpuLinear | None = None  # gate and up in one packed matmul (gpu/packed_linear.py)
        self.kernels: CpuKernels | None = None  # gpu/cpu_ops.py: SiLU and multiply in one pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(self.gate_up(x)))
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, layout: TPLayout, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(config, layer_id, layout, tp)
        self.mlp = MLP(config, layout, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.kernels: CpuKernels | None = None  # gpu/cpu_ops.py: the residual add fused into the norm

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: AttentionBackend
    ) -> torch.Tensor:
        delta = self.self_attn(self.input_layernorm(hidden), positions, rotary, attn)
        if self.kernels is None:
            hidden = hidden + delta
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        # In place: `hidden` is this forward's own activation (the embedding's or the last layer's).
        norm = self.post_attention_layernorm
        normed = self.kernels.add_rms_norm_(hidden, delta.contiguous(), norm.weight, norm.eps)
        return hidden.add_(self.mlp(normed))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, layout, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`model.*` and `lm_head` as in Hugging Face checkpoints; rotary tables built separately."""

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = config
        self.tp = tp
        layout = TPLayout(config, tp.rank, tp.size)
        self.model = DecoderModel(config, layout, tp)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, layout.vocab_shard, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.packed_head: CpuLinear | None = None  # the output layer packed (gpu/packed_linear.py)
        # Every layer of a CPU decode batch in one call (gpu/cpu_decode.py), set by the runner.
        self.cpu_decode: CpuDecodeLayers | None = None

    def init_rotary(self, device: torch.device | str) -> None:
        """Build the RoPE tables; separate from __init__ so the model can be created on `meta`."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings).to(device)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        assert self.rotary is not None, "call init_rotary() first"
        self.rotary.kernels = kernels
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, DecoderLayer)):
                module.kernels = kernels

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits for each request's last new token ([batch, vocab]), for every new token, or for
        the tokens `batch.logit_index` picks."""
        assert self.rotary is not None, "call init_rotary() before forward()"
        attn.init_forward_metadata(batch)
        hidden = self.model.embed_tokens(batch.input_ids)
        fast = self.cpu_decode.inputs(batch, attn) if self.cpu_decode is not None else None
        if fast is not None:
            self.cpu_decode.run(hidden, batch.positions, fast)
        else:
            hidden = self._layers(hidden, batch, attn)
        if batch.logit_index is not None:
            hidden = hidden[batch.logit_index]
        elif not batch.return_all_logits:
            hidden = hidden[batch.last_token_index()]
        hidden = self.model.norm(hidden)
        logits = self.packed_head(hidden) if self.packed_head is not None else F.linear(hidden, self.output_weight())
        if self.tp.size == 1:
            return logits
        return self.tp.gather_last_dim(logits)[:, : self.config.vocab_size]

    def _layers(self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        loads = batch.layer_loads
        for i, layer in enumerate(self.model.layers):
            if loads is not None:
                loads.ready(i)
            hidden = layer(hidden, batch.positions, self.rotary, attn)
        return hidden
