"""Speculative decoding statistics, counted the way vLLM reports them; the one place their arithmetic lives (the
engine, the server's responses and /metrics, and `peagle bench` all use it).

mean acceptance length = 1 + accepted / drafts (it counts the token the target adds every step).
A *draft* is a step that verified at least one drafted token; steps where the speculation policy chose K = 0 are
plain decoding steps, counted only in `steps_per_k[0]`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    max_k: int = 0  # the largest K a step may verify
    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    steps_per_k: list[int] = field(default_factory=list)  # decode steps by the K they verified (index 0: plain)
    # Under a grammar: emitted tokens that were the only one it allowed (verified without being drafted or sampled).
    num_forced_tokens: int = 0

    def __post_init__(self):
        k = self.max_k
        self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        self.steps_per_k += [0] * (k + 1 - len(self.steps_per_k))

    def record(self, num_drafted: int, num_accepted: int, depth: int | None = None) -> None:
        """One decode step that verified `num_drafted` drafts (0: a plain step) and accepted the first
        `num_accepted` of them; a draft tree's `depth` is its K (num_drafted counts all its nodes, as vLLM counts
        draft tokens)."""
        self.steps_per_k[num_drafted if depth is None else depth] += 1
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def merge(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        """Add other's counts to these (in place; returns self)."""
        self.max_k = max(self.max_k, other.max_k)
        self.__post_init__()
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_forced_tokens += other.num_forced_tokens
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n
        for i, n in enumerate(other.steps_per_k):
            self.steps_per_k[i] += n
        return self

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats().merge(self)

    @classmethod
    def total(cls, stats: Iterable["SpecDecodeStats | None"]) -> "SpecDecodeStats":
        out = cls()
        for s in stats:
            if s is not None:
                out.merge(s)
        return out

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of steps whose draft at position i was accepted."""
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_position]

    @property
    def mean_draft_tokens(self) -> float:
        """Draft tokens verified per drafting step: a chain's K, a draft tree's nodes."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_k(self) -> float:
        """Drafts verified per decode step, plain steps included (K itself under a fixed policy)."""
        steps = sum(self.steps_per_k)
        return sum(k * n for k, n in enumerate(self.steps_per_k)) / steps if steps else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "steps_per_k": list(self.steps_per_k),
            "mean_k": round(self.mean_k, 4),
            "mean_draft_tokens": round(self.mean_draft_tokens, 4),
            "num_forced_tokens": self.num_forced_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SpecDecodeStats":
        """The counters of an `as_dict()` (or of vLLM's /metrics); derived fields are recomputed, not trusted."""
        per_pos = [int(n) for n in d.get("accepted_per_position") or []]
        steps = [int(n) for n in d.get("steps_per_k") or []]
        return cls(max(len(per_pos), len(steps) - 1, 0), int(d.get("num_drafts") or 0),
                   int(d.get("num_draft_tokens") or 0), int(d.get("num_accepted_tokens") or 0), per_pos, steps,
                   int(d.get("num_forced_tokens") or 0))


def by_proposer(stats: dict[str, SpecDecodeStats]) -> dict[str, dict]:
    """Per drafter (engine.proposer_stats): how often it drafted and how much of it was accepted, for /v1/models and
    the generate command's stats."""
    return {name: {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                   "num_accepted_tokens": s.num_accepted_tokens, "acceptance_rate": round(s.acceptance_rate, 4),
                   "mean_acceptance_length": round(s.mean_acceptance_length, 4)}
            for name, s in stats.items()}


def describe_by_proposer(stats: dict[str, SpecDecodeStats]) -> str:
    """One line: e.g. `peagle 40 drafts (31% accepted), suffix 12 drafts (83% accepted)`."""
    return ", ".join(f"{name} {s.num_drafts} drafts ({100 * s.acceptance_rate:.0f}% accepted)"
                     for name, s in stats.items())
