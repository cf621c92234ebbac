"""Log-probabilities as a request reports them: each token's, with the most likely alternatives, for the output
(from the distribution each token was drawn from: sampling.target_logprobs) and for the prompt (the model's own
softmax: the prompt is not drawn from anything)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from peagle.engine.request import TokenLogprob

if TYPE_CHECKING:
    from peagle.engine.request import Request

# Prompt rows turned into log-probabilities at once (each row is a vocabulary-sized float32 vector).
PROMPT_LOGPROB_ROWS = 256


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """logprobs [n, V] at the positions of tokens[:n] -> each token's log-probability and the num_top most likely."""
    if not tokens:
        return []
    ids = torch.tensor(tokens, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None])[:, 0].tolist()
    if num_top:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]


def add_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """The prompt's log-probabilities from a chunk's logits (logits[i] predict position start + i + 1), a block of
    rows at a time, so a long prompt does not hold a second copy of its logits."""
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]
    num = min(len(logits), len(req.prompt_ids) - 1 - start)
    for i in range(0, num, PROMPT_LOGPROB_ROWS):
        lp = torch.log_softmax(logits[i: min(i + PROMPT_LOGPROB_ROWS, num)], dim=-1)
        first = start + 1 + i
        req.prompt_logprobs += token_logprobs(lp, req.prompt_ids[first:first + len(lp)], req.params.prompt_logprobs)
