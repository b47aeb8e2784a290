"""Finding and loading model weights: Hugging Face checkpoint directories and GGUF files.

A GGUF file is converted once into a cached checkpoint directory (gpu/gguf_loader.py), so after
`resolve_model_dir` every model is a directory with config.json, safetensors and tokenizer files.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu.model_config import ModelConfig
from gpu.models import CausalLM
from gpu.tensor_parallel import SliceReader, TPGroup, TPLayout

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

logger = logging.getLogger(__name__)

# torch.cpu.get_capabilities() keys for bfloat16 arithmetic in hardware: x86 AMX and AVX-512 BF16,
# ARM FEAT_BF16 and SVE BF16.
CPU_BF16_FEATURES = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")


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


def cpu_bf16_features() -> tuple[str, ...] | None:
    """The native-bfloat16 features torch detects on this CPU (`torch.cpu.get_capabilities()`,
    cpuinfo underneath), () if none, or None where this torch cannot say."""
    get_capabilities = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if get_capabilities is None:
        return None
    try:
        caps: Mapping[str, object] = get_capabilities()
    except Exception:  # noqa: BLE001 - an unanswerable query means "do not know", i.e. float32
        return None
    return tuple(f for f in CPU_BF16_FEATURES if caps.get(f) is True)


def choose_dtype(name: str, device_type: str, checkpoint_dtype: str, cpu_bf16: tuple[str, ...] | None) -> tuple[str, str]:
    """(dtype name, why) for the `dtype` setting `name`; pure, so it is testable on any machine.
    Names other than 'auto' are returned as given: `resolve_dtype` rejects unsupported ones."""
    if name != "auto":
        return name, "as configured"
    if device_type == "cuda":
        if checkpoint_dtype in DTYPES:
            return checkpoint_dtype, "the checkpoint's dtype"
        return "float32", f"the checkpoint's dtype {checkpoint_dtype!r} is not supported"
    if device_type != "cpu":
        return "float32", f"the default on a {device_type} device"
    if cpu_bf16:
        return "bfloat16", f"the CPU computes bfloat16 natively ({', '.join(cpu_bf16)})"
    if cpu_bf16 is None:
        return "float32", "torch cannot tell whether the CPU computes bfloat16 natively"
    return "float32", "the CPU has no native bfloat16 arithmetic (emulated bfloat16 is slower than float32)"


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The weights and KV dtype for the `dtype` setting (see `choose_dtype`); logs the choice and why."""
    cpu_bf16 = cpu_bf16_features() if name == "auto" and device.type == "cpu" else ()
    chosen, why = choose_dtype(name, device.type, config.dtype, cpu_bf16)
    if chosen not in DTYPES:
        raise ValueError(f"unsupported dtype {chosen!r}; supported: auto, {', '.join(DTYPES)}")
    logger.info("dtype %s -> %s on %s: %s", name, chosen, device.type, why)
    return DTYPES[chosen]


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name `dtype` settings use."""
    return str(dtype).removeprefix("torch.")


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = TPGroup()) -> CausalLM:
    """The model on `device`; under tensor parallelism, this rank's shard, each tensor read only
    as far as the shard needs (safetensors slices)."""
    config = ModelConfig.from_dir(model_dir)
    layout = TPLayout(config, tp.rank, tp.size)
    with torch.device("meta"):
        model = CausalLM(config, tp)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for name, reader in _progress(_checkpoint_tensors(model_dir), model_dir):
        if name not in expected:
            continue  # e.g. lm_head.weight of a tied checkpoint, rotary inv_freq buffers
        tensor = layout.shard(name, reader)
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{model_dir}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, assign=True, strict=True)
    model.init_rotary(device)
    return model.eval()


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, SliceReader]]:
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, SliceReader(f.get_slice(name))


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir} has no *.safetensors weights")
    return files


def _progress(items: Iterator[tuple[str, SliceReader]], model_dir: Path) -> Iterator[tuple[str, SliceReader]]:
    return tqdm(items, desc=f"loading {model_dir.name}", unit=" tensors", disable=not sys.stderr.isatty(), leave=False)


def load_tokenizer(model_dir: Path):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    return AutoTokenizer.from_pretrained(str(model_dir))
