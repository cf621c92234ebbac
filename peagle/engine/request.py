"""One request's state inside the engine, what the engine reports about it after each step, and the error a request
that cannot be served raises."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from peagle.engine.stats import SpecDecodeStats

if TYPE_CHECKING:
    from peagle.engine.detokenize import IncrementalDetokenizer
    from peagle.engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as asked (too long, bad parameters); other requests are unaffected.
    `param` names the sampling parameter or input at fault ("prompt", "max_tokens", ...), `code` a machine-readable
    reason (e.g. "context_length_exceeded"); the server maps both onto its own field names."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token there, and the most likely tokens (most likely first)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    text: str  # all output text so far (stop string excluded)
    delta_text: str  # text new since the previous report
    token_ids: list[int]
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    num_prompt_tokens: int
    spec: SpecDecodeStats
    time_to_first_token: float | None  # seconds
    elapsed: float  # seconds since arrival
    # With SamplingParams.logprobs: one entry per output token (all so far, and those of delta_token_ids).
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        decode_time = self.elapsed - (self.time_to_first_token or 0.0)
        return (len(self.token_ids) - 1) / decode_time if decode_time > 0 and len(self.token_ids) > 1 else 0.0


@dataclass(eq=False)  # identity semantics: requests live in sets and lists by reference
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecDecodeStats
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    # Drafter rows not yet run: tokens x_{t+1} with target features g_t, starting at position `pending_start`.
    pending_tokens: list[int] = field(default_factory=list)
    pending_features: list[torch.Tensor] = field(default_factory=list)  # [rows, 3H] chunks, one per step
    pending_start: int = 0
    # Text bookkeeping for streaming and stop strings.
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    reported_text_len: int = 0
    reported_token_len: int = 0
    # Log-probabilities, when the params ask for them (output: aligned with output_ids).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_tokens(self) -> int:
        """Committed tokens: prompt + output."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
