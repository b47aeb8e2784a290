"""The programs around the engine core, one folder each: `frontend/` (the caller's process:
`Engine`, the Receiver, the core client), `core/` (the engine core's process), `server/` (the
HTTP server) and `router/` (the HTTP router); `cli.py` is the `actorserve` command.

The public import is `from actorserve import Engine, SamplingParams`; `from api import ...`
stays as an alias of the same names.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import actorserve

    return getattr(actorserve, name)
