"""The speculative config: the same JSON as vLLM's `--speculative-config` (and SageMaker's
`SM_VLLM_SPECULATIVE_CONFIG`), e.g. {"model": ..., "method": "eagle3", "num_speculative_tokens": 3,
"parallel_drafting": true}. This module is the one place its schema and rules live."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_SPECULATIVE_TOKENS = 16
# K when a config or command gives none: with the bundled heads, drafts past the third are rarely accepted, and K = 3
# was the fastest at concurrency 1 in docs/benchmarks.md.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
ENV_VAR = "SM_VLLM_SPECULATIVE_CONFIG"
# The drafter's block formats ("quantization"): peagle.model.quant.QUANTIZATIONS, named here without importing torch.
DRAFTER_FORMATS = ("q4_0", "q4_1", "q8_0")


class SpeculativeConfigError(ValueError):
    """A speculative config that cannot be used; the message names the field and the fix."""


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="drafter head: a folder, or a bundled head name")
    method: Literal["eagle3", "eagle", "peagle"] = "eagle3"
    num_speculative_tokens: int = Field(DEFAULT_NUM_SPECULATIVE_TOKENS, description="K, tokens drafted per step")
    parallel_drafting: bool = False
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None
    # The drafter's weights: a block format of peagle.model.quant (its kernels: x86-64 CPUs); None: Q8_0 beside a
    # block-quantized target, the head's own floats otherwise (quant.drafter_quantization).
    quantization: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    speculative_token_tree: str | None = None

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k_range(cls, k: int) -> int:
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}")
        return k

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
    def _unsupported(cls, v, info):
        if v is not None:
            raise ValueError("not supported by peagle's engine; leave it unset")
        return v

    @model_validator(mode="after")
    def _method(self):
        # "peagle" is shorthand for eagle3 + parallel drafting; "eagle" heads are drafted the same way here.
        if self.method == "peagle":
            self.method, self.parallel_drafting = "eagle3", True
        return self

    @property
    def drafting(self) -> Literal["parallel", "chain"]:
        return "parallel" if self.parallel_drafting else "chain"

    @property
    def method_name(self) -> str:
        """What benchmarks and stats call it: `peagle` or `eagle3`."""
        return "peagle" if self.parallel_drafting else "eagle3"

    def to_dict(self) -> dict:
        """vLLM's JSON form, as a dict: every field that is set (defaults included, so K and the drafting mode are
        always spelled out). Every place that shows or passes on a config (export, `peagle models`, `/v1/models`, the
        trainer's hint, benchmark servers) writes this form. parallel_drafting appears only when true: vLLM releases
        before parallel drafting refuse the field, and false is their behaviour anyway."""
        d = self.model_dump(exclude_none=True)
        if not d["parallel_drafting"]:
            del d["parallel_drafting"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

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
