"""SGLang's launch flags with SGLang's meaning: the KV pool from --mem-fraction-static, the
model's sampling defaults, --preferred-sampling-params, the tokenizer flags, --random-seed,
--enable-deterministic-inference, --load-format and the watchdog."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import gpu.model_runner
from api.core.engine_core import CoreSetup
from api.frontend.engine import Engine, InvalidRequest
from api.launch import CHAT_TEMPLATES, IdsOnlyTokenizer, chat_template_text, load_tokenizer
from api.server.app import Server, ServerSettings, serve, start_site, stop_site
from api.server.watchdog import Watchdog
from gpu.model_runner import ModelRunner, RunnerConfig
from runtime.config import EngineConfig
from runtime.messages import Batch
from tests.engine_helpers import assert_idle_invariants

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}


# --- --mem-fraction-static ----------------------------------------------------------------------
def test_mem_fraction_static_sizes_the_pool_from_available_ram(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the pool is fraction x MemAvailable at start - the weights' bytes (SGLang's rule,
    with the weights standing for what loading them took)."""
    available = 96 * 2**20
    monkeypatch.setattr(gpu.model_runner, "available_memory_bytes", lambda device: available)
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama), dtype="float32", mem_fraction_static=0.25, max_running_requests=256))
    expected = (int(0.25 * available) - runner.weight_bytes()) // runner.kv_bytes_per_token()
    assert expected < 256 * runner.context_len  # the fraction decides, not the cap
    assert runner.allocator.size == expected
    with pytest.raises(ValueError, match=r"no room for the KV pool: .* raise mem_fraction_static \(0.001\)"):
        ModelRunner(RunnerConfig(model_path=str(tiny_llama), dtype="float32", mem_fraction_static=0.001))


async def test_mem_fraction_static_reaches_the_engine(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu.model_runner, "available_memory_bytes", lambda device: 64 * 2**20)
    async with Engine(model_path=str(tiny_llama), inline_core=True, dtype="float32", mem_fraction_static=0.5) as engine:
        runner = engine.runner
        assert runner is not None
        assert engine.config.max_total_tokens == (32 * 2**20 - runner.weight_bytes()) // runner.kv_bytes_per_token()


def test_mem_fraction_static_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mem_fraction_static must be in \(0, 1\), got 1.5"):
        EngineConfig(mem_fraction_static=1.5)


# --- sampling defaults ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a generation_config.json that makes chat requests greedy by default."""
    path = tmp_path_factory.mktemp("defaults") / "tiny-greedy"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_p": 0.9}))
    return path


async def _chat(session: aiohttp.ClientSession, url: str, **fields: Any) -> list[int]:
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "logprobs": True, "seed": 1, **fields}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    return [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("sampling_defaults", ["model", "openai"])
async def test_generation_config_temperature_applies_when_the_request_gives_none(model_with_defaults: Path, sampling_defaults: str) -> None:
    engine = Engine(model_path=str(model_with_defaults), inline_core=True, sampling_defaults=sampling_defaults)
    await engine.start()
    runner, port = await start_site(Server(engine, ServerSettings()), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            greedy = await _chat(session, url, temperature=0.0)
            sampled = await _chat(session, url, temperature=1.0)  # seeded: the same draw every run
            assert sampled != greedy  # so the two cases below are told apart
            left_out = await _chat(session, url)
            # Close, not equal: the later requests find the prompt cached and extend past it (other float rounding).
            assert left_out == pytest.approx(greedy if sampling_defaults == "model" else sampled, abs=1e-4)
    finally:
        await stop_site(runner, engine)


# --- --preferred-sampling-params ---------------------------------------------------------------
async def test_preferred_sampling_params_fill_what_the_request_leaves_out(tiny_llama: Path) -> None:
    async with Engine(model_path=str(tiny_llama), inline_core=True, preferred_sampling_params={"max_new_tokens": 3, "ignore_eos": True}) as engine:
        assert len((await engine.generate(input_ids=[1, 2, 3])).output_ids) == 3
        assert len((await engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 5})).output_ids) == 5


def test_preferred_sampling_params_must_be_sampling_params() -> None:
    with pytest.raises(ValueError, match="preferred_sampling_params.*temprature"):
        EngineConfig(preferred_sampling_params={"temprature": 0.5})


# --- tokenizer flags -----------------------------------------------------------------------------
def test_chat_template_by_name_or_jinja_file(tmp_path: Path) -> None:
    assert chat_template_text("chatml") == CHAT_TEMPLATES["chatml"]
    jinja = tmp_path / "t.jinja"
    jinja.write_text("\n{{ messages[0]['content'] }}\\n\n")
    assert chat_template_text(str(jinja)) == "{{ messages[0]['content'] }}\n"  # SGLang's reading: strip, unescape
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(ValueError, match="--chat-template .*t.json: only Jinja files"):
        chat_template_text(str(tmp_path / "t.json"))
    with pytest.raises(FileNotFoundError, match="--chat-template nope: not a built-in template name"):
        chat_template_text("nope")


def test_tokenizer_path_and_chat_template_are_used(tiny_llama: Path, tmp_path: Path) -> None:
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, tokenizer_dir / name)
    config = EngineConfig(tokenizer_path=str(tokenizer_dir), chat_template="chatml")
    tokenizer = load_tokenizer(config, tmp_path / "not-a-model")  # the model directory is not read for it
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(FileNotFoundError, match="--tokenizer-path .*missing: no such directory"):
        load_tokenizer(EngineConfig(tokenizer_path=str(tmp_path / "missing")), tiny_llama)


async def test_skip_tokenizer_init_takes_ids_and_answers_ids(tiny_llama: Path, core_mode: dict[str, bool]) -> None:
    async with Engine(model_path=str(tiny_llama), skip_tokenizer_init=True, **core_mode) as engine:
        assert isinstance(engine.tokenizer, IdsOnlyTokenizer)
        out = await engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert len(out.output_ids) == 6 and out.text == ""
        with pytest.raises(InvalidRequest, match="--skip-tokenizer-init: send input_ids"):
            await engine.generate("hello", sampling_params=GREEDY)
        for field, value in [("json_schema", '{"type": "object"}'), ("regex", "a+"), ("stop", ["ab"])]:
            with pytest.raises(InvalidRequest, match=f"{field} needs a tokenizer"):
                await engine.generate(input_ids=[1, 2], sampling_params={**GREEDY, field: value})
        await assert_idle_invariants(engine)


# --- --random-seed, --enable-deterministic-inference --------------------------------------------
async def _unseeded_sample(model: Path, **kwargs: Any) -> list[int]:
    async with Engine(model_path=str(model), inline_core=True, **kwargs) as engine:
        return (await engine.generate(input_ids=[4, 5, 6], sampling_params={"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 12})).output_ids


async def test_random_seed_makes_unseeded_sampling_repeat(tiny_llama: Path) -> None:
    first = await _unseeded_sample(tiny_llama, random_seed=7)
    assert await _unseeded_sample(tiny_llama, random_seed=7) == first
    assert await _unseeded_sample(tiny_llama, random_seed=8) != first


async def test_deterministic_inference_gives_one_answer_whatever_runs_beside_it(tiny_llama: Path) -> None:
    async with Engine(model_path=str(tiny_llama), inline_core=True, enable_deterministic_inference=True) as engine:
        assert engine.config.max_running_requests == 1 and engine.config.disable_radix_cache
        sampling = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 10}
        alone = await engine.generate(input_ids=[4, 5, 6], sampling_params=sampling, return_logprob=True)
        crowd = [engine.generate(input_ids=[9, 8, 7, k], sampling_params=sampling) for k in range(4)]
        again, *_ = await asyncio.gather(engine.generate(input_ids=[4, 5, 6], sampling_params=sampling, return_logprob=True), *crowd)
        assert again.output_ids == alone.output_ids and again.logprobs == alone.logprobs
    with pytest.raises(ValueError, match="enable_deterministic_inference runs one request per batch"):
        EngineConfig(enable_deterministic_inference=True, max_running_requests=4)


# --- --load-format, --kv-cache-dtype ------------------------------------------------------------
async def test_load_format_must_match_the_model(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="--load-format gguf: the model .* is not a .gguf file"):
        await Engine(model_path=str(tiny_llama), load_format="gguf").start()
    with pytest.raises(ValueError, match="load_format 'pt' is not supported"):
        EngineConfig(load_format="pt")


def test_kv_cache_dtype_is_the_models_or_refused() -> None:
    assert EngineConfig(kv_cache_dtype="bf16", dtype="bfloat16").kv_cache_dtype == "bf16"
    with pytest.raises(ValueError, match="kv_cache_dtype bf16 needs dtype bfloat16"):
        EngineConfig(kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e4m3' is not supported: .*no fp8/fp4 KV"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")


# --- --watchdog-timeout ----------------------------------------------------------------------------
def test_watchdog_flags_a_replica_that_runs_requests_without_finishing_steps() -> None:
    dog = Watchdog(10.0)
    busy = {"forward_steps": 5, "num_running": 2}
    assert dog.check(busy, now=0.0) is None
    assert dog.check(busy, now=9.0) is None
    assert "no forward step in 11 s with 2 requests running" in (dog.check(busy, now=11.0) or "")
    idle = Watchdog(10.0)  # no request running: waiting is not hanging
    assert idle.check({"forward_steps": 5, "num_running": 0}, 0.0) is None
    assert idle.check({"forward_steps": 5, "num_running": 0}, 100.0) is None
    moving = Watchdog(10.0)
    for t in range(0, 100, 5):
        assert moving.check({"forward_steps": t, "num_running": 1}, float(t)) is None
    replicas = Watchdog(10.0)  # one hung replica among moving ones is found
    stats = lambda t: {"replicas": [{"forward_steps": t, "num_running": 1}, {"forward_steps": 3, "num_running": 1}]}  # noqa: E731
    assert replicas.check(stats(0), 0.0) is None
    assert "replica 1" in (replicas.check(stats(20), 20.0) or "")


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HangingDevice:
    """A StepRunner whose step never finishes until the executor closes it."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def run(self, batch: Batch) -> Any:
        self.released.wait(60)  # a bound on hanging
        raise RuntimeError("the hung step was released")

    def close(self) -> None:
        self.released.set()


def hanging_device(runner: ModelRunner) -> HangingDevice:
    """CoreSetup step runner."""
    return HangingDevice()


async def test_a_hung_step_fails_the_server_loudly(tiny_llama: Path, free_port: int) -> None:
    setup = CoreSetup(step_runner="tests.test_launch_flags:hanging_device")
    settings = ServerSettings(port=free_port, watchdog_timeout_s=0.5)
    serving = asyncio.ensure_future(serve({"model_path": str(tiny_llama), "inline_core": True, "core_setup": setup}, settings))
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"http://127.0.0.1:{free_port}/health") as response:
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            body = {"input_ids": [1, 2, 3], "sampling_params": GREEDY}
            async with session.post(f"http://127.0.0.1:{free_port}/generate", json=body) as response:
                assert response.status == 500
                assert "watchdog: the engine core finished no forward step" in (await response.json())["error"]["message"]
        assert await asyncio.wait_for(serving, 30) == 1  # a bound on hanging, not a timing
    finally:
        serving.cancel()
