"""The HTTP server: an aiohttp application over one `actorserve.Engine`.

    OpenAI-compatible   POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models
                        GET and DELETE /v1/responses/{id} (stored responses)
    SGLang-native       POST /generate, GET /health, GET /health_generate, GET /server_info,
                        GET /model_info (and their older names /get_server_info, /get_model_info),
                        GET /get_load, POST /flush_cache, POST /abort_request,
                        GET or POST /clear_hicache_storage_backend,
                        POST /tokenize, POST /detokenize (also under /v1/)
    Prometheus          GET /metrics

Every error is answered in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
A streamed answer waits for the request's first delta before sending headers, so refusals
(invalid input, full queue, queue timeout, priority eviction) keep their real status codes; a
failure after the headers ends the stream with an error event and `data: [DONE]`.

Disconnects: the runner is made with `handler_cancellation=True`, so aiohttp cancels a handler
whose client went away, streaming or not. Every engine stream is consumed under `aclosing`, and
the cancellation runs `Engine.stream`'s `finally`, which sends the abort at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from api.frontend.engine import Engine, EngineError, InvalidRequest, Rejected
from api.launch import generation_defaults
from api.server.metrics import ServerMetrics
from api.server.chat_tools import ChatParsers, plan_chat
from api.server.openai_response import (
    Choice,
    ChatStream,
    chat_response,
    completion_chunk,
    completion_response,
    echoed,
    generate_body,
    usage_chunk,
)
from api.server.openai_schema import (
    AbortRequestBody,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EngineCall,
    GenerateRequest,
    TokenizeRequest,
    chat_calls,
    chat_messages,
    completion_calls,
    decode,
    detokenize_batch,
    error_body,
    generate_calls,
    invalid,
)
from api.server.request_log import RequestLog
from api.server.responses_api import Conversation, ResponseEvents, ResponseShell, ResponsesRequest, ResponseStore, chat_request, whole_response
from api.server.watchdog import watch
from runtime.service import ServiceClass
from runtime.stream import Delta

log = logging.getLogger("actorserve.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIAS = "default"  # accepted as `model` by every server, whatever it serves
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
DONE = b"data: [DONE]\n\n"
# Paths answered without an API key: probes and scrapers rarely carry one (as in SGLang).
OPEN_PATHS = ("/health", "/health_generate", "/metrics")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    # Names a client may give as `model`; the first is the one answers carry. Empty: the model
    # directory's name. "default" is always accepted too (the README's examples send it).
    served_model_names: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 2**20
    health_timeout_s: float = 20.0
    shutdown_timeout_s: float = 5.0
    # --log-requests (api/server/request_log.py)
    log_requests: bool = False
    log_requests_level: int = 2
    log_requests_format: Literal["text", "json"] = "text"
    # A replica running requests that finishes no forward step for this long fails the server
    # (api/server/watchdog.py); None: no watchdog.
    watchdog_timeout_s: float | None = 300.0
    # --tool-call-parser / --reasoning-parser (api/server/chat_tools.py); None: what the chat template names
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class Server:
    def __init__(self, engine: Engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(engine.stats)
        self.model_names = settings.served_model_names or (_default_model_name(engine.config.model_path),)
        self.model_name = self.model_names[0]
        self.model_aliases = {*self.model_names, DEFAULT_ALIAS, engine.config.model_path or self.model_name}
        self.live: set[str] = set()  # rids of requests this server has in the engine
        self._token_texts: dict[int, str] = {}
        self.chat_defaults = generation_defaults(engine.model_dir, engine.config.sampling_defaults)
        template = getattr(engine.tokenizer, "chat_template", None)
        self.chat_parsers = ChatParsers.resolve(settings.tool_call_parser, settings.reasoning_parser, template if isinstance(template, str) else None)
        self.request_log = RequestLog(settings.log_requests_level, settings.log_requests_format) if settings.log_requests else None
        self.stored_responses = ResponseStore()
        self.app = self._make_app()

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._errors, self._auth])
        post, get = web.post, web.get
        app.add_routes([
            post("/v1/completions", self.completions),
            post("/v1/chat/completions", self.chat_completions),
            post("/v1/responses", self.responses),
            get("/v1/responses/{response_id}", self.stored_response),
            web.delete("/v1/responses/{response_id}", self.delete_response),
            get("/v1/models", self.models),
            post("/generate", self.generate),
            get("/health", self.health),
            get("/health_generate", self.health_generate),
            get("/get_server_info", self.server_info),
            get("/get_model_info", self.model_info),
            # SGLang's current names, which SGLang's router asks first (it warns when it must fall back)
            get("/server_info", self.server_info),
            get("/model_info", self.model_info),
            get("/get_load", self.load),
            get("/flush_cache", self.flush_cache),
            post("/flush_cache", self.flush_cache),
            get("/clear_hicache_storage_backend", self.clear_hicache_storage),
            post("/clear_hicache_storage_backend", self.clear_hicache_storage),
            post("/abort_request", self.abort_request),
            post("/tokenize", self.tokenize),
            post("/v1/tokenize", self.tokenize),
            post("/detokenize", self.detokenize),
            post("/v1/detokenize", self.detokenize),
            get("/metrics", self.prometheus),
        ])
        return app

    @property
    def context_len(self) -> int:
        # Read per use: the engine resolves the model's context length when it starts.
        return self.engine.config.context_length or 0

    # --- middlewares --------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        except InvalidRequest as exc:
            return _error_response(400, str(exc), param=exc.param)
        except Rejected as exc:
            return _error_response(503, str(exc), code=exc.code)
        except EngineError as exc:
            return _error_response(500, str(exc), code="engine_error")
        except web.HTTPException as exc:
            return _http_error(exc)
        except Exception as exc:
            log.exception("unexpected error on %s %s", request.method, request.path)
            return _error_response(500, f"internal error: {exc!r}")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.settings.api_key
        if key is None or request.path in OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("X-API-Key", "")
        # aiohttp decodes header bytes as UTF-8 with surrogateescape: encoding back the same way
        # gives the bytes the client sent, whatever they are (strict UTF-8 raised: a 500).
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
        return await handler(request)

    # --- OpenAI -------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = _tenant_from_header(decode(await request.read(), CompletionRequest), request)
        self._check_model(req.model)
        rid, calls = completion_calls(req)
        token_text = self._token_text if req.logprobs is not None else None
        created = int(time.time())
        echoes = [self._prompt_text(c) for c in calls] if req.echo else None
        if not req.stream:
            choices = await self._collect(calls, echoes)
            return _json(completion_response(rid, self.model_name, created, choices, token_text))

        choices = [Choice(c.index, c.prompt_index) for c in calls]
        offsets = [0] * len(calls)  # text offsets of each choice, for streamed logprobs

        def chunk(call: EngineCall, delta: Delta) -> dict[str, Any]:
            if echoes is not None and choices[call.index].deltas == 0:
                delta = echoed(delta, echoes[call.index])
            choices[call.index].add(delta)
            body = completion_chunk(rid, self.model_name, created, call.index, delta, offsets[call.index], token_text)
            offsets[call.index] += len(delta.text)
            return body

        def closing() -> list[dict[str, Any]]:
            return [usage_chunk(rid, "text_completion", self.model_name, created, choices)] if req.include_usage else []

        return await self._stream(request, calls, chunk, [], closing)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = _tenant_from_header(decode(await request.read(), ChatCompletionRequest), request)
        self._check_model(req.model)
        plan = plan_chat(req, self.chat_parsers)
        input_ids = await self._render_chat(chat_messages(req), {**(req.chat_template_kwargs or {}), **plan.template_kwargs})
        rid, calls = chat_calls(req, input_ids, self.chat_defaults, plan.tool_schema)
        token_text = self._token_text if req.logprobs else None
        created = int(time.time())
        if not req.stream:
            choices = await self._collect(calls)
            return _json(chat_response(rid, self.model_name, created, choices, token_text, plan))
        chat = ChatStream(rid, self.model_name, created, [(c.index, c.prompt_index) for c in calls], plan, token_text)
        closing = (lambda: [chat.usage_chunk()]) if req.include_usage else list
        return await self._stream(request, calls, lambda call, delta: chat.chunks(call.index, delta), chat.opening(), closing)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API, served as one chat answer (api/server/responses_api.py)."""
        req = decode(await request.read(), ResponsesRequest)
        self._check_model(req.model)
        talk = Conversation.of(req, self.stored_responses)
        chat = _tenant_from_header(chat_request(req, talk), request)
        plan = plan_chat(chat, self.chat_parsers)
        input_ids = await self._render_chat(chat_messages(chat), {**(chat.chat_template_kwargs or {}), **plan.template_kwargs})
        rid, calls = chat_calls(chat, input_ids, self.chat_defaults, plan.tool_schema)
        shell = ResponseShell(id=f"resp_{rid}", created_at=int(time.time()), model=self.model_name, req=req)
        if not req.stream:
            [choice] = await self._collect(calls)
            body = whole_response(shell, choice, plan)
            self.stored_responses.keep(req, talk, body)
            return _json(body)
        events, choice = ResponseEvents(shell, plan), Choice(0, 0)
        sse = await self._stream(request, calls, lambda call, delta: events.chunks(choice, delta), events.opening(), list, events=True)
        self.stored_responses.keep(req, talk, events.response)  # empty unless it finished
        return sse

    async def stored_response(self, request: web.Request) -> web.Response:
        return _json(self.stored_responses.body(request.match_info["response_id"]))

    async def delete_response(self, request: web.Request) -> web.Response:
        return _json(self.stored_responses.delete(request.match_info["response_id"]))

    async def models(self, request: web.Request) -> web.Response:
        root = self.engine.config.model_path or self.model_name
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "actorserve", "root": root, "max_model_len": self.context_len}
            for name in self.model_names
        ]
        return _json({"object": "list", "data": cards})

    async def _stream(
        self,
        request: web.Request,
        calls: list[EngineCall],
        chunk: Callable[[EngineCall, Delta], dict[str, Any] | list[dict[str, Any]]],
        opening: list[dict[str, Any]],
        closing: Callable[[], list[dict[str, Any]]],
        events: bool = False,
    ) -> web.StreamResponse:
        """Server-sent events: `opening`, the `chunk` (or chunks) of each delta, `closing()`, then [DONE].
        `events`: a Responses stream, each body under an `event:` line naming its type, no [DONE] (as OpenAI's)."""
        send = _send_event if events else _send
        async with contextlib.aclosing(self._deltas(calls)) as deltas:
            item = await anext(deltas, None)  # a refusal raises here, before any header
            sse = await _open_sse(request)
            try:
                for body in opening:
                    await send(sse, body)
                while item is not None:
                    bodies = chunk(*item)
                    for body in bodies if isinstance(bodies, list) else [bodies]:
                        await send(sse, body)
                    item = await anext(deltas, None)
                for body in closing():
                    await send(sse, body)
            except (InvalidRequest, Rejected, EngineError) as exc:
                await send(sse, _exception_body(exc))
            except ConnectionResetError:
                return sse  # the client is gone; leaving this block aborts its requests
        if not events:
            with contextlib.suppress(ConnectionResetError):
                await sse.write(DONE)
        return sse

    async def _render_chat(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise invalid("this model has no chat template: use /v1/completions", "messages", code="no_chat_template")

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            # The template already placed any BOS it wants.
            return tokenizer.encode(text, add_special_tokens=False)

        try:
            if sum(len(m["content"]) for m in messages) > self.engine.config.tokenize_off_loop_chars:
                return await asyncio.to_thread(render)  # a long conversation must not stall the loop
            return render()
        except Exception as exc:  # jinja errors, template-raised exceptions, bad kwargs
            raise invalid(f"the chat template could not render these messages: {exc}", "messages") from None

    # --- native -------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = _tenant_from_header(decode(await request.read(), GenerateRequest), request)
        calls, batch = generate_calls(req)
        token_text = self._token_text if req.return_text_in_logprobs else None
        start = time.perf_counter()

        def body(choice: Choice) -> dict[str, Any]:
            index = choice.index if batch else None
            return generate_body(choice, time.perf_counter() - start, logprobs=req.return_logprob, token_text=token_text, index=index)

        if not req.stream:
            choices = await self._collect(calls)
            return _json([body(c) for c in choices] if batch else body(choices[0]))
        choices = [Choice(c.index, c.prompt_index) for c in calls]

        def chunk(call: EngineCall, delta: Delta) -> dict[str, Any]:
            choices[call.index].add(delta)
            return body(choices[call.index])  # cumulative text, as SGLang streams

        return await self._stream(request, calls, chunk, [], list)

    async def health(self, request: web.Request) -> web.Response:
        failure = self._failure()
        if failure is not None:
            return _error_response(503, failure, code="engine_unhealthy")
        return web.Response(text="OK")

    async def health_generate(self, request: web.Request) -> web.Response:
        """A real one-token generation through every actor."""
        call = EngineCall(0, 0, None, [0], {"max_new_tokens": 1, "temperature": 0.0}, {"rid": f"health-{uuid.uuid4().hex}"})
        try:
            await asyncio.wait_for(self._collect([call]), self.settings.health_timeout_s)
        except TimeoutError:
            return _error_response(503, f"no token within {self.settings.health_timeout_s} s", code="engine_unhealthy")
        except (Rejected, EngineError) as exc:
            return _error_response(503, str(exc), code="engine_unhealthy")
        return web.Response(text="OK")

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.settings
        info = {
            **msgspec.structs.asdict(self.engine.config),
            "served_model_name": self.model_name,
            "served_model_names": list(self.model_names),
            "host": s.host,
            "port": s.port,
            "max_body_bytes": s.max_body_bytes,
            "stats": {**await self.engine.current_stats(), "http_live_requests": len(self.live)},
        }
        return _json(info)

    async def model_info(self, request: web.Request) -> web.Response:
        path = self.engine.config.model_path or self.model_name
        tokenizer_path = self.engine.config.tokenizer_path or path
        return _json({"model_path": path, "tokenizer_path": tokenizer_path, "is_generation": True, "served_model_name": self.model_name})

    async def load(self, request: web.Request) -> web.Response:
        """SGLang's /get_load: one entry per data-parallel rank, as SGLang's router's load monitor reads it."""
        stats = await self.engine.current_stats()
        return _json([_rank_load(rank, s) for rank, s in enumerate(stats.get("replicas") or [stats])])

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not await self.engine.flush_cache():
            raise ApiError(400, "the cache was not flushed: requests are running; retry when idle", code="requests_running")
        return _json({"success": True, "message": "Cache flushed."})

    async def clear_hicache_storage(self, request: web.Request) -> web.Response:
        if not await self.engine.clear_hicache_storage():
            raise ApiError(400, "no storage tier to clear: start with --hicache-storage-backend file", code="no_storage_tier")
        return _json({"success": True, "message": "Hierarchical cache storage backend cleared."})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = decode(await request.read() or b"{}", AbortRequestBody)
        if not body.rid and not body.abort_all:
            raise invalid("give rid, or abort_all: true", "rid")
        rids = list(self.live) if body.abort_all else [body.rid]
        for rid in rids:
            await self.engine.abort(rid)
        return _json({"success": True, "aborted": rids})

    async def tokenize(self, request: web.Request) -> web.Response:
        req = decode(await request.read(), TokenizeRequest)
        self._check_model(req.model)
        self._check_tokenizer("/tokenize")
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        ids = [self.engine.tokenizer.encode(t, add_special_tokens=req.add_special_tokens) for t in texts]
        tokens = ids[0] if isinstance(req.prompt, str) else ids
        return _json({"tokens": tokens, "count": sum(map(len, ids)), "max_model_len": self.context_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = decode(await request.read(), DetokenizeRequest)
        self._check_model(req.model)
        self._check_tokenizer("/detokenize")
        seqs, batch = detokenize_batch(req, self.engine.receiver.limits.vocab_size)
        texts = [self.engine.tokenizer.decode(s, skip_special_tokens=req.skip_special_tokens) for s in seqs]
        return _json({"text": texts if batch else texts[0]})

    async def prometheus(self, request: web.Request) -> web.Response:
        await self.engine.current_stats()  # the collectors then read the core's counters as of now
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # --- engine calls -------------------------------------------------------------------------
    async def _collect(self, calls: list[EngineCall], echoes: list[str] | None = None) -> list[Choice]:
        """Whole answers; `echoes`: each choice's prompt text, put in front of it (`echo`)."""
        choices = [Choice(c.index, c.prompt_index) for c in calls]
        async with contextlib.aclosing(self._deltas(calls)) as deltas:
            async for call, delta in deltas:
                choice = choices[call.index]
                choice.add(delta if echoes is None or choice.deltas else echoed(delta, echoes[call.index]))
        return choices

    def _prompt_text(self, call: EngineCall) -> str:
        if call.prompt is not None:
            return call.prompt
        # Echo decodes the ids before the engine has checked them, and the tokenizer overflows on
        # ids outside its range (a 500): refuse them here, as the engine would.
        vocab = self.engine.receiver.limits.vocab_size
        bad = [t for t in call.input_ids if not 0 <= t < vocab]
        if bad:
            raise invalid(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        return self.engine.tokenizer.decode(call.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _deltas(self, calls: Sequence[EngineCall]) -> AsyncIterator[tuple[EngineCall, Delta]]:
        if len(calls) == 1:
            return self._single(calls[0])
        return self._merged(calls)

    async def _single(self, call: EngineCall) -> AsyncIterator[tuple[EngineCall, Delta]]:
        async with contextlib.aclosing(self._one(call)) as deltas:
            async for delta in deltas:
                yield call, delta

    async def _one(self, call: EngineCall) -> AsyncIterator[Delta]:
        options = call.options
        service = ServiceClass(tenant=options.get("tenant"), slo_ttft_ms=options.get("slo_ttft_ms"), deadline_ms=options.get("deadline_ms"))
        tracker = self.metrics.tracker(service, options.get("priority"))
        rid = call.options.get("rid")
        if rid is not None:
            self.live.add(rid)
        stream = self.engine.stream(call.prompt, input_ids=call.input_ids, sampling_params=call.sampling, **call.options)
        logged: list[Delta] | None = [] if self.request_log is not None else None
        started = self.request_log.received(call) if self.request_log is not None else 0.0
        error: str | None = "cancelled"
        try:
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    tracker.on_delta(delta)
                    if logged is not None:
                        logged.append(delta)
                    yield delta
            error = None
        except InvalidRequest as exc:
            tracker.refused()
            error = str(exc)
            raise
        except (Rejected, EngineError) as exc:
            error = str(exc)
            raise
        finally:
            tracker.on_exit()
            self.live.discard(rid)
            if self.request_log is not None and logged is not None:
                self.request_log.finished(call, logged, started, error)

    async def _merged(self, calls: Sequence[EngineCall]) -> AsyncIterator[tuple[EngineCall, Delta]]:
        """Several engine requests (n > 1, or a batch of prompts) as one stream, in arrival order.
        Leaving early cancels every pump, and each cancellation aborts its engine request."""
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with contextlib.aclosing(self._one(calls[i])) as deltas:
                    async for delta in deltas:
                        queue.put_nowait((i, delta))
                queue.put_nowait((i, None))
            except Exception as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(calls))]
        try:
            remaining = len(calls)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield calls[i], item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- helpers ------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model and model not in self.model_aliases:
            served = ", ".join(repr(n) for n in self.model_names)
            # 404 as vLLM answers, so clients tell "wrong name" from "bad request".
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", param="model", code="model_not_found")

    def _check_tokenizer(self, path: str) -> None:
        if self.engine.config.skip_tokenizer_init:
            raise invalid(f"{path} needs a tokenizer, and this server runs with --skip-tokenizer-init", code="no_tokenizer")

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def _failure(self) -> str | None:
        stats = self.engine.stats()
        if stats.get("failure"):
            return stats["failure"]
        return None if stats.get("running", True) else "the engine is not running"


# --- responses --------------------------------------------------------------------------------
R = TypeVar("R", CompletionRequest, ChatCompletionRequest, GenerateRequest)


def _tenant_from_header(req: R, request: web.Request) -> R:
    """The X-Tenant header names the tenant when the body does not (a gateway sets it)."""
    if req.tenant is None and "X-Tenant" in request.headers:
        req.tenant = request.headers["X-Tenant"]
    return req


def _rank_load(rank: int, stats: dict[str, Any]) -> dict[str, int]:
    """SGLang's GetLoadReqOutput fields: requests held (running + waiting) and KV slots held (not
    free, not evictable: what /metrics calls num_used_tokens)."""
    waiting = stats.get("num_waiting", 0)
    pool = stats.get("kv_pool_size", 0)
    held = pool - stats.get("kv_free", pool) - stats.get("kv_evictable", 0)
    return {"dp_rank": rank, "num_reqs": stats.get("num_running", 0) + waiting, "num_waiting_reqs": waiting, "num_tokens": held}


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    return _json(error_body(status, message, param=param, code=code), status)


def _http_error(exc: web.HTTPException) -> web.Response:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    if exc.status == 404:
        message = "no such endpoint"
    return _error_response(exc.status, message, code=codes.get(exc.status))


def _exception_body(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, InvalidRequest):
        return error_body(400, str(exc), param=exc.param)
    if isinstance(exc, Rejected):
        return error_body(503, str(exc), code=exc.code)
    return error_body(500, str(exc), code="engine_error")


async def _open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(body) + b"\n\n")


async def _send_event(response: web.StreamResponse, body: dict[str, Any]) -> None:
    """One event of a Responses stream; an error body is of type "error"."""
    kind = body.setdefault("type", "error")
    await response.write(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n")


def _default_model_name(model_path: str | None) -> str:
    if model_path is None:
        return DEFAULT_MODEL_NAME
    return Path(model_path).name or model_path


# --- running ----------------------------------------------------------------------------------
class ProtocolLog(logging.LoggerAdapter):
    """aiohttp's log of its connections. A request it cannot parse is the client's error, answered
    400: one warning line, not an error with a traceback. SGLang's router, for one, probes each
    worker with an HTTP/2 preface as it starts."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.warning(f"{msg} (answered {exc_info.code}): %s", *args, exc_info.message.splitlines()[0])
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


async def start_site(server: Server, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0: a free port); returns the runner and the bound port."""
    # auto_decompress off: bodies are read as sent (as SGLang's and vLLM's servers do). aiohttp's
    # decompression of a body that is not what its Content-Encoding says answered 500, or never.
    runner = web.AppRunner(
        server.app, handler_cancellation=True, access_log=None, shutdown_timeout=server.settings.shutdown_timeout_s,
        auto_decompress=False, logger=ProtocolLog(logging.getLogger("aiohttp.server"), {}),
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound


async def stop_site(runner: web.AppRunner, engine: Engine) -> None:
    """Stop listening, end what is in flight (clients get an error, not a hang), then close."""
    for site in list(runner.sites):
        await site.stop()
    await engine.close()
    await runner.cleanup()


def freeze_startup_objects() -> None:
    """Move everything loaded so far (torch, transformers, the tokenizer: ~350k objects) out of
    the garbage collector's view. Otherwise each full collection walks them all and stalls the
    loop for ~170 ms, which showed up as the p99 latency of every endpoint."""
    gc.collect()
    gc.freeze()


async def serve(engine_kwargs: dict[str, Any], settings: ServerSettings) -> int:
    """Run until SIGINT or SIGTERM (then 0), or until the engine fails (then 1, once every
    client in flight has been answered with the error)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    engine = Engine(**engine_kwargs)
    try:
        await engine.start()
        freeze_startup_objects()
        server = Server(engine, settings)
        runner, port = await start_site(server, settings.host, settings.port)
        log.info("actorserve ready: http://%s:%d serving %s", settings.host, port, server.model_name)
        failure = asyncio.ensure_future(engine.wait_failure())
        stopped = asyncio.ensure_future(stop.wait())
        hung = asyncio.ensure_future(watch(engine, settings.watchdog_timeout_s) if settings.watchdog_timeout_s else asyncio.Event().wait())
        await asyncio.wait([failure, stopped, hung], return_when=asyncio.FIRST_COMPLETED)
        if hung.done() and not failure.done():
            engine.fail(hung.result())  # in-flight requests end with a 500 naming the hang
            await asyncio.wait([failure])
        stopped.cancel()
        failure.cancel()
        hung.cancel()
        if failure.done() and not failure.cancelled():
            log.error("the engine failed: %s; the server exits", failure.result())
        else:
            log.info("shutting down")
        # A second Ctrl-C during shutdown interrupts it the usual way.
        for sig in signals:
            loop.remove_signal_handler(sig)
        await stop_site(runner, engine)
    finally:
        await engine.close()
    return 1 if engine.stats().get("failure") else 0
