"""Request decoding and conversion, response shapes and the serve flags: no engine needed."""

from __future__ import annotations

import argparse
import re

import msgspec
import pytest

from api.server import cli as serve_cli
from api.server.chat_tools import ChatPlan
from api.server.openai_response import ChatStream, Choice, completion_response, generate_body, usage
from api.server.openai_schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    chat_calls,
    chat_messages,
    completion_calls,
    completion_prompts,
    decode,
    generate_calls,
)
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.stream import Delta



def _completion(**fields) -> CompletionRequest:
    return decode(msgspec.json.encode({"prompt": "hi", **fields}), CompletionRequest)


def _chat(**fields) -> ChatCompletionRequest:
    return decode(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **fields}), ChatCompletionRequest)


def _error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


def test_malformed_json_is_400() -> None:
    err = _error(decode, b'{"prompt": "x"', CompletionRequest)
    assert err.code == "invalid_json"
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
        (b'{"prompt": 3}', "prompt"),
        (b'{"prompt": "x", "temperature": [1]}', "temperature"),
        (b'{"max_tokens": 3}', "prompt"),
        (b"[]", None),
    ],
)
def test_wrong_types_name_the_field(body: bytes, param: str | None) -> None:
    assert _error(decode, body, CompletionRequest).param == param


def test_unknown_fields_are_ignored() -> None:
    req = decode(b'{"prompt": "x", "user": "u", "parallel_tool_calls": true, "whatever": 1}', CompletionRequest)
    assert req.prompt == "x"


def test_completion_defaults_to_sglang_sampling() -> None:
    rid, [call] = completion_calls(_completion())
    assert call.options["rid"] == rid and call.prompt == "hi" and call.input_ids is None
    params = msgspec.convert(call.sampling, SamplingParams)  # every key is a SamplingParams field
    assert params.max_new_tokens == 16 and params.temperature == 1.0 and params.stop == []
    assert call.options["return_logprob"] is False


def test_completion_extras_and_stop() -> None:
    req = _completion(
        max_tokens=5, stop="\n", top_k=3, min_p=0.1, ignore_eos=True, stop_token_ids=[7], min_tokens=2,
        repetition_penalty=1.1, priority=4, rid="abc", routing_key="r", seed=9, logprobs=2, tenant="t", slo_ttft_ms=250,
    )
    rid, [call] = completion_calls(req)
    assert rid == "abc"
    s = call.sampling
    assert (s["max_new_tokens"], s["stop"], s["top_k"], s["min_p"], s["ignore_eos"]) == (5, ["\n"], 3, 0.1, True)
    assert (s["stop_token_ids"], s["min_new_tokens"], s["repetition_penalty"], s["seed"]) == ([7], 2, 1.1, 9)
    assert call.options == {
        "rid": "abc", "priority": 4, "routing_key": "r", "extra_key": None, "return_logprob": True, "top_logprobs_num": 2,
        "tenant": "t", "slo_ttft_ms": 250, "deadline_ms": None,
    }


def test_cache_salt_and_extra_key_make_one_namespace() -> None:
    assert completion_calls(_completion(cache_salt="s"))[1][0].options["extra_key"] == "s"
    assert completion_calls(_completion(extra_key="e"))[1][0].options["extra_key"] == "e"
    both = completion_calls(_completion(cache_salt="s", extra_key="e"))[1][0].options["extra_key"]
    assert both not in ("s", "e", None)


def test_prompt_forms() -> None:
    assert completion_prompts("a") == [("a", None)]
    assert completion_prompts([1, 2]) == [(None, [1, 2])]
    assert completion_prompts(["a", "b"]) == [("a", None), ("b", None)]
    assert completion_prompts([[1], [2, 3]]) == [(None, [1]), (None, [2, 3])]
    for bad in ([], [1, "a"], [[]], [True]):
        _error(completion_prompts, bad)


def test_batch_times_n_fans_out_in_openai_order() -> None:
    rid, calls = completion_calls(_completion(prompt=["a", "b"], n=2, seed=5, rid="x"))
    assert rid == "x"
    assert [(c.index, c.prompt_index, c.prompt) for c in calls] == [(0, 0, "a"), (1, 0, "a"), (2, 1, "b"), (3, 1, "b")]
    assert [c.options["rid"] for c in calls] == ["x-0", "x-1", "x-2", "x-3"]
    assert [c.sampling["seed"] for c in calls] == [5, 6, 5, 6]  # choices of one prompt differ
    rid, calls = completion_calls(_completion(n=3))
    assert len({c.options["rid"] for c in calls}) == 3 and all(c.options["rid"].startswith(rid) for c in calls)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 99}, "logprobs"),
        ({"rid": ["a", "b"]}, "rid"),
    ],
)
def test_completion_refusals(fields: dict, param: str) -> None:
    assert _error(completion_calls, _completion(**fields)).param == param


def test_logit_bias_goes_to_the_engine() -> None:
    _, [call] = completion_calls(_completion(logit_bias={"50": -100}))
    assert call.sampling["logit_bias"] == {"50": -100}


def test_completion_echo_scores_the_prompt() -> None:
    _, [call] = completion_calls(_completion(echo=True, max_tokens=0, logprobs=2))
    assert call.sampling["max_new_tokens"] == 0  # the engine prefills only
    assert call.options["logprob_start_len"] == 0 and call.options["top_logprobs_num"] == 2
    _, [call] = completion_calls(_completion(echo=True))
    assert "logprob_start_len" not in call.options  # echo without logprobs scores nothing


def test_chat_messages_and_limits() -> None:
    req = _chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "n"},
    ])
    assert chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab", "name": "n"}]
    _, [call] = chat_calls(_chat(max_tokens=9, max_completion_tokens=4, logprobs=True, top_logprobs=3), [1, 2])
    assert call.input_ids == [1, 2] and call.sampling["max_new_tokens"] == 4
    assert call.options["return_logprob"] is True and call.options["top_logprobs_num"] == 3
    _, [call] = chat_calls(_chat(), [1])
    assert call.sampling["max_new_tokens"] is None  # no limit: up to the context (the engine fills it in)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_chat_message_refusals(fields: dict, param: str) -> None:
    assert _error(chat_messages, _chat(**fields)).param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_chat_refusals(fields: dict, param: str) -> None:
    assert _error(chat_calls, _chat(**fields), [1]).param == param


def test_generate_single_and_batch() -> None:
    req = decode(b'{"text": "hi", "sampling_params": {"max_new_tokens": 3}, "rid": "r", "return_logprob": true}', GenerateRequest)
    [call], batch = generate_calls(req)
    assert not batch and call.prompt == "hi" and call.sampling == {"max_new_tokens": 3}
    assert call.options["rid"] == "r" and call.options["return_logprob"] is True
    req = decode(b'{"input_ids": [[1, 2], [3]], "sampling_params": [{"temperature": 0}, {"max_new_tokens": 1}]}', GenerateRequest)
    calls, batch = generate_calls(req)
    assert batch and [c.input_ids for c in calls] == [[1, 2], [3]] and calls[1].sampling == {"max_new_tokens": 1}


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b'{"text": "a", "input_ids": [1]}',
        b'{"input_ids": []}',
        b'{"input_ids": [1, [2]]}',
        b'{"text": ["a", "b"], "sampling_params": [{}]}',
    ],
)
def test_generate_refusals(body: bytes) -> None:
    _error(generate_calls, decode(body, GenerateRequest))


def _finished(choice: Choice, text: str, ids: list[int], reason: str, prompt: int, cached: int = 0) -> Choice:
    choice.add(Delta(rid="r", text=text, output_ids=ids, logprobs=[-0.5] * len(ids), top_logprobs=[[(ids[0], -0.5)]] * len(ids),
                     finish_reason=reason, matched_stop=None, prompt_tokens=prompt, completion_tokens=len(ids), cached_tokens=cached))
    return choice


def test_usage_counts_each_prompt_once() -> None:
    choices = [
        _finished(Choice(0, 0), "a", [1, 2], "length", 5, 2),
        _finished(Choice(1, 0), "b", [3], "stop", 5, 2),
        _finished(Choice(2, 1), "c", [4], "stop", 7),
    ]
    assert usage(choices) == {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16, "prompt_tokens_details": {"cached_tokens": 2}}


def test_response_shapes() -> None:
    choice = _finished(Choice(0, 0), "ab", [1, 2], "length", 3)
    body = completion_response("id", "m", 1, [choice], lambda t: f"<{t}>")
    [c] = body["choices"]
    assert c["text"] == "ab" and c["finish_reason"] == "length"
    assert c["logprobs"]["tokens"] == ["<1>", "<2>"] and c["logprobs"]["text_offset"] == [0, 3]
    plain = ChatPlan("none", (), None, None, None, None)
    [chunk] = ChatStream("id", "m", 1, [(0, 0)], plain, lambda t: "x").chunks(0, Delta(rid="r", text="x", output_ids=[1], logprobs=[-1.0], top_logprobs=[[(1, -1.0)]]))
    [c] = chunk["choices"]
    assert c["delta"] == {"content": "x"} and c["finish_reason"] is None
    assert c["logprobs"]["content"][0] == {"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": [{"token": "x", "logprob": -1.0, "bytes": [120]}]}
    native = generate_body(choice, 0.5, logprobs=True, token_text=None)
    assert native["text"] == "ab" and native["output_ids"] == [1, 2]
    assert native["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert native["meta_info"]["output_token_logprobs"] == [[-0.5, 1, None], [-0.5, 2, None]]


# --- serve flags ------------------------------------------------------------------------------
def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return parser


def test_every_engine_field_is_a_flag_and_the_defaults_are_sglangs() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    serve_cli.add_parser(commands)
    listed = set(re.findall(r"--[a-z0-9-]+", commands.choices["serve"].format_help()))
    wanted = ["--" + f.name.replace("_", "-") for f in msgspec.structs.fields(EngineConfig)]
    assert [flag for flag in wanted if flag not in listed] == []
    args = parser.parse_args(["serve"])
    # SGLang's values (/work/shared/reference/sglang-behaviour.md, "Constants"), not read from EngineConfig.
    sglang = {
        "schedule_policy": "fcfs", "max_prefill_tokens": 16384, "priority_scheduling_preemption_threshold": 10,
        "lpm_fallback_queue_len": 128, "schedule_conservativeness": 1.0, "page_size": 1,
        "enable_priority_scheduling": False, "disable_radix_cache": False,
    }
    assert {name: getattr(args, name) for name in sglang} == sglang
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 30000, None)


def test_sglang_spelling_parses() -> None:
    args = _serve_parser().parse_args([
        "serve", "--schedule-policy", "lpm", "--chunked-prefill-size", "512", "--enable-priority-scheduling",
        "--max-queued-requests", "8", "--queue-timeout-s", "2.5", "--context-length", "none", "--port", "0",
    ])
    config = EngineConfig(**serve_cli.engine_kwargs(args))
    assert config.schedule_policy == "lpm" and config.chunked_prefill_size == 512
    assert config.enable_priority_scheduling and config.max_queued_requests == 8 and config.queue_timeout_s == 2.5
    assert config.context_length is None


def test_help_lists_flags_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for field in msgspec.structs.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in out
    assert "(default: fcfs)" in out and "(default: 8192)" in out
