"""`python -m bench.serving`: the online load test (SGLang's bench_serving, vLLM's `bench serve`).

    # a running server (actorserve serve --model-path P --port 30000), native /generate
    python -m bench.serving --base-url http://127.0.0.1:30000 --backend native --workload W3-online \\
        --request-rate 4 --num-prompts 64
    # an in-process actorserve.Engine: no HTTP; engine flags as for `actorserve serve`
    python -m bench.serving --engine --model-path tiny-qwen3 --workload W2-shared-prefix --schedule-policy lpm
    # the W3 rate sweep: one row per rate
    python -m bench.serving --engine --model-path tiny-qwen3 --rate-sweep 1,2,4,8,16,inf --num-prompts 32

Target: `--base-url` with `--backend native` (POST /generate, streamed), `openai-completions`
(POST /v1/completions, token-id prompts) or `openai-chat` (POST /v1/chat/completions, prompts
decoded to text with the model's tokenizer); or `--engine` for an in-process `actorserve.Engine` on this
process's loop (the load generator then shares the loop with the engine).

Datasets: `--workload W1-mixed|W1-mixed-64|W2-shared-prefix|W3-online|W4-multi-turn|
W5-priority-overload` (bench/workloads.py, /work/shared/bench-workloads.md), or `--dataset`
`random-ids` (lengths uniform in [len * range_ratio, len]), `sharegpt` (a local ShareGPT JSON
file: first human turn as the prompt, the first answer's length as the output length),
`generated-shared-prefix` (`--gsp-*`: groups x prompts per group, request i in group i % groups),
`multi-turn` (`--mt-*`: each turn sent when the previous answer arrives, the history carried; its
defaults are W4). Token ids come from [10, vocab_size - 10) with numpy default_rng(seed).

Load: `--request-rate` (inf: all at t=0; else gamma gaps of shape `--burstiness`, Poisson at 1),
`--max-concurrency` (requests in flight; arrivals beyond it wait), `--num-prompts` (the first N
requests, conversations for multi-turn). W3 / W5 draw their own arrivals at the rate given; other
datasets draw theirs from default_rng([seed, 1]), so the prompts do not depend on the rate.
Every request is greedy with `ignore_eos` (`--disable-ignore-eos` to let EOS end it).

Classes: W5 gives each request a priority. `--tenants a=3,b=1` gives each request (each
conversation, for multi-turn) a tenant drawn with those weights, sent as the `tenant` field;
`--slo-classes 200=1,1000=3` a TTFT target in ms drawn likewise (`none` for requests with none),
sent as `slo_ttft_ms` and held against each request's own TTFT in goodput and SLO attainment.
Both are off by default. The result then splits TTFT, TPOT, E2E, queue time (`--engine`), goodput
and SLO attainment by priority, tenant and SLO class ("By class").

Before the timed run: `--warmup-requests` short requests with their own ids, then the prefix
cache is flushed (before every run of a sweep too; `--no-flush-cache` keeps it).

Output tokens are the server's count: meta_info.completion_tokens (native), usage with
stream_options.include_usage (openai), the engine's completion_tokens (engine). Cached tokens
likewise, which gives the cache hit rate. Metric definitions: bench/serving_metrics.py.

Results: a progress bar on stderr, a table on stdout, one JSON line per run appended to
`--output-file`, `--plot out.png|.svg|.pdf` (bench/serving_plot.py, matplotlib: latency CDFs,
throughput over time; `--plot-log-x` for log-scaled latency axes).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson

from bench import serving_backends
from bench.serving_backends import Backend, Call, EngineBackend, HttpBackend
from bench.serving_datasets import (
    BenchRequest,
    Dataset,
    MultiTurn,
    Service,
    gsp_dataset,
    multi_turn_dataset,
    parse_slo_classes,
    parse_tenants,
    random_ids_dataset,
    sharegpt_dataset,
    with_services,
    workload_dataset,
)
from bench.serving_metrics import LATENCIES, RequestOutput, compute_metrics, distserve_goodput, format_rate, metrics_by_class
from bench.serving_plot import plot_problem
from bench.workloads import ID_MARGIN, WORKLOADS
from runtime.config import EngineConfig

BACKENDS = ("native", "openai-completions", "openai-chat")
DATASETS = ("random-ids", "sharegpt", "generated-shared-prefix", "multi-turn")
SWEEP_WORKLOAD = "W3-online"
WARMUP_INPUT_LEN = 32
WARMUP_OUTPUT_LEN = 8
FREEZE_AFTER_START = False  # gc.freeze() once the engine has loaded (the command line does)
MAX_ERRORS_KEPT = 5


# --- running -------------------------------------------------------------------------------------


@dataclass
class RunResult:
    rate: float
    outputs: list[RequestOutput]
    duration_s: float
    metrics: dict[str, Any]
    server_info: dict[str, Any]


class Progress:
    def __init__(self, total: int, disable: bool, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=disable, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def run_dataset(
    backend: Backend, dataset: Dataset, *, max_concurrency: int | None = None, progress: Progress | None = None,
    tokenizer: Callable[[], Any] | None = None,
) -> tuple[list[RequestOutput], float]:
    """Send every request at its arrival offset; returns the outputs (request order, then
    conversation by conversation, turn by turn) and the duration (start to the last answer)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = serving_backends.clock()

    async def send(call: Call) -> RequestOutput:
        if limit is None:
            out = await backend.send(call, t0)
        else:
            async with limit:
                out = await backend.send(call, t0)
        if progress is not None:
            progress.update()
        return out

    async def at(offset: float, make: Callable[[], Awaitable[Any]]) -> Any:
        delay = offset - (serving_backends.clock() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        return await make()

    async def single(r: BenchRequest) -> list[RequestOutput]:
        out = await send(Call(r.output_len, input_ids=r.input_ids, text=r.text, priority=r.priority,
                              tenant=r.service.tenant, slo_ttft_ms=r.service.slo_ttft_ms))
        return [labelled(out, r.priority, r.service)]

    async def conversation(c: MultiTurn) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        history: list[int] = []
        messages: list[dict[str, str]] = []
        service = {"tenant": c.service.tenant, "slo_ttft_ms": c.service.slo_ttft_ms}  # every turn's
        for turn, user in enumerate(c.turns):
            if backend.name == "openai-chat":
                assert c.texts is not None, "openai-chat needs the turns as text"
                messages = [*messages, {"role": "user", "content": c.texts[turn]}]
                call = Call(c.output_len, messages=messages, **service)
            else:
                call = Call(c.output_len, input_ids=history + user, **service)
            out = labelled(await send(call), None, c.service)
            outs.append(out)
            if not out.success:
                for _ in c.turns[turn + 1 :]:  # the conversation cannot go on
                    lost = RequestOutput(error=f"turn {turn} failed", requested_output_len=c.output_len)
                    outs.append(labelled(lost, None, c.service))
                    if progress is not None:
                        progress.update()
                break
            if backend.name == "openai-chat":
                messages = [*messages, {"role": "assistant", "content": out.text}]
                continue
            answer = out.output_ids
            if answer is None:  # openai-completions says no ids: re-encode the text
                assert tokenizer is not None, "multi-turn over openai-completions needs the tokenizer"
                answer = tokenizer().encode(out.text, add_special_tokens=False)
            history = (call.input_ids or []) + list(answer)
        return outs

    tasks = [at(r.arrival_s, lambda r=r: single(r)) for r in dataset.requests]
    tasks += [at(c.arrival_s, lambda c=c: conversation(c)) for c in dataset.conversations]
    results = await asyncio.gather(*tasks)
    duration = serving_backends.clock() - t0
    return [o for group in results for o in group], duration


def labelled(out: RequestOutput, priority: int | None, service: Service) -> RequestOutput:
    """`out` with the classes of its request (the per-class split) and its own TTFT target."""
    given = {"priority": None if priority is None else str(priority), "tenant": service.tenant, "slo": service.slo_class}
    out.classes = {dim: value for dim, value in given.items() if value is not None}
    out.slo_ttft_ms = service.slo_ttft_ms
    return out


async def warm_up(backend: Backend, count: int, vocab_size: int, seed: int, chat_text: Callable[[list[int]], str] | None) -> None:
    """`count` short requests at once, with ids of their own (never a dataset's prefix)."""
    if count <= 0:
        return
    rng = np.random.default_rng([seed, 2])
    calls = []
    for _ in range(count):
        ids = rng.integers(ID_MARGIN, vocab_size - ID_MARGIN, size=WARMUP_INPUT_LEN).tolist()
        calls.append(Call(WARMUP_OUTPUT_LEN, input_ids=ids, text=chat_text(ids) if chat_text else None))
    if backend.name == "openai-chat":
        for c in calls:
            c.input_ids = None
    outs = await asyncio.gather(*(backend.send(c, serving_backends.clock()) for c in calls))
    failed = [o.error for o in outs if not o.success]
    if failed:
        raise SystemExit(f"warm-up failed: {failed[0]}")


# --- reporting -----------------------------------------------------------------------------------

LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E", "queue": "Queue"}


def format_table(m: dict[str, Any], header: dict[str, Any]) -> str:
    lines = ["", "{s:=^66}".format(s=" Serving Benchmark Result ")]
    rows: list[tuple[str, Any]] = [(k, v) for k, v in header.items()]
    rows += [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Requested output tokens", m["requested_output_tokens"]),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}"),
        ("Concurrency", f"{m['concurrency']:.2f}"),
        ("Cache hit rate (cached / prompt tokens)", f"{m['cache_hit_rate']:.1%}"),
    ]
    if "goodput" in m:
        rows.append((f"Goodput (req/s, {_slo_text(m)})", f"{m['goodput']:.2f}"))
        rows.append(("Requests meeting the SLOs", f"{m['slo_attained']:.1%}"))
    if "device_busy" in m:
        rows.append(("Device busy (server forward_s / wall)", f"{m['device_busy']:.1%}"))
    lines += [f"{k + ':':<46}{str(v):>20}" for k, v in rows]
    lines.append("{s:-^66}".format(s=" Latency (ms) "))
    lines.append(f"{'':<8}" + "".join(f"{c:>11}" for c in ("mean", "median", "p90", "p95", "p99")))
    for name in (*LATENCIES, "queue"):
        if f"mean_{name}_ms" in m:  # queue time only where the backend reports it
            lines.append(f"{LATENCY_NAMES[name]:<8}" + "".join(f"{m[f'{s}_{name}_ms']:>11.2f}" for s in ("mean", "median", "p90", "p95", "p99")))
    lines += _class_lines(m.get("by_class", {}))
    lines.append("=" * 66)
    return "\n".join(lines)


def _slo_text(m: dict[str, Any]) -> str:
    """The SLOs goodput was measured against: "TTFT<=500.0 ms, TPOT<=None ms", or with
    --slo-classes "TTFT<=own (200, 1000 ms), TPOT<=None ms" (plus "else" the flag's target)."""
    ttft = f"{m['slo_ttft_ms']} ms"
    own = m.get("slo_ttft_ms_per_request")
    if own:
        ttft = f"own ({', '.join(f'{t:g}' for t in own)} ms)" + ("" if m["slo_ttft_ms"] is None else f" else {ttft}")
    return f"TTFT<={ttft}, TPOT<={m['slo_tpot_ms']} ms"


CLASS_COLUMNS = (("requests", "completed"), ("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
                 ("TPOT p99", "p99_tpot_ms"), ("E2E p99", "p99_e2e_ms"), ("Queue p99", "p99_queue_ms"))


def _class_lines(by_class: dict[str, dict[str, Any]]) -> list[str]:
    """Per request class: requests, TTFT median and p99, TPOT p99, E2E p99, queue p99 (ms, where
    reported), then SLO attainment and goodput (req/s) when the run measured them."""
    if not by_class:
        return []
    classes = list(by_class.values())
    columns = [(title, key) for title, key in CLASS_COLUMNS if all(key in c for c in classes)]
    width = max(14, *(len(name) + 2 for name in by_class))  # tenant names can be long
    with_slo = all("slo_attained" in c for c in classes)
    lines = ["{s:-^66}".format(s=" By class (ms) ")]
    lines.append(f"{'':<{width}}" + "".join(f"{title:>10}" for title, _ in columns) + ("  SLO  goodput" if with_slo else ""))
    for name, c in by_class.items():
        cells = [f"{c[key]:>10}" if key == "completed" else f"{c[key]:>10.1f}" for _, key in columns]
        slo = f"  {c['slo_attained']:>4.0%}  {c['goodput']:>7.2f}" if with_slo else ""
        lines.append(f"{name:<{width}}" + "".join(cells) + slo)
    return lines


SWEEP_COLUMNS = ("rate", "done", "fail", "dur s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                 "ITL p50", "ITL p99", "E2E p50", "E2E p99", "conc", "hit", "goodput")


def sweep_header() -> str:
    return "| " + " | ".join(SWEEP_COLUMNS) + " |\n|" + " --- |" * len(SWEEP_COLUMNS)


def sweep_row(rate: float, m: dict[str, Any]) -> str:
    cells = [
        format_rate(rate), m["completed"], m["failed"], f"{m['duration_s']:.1f}", f"{m['request_throughput']:.2f}",
        f"{m['output_throughput']:.1f}",
        *(f"{m[f'{s}_{n}_ms']:.1f}" for n in ("ttft", "tpot", "itl", "e2e") for s in ("median", "p99")),
        f"{m['concurrency']:.2f}", f"{m['cache_hit_rate']:.1%}", f"{m['goodput']:.2f}" if "goodput" in m else "-",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def json_record(args: argparse.Namespace, result: RunResult, dataset_name: str, model: str | None, backend: str) -> dict[str, Any]:
    info = result.server_info
    config = {k: v for k, v in info.items() if k in EngineConfig.__struct_fields__}
    stats = {k: v for k, v in (info.get("stats") or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    errors = list(dict.fromkeys(o.error for o in result.outputs if not o.success))[:MAX_ERRORS_KEPT]
    record: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tag": args.tag,
        "backend": backend,
        "base_url": None if args.engine else args.base_url,
        "model": model,
        "dataset": dataset_name,
        "num_prompts": len(result.outputs),
        "request_rate": format_rate(result.rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "warmup_requests": args.warmup_requests,
        "ignore_eos": not args.disable_ignore_eos,
        **({"tenants": args.tenants.as_dict()} if args.tenants else {}),
        **({"slo_classes": args.slo_classes.as_dict()} if args.slo_classes else {}),
        **result.metrics,
        "errors": errors,
        "engine_config": config,
        "server_stats": stats,
    }
    if args.output_details:
        ok = [o for o in result.outputs if o.success]
        record.update(
            input_lens=[o.prompt_len for o in ok], output_lens=[o.output_len for o in ok],
            ttfts=[o.ttft for o in ok], e2es=[o.e2e for o in ok], itls=[o.itl for o in ok],
        )
    return record


def append_json_line(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        f.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")


# --- the command ---------------------------------------------------------------------------------


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser raising ValueError: argparse then prints the message
    after the flag's name (its own wording for ValueError is only "invalid value")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def parse_rate(text: str) -> float:
    rate = float(text)  # "inf" parses
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be positive, got {text}")
    return rate


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from api.server.cli import _add_field, _converter  # the one definition of how EngineConfig fields become flags

    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--backend", choices=BACKENDS, default="native", help="HTTP API to drive (default native)")
    t.add_argument("--base-url", default="http://127.0.0.1:30000", help="server address (default http://127.0.0.1:30000)")
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    t.add_argument("--model", default=None, help="model name for the openai backends (default: the server's first model)")
    t.add_argument("--engine", action="store_true", help="drive an in-process actorserve.Engine instead of a server (engine flags below)")
    t.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's) for sharegpt, openai-chat, multi-turn")
    t.add_argument("--vocab-size", type=int, default=None, help="id range of random prompts (default: the model's vocab_size)")
    d = p.add_argument_group("dataset")
    d.add_argument("--workload", choices=WORKLOADS, default=None, help="a standard workload (overrides --dataset)")
    d.add_argument("--dataset", choices=DATASETS, default=None, help="default random-ids (W3-online with --rate-sweep)")
    d.add_argument("--dataset-path", type=Path, default=None, help="the ShareGPT JSON file")
    d.add_argument("--num-prompts", type=int, default=None,
                   help="requests (conversations for multi-turn); default: the workload's, 1000 random-ids, 32 multi-turn")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=1024)
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len * ratio, len]")
    d.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length (default: the answer's)")
    d.add_argument("--sharegpt-context-len", type=int, default=2048, help="skip pairs longer than this")
    d.add_argument("--gsp-num-groups", type=int, default=64)
    d.add_argument("--gsp-prompts-per-group", type=int, default=16)
    d.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    d.add_argument("--gsp-question-len", type=int, default=128)
    d.add_argument("--gsp-output-len", type=int, default=256)
    d.add_argument("--mt-turns", type=int, default=4, help="multi-turn: user turns per conversation")
    d.add_argument("--mt-first-turn-len", type=int, default=256)
    d.add_argument("--mt-turn-len", type=int, default=64, help="tokens of each later user turn")
    d.add_argument("--mt-output-len", type=int, default=64)
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s (inf: all at t=0; else gamma/Poisson)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson, < 1: burstier)")
    ld.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    ld.add_argument("--seed", type=int, default=0, help="prompts and arrivals")
    ld.add_argument("--warmup-requests", type=int, default=1)
    ld.add_argument("--no-flush-cache", action="store_true", help="keep the prefix cache between warm-up and runs")
    ld.add_argument("--disable-ignore-eos", action="store_true", help="let EOS end answers early")
    ld.add_argument("--extra-request-body", type=json.loads, default={}, help="JSON merged into every request body (engine: sampling params)")
    ld.add_argument("--tenants", type=_flag_type(parse_tenants), default=None, metavar="NAME[=WEIGHT],...",
                    help="give each request (conversation) a tenant drawn with these weights, sent as the tenant field")
    ld.add_argument("--slo-classes", type=_flag_type(parse_slo_classes), default=None, metavar="MS|none[=WEIGHT],...",
                    help="give each request (conversation) a TTFT target drawn with these weights, sent as slo_ttft_ms "
                         "and used for its goodput (none: no target)")
    ld.add_argument("--rate-sweep", type=lambda s: [parse_rate(x) for x in s.split(",")], default=None,
                    help="comma-separated rates: run W3-online (or the dataset given) at each, one row per rate")
    o = p.add_argument_group("results")
    o.add_argument("--slo-ttft-ms", type=float, default=None)
    o.add_argument("--slo-tpot-ms", type=float, default=None)
    o.add_argument("--output-file", type=Path, default=None, help="append one JSON line per run here")
    o.add_argument("--output-details", action="store_true", help="per-request lengths and latencies in the JSON line")
    o.add_argument("--tag", default=None, help="free text stored in the JSON line")
    o.add_argument("--plot", type=Path, default=None, help="write latency CDFs and throughput over time to this .png, .svg or .pdf (needs matplotlib)")
    o.add_argument("--plot-log-x", action="store_true", help="latency CDFs on a log-scaled x axis (the whole tail shows)")
    o.add_argument("--disable-tqdm", action="store_true")
    e = p.add_argument_group("engine", "EngineConfig fields, as for actorserve serve (--engine only; --model-path also names the tokenizer)")
    for f in msgspec.structs.fields(EngineConfig):
        if f.name == "model_path":  # serve's alias --model is this bench's served-model name, as in SGLang's bench_serving
            e.add_argument("--model-path", type=_converter(str, True), default=None, help="checkpoint directory, .gguf file or tiny-qwen3 (none: the default model)")
            continue
        _add_field(e, f)
    args = p.parse_args(argv)
    if args.dataset == "sharegpt" and args.dataset_path is None and args.workload is None:
        p.error("--dataset sharegpt needs --dataset-path")
    if args.burstiness <= 0:
        p.error("--burstiness must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    if args.plot is not None and (problem := plot_problem(args.plot)):
        p.error(problem)  # before the run, not after it
    return args


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(EngineConfig)}
    kwargs["model_path"] = resolve_model_arg(kwargs["model_path"])
    return kwargs


def resolve_model_arg(path: str | None) -> str | None:
    """`tiny-qwen3` is bench.offline's tiny Qwen3 (made on first use); anything else is a path."""
    if path == "tiny-qwen3":
        from bench.offline import tiny_qwen3_dir

        return str(tiny_qwen3_dir())
    return path


class ModelInfo:
    """The model's directory, vocabulary and tokenizer, each found once and only when needed."""

    def __init__(self, model_path: str | None, tokenizer_path: str | None, vocab_size: int | None, engine: Any = None):
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._tokenizer: Any = None
        self.engine = engine

    def model_dir(self) -> Path:
        from gpu.loader import resolve_model_dir

        if self.engine is not None:
            return self.engine.model_dir
        return resolve_model_dir(self.model_path)

    def vocab_size(self) -> int:
        if self._vocab_size is None:
            if self.engine is not None:
                self._vocab_size = self.engine.vocab_size
            else:
                directory = Path(self.model_path) if self.model_path else None
                if directory is None or not (directory / "config.json").is_file():
                    directory = self.model_dir()
                self._vocab_size = int(json.loads((directory / "config.json").read_text())["vocab_size"])
        return self._vocab_size

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.engine is not None and self.tokenizer_path is None:
                self._tokenizer = self.engine.tokenizer
            else:
                from gpu.loader import load_tokenizer

                self._tokenizer = load_tokenizer(Path(self.tokenizer_path) if self.tokenizer_path else self.model_dir())
        return self._tokenizer


def dataset_name(args: argparse.Namespace, sweep: bool) -> str:
    if args.workload:
        return args.workload
    if args.dataset:
        return args.dataset
    return SWEEP_WORKLOAD if sweep else "random-ids"


def build_dataset(args: argparse.Namespace, name: str, rate: float, info: ModelInfo) -> Dataset:
    n = args.num_prompts
    if name in WORKLOADS:
        return workload_dataset(name, info.vocab_size(), args.seed, n, rate, args.burstiness)
    if name == "random-ids":
        return random_ids_dataset(info.vocab_size(), n or 1000, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, args.seed, rate, args.burstiness)
    if name == "generated-shared-prefix":
        return gsp_dataset(info.vocab_size(), args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                           args.gsp_question_len, args.gsp_output_len, args.seed, n, rate, args.burstiness)
    if name == "multi-turn":
        return multi_turn_dataset(info.vocab_size(), n or 32, args.mt_turns, args.mt_first_turn_len, args.mt_turn_len,
                                  args.mt_output_len, args.seed, rate, args.burstiness)
    if name == "sharegpt":
        return sharegpt_dataset(args.dataset_path, info.tokenizer(), n or 1000, args.seed, args.sharegpt_output_len,
                                args.sharegpt_context_len, rate, args.burstiness)
    raise ValueError(f"unknown dataset {name!r}")


def as_chat(dataset: Dataset, tokenizer: Any) -> Dataset:
    """openai-chat sends text: every id prompt decoded once, before the clock starts."""
    for r in dataset.requests:
        if r.text is None and r.input_ids is not None:
            r.text = tokenizer.decode(r.input_ids)
            r.input_ids = None
    for c in dataset.conversations:
        c.texts = [tokenizer.decode(t) for t in c.turns]
    return dataset


def _deviations(args: argparse.Namespace, name: str, rate: float) -> list[str]:
    notes = []
    if name in ("W1-mixed", "W1-mixed-64", "W2-shared-prefix", "W4-multi-turn") and not math.isinf(rate):
        notes.append(f"{name} arrives all at t=0 by definition; --request-rate {format_rate(rate)} changes that")
    if name == "W5-priority-overload" and math.isinf(rate):
        notes.append("W5-priority-overload should arrive at 2x the measured capacity: give --request-rate")
    return notes


async def run_once(
    args: argparse.Namespace, backend: Backend, info: ModelInfo, name: str, rate: float, desc: str
) -> RunResult:
    dataset = with_services(build_dataset(args, name, rate, info), args.seed, args.tenants, args.slo_classes)
    if backend.name == "openai-chat":
        dataset = as_chat(dataset, info.tokenizer())
    if not args.no_flush_cache and not await backend.flush_cache():
        print("note: the prefix cache was not flushed before the run", file=sys.stderr)
    needs_tokenizer = backend.name == "openai-completions" and dataset.conversations
    if needs_tokenizer:
        info.tokenizer()  # loaded before the clock starts
    progress = Progress(dataset.num_requests, args.disable_tqdm, desc)
    before = await backend.server_info()
    try:
        outputs, duration = await run_dataset(backend, dataset, max_concurrency=args.max_concurrency, progress=progress,
                                              tokenizer=info.tokenizer if needs_tokenizer else None)
    finally:
        progress.close()
    metrics = compute_metrics(outputs, duration, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    by_class = metrics_by_class(outputs, duration, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    if by_class:
        metrics["by_class"] = by_class
    after = await backend.server_info()
    busy = device_busy(before, after, duration)
    if busy is not None:
        metrics["device_busy"] = busy
    return RunResult(rate, outputs, duration, metrics, after)


def device_busy(before: dict[str, Any], after: dict[str, Any], duration_s: float) -> float | None:
    """The server's forward time over the run's wall time (actorserve reports `forward_s`; other
    servers do not, then None): how much of the run the device was computing."""
    start, end = (info.get("stats", {}).get("forward_s") for info in (before, after))
    if start is None or end is None or duration_s <= 0:
        return None
    return (end - start) / duration_s


async def amain(args: argparse.Namespace) -> list[RunResult]:
    extra = dict(args.extra_request_body)
    if args.engine:
        from api.frontend.engine import Engine

        kwargs = engine_kwargs(args)
        async with Engine(**kwargs) as engine:
            # As `actorserve serve` does: torch's objects out of the collector's view, or each full
            # collection stalls the loop (engine and load generator alike) for a long moment.
            if FREEZE_AFTER_START:
                gc.collect()
                gc.freeze()
            backend: Backend = EngineBackend(engine, extra)
            info = ModelInfo(kwargs["model_path"], args.tokenizer, args.vocab_size, engine=engine)
            return await _run_all(args, backend, info, str(engine.model_dir))
    _warn_engine_flags(args)
    backend = http = HttpBackend(args.backend, args.base_url, args.api_key, args.model, extra)
    try:
        server = await http.server_info()
        model_path = resolve_model_arg(args.model_path) or server.get("model_path")
        if http.model is None and args.backend != "native":
            http.model = await http.served_model()
        info = ModelInfo(model_path, args.tokenizer, args.vocab_size)
        return await _run_all(args, backend, info, model_path or server.get("served_model_name"))
    finally:
        await http.close()


async def _run_all(args: argparse.Namespace, backend: Backend, info: ModelInfo, model: str | None) -> list[RunResult]:
    backend.ignore_eos = not args.disable_ignore_eos
    sweep = args.rate_sweep is not None
    name = dataset_name(args, sweep)
    rates = args.rate_sweep if sweep else [args.request_rate]
    for note in {n for r in rates for n in _deviations(args, name, r)}:
        print(f"note: {note}", file=sys.stderr)
    chat_text = info.tokenizer().decode if backend.name == "openai-chat" else None
    await warm_up(backend, args.warmup_requests, info.vocab_size(), args.seed, chat_text)
    results = []
    if sweep:
        print(f"\nrate sweep: {name}, backend {backend.name}, {model}, burstiness {args.burstiness}, "
              f"max concurrency {args.max_concurrency or 'none'}, seed {args.seed}")
        print(sweep_header(), flush=True)
    for rate in rates:
        result = await run_once(args, backend, info, name, rate, f"{name} @ {format_rate(rate)} req/s")
        results.append(result)
        if sweep:
            print(sweep_row(rate, result.metrics), flush=True)
        else:
            header = {"Backend": backend.name, "Model": model, "Dataset": name, "Traffic request rate": format_rate(rate),
                      "Burstiness": args.burstiness, "Max request concurrency": args.max_concurrency or "not set"}
            print(format_table(result.metrics, header), flush=True)
        if args.output_file is not None:
            append_json_line(args.output_file, json_record(args, result, name, model, backend.name))
        for error in list(dict.fromkeys(o.error for o in result.outputs if not o.success))[:3]:
            print(f"failed request: {error}", file=sys.stderr)
    if sweep and (args.slo_ttft_ms is not None or args.slo_tpot_ms is not None):
        best = distserve_goodput([(r.rate, r.metrics["slo_attained"]) for r in results])
        print(f"DistServe goodput (highest rate with >= 90% of requests meeting the SLOs): "
              f"{'none' if best is None else format_rate(best) + ' req/s'}", flush=True)
    if args.plot is not None:
        from bench.serving_plot import plot_runs

        labels = [f"{format_rate(r.rate)} req/s" for r in results] if sweep else [f"{name} {backend.name}"]
        path = plot_runs(args.plot, list(zip(labels, [r.outputs for r in results])), log_x=args.plot_log_x)
        print(f"plot: {path}", file=sys.stderr)
    return results


def _warn_engine_flags(args: argparse.Namespace) -> None:
    changed = [f.name for f in msgspec.structs.fields(EngineConfig) if f.name != "model_path" and getattr(args, f.name) != f.default]
    if changed:
        print(f"note: engine flags apply with --engine only; ignored against a server: {', '.join(changed)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    import uvloop

    return uvloop.run(amain(parse_args(argv)))


if __name__ == "__main__":
    FREEZE_AFTER_START = True  # not under pytest: frozen objects would pile up over the suite
    main()
