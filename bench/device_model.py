"""A cost model of one forward step on a GPU, for benchmarks that run the real actors on a CPU.

`bench.overhead.NullDevice` sleeps `DeviceModel.step_s(batch.prefix_lens, batch.extend_lens)` per
step, so scheduling workloads see GPU-scale step times (on h100-qwen3-8b: 66 ms for a 2,048-token
prefill chunk, 8.4 ms for a decode step of 64 requests at 512 tokens of context) without a GPU.
The model is a roofline, per GPU (tensor parallelism splits weights, heads and FLOPs evenly over
`tp` GPUs):

    step = launch                                        fixed per step (launches, sampling, sync)
         + max(weight bytes / bandwidth,                 every weight is read once per step ...
               2 * weights * tokens / FLOP/s)            ... and multiplied by every token in it
         + context tokens * K/V bytes per token / bandwidth   each row reads its whole context
         + prefill attention FLOPs / FLOP/s              the quadratic term (rows extending > 1)

tokens = sum(extend_lens) (a decode row extends by 1); context = sum(prefix_len + extend_len).
Bandwidth and FLOP/s are the datasheet peaks times an efficiency (`bandwidth_eff`, `mfu`).
Decode rows' attention is memory-bound: its FLOPs hide under the K/V read and are not added.
Not modelled: tensor-parallel all-reduce bandwidth (folded into a lower `mfu` and a larger
`launch_s` for the TP preset), the sampler's vocabulary pass, quantization, CPU time (that is
what the real actors spend).

Sanity checks of h100-qwen3-8b against public numbers (Llama-3-8B is the same size: 32 layers,
8 KV heads, ~7.5B weights read per step):
- decode, batch 1, 1k context: 6.6 ms (152 tok/s); single-stream bf16 8B models on an H100 SXM
  with vLLM or SGLang are commonly reported at 6-7 ms per token (~150 tok/s).
- decode, batch 64 / 256 at ShareGPT-like contexts (~300 tokens): 7.7 / 12.8 ms, 20k tok/s of
  decode alone at 256. An offline run of 1,000 ShareGPT prompts on Llama-3.1-8B-Instruct, H100,
  bf16 measured 16.2k output tok/s with SGLang (research.aimultiple.com "inference-engines"),
  prefill included: the same order, the model a little optimistic, as a roofline is. At 1k
  context the K/V read grows to 38 GB per step at batch 256: 10.4 / 23.7 ms.
- prefill of 8,192 tokens: 292 ms (28k tok/s: 2 * 7.57B * 8192 FLOPs at 50% of 989 TFLOP/s, plus
  14% for causal attention); H100 prefill of 8B models at 40-60% MFU is the usual range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """Step-time model of one model on one GPU kind; architecture numbers are the whole model's
    (as its config.json gives them), device numbers are one GPU's."""

    name: str
    description: str
    # --- the model (config.json) ---
    weight_params: float  # weights every step reads in full and every token multiplies by:
    # all but the input embedding table (a step gathers only its tokens' rows); a tied table is
    # read in full as the LM head, so it counts.
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    # --- the device (datasheet) ---
    peak_flops: float  # dense bf16 tensor FLOP/s of one GPU
    bandwidth: float  # memory bytes/s of one GPU
    tp: int  # GPUs the model is split over (tensor parallel): each holds 1/tp of everything
    # --- what real kernels reach (assumptions, see each preset) ---
    mfu: float  # fraction of peak_flops in compute-bound GEMMs and prefill attention
    bandwidth_eff: float  # fraction of bandwidth in memory-bound decode (GEMV, paged K/V reads)
    launch_s: float  # fixed cost per step: kernel launches or graph replay, sampling, host sync
    dtype_bytes: int = 2  # bf16 weights and K/V
    # Host -> device copies (the host tier's loads, cache/host_tier.py): PCIe Gen5 x16 is 64 GB/s
    # each way (H100 SXM datasheet: 128 GB/s both ways); pinned copies reach about 80% of it.
    host_link_bytes_per_s: float = 64e9 * 0.8
    # Storage -> host reads (the storage tier's hits, cache/storage_tier.py): one PCIe Gen4 x4 NVMe
    # SSD, whose link carries 16 GT/s x 4 lanes x 128/130 / 8 = 7.88 GB/s (drives of that generation
    # list up to ~7 GB/s of sequential reads; a block of 64 tokens is 9.4 MB here, a sequential
    # read); 80% of the link, as for the host link.
    storage_read_bytes_per_s: float = 7.88e9 * 0.8

    def __post_init__(self) -> None:
        positive = (self.weight_params, self.layers, self.q_heads, self.kv_heads, self.head_dim, self.peak_flops, self.bandwidth, self.tp, self.launch_s, self.dtype_bytes, self.host_link_bytes_per_s, self.storage_read_bytes_per_s)
        if min(positive) <= 0:
            raise ValueError(f"{self.name}: every constant must be positive")
        if not (0 < self.mfu <= 1 and 0 < self.bandwidth_eff <= 1):
            raise ValueError(f"{self.name}: efficiencies are fractions in (0, 1]")
        if self.kv_heads % self.tp or self.q_heads % self.tp:
            raise ValueError(f"{self.name}: tp={self.tp} must divide the heads")

    # --- derived per-GPU rates ---

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.mfu

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth * self.bandwidth_eff

    @property
    def weight_read_s(self) -> float:
        """One full read of this GPU's weights: the floor of every step."""
        return self.weight_params / self.tp * self.dtype_bytes / self.bytes_per_s

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one context token, all layers, on one GPU."""
        return 2 * self.layers * (self.kv_heads // self.tp) * self.head_dim * self.dtype_bytes

    def attention_flops(self, prefix_len: float, extend_len: float) -> float:
        """Causal attention of `extend_len` new tokens over `prefix_len` cached ones, on one GPU:
        query i sees prefix_len + i + 1 keys; QK^T and PV are 2 FLOPs per multiply-add each."""
        pairs = extend_len * prefix_len + extend_len * (extend_len + 1) / 2
        return 4 * self.layers * (self.q_heads // self.tp) * self.head_dim * pairs

    # --- step time ---

    def time_s(self, tokens: float, context_tokens: float, prefill_attention_flops: float = 0.0) -> float:
        """The roofline from aggregates (fractional means allowed, for the capacity estimate)."""
        compute_s = 2 * self.weight_params / self.tp * tokens / self.flops_per_s
        kv_s = context_tokens * self.kv_bytes_per_token / self.bytes_per_s
        return self.launch_s + max(self.weight_read_s, compute_s) + kv_s + prefill_attention_flops / self.flops_per_s

    def step_s(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> float:
        """Seconds one forward step of these rows takes (a `Batch`'s prefix_lens, extend_lens)."""
        tokens = sum(extend_lens)
        context = tokens + sum(prefix_lens)
        attention = sum(self.attention_flops(p, e) for p, e in zip(prefix_lens, extend_lens) if e > 1)
        return self.time_s(tokens, context, attention)

    def host_load_s(self, tokens: int) -> float:
        """Seconds to copy `tokens` tokens of K/V from host memory to this GPU."""
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_per_s

    def storage_read_s(self, tokens: int) -> float:
        """Seconds to read `tokens` tokens of K/V from the storage tier's disk into host memory."""
        return tokens * self.kv_bytes_per_token / self.storage_read_bytes_per_s

    # --- steady-state throughput ---

    def decode_tokens_per_s(self, running: int, context_len: float) -> float:
        """Tokens per second of `running` requests decoding together at `context_len` each."""
        return running / self.time_s(running, running * context_len)

    def requests_per_s(self, prompt_len: float, output_len: float, running: int) -> float:
        """Requests per second with `running` requests in flight, each with `prompt_len` uncached
        prompt tokens and `output_len` output tokens: their prompts prefill as one extend step
        (chunking it costs about the same once it is compute-bound), the first token comes from
        it, then output_len - 1 decode steps at the mean context prompt_len + output_len / 2.
        An upper bound: the runtime's CPU and a batch that is not always full cost more."""
        prefill_s = self.time_s(running * prompt_len, running * prompt_len, running * self.attention_flops(0, prompt_len))
        decode_steps = max(output_len - 1, 0)
        mean_context = prompt_len + output_len / 2
        decode_s = decode_steps * self.time_s(running, running * mean_context)
        return running / (prefill_s + decode_s)


# --- presets ---------------------------------------------------------------------------------------
#
# GPUs (NVIDIA datasheets; dense, without sparsity):
H100_SXM_BF16_FLOPS = 989e12  # H100 SXM5 datasheet: BF16 tensor core 1,979 TFLOP/s with sparsity -> 989 dense
H100_SXM_HBM_BYTES = 3.35e12  # H100 SXM5 datasheet: HBM3 3.35 TB/s
A10G_BF16_FLOPS = 70e12  # AWS G5's A10G: 70 TFLOP/s BF16 tensor (Baseten "A10 vs A10G"; NVIDIA's A10 datasheet: 125)
A10G_GDDR6_BYTES = 600e9  # A10 / A10G: 24 GB GDDR6, 600 GB/s (NVIDIA A10 datasheet; the A10G shares it)

# Weights read per step, from each config.json (hidden h, intermediate f, layers L, heads q/kv,
# head_dim d, vocab V): per layer q,o = 2*h*q*d, k,v = 2*h*kv*d, MLP = 3*h*f; plus the LM head V*h.
# Qwen3-8B: h 4096, f 12288, L 36, q 32, kv 8, d 128, V 151936, untied:
#   36 * (2*4096*4096 + 2*4096*1024 + 3*4096*12288) = 6.95e9, + LM head 0.62e9 = 7.57e9
#   (8.19e9 with the input table: the model card's "8.2B, 6.95B non-embedding").
QWEN3_8B_WEIGHTS = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288) + 151936 * 4096
# Llama-3-70B: h 8192, f 28672, L 80, q 64, kv 8, d 128, V 128256, untied:
#   80 * (2*8192*8192 + 2*8192*1024 + 3*8192*28672) = 68.45e9, + LM head 1.05e9 = 69.5e9 (70.6e9 in all).
LLAMA3_70B_WEIGHTS = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) + 128256 * 8192
# Qwen3-0.6B: h 1024, f 3072, L 28, q 16, kv 8, d 128, V 151936, tied (the table is the LM head):
#   28 * (2*1024*2048 + 2*1024*1024 + 3*1024*3072) = 0.44e9, + table 0.16e9 = 0.60e9 (the card's 0.6B).
QWEN3_0_6B_WEIGHTS = 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072) + 151936 * 1024

DEVICE_MODELS: dict[str, DeviceModel] = {
    m.name: m
    for m in (
        DeviceModel(
            name="h100-qwen3-8b",
            description="Qwen3-8B bf16 on one H100 SXM (36 layers, 8 KV heads: 144 KiB of K/V per token)",
            weight_params=QWEN3_8B_WEIGHTS, layers=36, q_heads=32, kv_heads=8, head_dim=128,
            peak_flops=H100_SXM_BF16_FLOPS, bandwidth=H100_SXM_HBM_BYTES, tp=1,
            mfu=0.5,  # bf16 prefill GEMMs + FlashAttention on H100: 40-60% of dense peak
            bandwidth_eff=0.75,  # decode GEMV / paged-attention kernels: 70-80% of HBM peak
            launch_s=0.5e-3,  # CUDA-graph replay, sampling and the host sync of a step
        ),
        DeviceModel(
            name="h100-llama3-70b-tp4",
            description="Llama-3-70B bf16 over four H100 SXM, tensor parallel (80 layers, 2 KV heads per GPU)",
            weight_params=LLAMA3_70B_WEIGHTS, layers=80, q_heads=64, kv_heads=8, head_dim=128,
            peak_flops=H100_SXM_BF16_FLOPS, bandwidth=H100_SXM_HBM_BYTES, tp=4,
            mfu=0.45,  # lower than one GPU: 2 all-reduces per layer of every token's hidden state
            bandwidth_eff=0.75,
            launch_s=1.5e-3,  # 160 all-reduces per step at ~5-10 us of NVLink latency each
        ),
        DeviceModel(
            name="a10g-qwen3-0.6b",
            description="Qwen3-0.6B bf16 on one A10G (AWS G5; 28 layers, 8 KV heads: 112 KiB of K/V per token)",
            weight_params=QWEN3_0_6B_WEIGHTS, layers=28, q_heads=16, kv_heads=8, head_dim=128,
            peak_flops=A10G_BF16_FLOPS, bandwidth=A10G_GDDR6_BYTES, tp=1,
            mfu=0.5,  # small GEMMs (h 1024) on Ampere: assume the same 50%
            bandwidth_eff=0.7,  # GDDR6 and small kernels: a little below HBM's share
            launch_s=0.4e-3,  # 28 layers of launches (fewer than the 8B's 36) plus sampling
            host_link_bytes_per_s=32e9 * 0.8,  # A10G: PCIe Gen4 x16, 32 GB/s each way
        ),
    )
}
