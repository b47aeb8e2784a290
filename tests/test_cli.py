"""The `actorserve generate` command and its errors for bad input."""

from __future__ import annotations

import json

import pytest

from api.cli import main
from gpu.model_runner import ModelRunner, RunnerConfig
from gpu.offline import generate
from runtime.sampling_params import SamplingParams


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json(tiny_llama, capsys):
    code, out, _ = _run(capsys, "generate", "--model-path", str(tiny_llama), "--prompt", "hello world", "--max-new-tokens", "5", "--ignore-eos", "--json")
    assert code == 0
    record = json.loads(out)
    assert len(record["output_ids"]) == 5
    assert record["finish_reason"] == "length"
    assert isinstance(record["text"], str)


def test_generate_input_ids_is_deterministic_with_a_seed(tiny_qwen2, capsys):
    argv = ["generate", "--model-path", str(tiny_qwen2), "--input-ids", "5,6,7", "--max-new-tokens", "6", "--temperature", "1.0", "--seed", "3", "--ignore-eos", "--json"]
    first = json.loads(_run(capsys, *argv)[1])["output_ids"]
    second = json.loads(_run(capsys, *argv)[1])["output_ids"]
    assert first == second and len(first) == 6


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    code, _, err = _run(capsys, "generate", "--model-path", str(tmp_path / "nope"), "--prompt", "x")
    assert code == 2
    assert "does not exist" in err and "nope" in err
    assert "Traceback" not in err


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    code, _, err = _run(capsys, "generate", "--model-path", str(tmp_path), "--prompt", "x")
    assert code == 2
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err and "Qwen3ForCausalLM" in err


def test_prompt_longer_than_context_names_both_lengths(tiny_llama, capsys):
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama), context_length=64, max_total_tokens=256, max_running_requests=2))
    with pytest.raises(ValueError, match=r"100 tokens.*context length of 64"):
        generate(runner, [[1] * 100], [SamplingParams(max_new_tokens=4)])
    assert runner.allocator.available_size() == runner.allocator.size
    code, _, err = _run(capsys, "generate", "--model-path", str(tiny_llama), "--input-ids", ",".join(["1"] * 3000), "--max-new-tokens", "1")
    assert code == 2 and "3000 tokens" in err and "context length" in err


def test_bad_sampling_values_and_ids_are_refused(tiny_llama, capsys):
    code, _, err = _run(capsys, "generate", "--model-path", str(tiny_llama), "--input-ids", "1,2", "--top-p", "1.5")
    assert code == 2 and "top_p" in err
    code, _, err = _run(capsys, "generate", "--model-path", str(tiny_llama), "--input-ids", "1,x")
    assert code == 2 and "--input-ids" in err
    code, _, err = _run(capsys, "generate", "--model-path", str(tiny_llama), "--input-ids", "1,999999")
    assert code == 2 and "vocabulary" in err


def test_served_model_names_comma_or_space_separated():
    from api.cli import _parser
    from api.server.cli import served_model_names

    args = _parser().parse_args(["serve", "--served-model-name", "a,b", "c", "a"])
    assert served_model_names(args.served_model_name) == ("a", "b", "c")
    assert served_model_names(_parser().parse_args(["serve"]).served_model_name) == ()
