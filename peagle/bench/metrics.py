"""Benchmark arithmetic (docs/design.md, "Benchmark definitions"), kept free of I/O so it can be checked on
hand-made timings.

- OTPS (output tokens/s) = total generated tokens / wall time of the run (first request sent to last one done).
- TTFT = time from sending a request to its first output token.
- TPOT = (latency - TTFT) / (output tokens - 1) per request (requests with one token have none), as
  `vllm bench serve` computes it; its percentiles are over requests.
- ITL = gaps between successive chunks that carried tokens, pooled over all requests. With speculative decoding one
  chunk may carry several tokens, so ITL measures the time between deliveries, as vLLM's does.
- CPU OTPS = total generated tokens / CPU seconds of the engine's process: a shared machine's other processes move
  wall time far more than CPU time.
- Mean acceptance length = 1 + accepted / drafts (counts the target's own token every step), as vLLM reports it.
- Best K: the K with the highest OTPS for a method at a concurrency; ratios compare best-K OTPS.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    prompt_id: str
    ok: bool = True
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # clock when sent (seconds, any monotonic origin)
    ttft: float | None = None  # seconds from sending to the first token
    latency: float = 0.0  # seconds from sending to the last token
    itl: list[float] = field(default_factory=list)  # seconds between successive token-carrying chunks
    spec: dict | None = None  # this request's speculative stats (num_drafts, num_draft_tokens, ...)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution_ms(values: list[float]) -> dict:
    """mean, median, percentiles and maximum of seconds, in milliseconds (NaN-free: None where there is no data)."""
    if not values:
        return {"mean": None, "median": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    ms = [v * 1000.0 for v in values]
    out = {"mean": sum(ms) / len(ms), "median": percentile(ms, 50)}
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES})
    out["max"] = max(ms)
    return {k: round(v, 3) for k, v in out.items()}


def merge_spec(stats: list[dict | None]) -> dict | None:
    """Sum per-request speculative stats (`SpecDecodeStats.as_dict()` of each) into one set; None when no request
    decoded with a drafter (an adaptive run that only took plain steps still counts them)."""
    from peagle.engine.stats import SpecDecodeStats

    total = SpecDecodeStats.total(SpecDecodeStats.from_dict(s) for s in stats if s)
    return total.as_dict() if total.num_drafts or sum(total.steps_per_k) else None


@dataclass
class RunMetrics:
    """One measured cell: a method at one K and one concurrency."""
    method: str  # baseline, eagle3, peagle, transformers, transformers-pld
    k: int  # speculative tokens (0 for none; the largest K under the adaptive policy)
    concurrency: int
    num_requests: int
    num_failed: int
    duration: float  # seconds
    total_input_tokens: int
    total_output_tokens: int
    otps: float  # output tokens / s
    request_throughput: float  # requests / s
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict
    acceptance: dict | None = None
    errors: list[str] = field(default_factory=list)
    policy: str = "fixed"  # the engine's speculation policy: fixed or adaptive
    # CPU seconds the engine's process used in the run, and output tokens per CPU second: on a machine shared with
    # other processes, wall time mostly measures the scheduler; CPU time much less so. None where not measurable.
    cpu_s: float | None = None
    cpu_otps: float | None = None

    @property
    def label(self) -> str:
        return config_label(self.method, self.k, self.policy)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["label"] = self.label
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunMetrics":
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**d)


def summarize(results: list[RequestResult], duration: float, method: str, k: int, concurrency: int,
              acceptance: dict | None = None, policy: str = "fixed", cpu_s: float | None = None) -> RunMetrics:
    """Aggregate a run. `acceptance` overrides the per-request stats (e.g. a /metrics counter delta)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itl = [g for r in ok for g in r.itl]
    if acceptance is None:
        acceptance = merge_spec([r.spec for r in ok])
    return RunMetrics(
        method=method, k=k, concurrency=concurrency, num_requests=len(results), num_failed=len(results) - len(ok),
        duration=round(duration, 4), total_input_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=out_tokens,
        otps=round(out_tokens / duration, 4) if duration > 0 else 0.0,
        request_throughput=round(len(ok) / duration, 4) if duration > 0 else 0.0,
        ttft_ms=distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=distribution_ms(itl),
        e2el_ms=distribution_ms([r.latency for r in ok]),
        acceptance=acceptance,
        errors=sorted({r.error for r in results if r.error})[:5], policy=policy,
        cpu_s=round(cpu_s, 4) if cpu_s else None, cpu_otps=round(out_tokens / cpu_s, 4) if cpu_s else None)


def best_k(otps_by_k: dict[int, float | None]) -> tuple[int | None, float | None]:
    """(K, OTPS) of the fastest K; ties go to the smaller K. (None, None) when nothing was measured."""
    measured = [(k, v) for k, v in otps_by_k.items() if v is not None and v > 0]
    if not measured:
        return None, None
    return max(measured, key=lambda kv: (kv[1], -kv[0]))


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


METHOD_NAMES = {"baseline": "No speculation", "eagle3": "EAGLE-3", "peagle": "P-EAGLE",
                "transformers": "transformers generate()", "transformers-pld": "transformers prompt lookup",
                "ngram": "n-gram", "suffix": "Suffix decoding", "hybrid": "Hybrid (P-EAGLE + suffix)",
                "default": "peagle's default"}
SPEC_METHODS = ("eagle3", "peagle")  # the heads, measured at each K of --k
# peagle's other drafters, each at its own config's defaults under the adaptive policy (hybrid: the P-EAGLE head's)
AUTO_METHODS = ("ngram", "suffix", "hybrid")
# "default": what `peagle serve` runs for the model when no config is given (peagle/model/speculation.py)
DRAFTING_METHODS = SPEC_METHODS + AUTO_METHODS + ("default",)


def config_label(method: str, k: int, policy: str = "fixed") -> str:
    name = METHOD_NAMES.get(method, method)
    if method not in DRAFTING_METHODS:
        return name
    return f"{name} adaptive K<={k}" if policy == "adaptive" else f"{name} K={k}"
