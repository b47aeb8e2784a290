"""gpu/tiny_model.py: the checkpoints load in transformers, are deterministic, and are useful
(varied greedy output, round-tripping tokenizer, ChatML template)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu.tiny_model import (
    ARCHS,
    EOS_TOKEN,
    PAD_TOKEN,
    add_cli_arguments,
    make_tiny_model,
    run_cli,
)

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def model_dir(arch: str, tiny_model_factory) -> Path:
    return tiny_model_factory(arch)


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in CHECKPOINT_FILES}


def test_loads_in_transformers(arch: str, model_dir: Path) -> None:
    assert all((model_dir / name).is_file() for name in CHECKPOINT_FILES)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert model.config.vocab_size == 512
    assert model.dtype == torch.float32


def test_arch_specific_parameters_are_nontrivial(arch: str, model_dir: Path) -> None:
    """A loader that skips qwen2's biases or qwen3's q/k norms must produce different logits."""
    tensors = load_file(model_dir / "model.safetensors")
    biases = [t for name, t in tensors.items() if name.endswith("_proj.bias")]
    qk_norm_names = ("q_norm.weight", "k_norm.weight")
    qk_norms = [t for name, t in tensors.items() if name.endswith(qk_norm_names)]
    assert bool(biases) == (arch == "qwen2")
    assert bool(qk_norms) == (arch == "qwen3")
    assert all(t.abs().min() > 0 for t in biases)
    assert len(qk_norms) in (0, 2 * 2)  # q and k norm in each of the 2 layers
    assert all((t - 1).abs().max() > 0.1 for t in qk_norms)


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path) -> None:
    a = _file_bytes(make_tiny_model(tmp_path / "a", "qwen3", seed=1))
    b = _file_bytes(make_tiny_model(tmp_path / "b", "qwen3", seed=1))
    c = _file_bytes(make_tiny_model(tmp_path / "c", "qwen3", seed=2))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    # The tokenizer depends on the vocabulary size only.
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_greedy_generation_varies(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
    # min_new_tokens: a random model may emit EOS at any step; we want all 32.
    out = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    new_tokens = out[0, prompt.shape[1] :].tolist()
    assert len(new_tokens) == 32
    assert len(set(new_tokens)) >= 8, new_tokens


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading spaces\tand\ttabs\n",
        "Grüße, 你好, 🙂🚀, Ξεσκεπάζω",
        "x" * 300,
    ],
)
def test_tokenizer_round_trips(tiny_llama: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer.encode(text)
    assert max(ids) < 512
    assert tokenizer.decode(ids) == text


def test_tokenizer_is_trained_to_vocab_size(tiny_model_factory) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_factory("llama", vocab_size=1024))
    assert len(tokenizer) == 1024
    # Merges were learned: common words are single tokens, not bytes.
    assert len(tokenizer.encode(" the")) == 1


def test_special_tokens_and_eos_match_config(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.bos_token is None
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.eos_token_id
    assert config["pad_token_id"] == tokenizer.pad_token_id
    # Special tokens are single ids and are never split by the pre-tokenizer.
    assert tokenizer.encode("a<|im_start|>b<|im_end|>").count(tokenizer.eos_token_id) == 1


def test_chat_template_is_chatml(tiny_qwen2: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ids["input_ids"] == tokenizer.encode(text)


def test_tied_embeddings_and_bfloat16(tiny_model_factory) -> None:
    path = tiny_model_factory("llama", tie_word_embeddings=True, dtype="bfloat16")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_custom_head_dim(tiny_model_factory) -> None:
    """llama and qwen3 may decouple head_dim from hidden_size / num_heads."""
    path = tiny_model_factory("qwen3", hidden_size=48, num_heads=4, num_kv_heads=1, head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32
    assert model.model.layers[0].self_attn.k_proj.out_features == 32


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        ("gpt2", {}, "unknown arch 'gpt2'; supported: llama, qwen2, qwen3"),
        ("llama", {"num_heads": 4, "num_kv_heads": 3}, "must be divisible by num_kv_heads"),
        ("llama", {"vocab_size": 100}, "vocab_size must be at least 259"),
        ("llama", {"hidden_size": 0}, "hidden_size must be positive"),
        ("llama", {"head_dim": 15}, "head_dim must be even"),
        ("llama", {"dtype": "int8"}, "unknown dtype 'int8'"),
        ("qwen2", {"head_dim": 32}, "qwen2 needs hidden_size == num_heads * head_dim"),
    ],
)
def test_bad_flags_raise_clear_errors(
    tmp_path: Path, arch: str, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make_tiny_model(tmp_path / "m", arch, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "m").exists()  # validated before anything is written


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return parser.parse_args(argv)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    args = _parse([str(out), "--arch", "qwen2", "--seed", "3", "--num-layers", "1"])
    assert run_cli(args) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1

    assert run_cli(_parse([str(tmp_path / "bad"), "--arch", "llama", "--num-kv-heads", "3"])) == 2
    assert "divisible by num_kv_heads" in capsys.readouterr().err


def test_cli_requires_arch(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _parse([str(tmp_path)])


async def test_async_tests_run_on_uvloop() -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
