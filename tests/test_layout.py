"""The folders say what runs where, and the layers import downward only (README, Layout).

runtime/ is the bottom layer (messages, the request record, configs, IPC types); gpu/ (the model
and its KV pool) and cache/ (prefix caches over that pool) build on it; actors/ are the engine core's actors; api/ holds the programs: frontend/ (the
caller's process), core/ (the engine core's process), server/ and router/ (the HTTP programs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "cache", "gpu", "actors", "api", "actorserve", "bench")


def imported_packages(path: Path) -> set[str]:
    """The top-level packages of ours that `path` imports, type-only imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & set(PACKAGES)
    return found


def imports_of(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported_packages(p) for p in sorted((ROOT / folder).rglob("*.py"))}


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("runtime", {"cache", "gpu", "actors", "api", "actorserve", "bench"}),
        ("gpu", {"cache", "actors", "api", "actorserve", "bench"}),
        ("cache", {"actors", "api", "actorserve", "bench"}),  # its KV slots are gpu/'s allocator's
        ("actors", {"api", "actorserve", "bench"}),
    ],
)
def test_a_layer_imports_nothing_above_it(folder: str, forbidden: set[str]) -> None:
    upward = {path: sorted(found & forbidden) for path, found in imports_of(folder).items() if found & forbidden}
    assert upward == {}


def test_the_frontend_reaches_the_core_process_only_through_its_client() -> None:
    """Of the frontend, only the core client starts and talks to the core process; the Engine
    may also build the core inline, in its own process."""
    users = {
        path
        for path in imports_of("api/frontend")
        if "api.core.process" in (ROOT / path).read_text()
    }
    assert users == {"api/frontend/core_client.py"}


def test_the_programs_each_have_a_folder() -> None:
    api = ROOT / "api"
    assert {p.name for p in api.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == {"frontend", "core", "server", "router"}
    assert (api / "frontend" / "core_client.py").exists() and (api / "core" / "process.py").exists()


def attribute_names(folder: str) -> dict[str, set[str]]:
    return {
        str(p.relative_to(ROOT)): {n.attr for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Attribute)}
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


@pytest.mark.parametrize("folder", ["actors", "api/core", "cache", "gpu"])
def test_the_core_reads_no_frontend_setting(folder: str) -> None:
    """Only CoreConfig crosses to the core process: code that runs there reads none of the
    settings EngineConfig adds for the frontend and the router."""
    from runtime.config import CoreConfig, EngineConfig

    frontend_only = set(EngineConfig.__struct_fields__) - set(CoreConfig.__struct_fields__)
    assert {"inline_core", "dp_size", "router_policy", "preferred_sampling_params"} <= frontend_only
    readers = {path: sorted(names & frontend_only) for path, names in attribute_names(folder).items() if names & frontend_only}
    assert readers == {}
