"""Finding and loading model weights: Hugging Face checkpoint directories and GGUF files.

A GGUF file is converted once into a cached checkpoint directory (gpu/gguf_loader.py), so after
`resolve_model_dir` every model is a directory with config.json, safetensors and tokenizer files.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu.model_config import ModelConfig
from gpu.models import CausalLM

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_model_dir(model_path: str | Path | None) -> Path:
    """A checkpoint directory for a directory, a `.gguf` file, or None (the default model)."""
    from gpu import gguf_loader  # lazy: only GGUF users pay for importing gguf

    path = gguf_loader.default_model_path() if model_path is None else Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model path {path} is a file but not a .gguf file; give a checkpoint directory or a GGUF file")
        return gguf_loader.gguf_to_hf_dir(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on CUDA and float32 on a CPU (half types are slow there)."""
    if name == "auto":
        name = config.dtype if device.type == "cuda" else "float32"
        name = name if name in DTYPES else "float32"
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _progress(_checkpoint_tensors(model_dir), model_dir):
        if name not in expected:
            continue  # e.g. lm_head.weight of a tied checkpoint, rotary inv_freq buffers
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{model_dir}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, assign=True, strict=True)
    model.init_rotary(device)
    return model.eval()


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir} has no *.safetensors weights")
    return files


def _progress(items: Iterator[tuple[str, torch.Tensor]], model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    return tqdm(items, desc=f"loading {model_dir.name}", unit=" tensors", disable=not sys.stderr.isatty(), leave=False)


def load_tokenizer(model_dir: Path):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    return AutoTokenizer.from_pretrained(str(model_dir))
