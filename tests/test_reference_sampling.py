"""Output logprobs and penalties end to end, against references outside our sampler.

- Logprobs: transformers' forward over prompt + output (teacher forced) scores each generated
  token: log_softmax(logits at the position before it)[token], and its top k. Raw model scores,
  before temperature and penalties, as the sampler documents (gpu/sampler.py `_with_logprobs`).
- Repetition penalty: transformers' RepetitionPenaltyLogitsProcessor over prompt and output.
- Frequency and presence: a plain count of the output so far (OpenAI's definition).
Both penalty references decode greedily, one full forward per token, so nothing cached in them
can hide a difference; the engine runs with a cached prefix and with chunked prefill.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from api.frontend.engine import Engine
from api.server.app import ServerSettings
from tests.conftest import CORE_MODES
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks
from tests.test_server import ServerThread

PROMPT = [(11 * i + 7) % 300 + 20 for i in range(12)] * 2 + [21, 22, 23]  # repeats: penalties bite at once
NEW = 10
TOP = 3
ATOL = 1e-4  # float32 engine against float32 transformers
SEEDED = {"temperature": 0.8, "top_k": 50, "seed": 1234}


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _log_softmax(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of transformers' logits at each position of `ids`."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _scored(hf_model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: row i scores output token i (the position before it)."""
    return _log_softmax(hf_model, prompt + output)[len(prompt) - 1 : len(prompt) + len(output) - 1]


def _check_logprobs(rows: torch.Tensor, output: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]) -> None:
    assert len(logprobs) == len(top) == len(output)
    want = rows[torch.arange(len(output)), torch.tensor(output)]
    assert logprobs == pytest.approx(want.tolist(), abs=ATOL)
    values, ids = rows.topk(TOP, dim=-1)
    for step, row in enumerate(top):
        assert [t for t, _ in row] == ids[step].tolist(), f"step {step}"
        assert [v for _, v in row] == pytest.approx(values[step].tolist(), abs=ATOL), f"step {step}"


# --- logprobs ---------------------------------------------------------------------------------
async def test_output_logprobs_and_top_k_match_transformers(core_mode: dict, tiny_llama: Path, hf_model: Any) -> None:
    engine = Engine(model_path=str(tiny_llama), dtype="float32", **core_mode)
    async with engine:
        outs = [
            await engine.generate(
                input_ids=PROMPT, sampling_params={**sampling, "max_new_tokens": NEW, "ignore_eos": True},
                return_logprob=True, top_logprobs_num=TOP,
            )
            for sampling in ({"temperature": 0}, SEEDED)
        ]
        greedy = outs[0]
        for out in outs:
            _check_logprobs(_scored(hf_model, PROMPT, out.output_ids), out.output_ids, out.logprobs, out.top_logprobs)
        # Greedy: each token is transformers' top-1 at its step.
        assert greedy.output_ids == _scored(hf_model, PROMPT, greedy.output_ids).argmax(-1).tolist()
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_tensor_parallel_logprobs_match_transformers(tiny_llama: Path, hf_model: Any) -> None:
    """tp_size 2: each rank holds half the vocabulary's logits; the gathered scores are the model's."""
    engine = Engine(model_path=str(tiny_llama), dtype="float32", tp_size=2, core_threads=1, max_total_tokens=4096)
    async with engine:
        for sampling in ({"temperature": 0}, SEEDED):
            params = {**sampling, "max_new_tokens": NEW, "ignore_eos": True}
            out = await engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=TOP)
            _check_logprobs(_scored(hf_model, PROMPT, out.output_ids), out.output_ids, out.logprobs, out.top_logprobs)
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerThread]:
    engine = {"model_path": str(tiny_llama), "dtype": "float32", **CORE_MODES["core-process"]}
    with ServerThread(engine, ServerSettings(served_model_names=("tiny",))) as s:
        yield s


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_native_generate_logprobs_match_transformers(server: ServerThread, hf_model: Any) -> None:
    body = {
        "input_ids": PROMPT, "sampling_params": {**SEEDED, "max_new_tokens": NEW, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": TOP,
    }
    meta = (out := await _post(f"{server.url}/generate", body))["meta_info"]
    output = out["output_ids"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == output
    top = [[(t, v) for v, t, _ in row] for row in meta["output_top_logprobs"]]
    _check_logprobs(_scored(hf_model, PROMPT, output), output, [lp for lp, _, _ in meta["output_token_logprobs"]], top)


async def test_openai_completion_logprobs_match_transformers(server: ServerThread, hf_model: Any) -> None:
    """Greedy, so transformers alone gives the sequence; the OpenAI shape names tokens by text."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "logprobs": TOP}
    logprobs = (await _post(f"{server.url}/v1/completions", body))["choices"][0]["logprobs"]
    output: list[int] = []
    for _ in range(NEW):
        output.append(int(_log_softmax(hf_model, PROMPT + output)[-1].argmax()))
    rows = _scored(hf_model, PROMPT, output)
    assert logprobs["token_logprobs"] == pytest.approx(rows[torch.arange(NEW), torch.tensor(output)].tolist(), abs=ATOL)
    assert logprobs["token_logprobs"] == pytest.approx(rows.max(-1).values.tolist(), abs=ATOL)  # greedy: the top-1
    for step, row in enumerate(logprobs["top_logprobs"]):
        # Texts of distinct ids may coincide (a dict keeps one), so each value is one of the top k.
        want = rows[step].topk(TOP).values.tolist()
        assert 1 <= len(row) <= TOP and all(any(v == pytest.approx(w, abs=ATOL) for w in want) for v in row.values()), step


# --- penalties --------------------------------------------------------------------------------
def _penalised_greedy(hf_model: Any, prompt: list[int], new: int, *, repetition: float = 1.0, frequency: float = 0.0, presence: float = 0.0) -> list[int]:
    import transformers

    processor = transformers.RepetitionPenaltyLogitsProcessor(repetition) if repetition != 1.0 else None
    output: list[int] = []
    for _ in range(new):
        ids = prompt + output
        with torch.no_grad():  # raw logits: the repetition penalty's sign test reads them
            logits = hf_model(torch.tensor([ids])).logits[0, -1:].float()
        if processor is not None:
            logits = processor(torch.tensor([ids]), logits)
        counts = Counter(output)
        for token, n in counts.items():
            logits[0, token] -= frequency * n + presence
        output.append(int(logits.argmax()))
    return output


PENALTIES = {
    "repetition": {"repetition": 1.5},
    "frequency-presence": {"frequency": 1.0, "presence": 0.5},
    "all": {"repetition": 1.3, "frequency": 1.0, "presence": 0.5},
}


@pytest.fixture(scope="module")
def penalty_prompt(hf_model: Any) -> list[int]:
    """PROMPT and the model's own greedy continuation: the tokens it would say next are in the
    prompt already, and it repeats itself, so every penalty changes what it says."""
    return PROMPT + _penalised_greedy(hf_model, PROMPT, 20)


def _params(penalty: dict[str, float]) -> dict[str, Any]:
    return {
        "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True,
        "repetition_penalty": penalty.get("repetition", 1.0),
        "frequency_penalty": penalty.get("frequency", 0.0), "presence_penalty": penalty.get("presence", 0.0),
    }


@pytest.mark.parametrize("name", list(PENALTIES))
async def test_penalties_match_references_with_a_cached_prefix_and_chunked_prefill(
    tiny_llama: Path, hf_model: Any, penalty_prompt: list[int], name: str
) -> None:
    penalty, prompt = PENALTIES[name], penalty_prompt
    want = _penalised_greedy(hf_model, prompt, NEW, **penalty)
    assert want != _penalised_greedy(hf_model, prompt, NEW), "the penalty changes nothing here: no check"
    # Chunks of 8 split the prompt six ways; the prompt's first run leaves it in the radix cache.
    engine = Engine(model_path=str(tiny_llama), dtype="float32", inline_core=True, chunked_prefill_size=8)
    async with engine:
        chunked = await engine.generate(input_ids=prompt, sampling_params=_params(penalty), return_logprob=True)
        assert chunked.cached_tokens == 0 and chunked.output_ids == want
        # Logprobs stay the model's own scores, before any penalty.
        assert chunked.logprobs == pytest.approx(_scored(hf_model, prompt, want)[torch.arange(NEW), torch.tensor(want)].tolist(), abs=ATOL)
        cached = await engine.generate(input_ids=prompt, sampling_params=_params(penalty))
        assert cached.cached_tokens >= 16 and cached.output_ids == want  # prompt tokens from the cache count too
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


@pytest.mark.parametrize("core", list(CORE_MODES))
async def test_requests_with_different_penalties_in_one_batch_each_match_their_reference(
    tiny_llama: Path, hf_model: Any, penalty_prompt: list[int], core: str
) -> None:
    engine = Engine(model_path=str(tiny_llama), dtype="float32", **CORE_MODES[core])
    prompts = {name: penalty_prompt[i:] for i, name in enumerate([*PENALTIES, "none"])}
    penalties = {**PENALTIES, "none": {}}
    async with engine:
        outs = await asyncio.gather(*(engine.generate(input_ids=prompts[n], sampling_params=_params(penalties[n])) for n in penalties))
        for name, out in zip(penalties, outs):
            assert out.output_ids == _penalised_greedy(hf_model, prompts[name], NEW, **penalties[name]), name
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)
