"""Where `bench.serving` sends requests, and how it times them: an in-process `actorserve.Engine`, or a
server's native /generate, /v1/completions or /v1/chat/completions, streamed.

A chunk "carries output" when it brings new tokens: native, meta_info.completion_tokens grew;
engine, the delta has output ids; openai, the chunk has text (the openai streams do not say how
many tokens a chunk holds; the counts come from the closing usage chunk).

A request's priority, tenant and TTFT target travel as the top-level `priority`, `tenant` and
`slo_ttft_ms` of every body (the engine: Engine.stream's arguments of those names). Queue time
comes from the engine's deltas only: the HTTP APIs do not report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from bench.serving_metrics import RequestOutput

HTTP_TIMEOUT_S = 6 * 3600  # a long benchmark must not be cut by the client (SGLang's AIOHTTP_TIMEOUT)
clock = time.perf_counter  # one name for every timestamp, so tests can drive it


@dataclass(slots=True)
class Call:
    """One request as a backend sends it."""

    output_len: int
    input_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, str]] | None = None  # openai-chat
    priority: int | None = None
    tenant: str | None = None
    slo_ttft_ms: float | None = None

    @property
    def local_prompt_len(self) -> int:
        return len(self.input_ids) if self.input_ids is not None else 0

    def scheduling(self) -> dict[str, Any]:
        """The fields the server schedules by, each only when given: the native and OpenAI bodies
        carry them at the top level under the same names as Engine.stream's arguments."""
        given = {"priority": self.priority, "tenant": self.tenant, "slo_ttft_ms": self.slo_ttft_ms}
        return {k: v for k, v in given.items() if v is not None}


class Backend:
    name = ""
    ignore_eos = True
    extra: dict[str, Any]

    async def send(self, call: Call, t0: float) -> RequestOutput:
        """Send one request and time it; `t0` is the run's start (for offsets)."""
        out = RequestOutput(requested_output_len=call.output_len, prompt_len=call.local_prompt_len)
        start = clock()
        out.start = start - t0
        last: float | None = None
        try:
            async for now, delta_tokens in self._stream(call, out):
                if delta_tokens:
                    if last is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.chunk_times.append(now - t0)
            out.e2e = clock() - start
            if last is None:  # an answer with no non-empty chunk: its first token came at the end
                out.ttft = out.e2e
            out.success = not out.error
        except Exception as exc:  # every failure is a failed request, never a crashed benchmark
            out.success = False
            out.error = out.error or f"{type(exc).__name__}: {exc}"
        if out.success and out.output_len == 0 and call.output_len > 0:
            out.success, out.error = False, "the answer had no output tokens"
        return out

    def _stream(self, call: Call, out: RequestOutput) -> Any:
        """Async iterator of (time, chunk carries output) pairs; fills `out`'s counts."""
        raise NotImplementedError

    def _sampling(self, call: Call) -> dict[str, Any]:
        return {"max_new_tokens": call.output_len, "temperature": 0.0, "ignore_eos": self.ignore_eos}

    async def flush_cache(self) -> bool:
        return False

    async def server_info(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


class EngineBackend(Backend):
    name = "engine"

    def __init__(self, engine: Any, extra: dict[str, Any]):
        self.engine = engine
        self.extra = extra

    async def _stream(self, call: Call, out: RequestOutput):
        ids: list[int] = []
        stream = self.engine.stream(call.text, input_ids=call.input_ids, sampling_params={**self._sampling(call), **self.extra}, **call.scheduling())
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                now = clock()
                ids.extend(delta.output_ids)
                out.text += delta.text
                if delta.queue_time is not None:  # only the engine says how long a request queued
                    out.queue_time = delta.queue_time
                if delta.finish_reason is not None:
                    out.prompt_len = delta.prompt_tokens or out.prompt_len
                    out.cached_tokens = delta.cached_tokens
                    if delta.finish_reason == "abort":
                        out.error = f"aborted: {delta.error or 'by the engine'}"
                yield now, bool(delta.output_ids)
        out.output_ids = ids
        out.output_len = len(ids)

    async def flush_cache(self) -> bool:
        for _ in range(200):  # the last release may trail the last answer by a step
            if await self.engine.flush_cache():
                return True
            await asyncio.sleep(0.01)
        return False

    async def server_info(self) -> dict[str, Any]:
        return {**msgspec.structs.asdict(self.engine.config), "stats": await self.engine.current_stats()}


class HttpBackend(Backend):
    def __init__(self, kind: str, base_url: str, api_key: str | None, model: str | None, extra: dict[str, Any]):
        import aiohttp

        self.name = kind
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.extra = extra
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        # No connection limit: --max-concurrency is the only bound on requests in flight.
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=self.headers)

    async def close(self) -> None:
        await self.session.close()

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self.base_url + path) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def server_info(self) -> dict[str, Any]:
        try:
            return await self.get_json("/get_server_info")
        except Exception as exc:
            print(f"note: /get_server_info failed ({exc}); no server stats in the results", file=sys.stderr)
            return {}

    async def flush_cache(self) -> bool:
        for _ in range(200):
            async with self.session.post(self.base_url + "/flush_cache") as resp:
                if resp.status == 200:
                    return True
                if resp.status != 400:  # 400: requests still running; anything else: no flushing here
                    return False
            await asyncio.sleep(0.01)
        return False

    async def served_model(self) -> str | None:
        try:
            models = await self.get_json("/v1/models")
            return models["data"][0]["id"]
        except Exception:
            return None

    def _payload(self, call: Call) -> tuple[str, dict[str, Any]]:
        if self.name == "native":
            body: dict[str, Any] = {"sampling_params": {**self._sampling(call), **self.extra.get("sampling_params", {})}, "stream": True}
            if call.input_ids is not None:
                body["input_ids"] = call.input_ids
            else:
                body["text"] = call.text
            path = "/generate"
        else:
            body = {"max_tokens": call.output_len, "temperature": 0.0, "ignore_eos": self.ignore_eos, "stream": True,
                    "stream_options": {"include_usage": True}}
            if self.model:
                body["model"] = self.model
            if self.name == "openai-chat":
                body["messages"] = call.messages or [{"role": "user", "content": call.text or ""}]
                path = "/v1/chat/completions"
            else:
                body["prompt"] = call.input_ids if call.input_ids is not None else call.text
                path = "/v1/completions"
        body.update(call.scheduling())
        return path, {**body, **{k: v for k, v in self.extra.items() if k != "sampling_params"}}

    async def _stream(self, call: Call, out: RequestOutput):
        path, body = self._payload(call)
        async with self.session.post(self.base_url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            buffer = b""
            done = False
            async for piece in resp.content.iter_any():
                now = clock()
                buffer += piece
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    data = event.strip()
                    if not data.startswith(b"data:"):
                        continue
                    data = data[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    yield now, self._on_event(orjson.loads(data), out)
            if not done and not out.error:
                out.error = "the stream ended without [DONE]"

    def _on_event(self, body: dict[str, Any], out: RequestOutput) -> bool:
        """Fold one SSE event into `out`; True when it carried output."""
        if "error" in body:
            error = body["error"]
            out.error = str(error.get("message", error)) if isinstance(error, dict) else str(error)
            return False
        if self.name == "native":
            meta = body.get("meta_info", {})
            new = meta.get("completion_tokens", 0) > out.output_len
            out.output_len = meta.get("completion_tokens", out.output_len)
            out.text = body.get("text", out.text)
            out.output_ids = body.get("output_ids", out.output_ids)
            if meta.get("finish_reason") is not None:
                out.prompt_len = meta.get("prompt_tokens") or out.prompt_len
                out.cached_tokens = meta.get("cached_tokens", 0)
                if meta["finish_reason"].get("type") == "abort":
                    out.error = f"aborted: {meta['finish_reason'].get('message')}"
            return new
        usage = body.get("usage")
        if usage:
            out.output_len = usage.get("completion_tokens", 0)
            out.prompt_len = usage.get("prompt_tokens") or out.prompt_len
            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        new = False
        for choice in body.get("choices") or []:
            piece = choice.get("text") if self.name == "openai-completions" else (choice.get("delta") or {}).get("content")
            if piece:
                out.text += piece
                new = True
            if choice.get("finish_reason") == "abort":
                out.error = "aborted by the server"
        return new
