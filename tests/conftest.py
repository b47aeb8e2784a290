"""Shared fixtures for the whole suite.

- Hugging Face offline mode is forced (unless the caller set it): tests never touch the network.
- Async tests run on uvloop, the loop `actorserve` itself runs on.
- Tiny random-weight models are made once per session, on demand (see gpu/tiny_model.py).
- Our own compiled code (gpu/csrc, api/router/csrc) is skipped only where no compiler exists; with one
  (always in CI), a failed build fails every test that needs it, with the compiler's message.
"""

from __future__ import annotations

import os

# Set before anything imports transformers / huggingface_hub, which read these at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import ctypes  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import contextlib  # noqa: E402
from collections.abc import Callable, Iterator, Mapping  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

import hypothesis  # noqa: E402,F401  (see below)
import pytest  # noqa: E402
import uvloop  # noqa: E402

# hypothesis is imported up front: its pytest plugin otherwise imports it in the terminal
# summary, after the engine tests, and there CPython 3.11.7's AST validator can fail
# ("AST constructor recursion depth mismatch") on a run of files that never imported it.

from gpu.cpu_ops import CpuKernels, build_cpu_kernels, cpu_kernels, cxx_compiler  # noqa: E402
from gpu.packed_linear import Int8Kernels  # noqa: E402
from gpu.tiny_model import make_tiny_model  # noqa: E402

TinyModelFactory = Callable[..., Path]
Built = TypeVar("Built")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    """pytest-asyncio >= 1.3 hook: every async test (and async fixture) gets a uvloop loop.
    A single factory, so test ids are not parametrized by it."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`factory(arch, **make_tiny_model_kwargs) -> Path`; each distinct call builds its model
    once per session, so tests can ask for variants freely. Treat the directory as read-only."""
    made: dict[str, Path] = {}

    def factory(arch: str, **kwargs: Any) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True)
        if key not in made:
            out_dir = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = make_tiny_model(out_dir, arch, **kwargs)  # type: ignore[arg-type]
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen3")


def built_or_skipped(what: str, compiler: str | None, build: Callable[[], Built]) -> Built:
    """`build()`'s result; a skip only where no compiler exists and CI is not set (CI machines
    have one), else a failure that carries the build's error (the compiler's output)."""
    if compiler is None and os.environ.get("CI") != "true":
        pytest.skip(f"{what}: no compiler on PATH here")
    try:
        return build()
    except Exception as exc:  # the build's own error type varies (RuntimeError, OSError, ...)
        pytest.fail(f"{what} did not build:\n{exc}", pytrace=False)


def _kernels_or_raise() -> CpuKernels:
    # cpu_kernels() caches its answer and logs the reason; building again raises that reason.
    return cpu_kernels() or build_cpu_kernels()


def _int8_kernels_or_raise() -> Int8Kernels:
    from gpu.packed_linear import build_int8_ops, int8_kernels

    if int8_kernels() is None:  # cached None: build again to raise the reason
        build_int8_ops()
    built = int8_kernels()
    assert built is not None
    return built


def _native_library_or_raise() -> ctypes.CDLL:
    from api.router import native

    library = native.native_library()
    if library is None:
        ctypes.CDLL(str(native._build()))  # raises the compiler's or the loader's error
        raise RuntimeError("native_library() is None though the library builds and loads now")
    return library


@pytest.fixture(scope="session")
def kernels() -> CpuKernels:
    """The compiled CPU kernels (gpu/cpu_ops.py)."""
    return built_or_skipped("the CPU kernels (gpu/csrc)", cxx_compiler(), _kernels_or_raise)


@pytest.fixture(scope="session")
def int8_ops() -> Int8Kernels:
    """The compiled int8 kernels (gpu/packed_linear.py's int8_kernels)."""
    return built_or_skipped("the int8 kernels (gpu/csrc)", cxx_compiler(), _int8_kernels_or_raise)


@pytest.fixture(scope="session")
def native_plane() -> ctypes.CDLL:
    """The router's compiled data plane (api/router/native.py)."""
    return built_or_skipped("the router's compiled data plane (api/router/csrc)", shutil.which("cc"), _native_library_or_raise)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct GGUF) as a checkpoint directory, converted into
    the user's cache once, like `actorserve serve` does."""
    from gpu.gguf_loader import default_model_path, gguf_to_hf_dir

    return gguf_to_hf_dir(default_model_path())


@pytest.fixture(scope="session")
def smollm2_transformers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' own load of the default model's GGUF file (float32, eval), the reference of
    tests/test_gguf.py and tests/test_smollm2.py. Read-only. Its load takes 15-40 s even with
    `_gguf_parsed_once`, so the first pytest worker to need it saves the result in the run's
    temporary folder and the others load that (0.5 s): the same weights, config fields and
    generation config."""
    import copy

    import torch
    from filelock import FileLock
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from gpu.gguf_loader import default_model_path

    run_folder = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:  # a worker's folder is inside the run's
        run_folder = run_folder.parent
    shared = run_folder / "smollm2-transformers"
    with FileLock(f"{shared}.lock"):
        if shared.exists():
            return AutoModelForCausalLM.from_pretrained(str(shared), dtype=torch.float32).eval()
        gguf = default_model_path()
        with _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
        config = copy.deepcopy(model.config)
        del config.quantization_config  # "gguf", which refuses to be saved; the weights are float32 now
        config.save_pretrained(str(shared))
        model.generation_config.save_pretrained(str(shared))
        save_model(model, str(shared / "model.safetensors"))  # tied embeddings saved once
        return model


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF load parses the file's 49,000-entry vocabulary twice (config, then
    weights) and builds gguf's tensor-name map once per tensor: 30 of its 45 s here. Both are pure
    functions of their arguments, so within this load each is computed once (the same weights)."""
    import functools

    import gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


CORE_MODES = {"inline": {"inline_core": True}, "core-process": {"inline_core": False}}


@pytest.fixture(params=list(CORE_MODES))
def core_mode(request: pytest.FixtureRequest) -> dict[str, bool]:
    """Engine keyword arguments for each way of running the core: tests that only talk to the
    Engine's API take this and run in both."""
    return CORE_MODES[request.param]


@pytest.fixture(params=["python", "compiled"])
def router_plane(request: pytest.FixtureRequest) -> str:
    """`actorserve router`'s data planes (api/router/http_router.py's `data_plane`): router tests take
    this and run on both; the compiled one skips only where no C compiler exists."""
    if request.param == "compiled":
        request.getfixturevalue("native_plane")
    return request.param
