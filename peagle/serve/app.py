"""The HTTP app: OpenAI-compatible routes, the SageMaker contract, Prometheus metrics and the playground.

Routes
  POST /v1/chat/completions   chat (streamed as SSE when "stream": true)
  POST /v1/completions        text completion (one prompt, token ids, or a list of prompts)
  GET  /v1/models             the served model, with its speculative config
  GET  /health, GET /ping     200 once the engine runs (503 while draining); never need the API key
  POST /invocations           SageMaker: a chat-completions body when it has "messages", else a completions body
  GET  /metrics               Prometheus, vLLM's metric names
  GET  /                      the playground (a static page; it asks for the API key itself when one is set)

Every non-streamed response, and the last chunk(s) of a stream, carry the request's own speculative-decoding stats
(`speculative_decoding`) and timing (`metrics`). Errors use OpenAI's shape and name the field at fault.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from peagle.engine import RequestError, RequestOutput, SamplingParams, SpecDecodeStats
from peagle.serve.async_engine import AsyncEngine, EngineFailure, RequestStream
from peagle.serve.metrics import CONTENT_TYPE_LATEST
from peagle.serve.protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                   ChatCompletionResponse, ChatMessageOut, CompletionChoice, CompletionChunk,
                                   CompletionRequest, CompletionResponse, DeltaMessage, ModelCard, ModelList, new_id,
                                   now, parse, parse_json)

log = logging.getLogger("peagle.serve")
STATIC = Path(__file__).resolve().parent / "static"
OPEN_PATHS = {"/health", "/ping", "/", "/favicon.ico"}


class ServerState:
    def __init__(self, aengine: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
                 model_path: str | None = None, drain_timeout: float = 30.0):
        self.aengine = aengine
        self.engine = aengine.engine
        self.names = served_model_names or [aengine.engine.model_name]
        self.api_key = api_key
        self.model_path = model_path
        self.drain_timeout = drain_timeout
        self.created = now()
        spec = self.engine.spec
        self.speculative_config = spec.model_dump(exclude_none=True) if spec is not None else None
        self.method = self.engine.method
        self.k = self.engine.k

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(f"the model `{model}` does not exist; this server serves {', '.join(self.names)}", 404,
                           param="model", code="model_not_found")


def build_app(aengine: AsyncEngine, served_model_names: list[str] | None = None, api_key: str | None = None,
              model_path: str | None = None, drain_timeout: float = 30.0) -> FastAPI:
    state = ServerState(aengine, served_model_names or [], api_key, model_path, drain_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        yield
        await aengine.drain(state.drain_timeout)

    app = FastAPI(title="peagle", description="P-EAGLE speculative decoding, OpenAI-compatible", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.peagle = state
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    # -- errors -----------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(msg, exc.status_code, type=kind).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500,
                                     type="internal_server_error").body(), status_code=500)

    # -- routes -----------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200 if aengine.healthy and not aengine.draining else 503)

    @app.get("/ping")
    async def ping():
        return Response(status_code=200 if aengine.healthy and not aengine.draining else 503)

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, created=state.created, root=state.model_path or state.engine.model_name,
                           max_model_len=state.engine.max_model_len, speculative_config=state.speculative_config)
                 for name in state.names]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _chat(state, request, parse_json(await request.body()))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completion(state, request, parse_json(await request.body()))

    @app.post("/invocations")
    async def invocations(request: Request):
        data = parse_json(await request.body())
        if isinstance(data, dict) and "messages" in data:
            return await _chat(state, request, data)
        if isinstance(data, dict) and "prompt" in data:
            return await _completion(state, request, data)
        raise APIError("send a chat-completions body (with \"messages\") or a completions body (with \"prompt\")",
                       400, param="messages")

    @app.get("/metrics")
    async def metrics():
        m = aengine.metrics
        if m is None:
            raise APIError("metrics are disabled on this server", 404)
        return Response(m.render(aengine.num_running, aengine.num_waiting), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)

    return app


class APIKeyMiddleware:
    """Bearer-token auth on every route but the open ones (health checks and the static playground page)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        err = APIError("invalid or missing API key: send the header `Authorization: Bearer <key>`", 401,
                       code="invalid_api_key")
        await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


# ------------------------------------------------------------------------------------------------------------
# request handling


def _sampling(req, prompt_len: int, max_model_len: int, prompt_param: str) -> SamplingParams:
    if prompt_len >= max_model_len:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                       f"{prompt_len} tokens; shorten the prompt", 400, param=prompt_param,
                       code="context_length_exceeded")
    limit, param = req.output_limit(), req.output_limit_param()
    if limit is not None and prompt_len + limit > max_model_len:
        raise APIError(f"{param}={limit} is too large: this model's maximum context length is {max_model_len} "
                       f"tokens and the prompt has {prompt_len}, leaving room for {max_model_len - prompt_len} "
                       f"output tokens", 400, param=param, code="context_length_exceeded")
    top_k = req.top_k if req.top_k not in (None, 0) else -1
    try:
        return SamplingParams(max_tokens=limit, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, seed=req.seed,
                              stop=req.stop_list(), stop_token_ids=req.stop_token_ids or [],
                              ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise APIError(str(e), 400) from None


def _encode(state: ServerState, prompt, chat: bool, param: str) -> list[int]:
    try:
        ids = state.engine.encode_prompt(prompt, chat=chat)
    except RequestError as e:
        raise APIError(str(e), 400, param=param) from None
    if not ids:
        raise APIError(f"{param}: the prompt is empty", 400, param=param)
    vocab = state.engine.target.config.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise APIError(f"{param}: token ids must be in [0, {vocab})", 400, param=param)
    return ids


def spec_stats(state: ServerState, stats: SpecDecodeStats | None, speculation: bool = True) -> dict:
    if stats is None or not speculation or state.engine.spec is None:
        return {"method": "none", "num_speculative_tokens": 0, **SpecDecodeStats().as_dict()}
    return {"method": state.method, "speculation_policy": state.engine.policy.name, "num_speculative_tokens": state.k,
            **stats.as_dict()}


def request_metrics(outs: list[RequestOutput]) -> dict:
    ttft = min((o.time_to_first_token for o in outs if o.time_to_first_token is not None), default=None)
    elapsed = max(o.elapsed for o in outs)
    tokens = sum(o.num_output_tokens for o in outs)
    decode = elapsed - (ttft or 0.0)
    tps = (tokens - len(outs)) / decode if decode > 0 and tokens > len(outs) else 0.0
    return {"time_to_first_token": None if ttft is None else round(ttft, 6), "decode_tokens_per_second": round(tps, 3),
            "elapsed": round(elapsed, 6)}


def _merged_stats(outs: list[RequestOutput]) -> SpecDecodeStats:
    return SpecDecodeStats.total(o.spec for o in outs)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _failure(e: BaseException) -> APIError:
    return APIError(str(e), 500, type="internal_server_error", code="engine_failure")


async def _watch_disconnect(request: Request, streams: list[RequestStream]) -> None:
    """For non-streamed requests: abort when the client goes away (the body has been read, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for s in streams:
                s.abort()
            return


async def _collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    watcher = asyncio.ensure_future(_watch_disconnect(request, streams))
    try:
        return list(await asyncio.gather(*(s.final() for s in streams)))
    except EngineFailure as e:
        raise _failure(e) from None
    finally:
        watcher.cancel()
        for s in streams:
            s.abort()


async def _chat(state: ServerState, request: Request, data) -> Response:
    req: ChatCompletionRequest = parse(ChatCompletionRequest, data)
    req.check()
    state.check_model(req.model)
    ids = _encode(state, req.as_messages(), True, "messages")
    params = _sampling(req, len(ids), state.engine.max_model_len, "messages")
    rid = new_id("chatcmpl")
    stream = state.aengine.add(ids, params, rid, speculation=req.speculation)
    model = req.model or state.names[0]
    if req.stream:
        return SSEResponse(_chat_events(state, req, stream, rid, model, len(ids)), [stream])
    (out,) = await _collect(request, [stream])
    body = ChatCompletionResponse(
        id=rid, created=now(), model=model,
        choices=[ChatChoice(message=ChatMessageOut(content=out.text), finish_reason=out.finish_reason)],
        usage=_usage(len(ids), out.num_output_tokens),
        speculative_decoding=spec_stats(state, out.spec, req.speculation), metrics=request_metrics([out]))
    return JSONResponse(body.body())


async def _completion(state: ServerState, request: Request, data) -> Response:
    req: CompletionRequest = parse(CompletionRequest, data)
    req.check()
    state.check_model(req.model)
    prompts = req.prompts()
    encoded = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = _encode(state, p, False, param)
        encoded.append((ids, _sampling(req, len(ids), state.engine.max_model_len, param)))
    base = new_id("cmpl")
    rids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
    streams = state.aengine.add_many([(ids, params, rid) for (ids, params), rid in zip(encoded, rids)],
                                     speculation=req.speculation)
    model = req.model or state.names[0]
    echoes = [p if isinstance(p, str) else state.engine.tokenizer.decode(p) if state.engine.tokenizer else ""
              for p in prompts] if req.echo else None
    prompt_tokens = sum(len(ids) for ids, _ in encoded)
    if req.stream:
        return SSEResponse(_completion_events(state, req, streams, base, model, prompt_tokens, echoes), streams)
    outs = await _collect(request, streams)
    body = CompletionResponse(
        id=base, created=now(), model=model,
        choices=[CompletionChoice(index=i, text=(echoes[i] if echoes else "") + o.text, finish_reason=o.finish_reason)
                 for i, o in enumerate(outs)],
        usage=_usage(prompt_tokens, sum(o.num_output_tokens for o in outs)),
        speculative_decoding=spec_stats(state, _merged_stats(outs), req.speculation), metrics=request_metrics(outs))
    return JSONResponse(body.body())


# ------------------------------------------------------------------------------------------------------------
# streaming


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse_error(e: APIError) -> str:
    return _sse(e.body())


class SSEResponse(StreamingResponse):
    """Server-sent events; whatever ends the response (done, client gone, server stopping) aborts its requests
    that are still running, so their slots are freed at once."""

    def __init__(self, events, streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.abort()


async def _chat_events(state: ServerState, req: ChatCompletionRequest, stream: RequestStream, rid: str, model: str,
                       prompt_tokens: int):
    created = now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)

    def chunk(delta: dict, finish=None, out: RequestOutput | None = None, final=False) -> str:
        extra = {}
        if include_usage:
            extra["usage"] = _usage(prompt_tokens, out.num_output_tokens) if (continuous and out) else None
        if out is not None and (final or continuous):
            extra["speculative_decoding"] = spec_stats(state, out.spec, req.speculation)
            extra["metrics"] = request_metrics([out])
        return _sse(ChatCompletionChunk(id=rid, created=created, model=model, **extra, choices=[
            ChatChunkChoice(delta=DeltaMessage(**delta), finish_reason=finish)]).body())

    yield chunk({"role": "assistant", "content": ""})
    out = None
    try:
        async for out in stream:
            if out.delta_text or out.finished or continuous:
                delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
                yield chunk(delta, out.finish_reason if out.finished else None, out, final=out.finished)
    except EngineFailure as e:
        yield _sse_error(_failure(e))
        yield "data: [DONE]\n\n"
        return
    if include_usage and out is not None:
        yield _sse(ChatCompletionChunk(
            id=rid, created=created, model=model, choices=[], usage=_usage(prompt_tokens, out.num_output_tokens),
            speculative_decoding=spec_stats(state, out.spec, req.speculation), metrics=request_metrics([out])).body())
    yield "data: [DONE]\n\n"


async def _merge(streams: list[RequestStream]):
    """(index, report) pairs from several streams, in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the reader
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _completion_events(state: ServerState, req: CompletionRequest, streams: list[RequestStream], rid: str,
                             model: str, prompt_tokens: int, echoes: list[str] | None):
    created = now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    finals: dict[int, RequestOutput] = {}
    latest: dict[int, RequestOutput] = {}

    def chunk(i: int, text: str, finish=None, done_outs: list[RequestOutput] | None = None) -> str:
        extra = {}
        if include_usage:
            done = sum(o.num_output_tokens for o in latest.values())
            extra["usage"] = _usage(prompt_tokens, done) if continuous else None
        if done_outs:
            extra["speculative_decoding"] = spec_stats(state, _merged_stats(done_outs), req.speculation)
            extra["metrics"] = request_metrics(done_outs)
        return _sse(CompletionChunk(id=rid, created=created, model=model, **extra, choices=[
            CompletionChoice(index=i, text=text, finish_reason=finish)]).body())

    if echoes:
        for i, text in enumerate(echoes):
            yield chunk(i, text)
    try:
        async for i, out in _merge(streams):
            latest[i] = out
            if out.finished:
                finals[i] = out
            if out.delta_text or out.finished or continuous:
                last = len(finals) == len(streams) and out.finished
                extra = list(finals.values()) if last else ([out] if continuous else None)
                yield chunk(i, out.delta_text, out.finish_reason if out.finished else None, extra)
    except EngineFailure as e:
        yield _sse_error(_failure(e))
        yield "data: [DONE]\n\n"
        return
    if include_usage and finals:
        outs = list(finals.values())
        yield _sse(CompletionChunk(
            id=rid, created=created, model=model, choices=[],
            usage=_usage(prompt_tokens, sum(o.num_output_tokens for o in outs)),
            speculative_decoding=spec_stats(state, _merged_stats(outs), req.speculation),
            metrics=request_metrics(outs)).body())
    yield "data: [DONE]\n\n"
