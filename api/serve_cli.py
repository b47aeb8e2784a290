"""`actorserve serve`: the HTTP server's command line.

Engine flags are derived from `EngineConfig`'s fields (`schedule_policy` -> `--schedule-policy`),
so a field added to the config is a flag at once, with SGLang's spelling. This module imports only
the config: `actorserve --help` must not wait for torch.
"""

from __future__ import annotations

import argparse
import logging
import types
from typing import Any, Union, get_args, get_origin

import msgspec

from runtime.config import ATTENTION_BACKENDS, DTYPES, EVICTION_POLICIES, FAIRNESS, ROUTER_POLICIES, SCHEDULE_POLICIES, EngineConfig

CHOICES: dict[str, tuple[str, ...]] = {
    "schedule_policy": SCHEDULE_POLICIES,
    "fairness": FAIRNESS,
    "radix_eviction_policy": EVICTION_POLICIES,
    "attention_backend": ATTENTION_BACKENDS,
    "dtype": DTYPES,
    "router_policy": ROUTER_POLICIES,
}

FIELD_HELP: dict[str, str] = {
    "model_path": "checkpoint directory or .gguf file (none: the default SmolLM2-135M-Instruct)",
    "dtype": "weights and KV dtype (auto: the checkpoint's on CUDA; on a CPU bfloat16 where it computes bfloat16 natively, else float32)",
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
    "schedule_policy": "order of the waiting queue",
    "lpm_fallback_queue_len": "lpm acts as fcfs while the queue is longer than this",
    "max_prefill_tokens": "token budget of one prefill batch",
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
}


def add_parser(commands: Any) -> None:
    """Add the `serve` subcommand to the CLI's subparsers."""
    p = commands.add_parser(
        "serve",
        help="run the HTTP server (OpenAI-compatible and SGLang-native)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    server = p.add_argument_group("server")
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
    engine = p.add_argument_group("engine", "EngineConfig fields, with SGLang's flag names")
    for field in msgspec.structs.fields(EngineConfig):
        _add_field(engine, field)
    p.set_defaults(run=run)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in msgspec.structs.fields(EngineConfig)}


def run(args: argparse.Namespace) -> int:
    import uvloop

    from api.server import ServerSettings, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = engine_kwargs(args)
    EngineConfig(**kwargs)  # contradictions are reported before the model loads
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=served_model_names(args.served_model_name),
        max_body_bytes=int(args.max_body_mb * 2**20),
    )
    return uvloop.run(serve(kwargs, settings))


def served_model_names(given: list[str]) -> tuple[str, ...]:
    """`--served-model-name a,b c` -> ("a", "b", "c"), duplicates dropped, order kept."""
    names = (name.strip() for arg in given for name in arg.split(","))
    return tuple(dict.fromkeys(name for name in names if name))


def _add_field(group: argparse._ArgumentGroup, field: msgspec.structs.FieldInfo) -> None:
    flag = "--" + field.name.replace("_", "-")
    base, nullable = _unwrap_optional(field.type)
    help_text = FIELD_HELP.get(field.name, "engine setting")
    if base is bool:
        action = argparse.BooleanOptionalAction if field.default else "store_true"
        group.add_argument(flag, dest=field.name, action=action, default=field.default, help=help_text)
        return
    group.add_argument(
        flag,
        dest=field.name,
        type=_converter(base, nullable),
        default=field.default,
        choices=CHOICES.get(field.name),
        metavar=_metavar(base, nullable) if field.name not in CHOICES else None,
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
    name = {int: "INT", float: "FLOAT", str: "STR"}.get(base, base.__name__.upper())
    return f"{name}|none" if nullable else name
