"""`dtype="auto"` (gpu/loader.py): bfloat16 on a CPU that computes it natively, float32 on one that
does not, the checkpoint's dtype on CUDA; the choice and its reason are logged at startup."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from gpu import loader
from gpu.loader import choose_dtype, cpu_bf16_features, resolve_dtype
from gpu.model_config import ModelConfig


def _kernel_bf16_flags() -> set[str]:
    """The native-bfloat16 features Linux lists for this CPU (/proc/cpuinfo: x86 `flags`, ARM
    `Features`): a source other than the torch query the loader uses."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("flags", "Features"))]
    except OSError:
        pytest.skip("no /proc/cpuinfo to compare with")
    return set(lines[0].split(":", 1)[1].split()) & set(loader.CPU_BF16_FEATURES) if lines else set()


@pytest.mark.parametrize(
    ("cpu_bf16", "expected"),
    [
        (("avx512_bf16",), "bfloat16"),
        (("amx_bf16", "avx512_bf16"), "bfloat16"),
        (("bf16",), "bfloat16"),  # ARM FEAT_BF16
        ((), "float32"),  # e.g. plain AVX-512 or AVX2: bfloat16 would be emulated
        (None, "float32"),  # torch cannot say
    ],
)
def test_auto_on_a_cpu_follows_native_bf16(cpu_bf16: tuple[str, ...] | None, expected: str) -> None:
    chosen, why = choose_dtype("auto", "cpu", "bfloat16", cpu_bf16)
    assert chosen == expected
    assert why
    if cpu_bf16:
        assert all(feature in why for feature in cpu_bf16)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("cpu_bf16", [("avx512_bf16",), (), None])
def test_explicit_dtypes_are_untouched(name: str, device_type: str, cpu_bf16: tuple[str, ...] | None) -> None:
    assert choose_dtype(name, device_type, "bfloat16", cpu_bf16)[0] == name


@pytest.mark.parametrize("cpu_bf16", [("avx512_bf16",), (), None])
def test_auto_on_cuda_is_the_checkpoint_dtype(cpu_bf16: tuple[str, ...] | None) -> None:
    for checkpoint in ("bfloat16", "float16", "float32"):
        assert choose_dtype("auto", "cuda", checkpoint, cpu_bf16)[0] == checkpoint
    assert choose_dtype("auto", "cuda", "float64", cpu_bf16)[0] == "float32"  # unsupported: float32


def test_auto_on_another_device_is_float32() -> None:
    assert choose_dtype("auto", "mps", "bfloat16", ("avx512_bf16",))[0] == "float32"


def test_cpu_bf16_features_asks_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(cpu_bf16_features() or ()) == _kernel_bf16_flags()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_f": True, "avx512_bf16": False, "amx_bf16": True})
    assert cpu_bf16_features() == ("amx_bf16",)
    monkeypatch.delattr(torch.cpu, "get_capabilities")  # an older torch: do not know, so float32
    assert cpu_bf16_features() is None


def test_cpu_bf16_features_survives_a_failing_query(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict[str, bool]:
        raise RuntimeError("cpuinfo failed")

    monkeypatch.setattr(torch.cpu, "get_capabilities", broken)
    assert cpu_bf16_features() is None


@pytest.mark.parametrize(
    ("cpu_bf16", "expected", "reason"),
    [
        (("avx512_bf16",), torch.bfloat16, "dtype auto -> bfloat16 on cpu: the CPU computes bfloat16 natively (avx512_bf16)"),
        ((), torch.float32, "dtype auto -> float32 on cpu: the CPU has no native bfloat16 arithmetic"),
    ],
)
def test_startup_log_names_the_dtype_and_why(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    cpu_bf16: tuple[str, ...], expected: torch.dtype, reason: str,
) -> None:
    monkeypatch.setattr(loader, "cpu_bf16_features", lambda: cpu_bf16)
    config = ModelConfig.from_dir(tiny_llama)
    with caplog.at_level(logging.INFO, logger="gpu.loader"):
        assert resolve_dtype("auto", config, torch.device("cpu")) == expected
    lines = [r.getMessage() for r in caplog.records if r.name == "gpu.loader"]
    assert len(lines) == 1 and lines[0].startswith(reason), lines


def test_explicit_dtype_is_logged_and_bad_names_rejected(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = ModelConfig.from_dir(tiny_llama)
    with caplog.at_level(logging.INFO, logger="gpu.loader"):
        assert resolve_dtype("float32", config, torch.device("cpu")) == torch.float32
    assert [r.getMessage() for r in caplog.records if r.name == "gpu.loader"] == ["dtype float32 -> float32 on cpu: as configured"]
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", config, torch.device("cpu"))


async def test_runner_and_engine_config_show_the_resolved_dtype(tiny_llama: Path) -> None:
    from api.frontend.engine import Engine

    expected = "bfloat16" if _kernel_bf16_flags() else "float32"  # what `auto` is on this machine
    async with Engine(model_path=str(tiny_llama), max_total_tokens=256, inline_core=True) as engine:
        assert engine.runner is not None
        assert engine.config.dtype == engine.runner.dtype_name == expected != "auto"
        assert engine.runner.dtype == getattr(torch, expected)
