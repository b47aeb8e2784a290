"""`actorserve serve`: the HTTP server's command line.

Engine flags are derived from `EngineConfig`'s fields (`schedule_policy` -> `--schedule-policy`),
so a field added to the config is a flag at once, with SGLang's spelling. This module imports only
the config: `actorserve --help` must not wait for torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

import msgspec

from api.server.reasoning_parser import REASONING_PARSERS
from api.server.sglang_flags import COMPATIBLE, DEFAULT_ONLY, REFUSED, Takes
from api.server.tool_parsers import TOOL_PARSERS
from runtime.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    ROUTER_POLICIES,
    CoreConfig,
    EngineConfig,
)

# SGLang's other spellings of our flags.
ALIASES: dict[str, tuple[str, ...]] = {
    "model_path": ("--model",),
    "tp_size": ("--tensor-parallel-size",),
    "dp_size": ("--data-parallel-size",),
    "dist_init_addr": ("--nccl-init-addr",),
    "dist_timeout_s": ("--dist-timeout",),
}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # SGLang's --dtype accepts these too
# SGLang's --load-balance-method values that are one of our router policies.
LOAD_BALANCE_METHODS = {"round_robin": "round_robin", "shortest_queue": "shortest_queue"}

FIELD_HELP: dict[str, str] = {
    "model_path": "checkpoint directory or .gguf file (none: the default SmolLM2-135M-Instruct)",
    "dtype": "weights and KV dtype (auto: the checkpoint's on CUDA; on a CPU bfloat16 where it computes bfloat16 natively, else float32)",
    "quantization": "int8: linear layers with int8 weights and per-token int8 activations (CPU only; oneDNN); gguf: a .gguf model's quantized blocks kept (Q4_0/Q4_1/Q4_K/Q5_*/Q8_0 as stored, other block types requantized to 8 bits; CPU only); none: the dtype's matmuls",
    "device": "cpu or cuda",
    "context_length": "maximum tokens per request (none: the model's max_position_embeddings)",
    "attention_backend": "attention kernels",
    "disable_cuda_graph": "run decode eagerly on CUDA",
    "cuda_graph_max_bs": "largest decode batch captured as a CUDA graph",
    "random_seed": "seed of the scheduler's random choices",
    "inline_core": "run the engine core on the server's event loop instead of a process of its own (for debugging)",
    "core_threads": "torch threads of the engine core process (none: every core)",
    "core_backlog": "requests the core process queues beyond max_running_requests + max_queued_requests; later ones wait in the server",
    "dp_size": "data-parallel replicas: engine core processes, each with its own KV pool and scheduler",
    "router_policy": "how a request's replica is picked when dp_size > 1",
    "cache_threshold": "cache_aware: route by the cache when the best match covers more than this share of the prompt",
    "balance_abs_threshold": "cache_aware: the load is imbalanced when the busiest replica has more than this many requests more than the idlest...",
    "balance_rel_threshold": "...and more than this many times as many; then the idlest gets the request",
    "tp_size": "tensor-parallel ranks: the model's heads and MLP split over this many processes (GPUs)",
    "dist_init_addr": "host:port where the tensor-parallel ranks meet (none: a free loopback port)",
    "dist_timeout_s": "seconds a tensor-parallel rank may leave a collective unanswered before the engine fails",
    "max_total_tokens": "KV pool size in tokens (none: from a memory budget)",
    "max_running_requests": "most requests decoding at once (none: what the pool holds, at most 256)",
    "page_size": "tokens per KV page",
    "disable_radix_cache": "no prefix caching",
    "radix_eviction_policy": "which cached prefixes go first",
    "enable_hierarchical_cache": "keep KV evicted from the pool in host memory and load it back on a match (SGLang's HiCache L2)",
    "hicache_ratio": "host tier size as a multiple of the KV pool",
    "hicache_write_policy": "write_through: copy cached pages to the host as they are cached; write_back: when evicted",
    "hicache_block_tokens": "tokens per host-tier block (a multiple of page_size)",
    "hicache_storage_backend": "file: also keep host-tier blocks in files under --hicache-storage-dir, read back after a restart (SGLang's HiCache L3)",
    "hicache_storage_dir": "directory of the storage tier's files (one subdirectory per model; SGLang reads SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR)",
    "hicache_storage_prefetch_policy": "when a queued request whose blocks are being read from storage may run: best_effort at once, wait_complete once read, timeout then or at the timeout",
    "hicache_storage_prefetch_timeout_s": "timeout policy: seconds a request waits for its blocks, plus 0.25 per 1,024 tokens read",
    "schedule_policy": "order of the waiting queue",
    "lpm_fallback_queue_len": "lpm acts as fcfs while the queue is longer than this",
    "max_prefill_tokens": "token budget of one prefill batch",
    "prefill_max_requests": "most requests in one prefill batch (none: no limit)",
    "chunked_prefill_size": "longest prefill chunk (-1: no chunking)",
    "enable_mixed_chunk": "run prefill chunks and decodes in one batch",
    "schedule_conservativeness": "higher: reserve more KV for future tokens, retract less",
    "disable_overlap_schedule": "wait for each step before forming the next",
    "enable_priority_scheduling": "order by request priority and preempt by it",
    "schedule_low_priority_values_first": "a lower priority value is more urgent",
    "priority_scheduling_preemption_threshold": "priority gap needed to preempt a running request",
    "abort_on_priority_when_disabled": "refuse requests that give a priority while priority scheduling is off",
    "max_queued_requests": "queue length beyond which requests get 503 (none: unbounded)",
    "queue_timeout_s": "seconds a request may wait in the queue before a 503",
    "default_slo_ttft_ms": "first-token deadline (ms after arrival) of requests that give none (edf)",
    "reject_infeasible": "edf: refuse at once (503 deadline_infeasible) a request the queue ahead would make late",
    "fairness": "vtc: serve the backlogged tenant with the least weighted service first (OSDI'24 VTC)",
    "tenant_weights": "vtc shares, e.g. a=2,b=1 (tenants not named: 1)",
    "priority_aging_s": "a waiting request gains one priority level per this many seconds (none: no aging; sjf: 5)",
    "cold_lane_share": "lpm/dfs-weight: up to this share of admissions goes to the oldest cold requests, ahead of better cache matches; pair with --priority-aging-s (none: no lane)",
    "cold_lane_threshold": "a waiting request is cold while its cached prefix covers less than this share of its prompt",
    "stream_interval": "tokens per streamed chunk",
    "tokenize_off_loop_chars": "prompts longer than this are tokenized in a thread",
    "tokenizer_path": "tokenizer directory (none: the model's)",
    "trust_remote_code": "let a tokenizer run its own code (transformers' trust_remote_code)",
    "chat_template": "chat template: a .jinja file or a built-in name (chatml, qwen, llama-3-instruct); none: the tokenizer's",
    "skip_tokenizer_init": "load no tokenizer: prompts must be input_ids, answers carry output_ids and empty text",
    "mem_fraction_static": "share of the memory available at start (GPU memory; RAM on a CPU) for weights + KV pool: "
    "the pool gets fraction x available - weights, at most max_running_requests x context_length tokens "
    "(none: 80%% of free GPU memory, or 2 GiB of RAM, after the weights)",
    "kv_cache_dtype": "KV cache dtype: auto (the model's); bf16/bfloat16 with --dtype bfloat16; int8 (CPU: 8-bit rows "
    "with a scale each, about half a bfloat16 cache's bytes); no fp8/fp4 KV",
    "sampling_defaults": "defaults of chat requests that leave temperature/top_p/top_k/min_p/repetition_penalty out: "
    "model (generation_config.json, then OpenAI's) or openai",
    "preferred_sampling_params": "JSON object of sampling params under every request's own, e.g. '{\"temperature\": 0.7}'",
    "load_format": "weights format: auto, safetensors (a checkpoint directory) or gguf (a .gguf file)",
    "enable_deterministic_inference": "the same request gives the same output whatever runs beside it: one request per "
    "batch (no batch-invariant kernels here, so a single stream's throughput), no prefix cache, seed 42 for requests without one",
}


def add_parser(commands: Any) -> None:
    """Add the `serve` subcommand to the CLI's subparsers."""
    # "resolve": a flag of ours replaces the same SGLang flag's entry in api/server/sglang_flags.py, which
    # is added first, so honouring a flag needs no edit there to work.
    p = commands.add_parser(
        "serve",
        help="run the HTTP server (OpenAI-compatible and SGLang-native)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        conflict_handler="resolve",
    )
    server = p.add_argument_group("server")
    core = p.add_argument_group("engine core", "CoreConfig: what the engine core process is started with (SGLang's flag names)")
    frontend = p.add_argument_group("frontend", "EngineConfig's own: cores, replicas and routing, tokenization, request defaults")
    _add_sglang_compatibility(p)
    server.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=30000, help="port to bind")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on API requests")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="names the API accepts as `model`, comma or space separated; the first is the one answers carry "
        "(none: the model directory's name; 'default' is always accepted)",
    )
    server.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body in MiB (larger: 413)")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="logging level")
    server.add_argument("--log-requests", action="store_true", help="log each request when it arrives and when it ends")
    server.add_argument(
        "--log-requests-level", type=int, default=2, choices=(0, 1, 2, 3),
        help="0: ids and counts; 1: + sampling params; 2: + input and output, cut to 2048 characters; 3: + all of them",
    )
    server.add_argument("--log-requests-format", default="text", choices=("text", "json"), help="request log lines as text or JSON")
    server.add_argument(
        "--watchdog-timeout", type=_converter(float, True), default=300.0, metavar="FLOAT|none",
        help="seconds a replica may run requests without finishing a forward step before the server fails (exit 1)",
    )
    server.add_argument(
        "--tool-call-parser", choices=tuple(TOOL_PARSERS), default=None,
        help="how tool calls are read from answers (none: the format the chat template names, if any)",
    )
    server.add_argument(
        "--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
        help="<think> reasoning into reasoning_content (none: qwen3 where the template has enable_thinking and <think>)",
    )
    core_fields = set(CoreConfig.__struct_fields__)
    for field in msgspec.structs.fields(EngineConfig):
        _add_field(core if field.name in core_fields else frontend, field)
    frontend.add_argument(
        "--load-balance-method", dest="router_policy", type=_load_balance_method, default=argparse.SUPPRESS, metavar="{" + ",".join(LOAD_BALANCE_METHODS) + "}",
        help="SGLang's name for --router-policy round_robin or shortest_queue",
    )
    p.set_defaults(run=run)


def _add_sglang_compatibility(p: argparse.ArgumentParser) -> None:
    """SGLang's flags that are not ours (api/server/sglang_flags.py): accepted ones listed in --help,
    refused ones hidden and answered by name."""
    compat = p.add_argument_group("SGLang compatibility", "SGLang flags accepted because what they ask for is what actorserve does")
    for flag, spec in COMPATIBLE.items():
        _add_ignored(compat, flag, spec.takes, _parse_as(spec.takes), f"accepted: {spec.why}")
    for flag, gate in DEFAULT_ONLY.items():
        allowed = "|".join(gate.values)
        _add_ignored(compat, flag, gate.takes, _only(gate.takes, gate.values, gate.reason), f"accepted as {allowed} only: {gate.reason}")
    for flag in REFUSED:
        p.add_argument(flag, nargs="*", action=_Refuse, help=argparse.SUPPRESS)


def _add_ignored(group: argparse._ArgumentGroup, flag: str, takes: Takes, parse: Callable[[str], Any], help_text: str) -> None:
    dest = "sglang_" + flag.removeprefix("--").replace("-", "_")
    if takes == "flag":
        group.add_argument(flag, dest=dest, action="store_true", default=argparse.SUPPRESS, help=help_text)
    else:
        group.add_argument(flag, dest=dest, type=parse, default=argparse.SUPPRESS, metavar=takes.upper(), help=help_text)


class _Refuse(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        assert option_string is not None
        parser.error(f"{option_string} is not supported: {REFUSED[option_string]}")


def _parse_as(takes: Takes) -> Callable[[str], Any]:
    return {"flag": str, "int": int, "float": float, "str": str}[takes]


def _only(takes: Takes, values: tuple[str, ...], reason: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        value = text
        if takes == "int":
            value = str(int(text))  # "01" is 1; a non-number is argparse's "invalid" error
        if value not in values:
            raise argparse.ArgumentTypeError(f"{text} is not supported: {reason} (accepted: {', '.join(values)})")
        return value

    check.__name__ = takes
    return check


def _load_balance_method(text: str) -> str:
    if text not in LOAD_BALANCE_METHODS:
        raise argparse.ArgumentTypeError(
            f"{text} is not supported: the router's policies are {', '.join(ROUTER_POLICIES)} (--router-policy); "
            f"SGLang's names accepted here: {', '.join(LOAD_BALANCE_METHODS)}"
        )
    return LOAD_BALANCE_METHODS[text]


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _one_of(allowed: tuple[str, ...], why: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{text} is not supported: {why} (accepted: {', '.join(allowed)})")
        return text

    check.__name__ = "str"
    return check


# Engine flags whose text is converted (or refused with the reason) by more than its type.
CONVERTERS: dict[str, Callable[[str], Any]] = {
    "dtype": _dtype,
    "preferred_sampling_params": _json_object,
    "kv_cache_dtype": _one_of(KV_CACHE_DTYPES, "the KV pools hold the model's dtype or int8 rows, no backend here stores fp8/fp4 KV"),
    "load_format": _one_of(LOAD_FORMATS, "actorserve loads safetensors checkpoint directories and GGUF files, offline"),
}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in msgspec.structs.fields(EngineConfig)}


def run(args: argparse.Namespace) -> int:
    import uvloop

    from api.server.app import ServerSettings, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = engine_kwargs(args)
    EngineConfig(**kwargs)  # contradictions are reported before the model loads
    if args.watchdog_timeout is not None and args.watchdog_timeout <= 0:
        raise ValueError(f"--watchdog-timeout must be positive, got {args.watchdog_timeout:g} (none: no watchdog)")
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=served_model_names(args.served_model_name),
        max_body_bytes=int(args.max_body_mb * 2**20),
        log_requests=args.log_requests,
        log_requests_level=args.log_requests_level,
        log_requests_format=args.log_requests_format,
        watchdog_timeout_s=args.watchdog_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    return uvloop.run(serve(kwargs, settings))


def served_model_names(given: list[str]) -> tuple[str, ...]:
    """`--served-model-name a,b c` -> ("a", "b", "c"), duplicates dropped, order kept."""
    names = (name.strip() for arg in given for name in arg.split(","))
    return tuple(dict.fromkeys(name for name in names if name))


def _add_field(group: argparse._ArgumentGroup, field: msgspec.structs.FieldInfo) -> None:
    flags = ("--" + field.name.replace("_", "-"), *ALIASES.get(field.name, ()))
    base, nullable = _unwrap_optional(field.type)
    help_text = FIELD_HELP.get(field.name, "engine setting")
    if base is bool:
        action = argparse.BooleanOptionalAction if field.default else "store_true"
        group.add_argument(*flags, dest=field.name, action=action, default=field.default, help=help_text)
        return
    choices = None
    if get_origin(base) is Literal:  # the field's own values are the flag's choices
        base, choices = str, get_args(base)
    group.add_argument(
        *flags,
        dest=field.name,
        type=CONVERTERS.get(field.name) or _converter(base, nullable),
        default=field.default,
        choices=choices,
        metavar=_metavar(base, nullable) if choices is None else None,
        help=help_text,
    )


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(get_args(tp))
    return tp, False


def _converter(base: Any, nullable: bool) -> Any:
    def convert(text: str) -> Any:
        if nullable and text.lower() == "none":
            return None
        return base(text)

    convert.__name__ = base.__name__  # argparse names the type in its error messages
    return convert


def _metavar(base: Any, nullable: bool) -> str:
    name = "JSON" if get_origin(base) is dict else {int: "INT", float: "FLOAT", str: "STR"}.get(base, base.__name__.upper())
    return f"{name}|none" if nullable else name
