"""The settings split by the side that uses them (runtime/config.py): only CoreConfig crosses to
the core process; the frontend keeps its own settings and takes back what the core resolved."""

from __future__ import annotations

import msgspec
import pytest

from runtime.config import CoreConfig, EngineConfig, RouterConfig
from runtime.ipc import CoreReady, CoreStart

FRONTEND = {"dp_size": 2, "router_policy": "round_robin", "preferred_sampling_params": {"temperature": 0.5}, "core_backlog": 7}


def test_the_core_process_is_sent_the_core_settings_only() -> None:
    config = EngineConfig(page_size=4, schedule_policy="lpm", **FRONTEND)
    start = msgspec.msgpack.decode(msgspec.msgpack.encode(CoreStart(config.core(), None, [])), type=CoreStart)
    assert type(start.config) is CoreConfig
    assert (start.config.page_size, start.config.schedule_policy) == (4, "lpm")
    assert msgspec.structs.asdict(start.config) == {name: getattr(config, name) for name in CoreConfig.__struct_fields__}
    # The whole EngineConfig is not a CoreConfig on the wire: the core would refuse its frontend fields.
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(CoreStart(config, None, [])), type=CoreStart)


def test_the_frontend_takes_back_what_the_core_resolved_and_keeps_its_own() -> None:
    config = EngineConfig(**FRONTEND)
    resolved = msgspec.structs.replace(config.core(), dtype="bfloat16", max_total_tokens=4096, context_length=2048)
    ready = msgspec.msgpack.decode(msgspec.msgpack.encode(CoreReady(resolved, 100, [2])), type=CoreReady)
    merged = config.with_core(ready.config)
    assert (merged.dtype, merged.max_total_tokens, merged.context_length) == ("bfloat16", 4096, 2048)
    assert {name: getattr(merged, name) for name in FRONTEND} == FRONTEND


def test_each_side_refuses_its_own_bad_settings() -> None:
    with pytest.raises(ValueError, match="page_size"):
        CoreConfig(page_size=0)
    with pytest.raises(TypeError, match="dp_size"):
        CoreConfig(dp_size=2)  # type: ignore[call-arg]  # not a core setting
    with pytest.raises(ValueError, match="dp_size > 1 runs each replica"):
        EngineConfig(dp_size=2, inline_core=True)
    with pytest.raises(ValueError, match="balance_rel_threshold must be >= 1"):
        EngineConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="router_policy 'nearest' is unknown"):
        RouterConfig(policy="nearest")  # type: ignore[arg-type]


def test_the_router_settings_come_from_the_engine_flags() -> None:
    config = EngineConfig(router_policy="shortest_queue", cache_threshold=0.5, balance_abs_threshold=3, balance_rel_threshold=2.0)
    assert config.router() == RouterConfig("shortest_queue", 0.5, 3, 2.0)
