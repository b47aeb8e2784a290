"""Prompt (input) logprobs: `return_logprob` with `logprob_start_len`, as SGLang's native API has.

The oracle is transformers' forward over the whole prompt: the logprob of prompt token t is
log_softmax(logits at position t - 1)[token t].
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.output import OutputProcessor
from api.frontend.engine import Engine, InvalidRequest
from runtime.messages import InputLogprobs
from runtime.req import CallerRequest, Req
from runtime.sampling_params import SamplingParams
from tests.engine_helpers import assert_idle_invariants, close_and_check_tasks

GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]
REFERENCE_DTYPE = "float32"  # the oracle's dtype: values are compared to 1e-4


@pytest.fixture(scope="module")
def model_path(tiny_llama: Path) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def reference(model_path: str) -> torch.Tensor:
    """[prompt_len, vocab] log_softmax of transformers' logits over PROMPT."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, REFERENCE_DTYPE))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def _expected(reference: torch.Tensor, start: int) -> list[float]:
    return [reference[t - 1, PROMPT[t]].item() for t in range(max(start, 1), len(PROMPT))]


async def test_prompt_logprobs_over_chunks_match_transformers(core_mode: dict, model_path: str, reference: torch.Tensor) -> None:
    engine = Engine(model_path=model_path, **core_mode, dtype=REFERENCE_DTYPE, chunked_prefill_size=16)  # 40 tokens: three chunks
    async with engine:
        out = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
        assert out.input_token_ids == PROMPT
        assert out.input_logprobs[0] is None  # nothing scores the first token
        assert out.input_logprobs[1:] == pytest.approx(_expected(reference, 0), abs=1e-4)
        assert out.input_top_logprobs[0] == []
        for t in range(1, len(PROMPT)):
            values, ids = reference[t - 1].topk(3)
            assert [i for i, _ in out.input_top_logprobs[t]] == ids.tolist()
            assert [v for _, v in out.input_top_logprobs[t]] == pytest.approx(values.tolist(), abs=1e-4)
        assert len(out.logprobs) == 3  # output logprobs are unchanged
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_prompt_logprobs_from_a_position_behind_a_cached_prefix(core_mode: dict, model_path: str, reference: torch.Tensor) -> None:
    engine = Engine(model_path=model_path, **core_mode, dtype=REFERENCE_DTYPE)
    async with engine:
        await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)  # the whole prompt is cached now
        again = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert again.cached_tokens == len(PROMPT) - 1
        out = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=30)
        # Position 29 scores token 30, so only 29 tokens may come from the cache.
        assert out.cached_tokens == 29
        assert out.input_token_ids == PROMPT[30:]
        assert out.input_logprobs == pytest.approx(_expected(reference, 30), abs=1e-4)
        assert out.input_top_logprobs == []
        plain = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
        assert plain.input_logprobs == [] and plain.input_token_ids == []  # -1: output logprobs only
        off = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY, logprob_start_len=0)
        assert off.input_logprobs == []  # without return_logprob nothing is scored
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_max_new_tokens_zero_only_scores_the_prompt(core_mode: dict, model_path: str, reference: torch.Tensor) -> None:
    engine = Engine(model_path=model_path, **core_mode, dtype=REFERENCE_DTYPE)
    async with engine:
        sampling = {**GREEDY, "max_new_tokens": 0}
        out = await engine.generate(input_ids=PROMPT, sampling_params=sampling, return_logprob=True, logprob_start_len=0)
        assert out.output_ids == [] and out.text == "" and out.completion_tokens == 0 and out.finish_reason == "length"
        assert out.input_logprobs[1:] == pytest.approx(_expected(reference, 0), abs=1e-4)
        streamed = [d async for d in engine.stream(input_ids=PROMPT, sampling_params=sampling)]
        assert [d.output_ids for d in streamed] == [[]] and streamed[-1].finish_reason == "length"
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


async def test_bad_logprob_start_len_names_the_field(core_mode: dict, model_path: str) -> None:
    engine = Engine(model_path=model_path, **core_mode)
    async with engine:
        for bad in (-2, len(PROMPT)):
            with pytest.raises(InvalidRequest, match="logprob_start_len") as exc:
                await engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=bad)
            assert exc.value.param == "logprob_start_len"
            assert f"{len(PROMPT)}-token prompt" in str(exc.value)
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)


def test_a_prompt_computed_again_adds_no_duplicates() -> None:
    """A preempted request prefills its prompt again: already recorded positions are skipped."""
    req = Req(CallerRequest(rid="r", input_ids=list(range(10, 20)), sampling=SamplingParams(), logprob_start_len=0))
    OutputProcessor._add_input_logprobs(req, InputLogprobs(start=1, logprobs=[-1.0, -2.0, -3.0], top_logprobs=None))
    OutputProcessor._add_input_logprobs(req, InputLogprobs(start=1, logprobs=[-1.0, -2.0, -3.0, -4.0], top_logprobs=None))
    OutputProcessor._add_input_logprobs(req, InputLogprobs(start=5, logprobs=[-5.0], top_logprobs=None))
    assert req.out.input_logprobs == [None, -1.0, -2.0, -3.0, -4.0, -5.0]
    assert req.out.unsent is not None
    assert req.out.unsent.input_token_ids == list(range(10, 16))
    assert req.out.unsent.input_logprobs == req.out.input_logprobs


async def test_one_token_prompt_scores_its_token_as_none(core_mode: dict, model_path: str) -> None:
    engine = Engine(model_path=model_path, **core_mode)
    async with engine:
        out = await engine.generate(input_ids=[5], sampling_params={**GREEDY, "max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        assert out.input_token_ids == [5] and out.input_logprobs == [None]
        await assert_idle_invariants(engine)
    await close_and_check_tasks(engine)
