"""bench.many_users: W1-mixed from several clients through a real `actorserve serve` process (a tiny
model here; llama-server is not built in the test environment)."""

from __future__ import annotations

import pytest

from bench import cpu_servers, many_users
from bench.workloads import make_workload


def test_every_request_is_counted_once_at_its_full_length(tiny_model_factory, capsys) -> None:
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    runs = many_users.main(["--gguf", str(model), "--modes", "float32", "--clients", "2", "--requests", "4", "--threads", "1"])
    [run] = runs["actorserve float32"]
    wanted = [r.max_new_tokens for r in make_workload("W1-mixed-64", many_users._vocab_size(str(model)), num_requests=4).requests]
    assert sorted(f.output_tokens for f in run.requests) == sorted(wanted)
    assert run.output_tok_s == sum(wanted) / run.wall_s and all(f.ttft_s > 0 and f.tpot_s > 0 for f in run.requests)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| actorserve float32 |")]
    assert len(rows) == 1 and rows[0].endswith("| 4 |")
    assert 0 < run.forward_s < run.wall_s


def test_the_table_gives_each_server_its_ratio_to_the_fastest_llama_cpp() -> None:
    def run(label: str, tok_s: float) -> many_users.Run:
        return many_users.Run(label, 2.0, [many_users.Finished(int(tok_s * 2), 0.01, 0.002)])

    labels = {"llama.cpp m.Q4_1": 40.0, "llama.cpp m.Q4_K_M": 50.0, "actorserve int8": 135.0}
    text = many_users.table({label: [run(label, tok_s)] for label, tok_s in labels.items()})
    assert "| actorserve int8 | 135.0 | 2.70x | 10 / 10 | 2 / 2 |  | 1 |" in text
    assert "| llama.cpp m.Q4_K_M | 50.0 | 1.00x |" in text and "| llama.cpp m.Q4_1 | 40.0 | 0.80x |" in text
    assert "| actorserve int8 | 135.0 |  |" in many_users.table({"actorserve int8": [run("actorserve int8", 135.0)]})
    busy = many_users.Run("actorserve int8", 2.0, [many_users.Finished(270, 0.01, 0.002)], forward_s=1.5)
    assert "| 2 / 2 | 75% | 1 |" in many_users.table({"actorserve int8": [busy]})


def test_a_mode_names_its_quantization_activations_and_kv_cache() -> None:
    assert cpu_servers.mode_settings("float32") == ("float32", None, "auto")
    assert cpu_servers.mode_settings("bfloat16+kv-int8") == ("bfloat16", None, "int8")
    assert cpu_servers.mode_settings("gguf") == ("auto", "gguf", "auto")
    assert cpu_servers.mode_settings("gguf+kv-int8@float32") == ("float32", "gguf", "int8")
    assert cpu_servers.mode_settings("int8@bfloat16") == ("bfloat16", "int8", "auto")
    with pytest.raises(ValueError, match="only a quantization mode"):
        cpu_servers.mode_settings("float32@bfloat16")
