"""One request's state inside the engine, and what the engine reports about it after each step."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from peagle.engine.stats import SpecDecodeStats

if TYPE_CHECKING:
    from peagle.engine.detokenize import IncrementalDetokenizer
    from peagle.engine.grammar import GrammarMatcher
    from peagle.engine.sampling import SamplingParams


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
    spec_stats: SpecDecodeStats
    time_to_first_token: float | None  # seconds
    elapsed: float  # seconds since arrival
    # With SamplingParams.logprobs: one entry per output token (all so far, and those of delta_token_ids).
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        decode_time = self.elapsed - (self.time_to_first_token or 0.0)
        return (len(self.token_ids) - 1) / decode_time if decode_time > 0 and len(self.token_ids) > 1 else 0.0


class DrafterBacklog:
    """A request's real rows that the drafter has not run yet: row t is token x_{t+1} with the target's feature g_t,
    and the rows are contiguous from position `start` (everything before it is in the drafter's cache). Features are
    kept as one chunk per step (copies, so a step's batch can go) and joined only when the drafter runs: appending to
    one growing tensor would copy the whole backlog every plain step."""

    def __init__(self) -> None:
        self.start = 0
        self.tokens: list[int] = []
        self._chunks: list[torch.Tensor] = []  # [rows, 3H] each

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: list[int], features: torch.Tensor) -> None:
        """Rows that follow the ones already waiting (a prefill's prompt rows, or a step's verified positions)."""
        self.tokens += tokens
        self._chunks.append(features.clone())

    def features(self) -> torch.Tensor:
        """All waiting rows' features, [rows, 3H] (one chunk after this)."""
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    def consume(self, n: int | None = None) -> None:
        """The drafter has run the first n rows (all of them by default): they leave the backlog."""
        n = len(self.tokens) if n is None else n
        rest = self.features()[n:].clone() if n < len(self.tokens) else None
        self.start += n
        self.tokens = self.tokens[n:]
        self._chunks = [rest] if rest is not None else []

    def skip(self, n: int) -> None:
        """The drafter's cache already holds the next n rows (copied from the prefix cache): nothing to run."""
        assert not self.tokens, "rows can be skipped only where the drafter is caught up"
        self.start += n

    def clear(self) -> None:
        """The request is gone: let its features go."""
        self.tokens, self._chunks = [], []


@dataclass(eq=False)  # identity semantics: requests live in sets and lists by reference
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec_stats: SpecDecodeStats
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    backlog: DrafterBacklog = field(default_factory=DrafterBacklog)  # real rows the drafter has not run
    # Prefill progress: positions of prefill_ids whose keys and values are in the slot (computed or from the prefix
    # cache).
    num_computed: int = 0
    # After a preemption (the pool ran short and its blocks went back): the tokens to compute again before it
    # decodes on, its prompt and every output token but the last (None: the prompt).
    recompute_ids: list[int] | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # of them, those the prefix cache supplied
    # The request's chain in the prefix cache (prefix_cache.Block, one per BLOCK_SIZE positions), and the features
    # of the positions after it that do not yet fill a block.
    blocks: list = field(default_factory=list)
    unstored_features: list[torch.Tensor] = field(default_factory=list)
    # Text bookkeeping for streaming and stop strings.
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    reported_text_len: int = 0
    reported_token_len: int = 0
    # Log-probabilities, when the params ask for them (output: aligned with output_ids).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Structured output: the grammar state of the committed tokens (None when unconstrained).
    matcher: GrammarMatcher | None = None
    # Whose earlier outputs a suffix tree may draft from (proposers/suffix.py): requests under one key share a
    # tree, so no client's text is drafted into another's answers.
    cache_key: str = ""
    # vLLM's cache_salt: the prefix cache and the suffix trees' shared outputs reuse only what requests of the same
    # salt left, so one tenant cannot probe another's prompts through hit timing, and a benchmark's runs start from
    # the same empty caches.
    cache_salt: str = ""

    @property
    def num_tokens(self) -> int:
        """Committed tokens: prompt + output."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def decodes(self) -> bool:
        """Whether it goes on past the token its prompt's prefill samples (so drafts may ever be made for it)."""
        return self.params.max_tokens > 1

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens a prefill computes: the prompt, or what a preempted request had (its last token's keys and
        values come with its next decode step, as after a first prefill)."""
        return self.recompute_ids if self.recompute_ids is not None else self.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prefill_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
