"""Sampling parameters as users know them from vLLM / OpenAI, and the processed target distribution they define."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from peagle.engine.errors import RequestError

if TYPE_CHECKING:
    from peagle.engine.grammar import Constraint

# Most alternatives a request may ask for per token (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20
# Log-probability reported for a token the processing removed (top-k / top-p): JSON has no -inf; OpenAI and vLLM
# use this value.
MASKED_LOGPROB = -9999.0
# Temperatures below this decode greedily, as vLLM's do: dividing logits by a denormal temperature overflows to inf.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int | None = 256  # None: up to max_model_len
    temperature: float = 0.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None  # any int; folded into torch's unsigned 64-bit seed range
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: each output token's log-probability and the n most likely tokens
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Structured output: the output must match this (a JSON schema, regex, choice or grammar); the target's
    # distribution is restricted to it at every position, and its end of sequence allowed only where it matches.
    constraint: Constraint | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}", "top_k")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {n}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed target distribution (temperature, then top-k, then top-p) for logits [..., V], in float32.
    Verification accepts and resamples against exactly this distribution, so speculation keeps it."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays in).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def target_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [..., V] of the distribution a request's tokens are drawn from: the processed target
    distribution when sampling, the model's own softmax for greedy requests (whose draw is its argmax), as OpenAI
    reports them. Computed from the target's logits at each emitted position, so speculation does not change them."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return target_probs(logits, params).log().clamp_min(MASKED_LOGPROB)
