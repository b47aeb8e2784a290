"""Tiny random-weight Hugging Face checkpoints for tests and smoke runs.

`make_tiny_model(dir, "llama" | "qwen2" | "qwen3")` (or `actorserve make-tiny-model`) writes a
directory that transformers loads offline.

Why the weights are not transformers' default init: with std 0.02 a random model greedily repeats
one token, which hides scheduling and sampling bugs. With std 0.15 outputs vary and the top-1/top-2
logit gaps stay far above fp32 noise, so greedy parity tests against transformers are stable.
Biases (qwen2) and norm weights (qwen3's q/k norms included) are random around their neutral
value, so a loader that drops a bias or a norm produces visibly different logits.

Everything is a pure function of the arguments (and the installed torch / tokenizers /
transformers versions): the same seed gives the same files byte for byte. The tokenizer depends
only on `vocab_size`, never on the seed.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal, get_args

# torch, transformers and tokenizers are imported inside the functions that use them: they take
# seconds to import, and the actorserve CLI imports this module just to build its --help.
if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

Arch = Literal["llama", "qwen2", "qwen3"]
ARCHS: tuple[str, ...] = get_args(Arch)
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")  # names of torch dtypes

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trained first, so they get ids 0, 1, 2 in this order.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
EOS_TOKEN = IM_END
_NUM_BYTES = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + _NUM_BYTES

# Measured at the default sizes over 16 seeds, 32 greedy tokens: std 0.1 still falls into a
# one- or two-token loop for some seeds (qwen2 most often); 0.15 gives 14+ distinct tokens for
# every seed and arch, and larger logits (std ~1.2), so larger top-1/top-2 gaps.
WEIGHT_STD = 0.15
# Big enough that dropping a qwen2 q/k/v bias moves logits by ~0.1-1, small enough not to let the
# key bias dominate attention (which brings back the loops).
BIAS_STD = 0.1
NORM_NOISE_STD = 0.2
RMS_NORM_EPS = 1e-6

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ARCH_CLASSES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Training text for the tokenizer. Embedded rather than read from disk so that the vocabulary is
# the same on every machine; mixed scripts so that multi-byte sequences get merges too.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
A scheduler decides which requests run next; the executor runs the model on a batch of tokens.
Prefill processes the whole prompt at once, and decode produces one token per request per step.
The key-value cache stores attention keys and values so that earlier tokens are not recomputed.
When memory runs short, the scheduler retracts a request and runs it again later.
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i, "hello world")

{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828 -1 1e-6 0x1F.
Punctuation: ! ? , . ; : ' " ( ) [ ] { } < > / \\ | @ # $ % ^ & * - + = _ ~ `
Le cœur a ses raisons que la raison ne connaît point. Ça va très bien, merci.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Grüße aus München.
El niño comió una manzana en la mañana. ¿Dónde está la biblioteca?
Съешь же ещё этих мягких французских булок, да выпей чаю.
Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.
我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧。
私はガラスを食べられます。それは私を傷つけません。
나는 유리를 먹을 수 있어요. 그래도 아프지 않아요.
नमस्ते दुनिया। مرحبا بالعالم. שלום עולם.
Emoji: 🙂 🚀 🎉 ✨ 👍 ❤️ 🐍 ☕
"""

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are not or but have "
    "model token request batch cache memory queue prefix tree radix decode prefill chunk step "
    "graph kernel stream device host tensor weight layer head attention rotary norm bias "
    "server client stream prompt answer question user assistant system message content role "
    "time space light water river mountain city house garden window book letter music color "
    "red green blue small large quick slow early late first last next every many few some "
    "run runs ran make makes made take takes took give gives gave find finds found keep keeps"
).split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch dr fl gr kl pr sh st th tr".split()
_VOWELS = "a e i o u ai ea ou".split()
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "ng", "st")


def _check_positive(**values: int | float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True, slots=True)
class TinySizes:
    """The model's shape: each field is also a `make-tiny-model` flag with this default."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


def validate_args(arch: str, sizes: TinySizes, dtype: str) -> None:
    """Raise ValueError naming the offending flag; called before anything is written."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    _check_positive(**{name: value for name, value in asdict(sizes).items() if name != "vocab_size"})
    s = sizes
    if s.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 byte tokens + "
            f"{len(SPECIAL_TOKENS)} special tokens), got {s.vocab_size}"
        )
    if s.num_heads % s.num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({s.num_heads}) must be divisible by num_kv_heads ({s.num_kv_heads})"
        )
    if s.head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even (rotary embeddings rotate pairs), got {s.head_dim}")
    # Qwen2 configs have no head_dim field: every Qwen2 loader derives it from hidden_size.
    if arch == "qwen2" and s.num_heads * s.head_dim != s.hidden_size:
        raise ValueError(
            f"qwen2 needs hidden_size == num_heads * head_dim, got {s.hidden_size} != "
            f"{s.num_heads} * {s.head_dim}"
        )


def _lcg_stream(seed: int) -> Iterator[int]:
    """A fixed PRNG: Python's `random` only promises a stable `random()`, not `choice()`."""
    state = seed & 0xFFFFFFFFFFFFFFFF
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        yield state >> 33


def _pseudo_word(rng: Iterator[int]) -> str:
    syllables = 1 + next(rng) % 4
    return "".join(
        _ONSETS[next(rng) % len(_ONSETS)]
        + _VOWELS[next(rng) % len(_VOWELS)]
        + _CODAS[next(rng) % len(_CODAS)]
        for _ in range(syllables)
    )


def _generated_sentences(count: int) -> list[str]:
    """Real words give frequent merges; pseudo-words give enough distinct rare words for the
    trainer to reach the requested vocabulary size (about two sentences per wanted token)."""
    rng = _lcg_stream(1234)
    sentences = []
    for _ in range(count):
        length = 4 + next(rng) % 9
        words = [
            _WORDS[next(rng) % len(_WORDS)] if next(rng) % 2 else _pseudo_word(rng)
            for _ in range(length)
        ]
        sentences.append(" ".join(words).capitalize() + ".")
    return sentences


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE; cached because tests make many models with one vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, seen in the corpus or not, so that any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS.splitlines() + _generated_sentences(max(1000, vocab_size // 2))
    tokenizer.train_from_iterator(corpus, trainer)
    # If the corpus ran out of merges, fill up with reserved tokens so that the tokenizer and the
    # embedding table agree on the vocabulary size.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)]
        )
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer.to_str()


def _save_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> tuple[int, int]:
    """Write tokenizer files; returns (eos id, pad id) for the model config."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_class(out_dir / "tokenizer_config.json")
    return tokenizer.eos_token_id, tokenizer.pad_token_id


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 writes its internal class name "TokenizersBackend", which 4.x cannot load;
    "PreTrainedTokenizerFast" is understood by both (5.x aliases it)."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _make_config(
    arch: str,
    s: TinySizes,
    *,
    tie_word_embeddings: bool,
    dtype: str,
    eos_token_id: int,
    pad_token_id: int,
) -> PretrainedConfig:
    from transformers import AutoConfig

    kwargs: dict[str, object] = dict(
        architectures=[_ARCH_CLASSES[arch]],
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        intermediate_size=s.intermediate_size,
        max_position_embeddings=s.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(s.rope_theta)},
        rms_norm_eps=RMS_NORM_EPS,
        initializer_range=WEIGHT_STD,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=dtype,
    )
    if arch != "qwen2":  # Qwen2Config has no head_dim field; validate_args pinned it.
        kwargs["head_dim"] = s.head_dim
    return AutoConfig.for_model(arch, **kwargs)


def _tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: a tensor's values depend on its name only, not on iteration order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _random_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    import torch

    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + NORM_NOISE_STD * noise
    if name.endswith(".bias"):
        return BIAS_STD * noise
    return WEIGHT_STD * noise


def _randomize(model: torch.nn.Module, seed: int) -> None:
    import torch

    # named_parameters() yields a tied lm_head once, so tying is preserved.
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_value(name, param.shape, seed))


def _save_model(out_dir: Path, config: PretrainedConfig, seed: int, dtype: str) -> None:
    """Written by hand rather than with save_pretrained: no progress bars, normal file modes, and
    nothing in the files but the tensors and the configs."""
    import torch
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM, GenerationConfig

    # Draw in float32 whatever the target dtype, so a float16 model is the float32 one rounded.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    config.dtype = dtype  # from_config rewrote it to float32
    tensors = _unique_tensors(model, getattr(torch, dtype))
    # save() + write_bytes rather than save_file, which creates the file with mode 0600.
    (out_dir / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)


def _unique_tensors(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """State dict without tied duplicates: like transformers, keep the first name (the input
    embedding) and drop lm_head.weight, which config.tie_word_embeddings restores on load."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().to(dtype).contiguous()
    return tensors


def make_tiny_model(
    out_dir: Path,
    arch: Arch,
    *,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    **sizes: float,
) -> Path:
    """Write a random-weight `arch` checkpoint with a trained byte-level BPE tokenizer to
    `out_dir` (created if needed; files of the same names are overwritten) and return it.
    `sizes` are `TinySizes` fields; the others keep their defaults."""
    unknown = set(sizes) - {f.name for f in fields(TinySizes)}
    if unknown:
        raise ValueError(f"unknown size {sorted(unknown)}; the sizes are {', '.join(f.name for f in fields(TinySizes))}")
    shape = TinySizes(**sizes)  # type: ignore[arg-type]
    validate_args(arch, shape, dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_token_id, pad_token_id = _save_tokenizer(out_dir, shape.vocab_size, shape.max_position_embeddings)
    config = _make_config(
        arch,
        shape,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    _save_model(out_dir, config, seed, dtype)
    return out_dir


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `actorserve make-tiny-model`; defaults match make_tiny_model's."""
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    for f in fields(TinySizes):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")


def run_cli(args: argparse.Namespace) -> int:
    """Make the model described by parsed `args`; print its path. Returns the exit code."""
    try:
        path = _make_from_args(args)
    except ValueError as e:  # a bad flag: one line for the user, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _make_from_args(args: argparse.Namespace) -> Path:
    sizes = {f.name: getattr(args, f.name) for f in fields(TinySizes)}
    return make_tiny_model(args.dir, args.arch, seed=args.seed, tie_word_embeddings=args.tie_word_embeddings, dtype=args.dtype, **sizes)


def main(argv: list[str] | None = None) -> int:
    """`python -m gpu.tiny_model DIR --arch llama`, for use without the actorserve CLI."""
    parser = argparse.ArgumentParser(prog="make-tiny-model", description=__doc__.splitlines()[0])
    add_cli_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
