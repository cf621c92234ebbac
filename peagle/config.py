"""The speculative config: the same JSON as vLLM's `--speculative-config` (and SageMaker's
`SM_VLLM_SPECULATIVE_CONFIG`), e.g. {"model": ..., "method": "eagle3", "num_speculative_tokens": 3,
"parallel_drafting": true}. This module is the one place its schema and rules live, and the home of `Speculation`:
what a command runs once its config is resolved (peagle/model/speculation.py resolves it)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_SPECULATIVE_TOKENS = 16
# Model-free drafts (ngram, suffix) cost nothing to make, only verify rows, so they may run longer: the adaptive
# policy cuts each one to what its score pays for (docs/engine.md, "Choosing K").
MAX_MODEL_FREE_TOKENS = 32
# vLLM's defaults for its model-free methods (vllm.config.speculative): prompt lookup of 5-grams, suffix trees 24 deep.
DEFAULT_PROMPT_LOOKUP = 5
MAX_PROMPT_LOOKUP = 64  # n-gram match lengths: each length tried is one comparison over the context, every step
DEFAULT_NGRAM_TOKENS = 8
DEFAULT_SUFFIX_TREE_DEPTH = 24
DEFAULT_SUFFIX_CACHED_REQUESTS = 10_000
DEFAULT_SUFFIX_SPEC_FACTOR = 1.0
DEFAULT_SUFFIX_MIN_TOKEN_PROB = 0.1
HEAD_METHODS = ("eagle3", "eagle", "peagle")
MODEL_FREE_METHODS = ("ngram", "suffix")
# The head's draft or the suffix tree's, whichever is expected to pay more, per request and step
# (peagle/engine/proposers/hybrid.py): what `peagle serve` and `generate` run when no config is given.
HYBRID_METHOD = "hybrid"
# K when a config or command gives none: with the bundled heads, drafts past the third are rarely accepted, and K = 3
# was the fastest at concurrency 1 in docs/benchmarks.md.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
# Where a command reads its speculative config when no flag gives one (SageMaker's name for vLLM's flag).
SPECULATIVE_CONFIG_ENV = "SM_VLLM_SPECULATIVE_CONFIG"
# What turns speculation off where a config is expected, as with vLLM.
NO_SPECULATION = ("", "none", "null")
# How many drafts each step verifies (peagle/engine/policy.py): adaptive, every command's default, picks K from 0 up
# to num_speculative_tokens every step; fixed always verifies K, as vLLM does. On a CPU a fixed K loses to plain
# decoding wherever the drafts are weak, and adaptive is never far below the best fixed K (docs/engine.md).
SPECULATION_POLICIES = ("adaptive", "fixed")
DEFAULT_SPECULATION_POLICY = "adaptive"
SPECULATION_POLICY_ENV = "SM_VLLM_SPECULATION_POLICY"  # `peagle serve` maps every flag to SM_VLLM_<NAME>; generate too
# The drafter's block formats ("quantization"): peagle.model.quant.QUANTIZATIONS, named here without importing torch.
DRAFTER_FORMATS = ("q4_0", "q4_1", "q8_0")
# Draft trees (peagle/engine/draft_tree.py): a head's candidates kept per draft position (the target's token is in the
# bundled heads' top 8 three times in four at the first position), and the most nodes one tree verifies (the policy's
# cost model is measured that far; past 32 rows a forward costs nearly twice one row even on AMX).
TREE_TOP_M = 8
MAX_TREE_NODES = 32
# EAGLE-2's dynamic tree for EAGLE-3 heads (draft_tree_beams): the nodes expanded per depth, as EAGLE-2 does.
EAGLE2_BEAMS = 8


class SpeculativeConfigError(ValueError):
    """A speculative config that cannot be used; the message names the field and the fix."""


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="drafter head: a folder, or a bundled head name")
    method: Literal["eagle3", "eagle", "peagle", "ngram", "suffix", "hybrid"] = "eagle3"
    # None: the method's default (the head's K; ngram's DEFAULT_NGRAM_TOKENS; suffix: the tree depth, as vLLM). In
    # the hybrid it is the head's K; the suffix tree's drafts run up to suffix_decoding_max_tree_depth.
    num_speculative_tokens: int | None = Field(None, description="K, the most tokens drafted per step")
    parallel_drafting: bool = False
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None
    # The drafter's weights: a block format of peagle.model.quant (its kernels: x86-64 CPUs); None: Q8_0 beside a
    # block-quantized target, the head's own floats otherwise (quant.drafter_quantization).
    quantization: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    # vLLM's static tree: nodes as tuples of candidate ranks along their branch, e.g. "[(0,), (1,), (0, 0)]"
    speculative_token_tree: str | None = None
    # The head's draft trees: "auto" (the adaptive policy picks each step's tree from the measured cost of rows and
    # the head's calibrated probabilities; chains under the fixed policy), a node budget every step (best first by
    # branch probability), or 0 (chains only). Not a vLLM key: for_vllm() leaves it out.
    draft_tree_nodes: Literal["auto"] | int = "auto"
    # An EAGLE-3 head's draft trees: 0, the chain's alternatives as leaves beside it; n, EAGLE-2's dynamic tree, the
    # n most probable nodes of each depth drafted on as well (n rows per pass). Not a vLLM key.
    draft_tree_beams: int = 0
    # method "ngram" (vLLM's prompt lookup): the last n tokens, n from max down to min, matched in the request's own
    # prompt and output; None: the other one's value, or DEFAULT_PROMPT_LOOKUP for both.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # methods "suffix" and "hybrid" (vLLM's suffix decoding keys)
    suffix_decoding_max_tree_depth: int = DEFAULT_SUFFIX_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = DEFAULT_SUFFIX_CACHED_REQUESTS
    suffix_decoding_max_spec_factor: float = DEFAULT_SUFFIX_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = DEFAULT_SUFFIX_MIN_TOKEN_PROB

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k_range(cls, k: int | None, info) -> int | None:
        limit = MAX_MODEL_FREE_TOKENS if info.data.get("method") in MODEL_FREE_METHODS else MAX_SPECULATIVE_TOKENS
        if k is not None and not 1 <= k <= limit:
            raise ValueError(f"must be between 1 and {limit}, got {k}")
        return k

    @field_validator("suffix_decoding_max_tree_depth")
    @classmethod
    def _at_least_one(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v

    @field_validator("prompt_lookup_min", "prompt_lookup_max")
    @classmethod
    def _lookup_length(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_PROMPT_LOOKUP:
            raise ValueError(f"must be between 1 and {MAX_PROMPT_LOOKUP} tokens, got {v}")
        return v

    @field_validator("suffix_decoding_max_cached_requests")
    @classmethod
    def _not_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be 0 (no shared tree) or more, got {v}")
        return v

    @field_validator("suffix_decoding_max_spec_factor")
    @classmethod
    def _positive_factor(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"must be positive, got {v}")
        return v

    @field_validator("suffix_decoding_min_token_prob")
    @classmethod
    def _probability(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise ValueError(f"must be a probability in [0, 1], got {v}")
        return v

    @field_validator("draft_tensor_parallel_size")
    @classmethod
    def _tp(cls, tp: int | None) -> int | None:
        if tp is not None and tp != 1:
            raise ValueError(f"draft_tensor_parallel_size={tp}: peagle runs the drafter on one device; use 1, or "
                             "serve with vLLM (`peagle export`) for tensor-parallel drafting")
        return tp

    @field_validator("max_model_len", "disable_by_batch_size")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"must be a positive integer, got {v}")
        return v

    @field_validator("quantization")
    @classmethod
    def _drafter_format(cls, v: str | None) -> str | None:
        if v is not None and v not in DRAFTER_FORMATS:
            raise ValueError(f"{v!r} is not a drafter weight format peagle runs; use one of "
                             f"{', '.join(DRAFTER_FORMATS)} (block-quantized drafter weights), or leave it unset")
        return v

    @field_validator("speculative_token_tree")
    @classmethod
    def _token_tree(cls, v: str | None) -> str | None:
        if v is not None:
            token_tree_paths(v)
        return v

    @field_validator("draft_tree_beams")
    @classmethod
    def _tree_beams(cls, v: int) -> int:
        if not 0 <= v <= MAX_TREE_NODES:
            raise ValueError(f"must be 0 (side leaves) or a number of nodes expanded per depth up to {MAX_TREE_NODES} "
                             f"(EAGLE-2 expands {EAGLE2_BEAMS}), got {v}")
        return v

    @field_validator("draft_tree_nodes")
    @classmethod
    def _tree_nodes(cls, v):
        if v != "auto" and not 0 <= v <= MAX_TREE_NODES:
            raise ValueError(f"must be \"auto\" or a node budget from 0 (chains only) to {MAX_TREE_NODES}, got {v}")
        return v

    @model_validator(mode="after")
    def _method(self):
        # "peagle" is shorthand for eagle3 + parallel drafting; "eagle" heads are drafted the same way here.
        if self.method == "peagle":
            self.method, self.parallel_drafting = "eagle3", True
        if self.method == HYBRID_METHOD and "parallel_drafting" not in self.model_fields_set:
            self.parallel_drafting = True  # the hybrid's head is a P-EAGLE head unless the config says otherwise
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            self.prompt_lookup_min = lo or hi or DEFAULT_PROMPT_LOOKUP
            self.prompt_lookup_max = hi or lo or DEFAULT_PROMPT_LOOKUP
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                                 f"({self.prompt_lookup_max})")
        if self.num_speculative_tokens is None and self.speculative_token_tree is not None:
            self.num_speculative_tokens = max(map(len, token_tree_paths(self.speculative_token_tree)))
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = (DEFAULT_NGRAM_TOKENS if self.method == "ngram" else
                                           self.suffix_decoding_max_tree_depth if self.method == "suffix" else
                                           DEFAULT_NUM_SPECULATIVE_TOKENS)
        if self.num_speculative_tokens > MAX_MODEL_FREE_TOKENS:  # suffix's default: its tree's depth
            raise ValueError(f"num_speculative_tokens must be at most {MAX_MODEL_FREE_TOKENS}, got "
                             f"{self.num_speculative_tokens} (from suffix_decoding_max_tree_depth)")
        if self.speculative_token_tree is not None:
            paths = token_tree_paths(self.speculative_token_tree)
            if not self.uses_head:
                raise ValueError(f"speculative_token_tree shapes a head's drafts; method {self.method!r} has no head")
            depth = max(map(len, paths))
            if self.num_speculative_tokens < depth:
                raise ValueError(f"speculative_token_tree is {depth} deep but num_speculative_tokens is "
                                 f"{self.num_speculative_tokens}: raise it to {depth} or leave it unset")
            if not self.parallel_drafting and any(any(p[:-1]) for p in paths):
                raise ValueError("an EAGLE-3 head drafts one chain: only its top tokens have children (nodes such "
                                 "as (0, 0, 1), never (1, 0)); draft in parallel with a P-EAGLE head for any shape")
        if self.method == HYBRID_METHOD and self.suffix_decoding_max_tree_depth > MAX_MODEL_FREE_TOKENS:
            raise ValueError(f"suffix_decoding_max_tree_depth must be at most {MAX_MODEL_FREE_TOKENS} in the hybrid "
                             f"(its suffix drafts run that long), got {self.suffix_decoding_max_tree_depth}")
        return self

    @property
    def token_tree(self) -> list[tuple[int, ...]] | None:
        """The static tree's nodes, parents first (None: none given)."""
        return token_tree_paths(self.speculative_token_tree) if self.speculative_token_tree else None

    def without_head(self) -> "SpeculativeConfig | None":
        """What still drafts when the head this config names is not loaded: the hybrid's suffix trees alone (at its
        keys), nothing for a head's own method."""
        return self.model_copy(update={"method": "suffix"}) if self.method == HYBRID_METHOD else None

    @property
    def uses_head(self) -> bool:
        """Whether a drafter head runs (the heads' methods and the hybrid)."""
        return self.method not in MODEL_FREE_METHODS

    @property
    def head_method(self) -> str:
        """The kind of head that drafts: `peagle` (parallel drafting) or `eagle3`."""
        return "peagle" if self.parallel_drafting else "eagle3"

    @property
    def uses_suffix_tree(self) -> bool:
        return self.method in ("suffix", HYBRID_METHOD)

    @property
    def max_draft_tokens(self) -> int:
        """The longest draft any of the method's proposers makes: a step's widest window."""
        if self.method == HYBRID_METHOD:
            return max(self.num_speculative_tokens, self.suffix_decoding_max_tree_depth)
        return self.num_speculative_tokens

    @property
    def drafting(self) -> Literal["parallel", "chain"]:
        return "parallel" if self.parallel_drafting else "chain"

    @property
    def method_name(self) -> str:
        """What benchmarks and stats call it: `peagle`, `eagle3`, `ngram`, `suffix` or `hybrid`."""
        if not self.uses_head or self.method == HYBRID_METHOD:
            return self.method
        return self.head_method

    def describe(self, policy: str) -> str:
        """What runs, in words, e.g. `hybrid (adaptive K<=24, head smollm2-135m-peagle)`."""
        k = f"K{'<=' if policy == 'adaptive' else '='}{self.max_draft_tokens}"
        head = f", head {Path(self.model).name}" if self.uses_head and self.model else ""
        return f"{self.method_name} ({policy} {k}{head})"

    def to_dict(self) -> dict:
        """vLLM's JSON form, as a dict: every field that is set (defaults included, so K and the drafting mode are
        always spelled out). Every place that shows or passes on a config (export, `peagle models`, `/v1/models`, the
        trainer's hint, benchmark servers) writes this form. parallel_drafting appears only when true: vLLM releases
        before parallel drafting refuse the field, and false is their behaviour anyway."""
        d = self.model_dump(exclude_none=True)
        if d["draft_tree_nodes"] == "auto" or not self.uses_head:
            del d["draft_tree_nodes"]
        if d["draft_tree_beams"] == 0 or not self.uses_head or self.parallel_drafting:
            del d["draft_tree_beams"]
        if not d["parallel_drafting"] or not self.uses_head:
            del d["parallel_drafting"]
        if not self.uses_suffix_tree:  # vLLM sets them on every config; written only where they are used
            d = {k: v for k, v in d.items() if not k.startswith("suffix_decoding_")}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def for_vllm(self) -> "SpeculativeConfig":
        """The config `vllm serve` is given for this one: vLLM has no hybrid, so it runs the hybrid's head alone."""
        if self.method != HYBRID_METHOD:
            # peagle's own keys; vLLM's trees are static
            return self.model_copy(update={"draft_tree_nodes": "auto", "draft_tree_beams": 0})
        return SpeculativeConfig.for_head(self.model, self.num_speculative_tokens, self.parallel_drafting)

    @classmethod
    def hybrid(cls, head: str | None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
               ) -> "SpeculativeConfig":
        """A P-EAGLE head beside suffix trees at their defaults (proposers/hybrid.py)."""
        return cls(model=head, method=HYBRID_METHOD, num_speculative_tokens=num_speculative_tokens)

    @classmethod
    def for_head(cls, head: str | None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 parallel_drafting: bool = True) -> "SpeculativeConfig":
        """The config that serves a head: P-EAGLE (parallel drafting) by default, EAGLE-3 with parallel=False."""
        return cls(model=head, num_speculative_tokens=num_speculative_tokens, parallel_drafting=parallel_drafting)

    def check_head(self, head_parallel_capable: bool, head_name: str = "the head") -> None:
        """Refuse parallel drafting on a head that has no mask_hidden, as vLLM would."""
        if self.parallel_drafting and not head_parallel_capable:
            raise SpeculativeConfigError(
                f"parallel_drafting is true but {head_name} has no mask_hidden / mask_token_id, so it cannot draft "
                "in parallel: use a P-EAGLE head, or set \"parallel_drafting\": false to draft it as EAGLE-3")

    @classmethod
    def parse(cls, text: str | dict) -> "SpeculativeConfig":
        """Parse JSON text or a dict; every failure is a SpeculativeConfigError naming the field."""
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(f"speculative config is not valid JSON ({e.msg} at char {e.pos}): "
                                             f"{text[:200]!r}") from e
        if not isinstance(text, dict):
            raise SpeculativeConfigError("speculative config must be a JSON object, e.g. "
                                         '{"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": true}')
        try:
            return cls.model_validate(text)
        except ValidationError as e:
            parts = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"]) or "config"
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    msg = f"unknown field; allowed fields: {', '.join(cls.model_fields)}"
                parts.append(f"{loc}: {msg}")
            raise SpeculativeConfigError("invalid speculative config: " + "; ".join(parts)) from None


# Where a command's speculation came from ("argument": a caller of the Python API passed it).
ORIGINS = ("flag", "environment", "preset", "default", "argument")


@dataclass(frozen=True)
class Speculation:
    """The speculation a command runs, resolved once (peagle/model/speculation.py) and passed down as it is: the
    target, the config (None: plain decoding) with its head resolved to `head_path`, the policy, where the config
    came from (ORIGINS) and a note when the default had to settle for less than it wanted."""
    model: str | None  # the target as the user named it (None: the embedded model)
    model_path: Path | None  # its folder or .gguf file; None only for a model another engine (vLLM) fetches
    config: SpeculativeConfig | None
    head_path: Path | None = None  # the head's folder when a head drafts and is on this disk
    policy: str = DEFAULT_SPECULATION_POLICY
    origin: str = "default"
    note: str | None = None

    @property
    def method(self) -> str:
        """`none`, or the config's method_name (peagle, eagle3, ngram, suffix, hybrid)."""
        return self.config.method_name if self.config is not None else "none"

    @property
    def num_speculative_tokens(self) -> int:
        """The most drafts a step verifies (the widest proposer's, in the hybrid); 0 without speculation."""
        return self.config.max_draft_tokens if self.config is not None else 0

    def describe(self) -> str:
        """What runs and why, for start-up lines and /v1/models, e.g. `suffix (adaptive K<=24), the default`."""
        what = self.config.describe(self.policy) if self.config is not None else "no speculation"
        return f"{what}, {'the default' if self.origin == 'default' else 'from the ' + self.origin}"

    def as_dict(self) -> dict:
        """The JSON form /v1/models and the stats show."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "speculation_policy": self.policy if self.config is not None else None,
                "head": str(self.head_path or self.config.model) if self.config and self.config.uses_head else None,
                "origin": self.origin, "what_runs": self.describe()}


def token_tree_paths(text: str) -> list[tuple[int, ...]]:
    """vLLM's speculative_token_tree, e.g. "[(0,), (1,), (0, 0)]": each node as the ranks of the head's candidates
    along its branch, sorted parents first; ValueError naming the fault."""
    import ast

    example = 'e.g. "[(0,), (1,), (0, 0)]"'
    try:
        nodes = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"must be a list of tuples of candidate ranks, {example}; got {text!r}") from None
    if not isinstance(nodes, (list, tuple)) or not nodes:
        raise ValueError(f"must be a non-empty list of tuples of candidate ranks, {example}")
    for node in nodes:
        if not (isinstance(node, tuple) and node and len(node) <= MAX_SPECULATIVE_TOKENS
                and all(isinstance(r, int) and 0 <= r < TREE_TOP_M for r in node)):
            raise ValueError(f"node {node!r} is not a tuple of at most {MAX_SPECULATIVE_TOKENS} candidate ranks in "
                             f"[0, {TREE_TOP_M}), {example}")
    paths = sorted(set(nodes), key=lambda p: (len(p), p))
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"has {len(paths)} nodes; peagle verifies at most {MAX_TREE_NODES}")
    for p in paths:
        if len(p) > 1 and p[:-1] not in paths:
            raise ValueError(f"node {p} has no parent {p[:-1]} in the tree")
    return paths
