"""The faces of actorserve: `Engine` (embedded asyncio library), the HTTP server and the CLI.

    from api import Engine, SamplingParams

Names are imported on first use, so `actorserve --help` does not pay for torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Engine": "api.engine",
    "EngineError": "api.engine",
    "GenerateOutput": "api.engine",
    "InvalidRequest": "api.engine",
    "Rejected": "api.engine",
    "SamplingParams": "runtime.sampling_params",
    "EngineConfig": "runtime.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'api' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
