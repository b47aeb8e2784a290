"""Every SGLang 0.5.7 server flag is honoured, accepted, or refused by name with a reason: never
argparse's "unrecognized arguments". The list is read from the sglang wheel's server_args.py
(parsed, not imported: importing needs sglang's dependencies)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path

import pytest

from api.cli import _parser
from api.server.sglang_flags import COMPATIBLE, DEFAULT_ONLY, REFUSED

# Values that our parser accepts for SGLang flags whose generic sample (below) it would refuse.
VALUES = {
    "--attention-backend": "torch",
    "--device": "cpu",
    "--dist-init-addr": "127.0.0.1:5000",
    "--nccl-init-addr": "127.0.0.1:5000",
    "--dtype": "half",
    "--kv-cache-dtype": "auto",
    "--load-format": "auto",
    "--load-balance-method": "round_robin",
    "--log-level": "info",
    "--preferred-sampling-params": '{"temperature": 0.5}',
    "--radix-eviction-policy": "lru",
    "--sampling-defaults": "openai",
    "--schedule-policy": "lpm",
    "--log-requests-level": "1",
    "--log-requests-format": "json",
}
SAMPLES = {"int": "1", "float": "0.5", "json.loads": "{}"}


def _server_args_source() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "srt" / "server_args.py"
    return path if path.is_file() else None


def sglang_flags(source: Path) -> dict[str, str | None]:
    """Each option string of SGLang's server parser -> the type of its value (None: a switch)."""
    flags: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            switch = keywords.get("action") in ("'store_true'", "'store_false'")
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    flags[arg.value] = None if switch else keywords.get("type", "str")
    return flags


@pytest.fixture(scope="module")
def wheel_flags() -> dict[str, str | None]:
    source = _server_args_source()
    if source is None:
        pytest.skip("the sglang wheel is not installed (pip install --no-deps sglang==0.5.7): its flag list is read from it")
    flags = sglang_flags(source)
    assert len(flags) > 300, f"{source}: only {len(flags)} flags found; has the file's layout changed?"
    return flags


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return _parser()


def _parse(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[argparse.Namespace | None, str]:
    try:
        args = parser.parse_args(["serve", *argv])
    except SystemExit:
        return None, capsys.readouterr().err
    return args, capsys.readouterr().err


def _sample(flag: str, source_type: str) -> str:
    if flag in DEFAULT_ONLY:
        return DEFAULT_ONLY[flag].values[0]
    return VALUES.get(flag, SAMPLES.get(source_type, "x"))


def test_every_sglang_flag_is_honoured_accepted_or_refused_by_name(
    parser: argparse.ArgumentParser, wheel_flags: dict[str, str | None], capsys: pytest.CaptureFixture[str]
) -> None:
    unknown = [f for f in [*REFUSED, *COMPATIBLE, *DEFAULT_ONLY] if f not in wheel_flags]
    assert not unknown, f"not SGLang 0.5.7 flags (typos?): {unknown}"
    for flag, value_type in wheel_flags.items():
        argv = [flag] if value_type is None else [flag, _sample(flag, value_type)]
        args, err = _parse(parser, capsys, *argv)
        assert "unrecognized arguments" not in err, (argv, err)
        if args is not None:
            continue  # honoured, or accepted for compatibility
        refused = f"error: {flag} is not supported: "
        # Refused by name with its reason, or a value of a flag we take refused by argparse, naming it.
        assert (refused in err and REFUSED.get(flag, "?") in err) or (f"error: argument {flag}" in err or f"/{flag}:" in err), (argv, err)


def test_default_only_flags_refuse_other_values_by_name(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]) -> None:
    args, _ = _parse(parser, capsys, "--tokenizer-worker-num", "1", "--pp-size", "1", "--model-impl", "sglang")
    assert args is not None
    args, err = _parse(parser, capsys, "--tokenizer-worker-num", "4")
    assert args is None and "argument --tokenizer-worker-num: 4 is not supported: one tokenizer" in err


def test_refusals_name_the_flag_and_why(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, expected in [
        (["--lora-paths", "a=/x", "b=/y"], "--lora-paths is not supported: no LoRA adapters here"),
        (["--revision", "main"], "--revision is not supported: models are never downloaded here"),
        (["--download-dir", "/data"], "--download-dir is not supported: models are never downloaded here"),
        (["--enable-lora"], "--enable-lora is not supported"),
        (["--load-format", "pt"], "argument --load-format: pt is not supported: actorserve loads safetensors"),
        (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: fp8_e5m2 is not supported"),
        (["--load-balance-method", "minimum_tokens"], "argument --load-balance-method: minimum_tokens is not supported"),
    ]:
        args, err = _parse(parser, capsys, *argv)
        assert args is None and expected in err and "unrecognized" not in err, (argv, err)


def test_sglang_spellings_set_our_settings(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]) -> None:
    args, err = _parse(
        parser, capsys, "--model", "/m", "--tensor-parallel-size", "2", "--data-parallel-size", "3", "--dtype", "half",
        "--dist-timeout", "60", "--load-balance-method", "shortest_queue", "--preferred-sampling-params", '{"top_k": 5}',
        "--mem-fraction-static", "0.8", "--enable-metrics", "--enable-cache-report", "--log-requests",
    )
    assert args is not None, err
    assert (args.model_path, args.tp_size, args.dp_size, args.dtype, args.dist_timeout_s) == ("/m", 2, 3, "float16", 60.0)
    assert args.router_policy == "shortest_queue" and args.preferred_sampling_params == {"top_k": 5}
    assert args.mem_fraction_static == 0.8 and args.log_requests
    args, err = _parse(parser, capsys, "--preferred-sampling-params", "[1]")
    assert args is None and "argument --preferred-sampling-params: must be a JSON object" in err
