"""Our own compiled code (gpu/csrc, api/router/csrc) is skipped in the suite only where no compiler exists:
a compile error with a compiler present (always in CI) must fail the run, not turn into skips."""

from __future__ import annotations

import pytest

from tests.conftest import built_or_skipped


def _broken_build() -> object:
    raise RuntimeError("decode_attention.cpp:12: error: expected ';' before '}' token")


def test_a_failed_build_with_a_compiler_fails_with_the_compilers_message(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.fail.Exception, match="expected ';' before"):
        built_or_skipped("the CPU kernels", "/usr/bin/c++", _broken_build)


def test_no_compiler_skips_outside_ci_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no compiler"):
        built_or_skipped("the CPU kernels", None, _broken_build)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="did not build"):
        built_or_skipped("the CPU kernels", None, _broken_build)


def test_a_good_build_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert built_or_skipped("the CPU kernels", "/usr/bin/c++", lambda: "library") == "library"

