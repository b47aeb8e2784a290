"""`--log-requests`: one line when a request arrives and one when it ends, as SGLang logs them.

Levels are SGLang's: 0 ids, counts and finish reason; 1 adds the sampling params; 2 adds the
input and output, each cut to 2048 characters (head and tail); 3 logs them whole. The format is
"text" (`Receive: ...` / `Finish: ...`) or "json" (one object per line).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import orjson

from api.server.openai_schema import EngineCall
from runtime.stream import Delta

log = logging.getLogger("actorserve.requests")

CUT_CHARS = 2048  # level 2: what is kept of a long input or output (SGLang's max_length)


class RequestLog:
    def __init__(self, level: int, fmt: Literal["text", "json"]):
        self.level = level
        self.fmt = fmt

    def received(self, call: EngineCall) -> float:
        """Log the request's arrival; returns when it arrived (for `finished`)."""
        record: dict[str, Any] = {"rid": call.options.get("rid")}
        if self.level >= 1:
            record["sampling_params"] = call.sampling
        if self.level >= 2:
            record["input"] = self._cut(call.prompt if call.prompt is not None else call.input_ids)
        self._emit("Receive", record)
        return time.perf_counter()

    def finished(self, call: EngineCall, deltas: list[Delta], started: float, error: str | None) -> None:
        last = deltas[-1] if deltas else None
        record: dict[str, Any] = {
            "rid": call.options.get("rid") if last is None else last.rid,
            "finish_reason": None if last is None else last.finish_reason,
            "prompt_tokens": 0 if last is None else last.prompt_tokens,
            "completion_tokens": sum(len(d.output_ids) for d in deltas),
            "cached_tokens": 0 if last is None else last.cached_tokens,
            "e2e_latency": round(time.perf_counter() - started, 6),
        }
        if error is not None:
            record["error"] = error
        if self.level >= 2:
            record["output"] = self._cut("".join(d.text for d in deltas))
            record["output_ids"] = self._cut([t for d in deltas for t in d.output_ids])
        self._emit("Finish", record)

    def _cut(self, value: Any) -> Any:
        if self.level >= 3 or value is None or len(value) <= CUT_CHARS:
            return value
        half = CUT_CHARS // 2
        if isinstance(value, str):
            return f"{value[:half]} ... {value[-half:]}"
        return [*value[:half], "...", *value[-half:]]

    def _emit(self, event: str, record: dict[str, Any]) -> None:
        if self.fmt == "json":
            log.info("%s", orjson.dumps({"event": f"request.{event.lower()}", **record}, default=str).decode())
        else:
            log.info("%s: %s", event, ", ".join(f"{k}={v!r}" for k, v in record.items()))
