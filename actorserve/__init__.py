"""actorserve's public names: the embedded engine, its parameters and the programs' entry points.

    from actorserve import Engine, SamplingParams

    async with Engine(model_path="...") as engine:
        out = await engine.generate("Hello", SamplingParams(max_new_tokens=8))

`main` is the `actorserve` command (`serve`, `router`, ...); `serve` runs the HTTP server from an
asyncio program. Names are imported on first use, so `import actorserve` does not pay for torch.
The folders behind them: `api/frontend/` (this process), `api/core/` (the engine core's process),
`api/server/` and `api/router/` (the two HTTP programs).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "api.frontend.engine",
    "EngineError": "api.frontend.engine",
    "GenerateOutput": "api.frontend.engine",
    "InvalidRequest": "api.frontend.engine",
    "Rejected": "api.frontend.engine",
    "SamplingParams": "runtime.sampling_params",
    "EngineConfig": "runtime.config",
    "main": "api.cli",
    "serve": "api.server.app",
    "ServerSettings": "api.server.app",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'actorserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
