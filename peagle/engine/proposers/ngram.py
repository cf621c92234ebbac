"""Prompt lookup (vLLM's `method: "ngram"`): the draft is what followed the latest earlier occurrence of the
request's last n tokens in its own prompt and output, for the longest n from prompt_lookup_max down to
prompt_lookup_min that occurs. Text that quotes its prompt (code edits, summaries with quotes, resent turns) is
drafted for free; the policy cuts each draft to what its measured acceptance pays for."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from peagle.engine.acceptance import Draft, MeasuredAcceptance, survival
from peagle.engine.proposers.base import NoHead

if TYPE_CHECKING:
    from peagle.engine.request import Request

NAME = "ngram"


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens after the latest earlier match of the last n tokens of `tokens` (int64 [L]), longest n first;
    [] when none of them occurs earlier."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows starting at 0 .. size - n - 1: every earlier occurrence, none that is the suffix itself
        windows = sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist()
    return []


class NgramProposer(NoHead):
    names = (NAME,)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.max_k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self.acceptance = MeasuredAcceptance(num_speculative_tokens)
        # Each request's prompt + output as one array with room to grow (doubling), so a step copies only its new
        # tokens.
        self._tokens: dict[str, np.ndarray] = {}
        self._length: dict[str, int] = {}

    def _context(self, req: "Request") -> np.ndarray:
        rid, seq_len = req.request_id, req.num_tokens
        buf, have = self._tokens.get(rid), self._length.get(rid, 0)
        if buf is None or len(buf) < seq_len:
            grown = np.zeros(max(2 * seq_len, 64), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = self._tokens[rid] = grown
        if have < seq_len:
            new = (req.prompt_ids + req.output_ids)[have:] if have < len(req.prompt_ids) else \
                req.output_ids[have - len(req.prompt_ids):]
            buf[have:seq_len] = new
            self._length[rid] = seq_len
        return buf[:seq_len]

    def score(self, reqs: Sequence["Request"]) -> list[Draft | None]:
        out = []
        for req in reqs:
            tokens = lookup(self._context(req), self.min_n, self.max_n, self.max_k)
            out.append(Draft(NAME, tokens, survival(self.acceptance.conditional(req.request_id)[: len(tokens)])))
        return out

    def observe(self, req: "Request", draft: Draft, num_drafted: int, num_accepted: int,
                emitted: Sequence[int] = ()) -> None:
        self.acceptance.observe(req.request_id, num_drafted, num_accepted)

    def prefill(self, req: "Request") -> None:
        pass  # a prompt is one array copy at the first `score`: cheap however long

    def add_tokens(self, req: "Request", tokens: list[int]) -> None:
        pass  # read from the request at the next `score`

    def cached_bytes(self) -> int:
        return 0  # each request's own tokens, gone when it finishes

    def finish(self, req: "Request") -> None:
        self._tokens.pop(req.request_id, None)
        self._length.pop(req.request_id, None)
        self.acceptance.forget(req.request_id)
