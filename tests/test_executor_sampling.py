"""The Executor's per-step sampling tensors: kept across the steps of an unchanged running set,
rebuilt whenever a row's params differ (a request joined, left or was replaced)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from actors.executor import ModelStepRunner
from gpu.model_runner import ModelRunner, RunnerConfig
from runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class _Asked:
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class _Row:
    asked: _Asked


@dataclass(frozen=True, slots=True)
class _Batch:
    """What `_sampling_info` reads of a Batch: its rows' params."""

    reqs: list[_Row]


def _batch(*params: SamplingParams) -> _Batch:
    return _Batch([_Row(_Asked(p)) for p in params])


@pytest.fixture(scope="module")
def step_runner(tiny_model_factory) -> ModelStepRunner:
    config = RunnerConfig(model_path=str(tiny_model_factory("llama")), context_length=64, max_total_tokens=256, max_running_requests=2)
    return ModelStepRunner(ModelRunner(config))


def test_sampling_info_is_kept_only_while_every_row_keeps_its_params(step_runner: ModelStepRunner) -> None:
    greedy = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={5: 100.0})
    first = step_runner._sampling_info(_batch(greedy))  # type: ignore[arg-type]
    assert step_runner._sampling_info(_batch(greedy)) is first  # the next decode step: not rebuilt
    joined = step_runner._sampling_info(_batch(greedy, biased))  # type: ignore[arg-type]
    assert joined.batch_size == 2 and joined.logit_bias is not None
    assert step_runner._sampling_info(_batch(greedy, biased)) is joined  # type: ignore[arg-type]
    # Same size, another request in the row: its own params, not the kept ones.
    replaced = step_runner._sampling_info(_batch(biased))  # type: ignore[arg-type]
    assert replaced.batch_size == 1 and replaced.logit_bias is not None
    # Equal params of another request are other objects: rebuilt, and equal in what they say.
    other = step_runner._sampling_info(_batch(SamplingParams(temperature=0.0)))  # type: ignore[arg-type]
    assert other is not first and other.logit_bias is None and other.all_greedy
