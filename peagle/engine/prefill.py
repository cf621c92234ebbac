"""A step's prompt work (docs/engine.md, "Chunked prefill"): under a budget of max_num_batched_tokens prompt tokens
per step, and while streams decode under the step's time budget (step_budget.py), each admitted prompt in turn
continues from what the prefix cache holds (prefix_reuse.py) and runs its next chunk through the target, all chunks
in one padded forward; a prompt's last chunk samples its first token. Chunks start on block boundaries and compute
each row as one pass would, so chunking and caching change no output. The rows wait for the drafter
(catch_up.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from peagle.engine.catch_up import DrafterCatchUp
from peagle.engine.logprobs import add_prompt_logprobs
from peagle.engine.prefix_cache import BLOCK_SIZE
from peagle.engine.prefix_reuse import PrefixReuse
from peagle.engine.step_budget import StepBudget
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel

if TYPE_CHECKING:
    from peagle.engine.proposers import Proposer
    from peagle.engine.request import Request

Chunk = tuple["Request", int]  # a request and how many of its next prompt positions this step computes


class Prefill:
    def __init__(self, target: TargetModel, target_cache, budget: StepBudget, catch_up: DrafterCatchUp,
                 prefix_reuse: PrefixReuse, proposer: Proposer, max_num_batched_tokens: int, chunked: bool,
                 first_token: Callable[[Request, torch.Tensor], int]):
        """`first_token(req, logits)`: samples and commits the token after a complete prompt, and returns it."""
        self.target, self.target_cache, self.budget = target, target_cache, budget
        self.catch_up, self.prefix_reuse, self.proposer = catch_up, prefix_reuse, proposer
        self.max_num_batched_tokens, self.chunked, self.first_token = max_num_batched_tokens, chunked, first_token

    def step(self, running: list[Request]) -> tuple[list[Request], int]:
        """Prefill one chunk for as many prompts as this step's budget holds, in the order they came, in one padded
        forward (its rows cost max chunk x prompts, kept within max_num_batched_tokens); while streams decode the
        work is sized in time, the oldest prompt getting at least one block. Returns the requests whose prompt is
        now complete (and first token sampled), and the prompt tokens computed."""
        budget = self.budget
        admitting = [r for r in running if not r.finished and r.prefilling]
        budget.start_step(decoding=len(admitting) < sum(not r.finished for r in running))
        batch = self.choose_chunks(admitting)
        if batch:
            clock = budget.clock
            predicted, started = self.chunk_cost(batch, drafter=False), clock()
            self.run_chunks(batch)
            seconds = clock() - started
            budget.cost.prefill.observe(predicted, seconds)
            budget.spend(seconds)
            started = clock()  # index what was prefilled (suffix trees), a chunk at a time
            for req, _ in batch:
                if req.decodes and req.recompute_ids is None:  # a resumed request's tokens are indexed
                    self.proposer.prefill(req)
            budget.spend(clock() - started)
        return [req for req, _ in batch if not req.prefilling], sum(n for _, n in batch)

    def choose_chunks(self, admitting: list[Request]) -> list[Chunk]:
        """Each prompt in turn continues from the prefix cache, then takes the largest chunk the budgets allow."""
        budget, tokens_budget, batch, widest = self.budget, self.max_num_batched_tokens, [], 0
        for req in admitting:
            started = budget.clock()
            self.prefix_reuse.continue_prompt(req)
            budget.spend(budget.clock() - started)
            if any(_will_compute_its_next_block(other, n, req) for other, n in batch):
                continue  # the next step finds that block in the cache instead of computing it twice
            left = len(req.prefill_ids) - req.num_computed
            if left <= tokens_budget or not self.chunked:
                cap = left
            else:  # whole blocks, so that the next chunk starts where a cached block would
                cap = tokens_budget // BLOCK_SIZE * BLOCK_SIZE
            if self.chunked:
                n = budget.largest(lambda n: self.chunk_cost(batch + [(req, n)]), cap, floor=not batch)
            else:
                n = cap if not batch or budget.fits(self.chunk_cost(batch + [(req, cap)])) else 0
            if not n or batch and max(widest, n) * (len(batch) + 1) > tokens_budget:
                break
            batch.append((req, n))
            widest = max(widest, n)
        return batch

    def chunk_cost(self, batch: list[Chunk], drafter: bool = True) -> float:
        """Predicted seconds of a padded prefill forward over batch's chunks (and, with `drafter`, of the drafter's
        pass later in the step over the rows that would take a request's waiting rows past max_pending_rows)."""
        width = max(n for _, n in batch)
        every_row = any(req.params.prompt_logprobs is not None for req, _ in batch)
        logit_rows = len(batch) * width if every_row else \
            sum(req.num_computed + n == len(req.prefill_ids) for req, n in batch)
        cost = self.budget.cost.prefill.predict([(width, req.num_computed) for req, _ in batch], logit_rows)
        if drafter:
            cost += sum(self.budget.cost.catch_up.predict([(due, req.backlog.start)]) for req, n in batch
                        if (due := self.catch_up.rows_due(req, n)))
        return cost

    def run_chunks(self, batch: list[Chunk]) -> None:
        """Run each request's next n prompt positions through the target in one padded batch (pad rows write past
        a chunk's end: stale entries that later rows overwrite); a request whose prompt is then complete samples
        its first token. The rows wait for the drafter (row t: token x_{t+1}, feature g_t)."""
        dev, B = self.target.device, len(batch)
        T = max(n for _, n in batch)
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, (req, n) in enumerate(batch):
            tokens[b, :n] = torch.tensor(req.prefill_ids[req.num_computed:req.num_computed + n], device=dev)
        starts = torch.tensor([req.num_computed for req, _ in batch], device=dev)
        layout = BatchLayout.build(torch.tensor([req.slot for req, _ in batch], device=dev),
                                   starts[:, None] + torch.arange(T, device=dev)[None])
        every_row = any(req.params.prompt_logprobs is not None for req, _ in batch)
        finishing = any(req.num_computed + n == len(req.prefill_ids) for req, n in batch)
        if every_row or finishing:
            last = torch.tensor([n - 1 for _, n in batch], device=dev)[:, None]
            out = self.target(tokens, layout, self.target_cache, logit_index=None if every_row else last,
                              num_logits=None)
            logits, features = out.logits, out.features
        else:  # no chunk here is a prompt's last: no logits needed
            logits, features = None, self.target.trunk(tokens, layout, self.target_cache)[1]
        for b, (req, n) in enumerate(batch):
            rows = logits[b, :n] if every_row else logits[b] if logits is not None else None
            self.after_chunk(req, n, rows, features[b, :n])

    def after_chunk(self, req: Request, n: int, logits: torch.Tensor | None, features: torch.Tensor) -> None:
        """A chunk of n prompt rows is in the cache: logits (every row's, or only the last's) and features [n, F]."""
        resumed = req.recompute_ids is not None  # computing again what it had before a preemption
        start, m = req.num_computed, len(req.prefill_ids)
        end = req.num_computed = start + n
        if req.params.prompt_logprobs is not None and not resumed:
            add_prompt_logprobs(req, start, logits)
        next_tokens = req.prefill_ids[start + 1:end + 1]  # each row's x_{t+1}; the last prompt row's: the first token
        if end == m:
            next_tokens.append(req.output_ids[-1] if resumed else self.first_token(req, logits[-1]))
        if self.catch_up.drafts_later(req):  # the rows wait for the drafter
            req.backlog.append(next_tokens, features)
        self.prefix_reuse.store_blocks(req, features)


def _will_compute_its_next_block(other: Request, n: int, req: Request) -> bool:
    """Whether `other`'s chunk of n rows computes the block `req` needs next (same tokens up to its end)."""
    start, end = req.num_computed, req.num_computed + BLOCK_SIZE
    return (other.num_computed <= start and other.num_computed + n >= end
            and len(req.prefill_ids) > end and other.prefill_ids[:end] == req.prefill_ids[:end])
