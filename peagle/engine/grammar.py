"""Structured outputs: a constraint (JSON schema, any JSON object, regex, a choice of strings, a context-free
grammar) compiled by llguidance into a token-level matcher (docs/design.md, "Structured outputs").

llguidance (a Rust library with CPU wheels and no GPU stack) does the grammar work: compiling, the set of tokens
allowed next (a bitmask over the target vocabulary), consuming tokens and rolling them back. This module adds what
the engine needs around it:

  * `GrammarCompiler`: one per tokenizer; compiles each distinct constraint once (an LRU cache of compiled
    matchers, each request getting a cheap copy), in a small thread pool with a time limit, a size limit and
    llguidance's own fuel limits, so a hostile schema fails alone with a `GrammarError` instead of stalling others;
  * `GrammarMatcher`: one per request; the allowed tokens of its current state (cached per state, so a rejected
    draft's masks are never computed twice), advancing and rolling back, the forced token (the only one allowed);
  * `GrammarWindow`: one per constrained request and decode step; its drafts proposed under the mask, the forced
    run verified after them, the mask of every verified row, and the roll-back to what was committed.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from peagle.engine.errors import RequestError

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# Largest constraint text compiled (a JSON schema's serialised size, a regex, a grammar): far above any real schema,
# and small enough that compiling it stays well inside COMPILE_TIMEOUT_S.
MAX_CONSTRAINT_CHARS = 100_000
# Seconds a compile may take before its request is refused; llguidance's fuel limits end the work itself soon after.
COMPILE_TIMEOUT_S = 10.0
# Distinct compiled constraints kept per engine.
CACHE_SIZE = 64
# JSON is generated on one line with json.dumps's separators: no whitespace runs for a small model to loop in, and
# punctuation and keys become forced tokens (the only ones allowed), which cost no drafting.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(RequestError):
    """A constraint that cannot be compiled (invalid, too large, too slow); `param` names the request field."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `spec` is canonical text: a JSON schema serialised compactly (its key
    order kept), a regex, a JSON list of choices, or a grammar (Lark, or llama.cpp's GBNF / EBNF); "json_object" has
    none. `param` is the request field it came from, for error messages (not part of its identity)."""
    kind: ConstraintKind
    spec: str = ""
    param: str = "response_format"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}", self.param)
        if len(self.spec) > MAX_CONSTRAINT_CHARS:
            raise GrammarError(f"{self.param}: the constraint is {len(self.spec)} characters long, over this "
                               f"server's limit of {MAX_CONSTRAINT_CHARS}; send a smaller schema or grammar",
                               self.param)

    def __eq__(self, other):
        return isinstance(other, Constraint) and (self.kind, self.spec) == (other.kind, other.spec)

    def __hash__(self):
        return hash((self.kind, self.spec))

    @classmethod
    def json_schema(cls, schema: dict | str, param: str = "response_format") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{param}: a JSON schema must be a JSON object, not {type(schema).__name__}", param)
        # Key order is kept: properties are generated in the order the schema lists them.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> "Constraint":
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> "Constraint":
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "choice") -> "Constraint":
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError(f"{param}: a choice needs a non-empty list of strings", param)
        return cls("choice", json.dumps(list(choices)), param)

    @classmethod
    def grammar(cls, text: str, param: str = "grammar") -> "Constraint":
        return cls("grammar", text, param)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own form (raises GrammarError for text it cannot even read)."""
        import llguidance

        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec, overrides=JSON_OPTIONS)
            if self.kind == "choice":
                return llguidance.grammar_from("choice", self.spec)
            return llguidance.grammar_from("regex" if self.kind == "regex" else "grammar", self.spec)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{self.param}: {e}", self.param) from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary. Thread-safe: the server compiles in its request
    threads, never on the engine's step thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = CACHE_SIZE,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        import llguidance
        import tokenizers

        self.vocab_size = vocab_size
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise GrammarError(f"structured outputs need a tokenizer the tokenizers library runs; this model's is "
                               f"{type(tokenizer).__name__}")
        # llguidance reads the tokenizers pipeline as JSON (its `hf` helper would import transformers to get it)
        pipeline = tokenizers.Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        pipeline.no_padding()
        pipeline.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(pipeline.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.limits = llguidance.LLParserLimits()  # llguidance's defaults bound lexer fuel and grammar size
        self.cache_size, self.timeout_s = cache_size, timeout_s
        self._cache: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()
        # Two workers: one slow compile cannot hold up every other new constraint.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peagle-grammar")

    def matcher(self, constraint: Constraint) -> "GrammarMatcher":
        """A fresh matcher for `constraint` (compiled once; later requests copy the compiled one)."""
        return GrammarMatcher(self._compiled(constraint).deep_copy(), self.vocab_size, min(self.tokenizer.eos_tokens))

    def _compiled(self, constraint: Constraint):
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        grammar = constraint.llguidance_grammar()
        future = self._pool.submit(self._build, grammar)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise GrammarError(f"{constraint.param}: the constraint took more than {self.timeout_s:g} s to compile; "
                               "send a simpler schema or grammar", constraint.param) from None
        if compiled.is_error():
            raise GrammarError(f"{constraint.param}: {_first_lines(compiled.get_error())}", constraint.param)
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, grammar: str):
        import llguidance

        # llguidance reports grammar errors and exhausted limits through is_error(), never by raising.
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)


def _first_lines(message: str, n: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:n])


# Byte value -> the additive bias of its 8 tokens (bit i of byte j is token 8j + i): 0 allowed, -inf forbidden. Adding
# a bias row is several times faster than masked_fill on CPU.
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, 0.0, -np.inf).astype(np.float32)


@dataclass(frozen=True)
class StateMask:
    """One grammar state's mask as an additive bias over the vocabulary (float32 [V]: 0 where allowed, -inf where
    forbidden), how many tokens it allows, and the token it forces when it allows exactly one."""
    bias: torch.Tensor
    num_allowed: int
    forced: int | None


class GrammarMatcher:
    """One request's grammar state. States are numbered by the tokens consumed; `_masks[i]` is the mask after i of
    them, computed on demand and kept only for the current state and those of a step's window (`GrammarWindow`), so rolling back and
    re-advancing over the same tokens (a draft that the target accepted) costs no new mask.

    A matcher that fails mid-answer (llguidance's per-step limits, a token it refuses) sets `error` and from then on
    allows only the end of sequence, so its request ends at once (the engine reports it as aborted) and no other
    request is touched."""

    def __init__(self, matcher, vocab_size: int, eos_token_id: int):
        self._m, self.vocab_size, self.eos_token_id = matcher, vocab_size, eos_token_id
        self.error: str | None = None
        self._tokens: list[int] = []
        self._masks: dict[int, StateMask] = {}

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (the end of the sequence is allowed here)."""
        return self._m.is_accepting()

    @property
    def terminated(self) -> bool:
        """Nothing but the end of the sequence may follow."""
        return self._m.is_stopped()

    def mask(self) -> StateMask:
        """The current state's mask (computed once per state)."""
        mask = self._masks.get(len(self._tokens))
        if mask is None and self.error is None:
            raw = self._m.compute_bitmask()
            num_allowed = int.from_bytes(raw, "little").bit_count()
            if num_allowed == 0 or self._m.is_error():
                self._fail(self._m.get_error() or "the grammar allows no token here")
            packed = np.frombuffer(raw, dtype=np.uint8)
            bias = torch.from_numpy(np.take(_BYTE_BIAS, packed, axis=0).reshape(-1)[: self.vocab_size])
            forced = None
            if num_allowed == 1:
                byte = int(np.flatnonzero(packed)[0])
                forced = 8 * byte + int(packed[byte]).bit_length() - 1
            mask = StateMask(bias, num_allowed, forced)
        if self.error is not None:
            bias = torch.full((self.vocab_size,), float("-inf"))
            bias[self.eos_token_id] = 0.0
            mask = StateMask(bias, 1, self.eos_token_id)
        self._masks[len(self._tokens)] = mask
        return mask

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message.strip().splitlines()[0] if message.strip() else "grammar error"

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens allowed in the current state."""
        return self.mask().bias == 0

    def forced_token(self) -> int | None:
        """The only token allowed in the current state, if exactly one is."""
        return self.mask().forced

    def mask_logits(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """logits [..., V] with every token the grammar forbids at -inf (bias [..., V]: default, the current
        state's). The target's distribution restricted to the grammar, renormalised by the softmax after it."""
        bias = self.mask().bias if bias is None else bias
        return logits.float() + bias.to(logits.device)

    # -- moving --------------------------------------------------------------------------------------------------
    def advance(self, tokens: list[int]) -> None:
        for tok in tokens:
            if self.error is None and not self._m.consume_token(tok):
                self._fail(f"the grammar refused token {tok}: {self._m.get_error()}")
            self._tokens.append(tok)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self.error is None and not self._m.rollback(n):
            self._fail(f"cannot roll back {n} tokens: {self._m.get_error()}")
        del self._tokens[-n:]
        for state in [i for i in self._masks if i > len(self._tokens)]:
            del self._masks[state]

    def commit(self, committed: list[int]) -> None:
        """Tokens the engine committed (outside a window, or the remainder a settled window did not propose): consume
        them and drop the masks of the states behind them."""
        self.advance(committed)
        for state in [i for i in self._masks if i < len(self._tokens)]:
            del self._masks[state]

    def masks_from(self, state: int) -> list[StateMask]:
        """The masks of states `state`.. up to the current one (each computed when its state was reached)."""
        self.mask()
        return [self._masks[i] for i in range(state, len(self._tokens) + 1)]

    def tokens_from(self, state: int) -> list[int]:
        return self._tokens[state:]


class GrammarWindow:
    """A constrained request's part of one decode step, from plan to commit, and the only code that moves its
    matcher during the step: the drafts proposed under the grammar's mask (tentatively consumed), the forced tokens
    verified after them, the masks of the rows the target verifies, and, at commit, the settling of what was
    proposed against what was committed."""

    def __init__(self, matcher: GrammarMatcher):
        self.matcher = matcher
        self.start = matcher.num_tokens  # the state the window opened in
        self.closed = False  # no more drafts (see `propose`)

    @property
    def proposed(self) -> list[int]:
        """The tokens consumed since the window opened: its drafts, then any forced run."""
        return self.matcher.tokens_from(self.start)

    def _open(self) -> bool:
        m = self.matcher
        return not self.closed and m.error is None and not m.terminated

    def propose(self, draft_logits: torch.Tensor, draft_to_target: torch.Tensor) -> int | None:
        """The next draft, consumed tentatively: the forced token if the grammar allows only one, else the drafter's
        best allowed token (draft_logits [Vd] over the draft vocabulary, whose ids map to target ids through
        draft_to_target [Vd]). None once nothing more is worth drafting: the grammar has ended, or no allowed token
        is in the draft vocabulary."""
        if not self._open():
            return None
        m = self.matcher
        token = m.forced_token()
        if token is None:
            scores = draft_logits.float() + m.mask().bias[draft_to_target.cpu()].to(draft_logits.device)
            best = int(scores.argmax())
            if scores[best] == float("-inf"):  # nothing the grammar allows is in the draft vocabulary
                self.closed = True
                return None
            token = int(draft_to_target[best])
        m.advance([token])
        return token

    def take(self, tokens: list[int]) -> list[int]:
        """A draft made without the grammar (a model-free proposer's), consumed as far as the grammar allows it:
        the tokens taken."""
        m, taken = self.matcher, []
        for tok in tokens:
            if not self._open() or m.mask().bias[tok] != 0:
                break
            m.advance([tok])
            taken.append(tok)
        return taken

    def forced_run(self, limit: int) -> list[int]:
        """The run of forced tokens after the drafts, at most `limit`, consumed tentatively: tokens the target must
        produce, verified without being drafted. Only behind drafts that are certain to be accepted (none, or all
        forced): behind a draft the target may reject, the run would cost rows for tokens usually thrown away."""
        m, run = self.matcher, []
        if not all(mask.forced is not None for mask in m.masks_from(self.start)[:-1]):
            return run
        while len(run) < limit and m.error is None and not m.terminated:
            tok = m.forced_token()
            if tok is None:
                break
            m.advance([tok])
            run.append(tok)
        return run

    def masks(self) -> list[StateMask]:
        """The masks of the n + 1 rows the target verifies for the n tokens proposed (row i: after i of them)."""
        return self.matcher.masks_from(self.start)

    def settle(self, committed: list[int]) -> None:
        """The tokens the engine committed: keep the proposals that were committed, roll back the rest, consume the
        remainder (the target's correction or bonus token)."""
        proposed = self.proposed
        keep = 0
        while keep < min(len(proposed), len(committed)) and proposed[keep] == committed[keep]:
            keep += 1
        self.matcher.rollback(len(proposed) - keep)
        self.matcher.commit(committed[keep:])


def stack_bias(masks: list[StateMask]) -> torch.Tensor:
    """Float32 [rows, V]: the biases of a window's rows, to mask its logits at once."""
    return torch.stack([m.bias for m in masks])


def count_forced(masks: list[StateMask], emitted: int) -> int:
    """How many of a window's first `emitted` rows allowed exactly one token."""
    return sum(1 for m in masks[:emitted] if m.forced is not None)
