"""The model hyperparameters the runtime needs, read from a Hugging Face `config.json`.

Both transformers 4.x keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x keys
(`rope_parameters`, `dtype`) are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

# architectures name -> family; the families share one model definition (gpu/models.py)
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class RopeConfig(msgspec.Struct, frozen=True):
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | dynamic (treated as default within the trained length)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (always on for Qwen2)
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str  # the checkpoint's own dtype name, e.g. "bfloat16"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(raw)
        family = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            o_proj_bias=family == "llama" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory: it has no config.json")
        return cls.from_dict(json.loads(path.read_text()))


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(names) if names else f"model_type={raw.get('model_type')!r}"
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise ValueError(f"unsupported model architecture {shown}; supported: {supported}")


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # 5.x: rope_parameters holds theta and scaling together; 4.x: rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3", "dynamic"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, dynamic")
    original = merged.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
    )
