"""Decode batches on a CPU: every decoder layer in one call.

At batch 1 the kernels of a decode step do little work each, and calling ~450 of them from Python
cost about a third of SmolLM2-135M's int8 step. `CpuDecodeLayers` hands the whole stack of layers
to gpu/csrc/decode_layers.cpp, which makes the same kernel calls in the same order from C++: the
result is the modules' own, bit for bit. `CausalLM.forward` (gpu/models.py) takes it for a batch
that `inputs` accepts and runs its modules for any other.

It covers the compiled CPU kernels with one tensor-parallel rank and no per-head q/k norm
(Qwen3's), decode batches whose attention is the plain paged decode (no shared prefix to merge, no
host-tier loads to wait for layer by layer), and linear layers (gpu/packed_linear.py) that are
either all PackedLinears (oneDNN, float32 or bfloat16), all Int8Linears (our int8 kernel where
the CPU has AVX512-VNNI or AVX2, else oneDNN's) or all GgufLinears on their kernel
(gpu/gguf_linear.py), at any batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpu.attention import AttentionBackend, TorchAttention
from gpu.forward_batch import ForwardBatch
from gpu.gguf_linear import GgufLinear
from gpu.packed_linear import CpuLinear, Int8Linear, PackedLinear, int8_kernels
from gpu.paged_attention import PagedDecode

if TYPE_CHECKING:
    from gpu.models import CausalLM


# gpu/csrc/decode_layers.cpp's LinearKind: the class every linear layer of the model must be.
LINEAR_KINDS: dict[type, int] = {PackedLinear: 0, Int8Linear: 1, GgufLinear: 2}


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """What one decode step passes besides the hidden states."""

    out_cache_loc: torch.Tensor  # [batch] int64, contiguous
    paged: PagedDecode


class CpuDecodeLayers:
    def __init__(self, layers: torch.ScriptObject, attn: TorchAttention):
        self._layers = layers
        self._attn = attn

    @classmethod
    def build(cls, model: CausalLM, attn: AttentionBackend) -> CpuDecodeLayers | None:
        """The model's layers as one call over `attn`'s KV pool, or None where the model, the
        attention backend or this CPU is not covered."""
        if not isinstance(attn, TorchAttention) or attn.kernels is None or attn.req_to_token.device.type != "cpu":
            return None
        if model.tp.size != 1 or model.config.qk_norm or model.rotary is None or model.rotary.kernels is None:
            return None
        kind = type(model.model.layers[0].self_attn.qkv)
        if kind not in LINEAR_KINDS:
            return None
        weights: list[torch.Tensor] = []
        out_features: list[int] = []
        code_bits: list[int] = []
        for layer in model.model.layers:
            self_attn, mlp = layer.self_attn, layer.mlp
            linears = [self_attn.qkv, self_attn.o_proj.packed, mlp.gate_up, mlp.down_proj.packed]
            if not all(_takes(m, kind) for m in linears) or layer.kernels is None:
                return None
            weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            eps = layer.input_layernorm.eps
            for m in linears:
                weights += _linear_weights(m)
                out_features.append(0 if kind is PackedLinear else m.out_features)  # 0: the packed weight's rows
                code_bits += [m.bits] if isinstance(m, GgufLinear) else []
        if int8_kernels() is None:  # the extension that holds DecodeLayers did not build here
            return None
        attn0 = model.model.layers[0].self_attn
        dims = [attn0.num_heads, attn0.num_kv_heads, attn0.head_dim]
        rotary = model.rotary
        layers = torch.classes.actorserve.DecodeLayers(
            LINEAR_KINDS[kind], weights, out_features, code_bits, dims, [eps, attn.scale], rotary.cos, rotary.sin, attn.kv.k, attn.kv.v
        )
        return cls(layers, attn)

    def inputs(self, batch: ForwardBatch, attn: AttentionBackend) -> DecodeInputs | None:
        """This step's inputs, or None when the batch is not one this path covers."""
        if attn is not self._attn or batch.layer_loads is not None:
            return None
        plan = self._attn.plain_paged_decode()
        return None if plan is None else DecodeInputs(plan[1], plan[0])

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, step: DecodeInputs) -> None:
        """Apply every layer to `hidden` ([batch, hidden], contiguous) in place."""
        paged = step.paged
        self._layers.run(hidden, positions, step.out_cache_loc, self._attn.req_to_token, paged.req_rows, paged.key_begin, paged.key_end)


def _takes(linear: object, kind: type) -> bool:
    if type(linear) is not kind:
        return False
    if isinstance(linear, Int8Linear):
        return linear.kernels is not None
    return not isinstance(linear, GgufLinear) or linear.kernel


def _linear_weights(m: CpuLinear) -> list[torch.Tensor]:
    """decode_layers.cpp's six tensors of a linear layer (an empty one: none)."""
    none = torch.empty(0)
    bias = m.bias if m.bias is not None else none
    if isinstance(m, PackedLinear):
        return [none, none, none, bias, m.weight, none]
    if isinstance(m, GgufLinear):
        return [m.weight, m.scale, m.minimum, bias, none, none]
    if m.kernel is None:
        return [none, none, m.weight_scale, bias, m.weight, m.weight_zero_point]
    return [m.kernel_weight, m.kernel_offsets, m.weight_scale, bias, none, none]
