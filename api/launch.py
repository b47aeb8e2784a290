"""What SGLang's launch flags change when the engine starts: the tokenizer (`--tokenizer-path`,
`--trust-remote-code`, `--chat-template`, `--skip-tokenizer-init`), the weights' format
(`--load-format`) and the model's sampling defaults (`--sampling-defaults`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from api.frontend.receiver import InvalidInput
from runtime.config import CoreConfig

log = logging.getLogger("actorserve.launch")

# SGLang's built-in conversation templates that have a Jinja form here, by SGLang's names.
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QWEN = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}" + _CHATML
)
_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHAT_TEMPLATES: dict[str, str] = {"chatml": _CHATML, "qwen": _QWEN, "llama-3-instruct": _LLAMA3}
# generation_config.json fields SGLang's chat endpoint takes as defaults (ModelConfig.get_default_sampling_params).
GENERATION_DEFAULT_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


def chat_template_text(arg: str) -> str:
    """The Jinja text for `--chat-template`: a built-in name, else a `.jinja` file (SGLang's order)."""
    if arg in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[arg]
    path = Path(arg).expanduser()
    names = ", ".join(CHAT_TEMPLATES)
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {arg}: not a built-in template name ({names}) nor a file")
    if path.suffix != ".jinja":
        raise ValueError(
            f"--chat-template {arg}: only Jinja files (.jinja) are supported, not SGLang's JSON conversation templates; "
            f"or give a built-in name ({names})"
        )
    # As SGLang reads it: a template written with literal "\n" escapes means newlines.
    return path.read_text().strip("\n").replace("\\n", "\n")


class IdsOnlyTokenizer:
    """`--skip-tokenizer-init`: no vocabulary at all. Prompts must be token ids, and answers carry
    `output_ids` with empty text (SGLang answers the same way)."""

    chat_template = None
    all_special_ids: tuple[int, ...] = ()

    def encode(self, text: str, **_: Any) -> list[int]:
        raise InvalidInput("this server runs with --skip-tokenizer-init: send input_ids, not text", "text")

    def decode(self, ids: Any, **_: Any) -> str:
        return ""


def needs_tokenizer(sampling: dict[str, Any]) -> str | None:
    """The sampling field that cannot work without a tokenizer (--skip-tokenizer-init), if any:
    grammars are compiled over the vocabulary, stop strings are matched in the text."""
    for name in ("json_schema", "regex", "ebnf"):
        if sampling.get(name) is not None:
            return name
    return "stop" if sampling.get("stop") else None


def load_tokenizer(config: CoreConfig, model_dir: Path) -> Any:
    """The tokenizer the engine's flags ask for (a transformers tokenizer, or IdsOnlyTokenizer)."""
    if config.skip_tokenizer_init:
        return IdsOnlyTokenizer()
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    source = Path(config.tokenizer_path).expanduser() if config.tokenizer_path else model_dir
    if not source.is_dir():
        raise FileNotFoundError(f"--tokenizer-path {source}: no such directory (models are never downloaded here)")
    tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=config.trust_remote_code)
    if config.chat_template is not None:
        tokenizer.chat_template = chat_template_text(config.chat_template)
    return tokenizer


def check_load_format(load_format: str, model_path: str | None) -> None:
    """`--load-format safetensors` needs a checkpoint directory, `gguf` a .gguf file (none: the
    default model, a GGUF file); `auto` takes either."""
    is_gguf = model_path is None or Path(model_path).suffix == ".gguf"
    if load_format == "safetensors" and is_gguf:
        raise ValueError(f"--load-format safetensors: the model {model_path or '(default)'} is a GGUF file")
    if load_format == "gguf" and not is_gguf:
        raise ValueError(f"--load-format gguf: the model {model_path} is not a .gguf file")


def generation_defaults(model_dir: Path | None, mode: str) -> dict[str, Any]:
    """Chat sampling defaults: with `mode` "model", the generation_config.json values SGLang takes
    (temperature, top_p, top_k, min_p, repetition_penalty); "openai": none."""
    path = None if model_dir is None else model_dir / "generation_config.json"
    if mode != "model" or path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s): no model sampling defaults", path, exc)
        return {}
    defaults = {name: raw[name] for name in GENERATION_DEFAULT_FIELDS if raw.get(name) is not None}
    if defaults:
        log.info("chat sampling defaults from %s: %s", path, defaults)
    return defaults
