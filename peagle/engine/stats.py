"""Speculative decoding statistics, counted the way vLLM reports them.

mean acceptance length = 1 + accepted / drafts (it counts the token the target adds every step).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int = 0
    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One step that drafted `num_drafted` tokens of which the first `num_accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position += [0] * (len(other.accepted_per_position) - len(self.accepted_per_position))
            self.num_speculative_tokens = len(self.accepted_per_position)
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

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

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
        }
