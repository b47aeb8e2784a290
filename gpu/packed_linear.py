"""Linear layers with weights reordered once for oneDNN, on a CPU.

`F.linear` on a CPU reorders the weight into oneDNN's blocked layout inside every call; doing it
once at load time makes decode (a few rows) about 2x faster and batches of 64 rows about 15%
(bench/forward.py's shapes, bfloat16). q/k/v and gate/up are also fused into one matmul each, which
reads the input once and makes one larger call instead of several small ones.

`pack_for_cpu(model)` rewrites a loaded `CausalLM` in place: the fused and packed weights replace
the modules' own (so memory does not double), and the model's forward takes the packed path
wherever a module has one. Only float32 and bfloat16 are packed (oneDNN's CPU formats).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE = (torch.float32, torch.bfloat16)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    # oneDNN refuses to reorder bfloat16 weights on CPUs without its bf16 instructions (AVX2 only).
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """y = x W^T + b with W reordered for oneDNN; the concatenation of one or more layers'."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        super().__init__()
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None), persistent=False)
        bias = None if all(b is None for b in biases) else torch.cat([b if b is not None else weight.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def packed_from(*layers: nn.Module) -> PackedLinear:
    return PackedLinear([layer.weight.detach() for layer in layers], [_bias(layer) for layer in layers])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedLinear | None) -> torch.Tensor:
    return packed(x) if packed is not None else F.linear(x, weight, bias)


def pack_for_cpu(model: nn.Module) -> None:
    """Fuse and pack every linear layer of a loaded CausalLM (gpu/models.py)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv = packed_from(attn.q_proj, attn.k_proj, attn.v_proj)
        attn.o_proj.packed = _packed_row_parallel(attn.o_proj)
        mlp.gate_up = packed_from(mlp.gate_proj, mlp.up_proj)
        mlp.down_proj.packed = _packed_row_parallel(mlp.down_proj)
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            _drop_weight(module)
    # The output layer gets its own packed copy when tied: the embedding lookup needs the plain rows.
    head = model.output_weight()
    model.packed_head = PackedLinear([head.detach()], [None])
    if not model.config.tie_word_embeddings:
        _drop_weight(model.lm_head)


def _packed_row_parallel(layer: nn.Module) -> PackedLinear:
    """Under tensor parallelism the bias is added once, after the all-reduce, not by each rank."""
    return PackedLinear([layer.weight.detach()], [_bias(layer) if layer.tp.size == 1 else None])


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return None if layer.bias is None else layer.bias.detach()


def _drop_weight(module: nn.Module) -> None:
    """Free a module's own weight once a packed copy replaces it (the bias stays: row-parallel
    layers still add theirs)."""
    module.weight = nn.Parameter(module.weight.detach().new_empty(0), requires_grad=False)
