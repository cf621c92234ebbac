"""The HTTP app: OpenAI-compatible routes, the SageMaker contract, Prometheus metrics and the playground.

Routes
  POST /v1/chat/completions   chat (streamed as SSE when "stream": true)
  POST /v1/completions        text completion (one prompt, token ids, or a list of prompts)
  GET  /v1/models             the served model, with its speculative config
  GET  /health, GET /ping     200 once the engine runs (503 while draining)
  POST /invocations           SageMaker: a chat-completions body when it has "messages", else a completions body
  GET  /metrics               Prometheus, vLLM's metric names
  GET  /                      the playground (a static page; it asks for the API key itself when one is set)

With an API key, /v1/* and /invocations need it (and /metrics too with `protect_metrics`); under `sagemaker`,
/invocations stays open, since SageMaker authenticates its callers itself; health checks and the static page stay
open. JSON routes take only a JSON body (`Content-Type: application/json`, or none): a browser can send text/plain
or a form cross-site without a CORS preflight, so those get 415. Cross-origin calls are refused unless
`allowed_origins` names the origins (docs/serving.md, "Authentication and cross-site calls").

Every request is bounded before it can cost the others anything: bodies over `max_body_bytes` get 413 while being
read; parsing, validation and tokenisation run in a worker thread, never on the event loop that streams to other
clients; text that cannot fit the context is refused before it is tokenised (the engine's `make_request`).

Every non-streamed response, and the last chunk(s) of a stream, carry the request's own speculative-decoding stats
(`speculative_decoding`) and timing (`metrics`). Errors use OpenAI's shape and name the field at fault.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from peagle.config import Speculation
from peagle.engine import LLMEngine, RequestError, RequestOutput, SamplingParams, SpecDecodeStats
from peagle.engine.detokenize import TokenStrings
from peagle.engine.request import Request as EngineRequest
from peagle.engine.request import TokenLogprob
from peagle.engine.stats import by_proposer
from peagle.serve import tools
from peagle.serve.async_engine import AsyncEngine, EngineFailure, RequestStream
from peagle.serve.metrics import CONTENT_TYPE_LATEST
from peagle.serve.protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                   ChatCompletionResponse, ChatLogprobs, ChatMessageOut, ChatTokenLogprob,
                                   CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest,
                                   CompletionResponse, DeltaMessage, ModelCard, ModelList, TopLogprob, new_id, now,
                                   parse, parse_json)

log = logging.getLogger("peagle.serve")
STATIC = Path(__file__).resolve().parent / "static"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DONE = "data: [DONE]\n\n"


class ErrorJSONResponse(JSONResponse):
    """Errors may quote what the client sent, and that can hold a lone UTF-16 surrogate (in a field name, say),
    which UTF-8 cannot encode: escape everything outside ASCII, so an error body always renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class ServerState:
    def __init__(self, aengine: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
                 model_path: str | None = None, drain_timeout: float = 30.0, speculation: Speculation | None = None):
        self.aengine = aengine
        self.engine = aengine.engine
        self.names = served_model_names or [aengine.engine.model_name]
        self.api_key = api_key
        self.model_path = model_path
        self.drain_timeout = drain_timeout
        self.created = now()
        spec = self.engine.spec
        self.speculative_config = spec.to_dict() if spec is not None else None
        # what runs, for /v1/models: as `peagle serve` resolved it, else as the engine's caller configured it
        self.speculation = speculation or Speculation(self.engine.model_name, None, spec, None,
                                                      self.engine.policy.name, origin="argument")
        self.method = self.engine.method
        self.k = self.engine.k
        self.token_strings = TokenStrings(self.engine.tokenizer)
        self.open_streams = 0  # SSE responses still writing

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(f"the model `{model}` does not exist; this server serves {', '.join(self.names)}", 404,
                           param="model", code="model_not_found")

    async def drain(self, deadline: float | None = None) -> None:
        """Refuse new requests (503), let those in flight finish for up to `deadline` seconds, abort the rest (their
        streams end with finish_reason "abort" and [DONE]), and return once every stream has been written out."""
        await self.aengine.drain(self.drain_timeout if deadline is None else deadline)
        end = time.monotonic() + 5
        while self.open_streams and time.monotonic() < end:
            await asyncio.sleep(0.02)


def build_app(aengine: AsyncEngine, served_model_names: list[str] | None = None, api_key: str | None = None,
              model_path: str | None = None, drain_timeout: float = 30.0,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, protect_metrics: bool = False, sagemaker: bool = False,
              allowed_origins: list[str] | None = None, body_timeout: float = 30.0,
              speculation: Speculation | None = None) -> FastAPI:
    """The server's app. `speculation`: what `peagle serve` resolved, shown by /v1/models (None: described from the
    engine)."""
    state = ServerState(aengine, served_model_names or [], api_key, model_path, drain_timeout, speculation)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        yield
        await state.drain()

    app = FastAPI(title="peagle", description="P-EAGLE speculative decoding, OpenAI-compatible", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.peagle = state
    _add_middleware(app, max_body_bytes, body_timeout, api_key, protect_metrics, sagemaker, allowed_origins)
    _add_error_handlers(app)
    _add_operational_routes(app, state)
    _add_inference_routes(app, state)
    _add_page_routes(app)
    return app


def _add_middleware(app: FastAPI, max_body_bytes: int, body_timeout: float, api_key: str | None,
                    protect_metrics: bool, sagemaker: bool, allowed_origins: list[str] | None) -> None:
    app.add_middleware(BodySizeLimit, limit=max_body_bytes, timeout=body_timeout)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protect_metrics=protect_metrics,
                           protect_invocations=not sagemaker)
    if allowed_origins:  # added last: it runs first, so a preflight is answered before the key is asked for
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's (unknown route, wrong method) or a crash, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return ErrorJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return ErrorJSONResponse(APIError(msg, exc.status_code, type=kind).body(), status_code=exc.status_code,
                                 headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return ErrorJSONResponse(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500,
                                          type="internal_server_error").body(), status_code=500)


def _add_operational_routes(app: FastAPI, state: ServerState) -> None:
    """Health checks and Prometheus metrics (what a load balancer and a scraper ask)."""
    aengine = state.aengine

    @app.get("/health")
    @app.get("/ping")
    async def health():
        return Response(status_code=200 if aengine.healthy and not aengine.draining else 503)

    @app.get("/metrics")
    async def metrics():
        m = aengine.metrics
        if m is None:
            raise APIError("metrics are disabled on this server", 404)
        return Response(m.render(aengine.num_running, aengine.num_waiting), media_type=CONTENT_TYPE_LATEST)


def _add_inference_routes(app: FastAPI, state: ServerState) -> None:
    """The OpenAI routes and SageMaker's /invocations."""

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, created=state.created, root=state.model_path or state.engine.model_name,
                           max_model_len=state.engine.max_model_len, speculative_config=state.speculative_config,
                           speculation=state.speculation.as_dict(),
                           proposers=by_proposer(state.engine.proposer_stats) if state.engine.spec else None,
                           kernels=state.engine.kernels)
                 for name in state.names]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(state, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(state, request, "completion")

    @app.post("/invocations")
    async def invocations(request: Request):
        return await _serve(state, request, None)


def _add_page_routes(app: FastAPI) -> None:
    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)


# ------------------------------------------------------------------------------------------------------------
# middleware


class APIKeyMiddleware:
    """Bearer-token auth on /v1/* (vLLM's scope) and /invocations (unless SageMaker authenticates it), and on
    /metrics when `protect_metrics`."""

    def __init__(self, app, api_key: str, protect_metrics: bool = False, protect_invocations: bool = True):
        self.app, self.key = app, api_key.encode()
        self.protect_metrics, self.protect_invocations = protect_metrics, protect_invocations

    def guards(self, path: str) -> bool:
        return (path.startswith("/v1/") or path == "/v1" or (self.protect_metrics and path == "/metrics")
                or (self.protect_invocations and path == "/invocations"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self.guards(scope["path"]):
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        err = APIError("invalid or missing API key: send the header `Authorization: Bearer <key>`", 401,
                       code="invalid_api_key")
        await ErrorJSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive,
                                                                                                     send)


class BodySizeLimit:
    """413 for a request body over `limit` bytes, decided from Content-Length before anything is read or as soon as
    a streamed body passes the limit. The rest of the body is read and dropped (cheap: nothing is kept or parsed),
    so the client gets the 413 instead of a broken connection. A body that has not fully arrived `timeout` seconds
    after the request started (a client trickling it, or declaring more than it sends) gets 408 and the connection
    is closed, so no client can hold a connection and a handler open forever."""

    def __init__(self, app, limit: int, timeout: float = 30.0):
        self.app, self.limit, self.timeout = app, limit, timeout

    def error(self) -> APIError:
        return APIError(f"the request body is larger than this server's limit of {self.limit} bytes; send a smaller "
                        "request, or start the server with a larger --max-request-bytes", 413,
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await _drop_body(receive)
            err = self.error()
            return await ErrorJSONResponse(err.body(), status_code=413)(scope, receive, send)
        seen, deadline, done = 0, time.monotonic() + self.timeout, False

        async def limited():
            nonlocal seen, done
            if done:  # the body is in: what follows is the disconnect a streaming handler waits for
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise APIError(f"the request body did not arrive within {self.timeout:g} s; send it at once (or "
                               "start the server with a larger --body-timeout)", 408, code="request_timeout",
                               headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                done = not message.get("more_body")
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if message.get("more_body"):
                        await _drop_body(receive)
                    raise self.error()
            return message

        await self.app(scope, limited, send)


async def _drop_body(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return


# ------------------------------------------------------------------------------------------------------------
# request handling


@dataclass
class Job:
    """One HTTP request as engine requests: choice i is requests[i], for prompt i // n."""
    kind: str  # "chat" or "completion"
    req: ChatCompletionRequest | CompletionRequest
    engine: LLMEngine
    requests: list[EngineRequest]
    id: str
    model: str
    count_param: str  # the field that sets how many requests there are
    echoes: list[str] | None = None  # completions with echo: each choice's prompt text
    created: int = field(default_factory=now)
    text_offsets: list[int] = field(default_factory=list)  # completions logprobs: each choice's text so far
    tool_plan: tools.ToolPlan | None = None  # chat with a forced tool call: the output is its arguments or calls

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests[:: self.req.n])


def cache_key(authorization: str) -> str:
    """Whose earlier answers a request's suffix tree may draft from (proposers/suffix.py): one key per credential
    (a digest, so the tree never holds the credential itself); "" without one."""
    return hashlib.sha256(authorization.encode()).hexdigest()[:16] if authorization else ""


def _prepare(state: ServerState, raw: bytes, kind: str | None, arrival: float) -> Job:
    """Parse, validate and tokenise one HTTP request (CPU-heavy for big ones: runs in a worker thread)."""
    data = parse_json(raw)
    if kind is None:  # /invocations
        kind = ("chat" if isinstance(data, dict) and "messages" in data else
                "completion" if isinstance(data, dict) and "prompt" in data else None)
        if kind is None:
            raise APIError("send a chat-completions body (with \"messages\") or a completions body (with "
                           "\"prompt\")", 400, param="messages")
    req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, data)
    req.check()
    state.check_model(req.model)
    engine = state.aengine.engine_for(req.speculation)
    tool_plan = req.tool_plan() if kind == "chat" else None
    constraint = tool_plan.constraint if tool_plan is not None else req.constraint()
    prompts = [req.as_messages()] if kind == "chat" else req.prompts()
    if tool_plan is not None:
        prompts = [tools.with_tool_message(prompts[0], tool_plan)]
    count_param = "n" if req.n > 1 else "prompt"
    state.aengine.check_room(len(prompts) * req.n, count_param)  # before tokenising anything
    base = new_id("chatcmpl" if kind == "chat" else "cmpl")
    requests: list[EngineRequest] = []
    for i, prompt in enumerate(prompts):
        param = "messages" if kind == "chat" else "prompt" if len(prompts) == 1 else f"prompt.{i}"
        for j in range(req.n):
            rid = base if len(prompts) * req.n == 1 else f"{base}-{len(requests)}"
            # n copies of one prompt: tokenise it once
            source = prompt if j == 0 else requests[-1].prompt_ids
            try:
                requests.append(engine.make_request(source, _sampling(req, j, constraint), rid,
                                                    chat=kind == "chat", arrival=arrival,
                                                    cache_salt=req.cache_salt or ""))
            except RequestError as e:
                raise _request_error(e, req, param) from None
    echoes = None
    if kind == "completion" and req.echo:
        echoes = [p if isinstance(p, str) else state.engine.tokenizer.decode(p) if state.engine.tokenizer else ""
                  for p in prompts for _ in range(req.n)]
    return Job(kind, req, engine, requests, base, req.model or state.names[0], count_param, echoes,
               text_offsets=[0] * len(requests), tool_plan=tool_plan)


def _sampling(req: ChatCompletionRequest | CompletionRequest, index: int, constraint=None) -> SamplingParams:
    """The engine's parameters for choice `index` of a request (n > 1 with a seed: seed, seed + 1, ...)."""
    top_k = req.top_k if req.top_k not in (None, 0) else -1
    echo_logprobs = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
    return SamplingParams(max_tokens=req.output_limit(),
                          temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
                          seed=None if req.seed is None else req.seed + index, stop=req.stop_list(),
                          stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                          logprobs=req.num_logprobs(), prompt_logprobs=req.logprobs if echo_logprobs else None,
                          constraint=constraint)


def _request_error(e: RequestError, req: ChatCompletionRequest | CompletionRequest, prompt_param: str) -> APIError:
    """The engine names its own parameters; the API's field for each is this request's."""
    param = {"prompt": prompt_param, "max_tokens": req.output_limit_param(), "logprobs": req.logprobs_param(),
             "prompt_logprobs": req.logprobs_param()}.get(e.param, e.param)
    message = str(e) if param is None or str(e).startswith(param) else f"{param}: {e}"
    return APIError(message, 400, param=param, code=e.code)


def _check_content_type(request: Request) -> None:
    """Only JSON (or an unlabelled body): text/plain and form bodies are what a web page can send cross-site
    without a CORS preflight, so taking them would let any page drive this server through a user's browser."""
    kind = request.headers.get("content-type")
    if kind is None:
        return
    media = kind.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(f"Content-Type {media or kind!r} is not accepted: send the body as JSON with "
                       "`Content-Type: application/json`", 415, code="unsupported_media_type")


async def _serve(state: ServerState, request: Request, kind: str | None) -> Response:
    arrival = time.perf_counter()
    _check_content_type(request)
    raw = await request.body()
    job = await asyncio.to_thread(_prepare, state, raw, kind, arrival)
    key = cache_key(request.headers.get("authorization", ""))
    for r in job.requests:
        r.cache_key = key
    streams = state.aengine.submit(job.engine, job.requests, job.count_param)
    if job.req.stream:
        return SSEResponse(_events(state, job, streams), streams, state)
    outs = await _collect(request, streams)
    if job.kind == "chat":
        choices = [_chat_choice(state, job, i, o) for i, o in enumerate(outs)]
        cls = ChatCompletionResponse
    else:
        choices = [CompletionChoice(index=i, text=(job.echoes[i] if job.echoes else "") + o.text,
                                    finish_reason=o.finish_reason,
                                    logprobs=_whole_logprobs(state, job, i, o))
                   for i, o in enumerate(outs)]
        cls = CompletionResponse
    body = cls(id=job.id, created=job.created, model=job.model, choices=choices,
               usage=_usage(job, outs),
               speculative_decoding=spec_stats(state, _merged_stats(outs), job.req.speculation),
               metrics=request_metrics(outs))
    return JSONResponse(body.body())


def _chat_choice(state: ServerState, job: Job, i: int, out: RequestOutput) -> ChatChoice:
    """A whole chat choice: text, or (with a forced tool call that completed) OpenAI's tool_calls."""
    calls = job.tool_plan.calls(out.text) if job.tool_plan is not None and out.finish_reason == "stop" else None
    message = ChatMessageOut(content=None, tool_calls=calls) if calls else ChatMessageOut(content=out.text)
    return ChatChoice(index=i, message=message, finish_reason=tools.finish_reason(out.finish_reason, calls),
                      logprobs=_chat_logprobs(state, out.logprobs))


# ------------------------------------------------------------------------------------------------------------
# log-probabilities in OpenAI's two shapes


def _top(state: ServerState, entry: TokenLogprob) -> list[TopLogprob]:
    out = []
    for token_id, logprob in entry.top:
        text, raw = state.token_strings(token_id)
        out.append(TopLogprob(token=text, logprob=logprob, bytes=raw))
    return out


def _chat_logprobs(state: ServerState, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if entries is None:
        return None
    content = []
    for e in entries:
        text, raw = state.token_strings(e.token_id)
        content.append(ChatTokenLogprob(token=text, logprob=e.logprob, bytes=raw, top_logprobs=_top(state, e)))
    return ChatLogprobs(content=content)


def _completion_logprobs(state: ServerState, job: Job, index: int, ids: list[int],
                         entries: list[TokenLogprob | None] | None) -> CompletionLogprobs | None:
    """Choice `index`'s log-probabilities for tokens `ids` (None entries: nothing predicts that token), with text
    offsets that continue from the choice's earlier tokens."""
    if job.req.logprobs is None or entries is None:
        return None
    result = CompletionLogprobs()
    for token_id, e in zip(ids, entries):
        text, _ = state.token_strings(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(None if e is None else e.logprob)
        result.top_logprobs.append(None if e is None else {
            **{state.token_strings(t)[0]: lp for t, lp in e.top}, text: e.logprob})
        result.text_offset.append(job.text_offsets[index])
        job.text_offsets[index] += len(text)
    return result


def _prompt_logprobs(state: ServerState, job: Job, index: int, out: RequestOutput) -> CompletionLogprobs | None:
    return _completion_logprobs(state, job, index, job.requests[index].prompt_ids, out.prompt_logprobs)


def _output_logprobs(state: ServerState, job: Job, index: int, entries: list[TokenLogprob] | None
                     ) -> CompletionLogprobs | None:
    return _completion_logprobs(state, job, index, [e.token_id for e in entries or []], entries)


def _whole_logprobs(state: ServerState, job: Job, index: int, out: RequestOutput) -> CompletionLogprobs | None:
    """A non-streamed choice: the echoed prompt's log-probabilities, then the output's."""
    head = _prompt_logprobs(state, job, index, out) if job.echoes else None
    tail = _output_logprobs(state, job, index, out.logprobs)
    if head is None or tail is None:
        return tail
    return CompletionLogprobs(**{k: getattr(head, k) + getattr(tail, k) for k in CompletionLogprobs.model_fields})


# ------------------------------------------------------------------------------------------------------------
# shared pieces of responses


def spec_stats(state: ServerState, stats: SpecDecodeStats | None, speculation: bool = True) -> dict:
    """A response's `speculative_decoding`, in one shape whether or not the request speculated: without speculation
    (none on the server, or `speculation: false`) method "none", K 0 and the counters of a run that drafted nothing."""
    if stats is None or not speculation or state.engine.spec is None:
        # no drafts, but forced tokens under a grammar still count
        forced = stats.num_forced_tokens if stats is not None else 0
        stats, method, k, policy = SpecDecodeStats(num_forced_tokens=forced), "none", 0, None
    else:
        method, k, policy = state.method, state.k, state.engine.policy.name
    return {"method": method, "num_speculative_tokens": k, **stats.as_dict(), "speculation_policy": policy}


def request_metrics(outs: list[RequestOutput]) -> dict:
    ttft = min((o.time_to_first_token for o in outs if o.time_to_first_token is not None), default=None)
    elapsed = max(o.elapsed for o in outs)
    tokens = sum(o.num_output_tokens for o in outs)
    decode = elapsed - (ttft or 0.0)
    tps = (tokens - len(outs)) / decode if decode > 0 and tokens > len(outs) else 0.0
    return {"time_to_first_token": None if ttft is None else round(ttft, 6), "decode_tokens_per_second": round(tps, 3),
            "elapsed": round(elapsed, 6)}


def _merged_stats(outs: list[RequestOutput]) -> SpecDecodeStats:
    total = SpecDecodeStats(outs[0].spec_stats.max_k)
    for o in outs:
        total.merge(o.spec_stats)
    return total


def _usage(job: Job, outs: list[RequestOutput]) -> dict:
    """OpenAI's usage of a job's outputs (in choice order): a prompt's cached tokens are its first choice's, the
    ones that came from earlier requests."""
    completion_tokens = sum(o.num_output_tokens for o in outs)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs[:: job.req.n])}}


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


# ------------------------------------------------------------------------------------------------------------
# streaming


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events; whatever ends the response (done, client gone, server stopping) aborts its requests
    that are still running, so their slots are freed at once."""

    def __init__(self, events, streams: list[RequestStream], state: ServerState):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams, self.state = streams, state

    async def __call__(self, scope, receive, send):
        self.state.open_streams += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.state.open_streams -= 1
            for s in self.streams:
                s.abort()


def _echo_choice(state: ServerState, job: Job, i: int, out: RequestOutput) -> CompletionChoice:
    """Completions with echo: choice i's prompt, with its log-probabilities once prefill has computed them (so it
    is sent with the choice's first report)."""
    return CompletionChoice(index=i, text=job.echoes[i], logprobs=_prompt_logprobs(state, job, i, out))


def _delta_choice(state: ServerState, job: Job, i: int, out: RequestOutput,
                  call_stream: tools.ToolCallStream | None = None) -> ChatChunkChoice | CompletionChoice:
    finish = out.finish_reason if out.finished else None
    if call_stream is not None:
        calls = call_stream.delta(out.delta_text, out.finished)
        ended = out.finished and job.tool_plan.calls(call_stream.text) is not None
        delta = DeltaMessage(tool_calls=calls) if calls else DeltaMessage()
        if out.finished and not ended and job.tool_plan.named is None:  # an unfinished array: say what was written
            delta = DeltaMessage(content=call_stream.text)
        return ChatChunkChoice(index=i, delta=delta, finish_reason=tools.finish_reason(finish, [1] if ended else None),
                               logprobs=_chat_logprobs(state, out.delta_logprobs))
    if job.kind == "chat":
        delta = DeltaMessage(content=out.delta_text) if out.delta_text or not out.finished else DeltaMessage()
        return ChatChunkChoice(index=i, delta=delta, finish_reason=finish,
                               logprobs=_chat_logprobs(state, out.delta_logprobs))
    return CompletionChoice(index=i, text=out.delta_text, finish_reason=finish,
                            logprobs=_output_logprobs(state, job, i, out.delta_logprobs))


async def _events(state: ServerState, job: Job, streams: list[RequestStream]):
    """The SSE events of a streamed chat or completions request, any number of choices: chat's role chunk per
    choice, then each report's delta as it arrives (after the echoed prompt, for completions with echo; the last
    delta, once every choice has finished, with the request's stats), the usage chunk when asked for, and [DONE]."""
    chunk_cls = ChatCompletionChunk if job.kind == "chat" else CompletionChunk
    opts = job.req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    latest: dict[int, RequestOutput] = {}
    call_streams = {i: tools.ToolCallStream(job.tool_plan) for i in range(len(streams))} if job.tool_plan else {}

    def chunk(choices: list, outs: list[RequestOutput] | None = None, **extra) -> str:
        if include_usage and "usage" not in extra:
            extra["usage"] = _usage(job, [latest[i] for i in sorted(latest)]) if continuous and latest else None
        if outs:
            extra["speculative_decoding"] = spec_stats(state, _merged_stats(outs), job.req.speculation)
            extra["metrics"] = request_metrics(outs)
        return _sse(chunk_cls(id=job.id, created=job.created, model=job.model, choices=choices, **extra).body())

    if job.kind == "chat":
        for i in range(len(streams)):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    try:
        async for i, out in _merge(streams):
            if job.echoes and i not in latest:
                yield chunk([_echo_choice(state, job, i, out)])
            latest[i] = out
            if out.delta_text or out.delta_logprobs or out.finished or continuous:
                finished = [o for o in latest.values() if o.finished]
                last = out.finished and len(finished) == len(streams)
                yield chunk([_delta_choice(state, job, i, out, call_streams.get(i))],
                            finished if last else [out] if continuous else None)
    except EngineFailure as e:
        yield _sse(_failure(e).body())
        yield DONE
        return
    if include_usage and latest:
        outs = [latest[i] for i in sorted(latest)]
        yield chunk([], outs, usage=_usage(job, outs))
    yield DONE


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
