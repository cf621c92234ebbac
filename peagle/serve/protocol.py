"""Request and response schemas of the HTTP API, in OpenAI's shape (the subset vLLM serves), plus peagle's
extensions: every response carries its own speculative-decoding stats (`speculative_decoding`) and timing
(`metrics`), and a request may ask for `"speculation": false` (run on the target alone, for comparisons).

Parsing is strict about types (`"max_tokens": "5"` or `true` is an error, as in OpenAI's API) and ignores fields
it does not know (as vLLM does). Every failure becomes an `APIError` naming the offending field, which the app
turns into OpenAI's error body: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from peagle.engine.grammar import Constraint, GrammarError
from peagle.engine.sampling import MAX_LOGPROBS
from peagle.serve.tools import ToolError, ToolPlan, plan

# Deepest JSON nesting a request may have; no field of the API nests deeper than a few levels.
MAX_JSON_DEPTH = 32

# --------------------------------------------------------------------------------------------------------------
# errors


class APIError(Exception):
    """An error answered in OpenAI's shape. `param` names the request field at fault (dotted path)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list", "literal"}


def _param_of(loc: tuple) -> str | None:
    """A dotted field path from a pydantic error location, without the union-member names pydantic adds."""
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif isinstance(p, str) and not ("[" in p or "-" in p or p.lower() in _TYPE_NAMES or p[:1].isupper()):
            parts.append(p)
    return ".".join(parts) or None


def validation_error(e: ValidationError) -> APIError:
    """One APIError from a pydantic ValidationError: the first field at fault, with every reason given for it."""
    by_param: dict[str | None, list[str]] = {}
    for err in e.errors():
        param = _param_of(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "this field is required"
        elif err["type"] == "model_type":  # pydantic names our class ("instance of ChatMessage"): say what to send
            msg = f"expected a JSON object, got {type(err.get('input')).__name__}"
        if msg not in by_param.setdefault(param, []):
            by_param[param].append(msg)
    param, msgs = next(iter(by_param.items()))
    text = " or ".join(msgs)
    return APIError(f"{param}: {text}" if param else text, 400, param)


def parse_json(raw: bytes) -> Any:
    if not raw.strip():
        raise APIError("the request body is empty; send a JSON object", 400)
    try:
        text = raw.decode("utf-8")  # JSON is UTF-8 on the wire (RFC 8259); no guessing at UTF-16 or UTF-32
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); send JSON "
                       "encoded as UTF-8", 400) from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise APIError(f"the request body is not valid JSON: {getattr(e, 'msg', str(e))}{where}", 400) from None
    except RecursionError:
        raise _too_deep(None) from None
    _check_depth(data)
    return data


def _too_deep(param: str | None) -> APIError:
    return APIError(f"{param + ': ' if param else ''}the request body nests JSON more than {MAX_JSON_DEPTH} levels "
                    "deep; no field of this API needs that", 400, param)


def _check_depth(data: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH (iteratively: the check itself must not recurse), and strings
    that are not Unicode text: JSON's \\ud800-style escapes can spell a lone UTF-16 surrogate, which no tokenizer
    (and no UTF-8 encoder) accepts."""
    todo = [(v, 2, k) for k, v in data.items()] if isinstance(data, dict) else [(data, 1, None)]
    todo += [(k, 2, k) for k in data] if isinstance(data, dict) else []
    while todo:
        value, depth, top = todo.pop()
        if isinstance(value, str):
            if not value.isascii():
                _check_unicode(value, top)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep(top)
            items = value.values() if isinstance(value, dict) else value
            todo.extend((v, depth + 1, top) for v in items)
            if isinstance(value, dict):
                todo.extend((k, depth + 1, top) for k in value)


def _check_unicode(text: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"{param}: " if param else ""
        raise APIError(f"{where}the text holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                       "which is not Unicode; send valid UTF-8 text (pair or drop the \\uD800-\\uDFFF escape)",
                       400, param) from None


def parse(model: type[BaseModel], data: Any) -> BaseModel:
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, not {type(data).__name__}", 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


# --------------------------------------------------------------------------------------------------------------
# requests

_STRICT = ConfigDict(strict=True, extra="ignore", protected_namespaces=(), allow_inf_nan=False)
MAX_STOP_SEQUENCES = 16
MAX_PROMPTS = 64  # prompts in one completions request
# Content-part types of OpenAI's chat API that carry something other than text.
IMAGE_PARTS = {"image_url", "image", "input_image"}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # vLLM's extension: usage (and, here, the running speculative-decoding stats) on every chunk.
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, sent back in a tool round trip
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        for part in v if isinstance(v, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS:
                raise ValueError("image input is not supported by this model")
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported by this model; send text")
        return v

    @model_validator(mode="after")
    def _content_needed(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs \"content\" (a string or a list of text parts)")
        return self

    def text(self) -> str:
        if self.content is None and self.tool_calls:  # the model sees its earlier calls as the JSON it wrote
            return json.dumps([{"name": (c.get("function") or {}).get("name"),
                                "arguments": _arguments((c.get("function") or {}).get("arguments"))}
                               for c in self.tool_calls])
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def _arguments(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""
    model_config = ConfigDict(strict=True, extra="ignore")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# vLLM's older names for the structured_outputs members.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _constraint_of(kind: str, value, param: str) -> Constraint:
    if kind == "json":
        return Constraint.json_schema(value, param)
    if kind == "json_object":
        return Constraint.json_object(param)
    return {"regex": Constraint.regex, "choice": Constraint.choice, "grammar": Constraint.grammar}[kind](value, param)


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what a 64-bit generator seed can hold
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: the prefix cache (and peagle's suffix trees) reuse only what requests with the same salt left
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # peagle extension: false runs this request on the target alone (no drafter), for side-by-side comparisons.
    speculation: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> Constraint | None:
        """The output constraint these fields ask for (at most one of them may); APIError naming the field."""
        found: list[tuple[str, Constraint]] = []
        try:
            rf = self.response_format
            if rf is not None and rf.type == "json_object":
                found.append(("response_format", Constraint.json_object("response_format")))
            elif rf is not None and rf.type == "json_schema":
                param = "response_format.json_schema.schema"
                schema = (rf.json_schema or {}).get("schema")
                if schema is None:
                    raise GrammarError(f"{param}: this field is required for {{\"type\": \"json_schema\"}}", param)
                found.append(("response_format", Constraint.json_schema(schema, param)))
            so = self.structured_outputs
            members = [] if so is None else [
                (f"structured_outputs.{kind}", kind, value) for kind, value in
                (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                 ("json_object", so.json_object or None))]
            members += [(field, kind, getattr(self, field)) for field, kind in GUIDED_FIELDS.items()]
            for param, kind, value in members:
                if value is not None:
                    found.append((param, _constraint_of(kind, value, param)))
        except GrammarError as e:
            raise APIError(str(e), 400, e.param) from None
        if len(found) > 1:
            names = " and ".join(p for p, _ in found)
            raise APIError(f"{found[1][0]}: send one output constraint, not several ({names})", 400, found[1][0])
        if so is not None and not found:
            raise APIError("structured_outputs: set one of json, regex, choice, grammar or json_object", 400,
                           "structured_outputs")
        return found[0][1] if found else None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info):
        if v not in (None, 0, 0.0):
            raise ValueError(f"{info.field_name} is not supported by this server; leave it unset or 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v

    def check(self) -> None:
        """Rules across fields (raised as APIError so they name their field)."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only allowed when stream is true", 400, "stream_options")

    def output_limit(self) -> int | None:
        return self.max_tokens

    def output_limit_param(self) -> str:
        return "max_tokens"

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def num_logprobs(self) -> int | None:
        """Alternatives per output token the engine should report; None for no log-probabilities."""
        return None

    def logprobs_param(self) -> str:
        return "logprobs"


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True

    def tool_plan(self) -> ToolPlan | None:
        """The constrained tool call asked for (tool_choice "required" or a named function), or None."""
        try:
            result = plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        except (ToolError, GrammarError) as e:
            raise APIError(str(e), 400, e.param) from None
        if result is not None and self.constraint() is not None:
            raise APIError("tool_choice: a forced tool call cannot be combined with response_format or "
                           "structured_outputs; send one of them", 400, "tool_choice")
        return result

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs: only allowed when logprobs is true", 400, "top_logprobs")

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def output_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def logprobs_param(self) -> str:
        return "top_logprobs"

    def as_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
             ) = Field(...)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """Say which of the four shapes was meant, instead of pydantic's four failed alternatives."""
        shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(v, str) or not isinstance(v, list):
            return v
        if not v:
            raise ValueError(f"must not be empty; send {shapes}")
        kinds = {"id" if isinstance(x, int) and not isinstance(x, bool) else type(x).__name__ for x in v}
        if len(kinds) > 1:
            raise ValueError(f"mixes {' and '.join(sorted(kinds))} items; send {shapes}")
        for i, item in enumerate(v):
            if isinstance(item, list) and (not item or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in item)):
                raise ValueError(f"item {i} must be a non-empty list of token ids (integers)")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v is not None:
            raise ValueError("suffix is not supported by this server")
        return v

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one string, one list of token ids, or several of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


# --------------------------------------------------------------------------------------------------------------
# responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class SpeculativeStats(BaseModel):
    """peagle extension: this request's speculative decoding, counted as vLLM counts it."""
    method: str  # "peagle", "eagle3" or "none"
    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_per_position: list[float]
    acceptance_rate: float
    mean_acceptance_length: float  # 1 + accepted / drafts
    speculation_policy: str | None = None  # "adaptive" or "fixed" (None without speculation)
    steps_per_k: list[int] = []  # decode steps by the depth of the drafts they verified (index 0: plain steps)
    mean_k: float = 0.0  # depth of the drafts verified per decode step
    mean_draft_tokens: float = 0.0  # draft tokens verified per draft: a chain's K, a draft tree's nodes
    num_forced_tokens: int = 0  # under a grammar: emitted tokens that were the only one it allowed


class RequestMetrics(BaseModel):
    """peagle extension: this request's timing."""
    time_to_first_token: float | None = None  # seconds from arrival to the first token
    decode_tokens_per_second: float = 0.0  # output tokens after the first, over the time after the first
    elapsed: float = 0.0  # seconds from arrival to the last token


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (None for the first prompt token)."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _Choice(BaseModel):
    index: int = 0
    finish_reason: str | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None

    @model_serializer
    def _calls_when_present(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        return out


class ChatChoice(_Choice):
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # OpenAI's tool-call deltas: {"index", then "id", "type", "function"}

    @model_serializer
    def _present_only(self) -> dict:
        # A delta carries only what changed: {"role", "content": ""} first, then {"content"}, then {} at the end.
        return {k: v for k, v in (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
                if v is not None}


class ChatChunkChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class _Envelope(BaseModel):
    """What every completion response and streamed chunk carries besides its choices."""
    id: str
    created: int
    model: str
    speculative_decoding: SpeculativeStats | None = None
    metrics: RequestMetrics | None = None

    def body(self) -> dict:
        """The JSON body. Optional fields appear only when set: a streamed chunk carries usage only when the client
        asked for it, and stats only on its last chunk."""
        unset = {k for k in ("usage", "speculative_decoding", "metrics") if k not in self.model_fields_set}
        return self.model_dump(exclude=unset)


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "peagle"
    root: str | None = None
    max_model_len: int | None = None
    # peagle extensions: how this model decodes, and which kernels run its forward.
    speculative_config: dict | None = None
    # what runs: method, K, policy, head, where the config came from, and all that in words (`what_runs`)
    speculation: dict | None = None
    # engine-wide since start, per drafter (the hybrid has two): drafts, draft and accepted tokens, acceptance
    proposers: dict | None = None
    kernels: dict | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
