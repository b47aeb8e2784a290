"""SmoothQuant (Xiao et al. 2023) for `--quantization int8`: activation outliers moved into the weights.

Int8Linear quantizes each token with one scale, its largest |value| / 127. A few input channels of
the RMSNorm-fed projections (q/k/v, gate/up) and of down_proj carry values far larger than the
rest, so they set that scale and the other channels keep only a few levels. Dividing input channel
j by s_j and multiplying the weights' column j by s_j leaves the product unchanged and evens the
channels out; s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) trades activation range for weight range.
The division folds into what produces the input, so a step costs nothing more: the RMSNorm weight
in front of q/k/v and gate/up, and up_proj's rows in front of down_proj (down's input is
silu(gate) * up, linear in up). Scales are rounded to powers of two: multiplying and dividing by
them is exact in bfloat16, so the fold itself changes no value, and up_proj's int8 rows (one scale
per row) quantize exactly as before.

max|X_j| comes from one forward of the unquantized model over a fixed calibration sequence of
seeded random token ids: the same for every model, with no tokenizer needed (the runner has none),
and it measured as good as English text (BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention import AttentionBackend
from gpu.forward_batch import ForwardBatch

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0


@dataclass(frozen=True, slots=True)
class SmoothingAlphas:
    """Migration strength per projection input, chosen on SmolLM2-135M from 0.3/0.5/0.75/0.9
    (down also 0.4/0.6/0.7) by the logit error of that site's layers alone in int8 (BENCHMARKS.md)."""

    qkv: float = 0.75
    gate_up: float = 0.5
    down: float = 0.5


class CausalAttention(AttentionBackend):
    """Causal attention over one new sequence with no KV cache: all a calibration forward needs."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        assert len(batch.extend_lens) == 1 and batch.prefix_lens == [0], "one new sequence only"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        heads_first = [t.transpose(0, 1) for t in (q, k, v)]
        return F.scaled_dot_product_attention(*heads_first, is_causal=True, enable_gqa=True).transpose(0, 1)


def calibration_ids(vocab_size: int, tokens: int = CALIBRATION_TOKENS, seed: int = CALIBRATION_SEED) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (tokens,), generator=generator).tolist()


@contextmanager
def _recording_input_peaks(modules: list[nn.Module], peaks: list[torch.Tensor]) -> Iterator[None]:
    """Append each module's per-input-channel max |input| to `peaks`, in `modules` order (each
    module runs once in the calibration forward)."""

    def record(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        peaks.append(column_peaks(args[0]))

    handles = [m.register_forward_pre_hook(record) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def column_peaks(matrix: torch.Tensor) -> torch.Tensor:
    """max |matrix[:, j]| for each column j, in float32."""
    return matrix.detach().abs().amax(dim=0).float()


def input_channel_peaks(model: nn.Module, ids: list[int]) -> list[torch.Tensor]:
    """max |input| per channel of each layer's q_proj, gate_proj and down_proj, in that order:
    [q_0, gate_0, down_0, q_1, ...] (q/k/v share q's input, gate/up gate's)."""
    watched = [m for layer in model.model.layers for m in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.down_proj)]
    peaks: list[torch.Tensor] = []
    batch = ForwardBatch.build([ids], [0], [0], torch.arange(len(ids)), model.output_weight().device)
    with _recording_input_peaks(watched, peaks):
        model(batch, CausalAttention())
    if len(peaks) != len(watched):
        raise RuntimeError(f"calibration saw {len(peaks)} projection inputs, expected {len(watched)}")
    return peaks


def smoothing_scales(act_peak: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) over the input channels j, as the nearest power of two."""
    weight_peak = torch.stack([column_peaks(w) for w in weights]).amax(dim=0)
    floor = 1e-5  # a channel that is zero throughout keeps a finite scale
    scales = act_peak.clamp(min=floor).pow(alpha) / weight_peak.clamp(min=floor).pow(1 - alpha)
    return scales.log2().round().exp2()


@torch.no_grad()
def _fold(producers: list[torch.Tensor], consumers: list[torch.Tensor], scales: torch.Tensor) -> None:
    """Channel j of each producer (dim 0: a norm weight, up_proj's rows and bias) divided by s_j,
    column j of each consumer weight multiplied by it."""
    for tensor in producers:
        tensor.div_(scales.view(-1, *[1] * (tensor.dim() - 1)).to(tensor.dtype))
    for weight in consumers:
        weight.mul_(scales.to(weight.dtype))


def smooth(model: nn.Module, alphas: SmoothingAlphas = SmoothingAlphas()) -> None:
    """Fold SmoothQuant scales into every decoder layer of a loaded, not yet packed CausalLM."""
    peaks = input_channel_peaks(model, calibration_ids(model.config.vocab_size))
    for i, layer in enumerate(model.model.layers):
        for alpha, producers, consumers, peak in _sites(layer, alphas):
            _fold(producers, consumers, smoothing_scales(peaks[3 * i + peak], consumers, alpha))


Site = tuple[float, list[torch.Tensor], list[torch.Tensor], int]


def _sites(layer: nn.Module, alphas: SmoothingAlphas) -> list[Site]:
    """(alpha, producers, consumer weights, index of the input's peaks within the layer's three)."""
    attn, mlp = layer.self_attn, layer.mlp
    up = [t for t in (mlp.up_proj.weight, mlp.up_proj.bias) if t is not None]
    return [
        (alphas.qkv, [layer.input_layernorm.weight], [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0),
        (alphas.gate_up, [layer.post_attention_layernorm.weight], [mlp.gate_proj.weight, mlp.up_proj.weight], 1),
        (alphas.down, up, [mlp.down_proj.weight], 2),
    ]
