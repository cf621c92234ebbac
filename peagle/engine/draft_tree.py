"""Draft trees (docs/design.md, "Draft trees"): several continuations verified in one target forward.

A tree's nodes hang below the request's newest token x_n (the root, parent -1); node i has a token, a parent
before it (parents[i] < i) and a depth (its parent's + 1). A chain is the tree whose every node has one child. The
target verifies [x_n, nodes...] in one forward: node i is written at cache position n + 1 + i and rotated as
position n + depth, and reads the keys 0..n and its own branch (`verify_keys`), so each node computes the bits its
branch would as a chain. Verification walks down from the root: at each node the target's token (greedy) or a draw
by the multi-candidate rejection rule (sampling) picks the child to follow; the walk's path is what is accepted.

Trees are chosen best first, by the product of the head's probabilities along the branch, among its candidates:
either its top-M per draft position (`Candidates`) or a tree of candidates it expanded (`ExpandedTree`). P-EAGLE's
positions are drafted in one pass, each a marginal that does not depend on the tokens before it, so any node may
have children; an EAGLE-3 chain knows the distribution after its own top tokens only, so there only the chain's
nodes have children (its alternatives are leaves beside it), unless the drafter expands the most probable nodes of
each depth too (EAGLE-2's dynamic tree, `Drafter.draft_tree`). The shaper takes either kind (`CandidateTree`).

A model-free draft (the suffix tree's) offers branches whose probabilities are measured already (its draft's own
tokens and its side leaves: acceptance.Draft.branches): the shaper grafts them onto its window's chain, or onto the
head's tree where the hybrid's head beat that draft (`beside`), as far as they pay (`TreeShaper.grow`).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from peagle.config import MAX_TREE_NODES, TREE_TOP_M


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[i] < i; -1: the root x_n
    # the head's probability of each node's whole branch (empty: not known; 0: a node grafted from a model-free draft)
    probs: tuple[float, ...] = ()

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """Each node's children (-1: the root's), in the order they are tried: best first."""
        out: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
            out.setdefault(i, [])
        return out

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def branch(self, i: int) -> list[int]:
        """Node i's ancestors from the root's child down, and i itself."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    @property
    def head_depth(self) -> int:
        """The depth of the head's own nodes (past it: nodes grafted from a model-free draft)."""
        return max((d for d, p in zip(self.depths, self.probs) if p), default=self.depth)

    def first_children(self, path: list[int]) -> int:
        """How many of a path's leading nodes are each their parent's first child, and not grafted onto a head's
        tree: what the best chain among the drafter's own nodes would have accepted."""
        n = 0
        for i in path:
            if self.children[self.parents[i]][0] != i or (self.probs and not self.probs[i]):
                break
            n += 1
        return n

    def verify_keys(self, n: int) -> tuple[list[int], list[list[int]]]:
        """For the rows [x_n, nodes...] at cache positions n, n+1, ..: each row's rotary position, and the cache
        positions each reads as kernels' peagle_kv.keys lays them out: [first, end, count, listed...] (keys
        first..end-1, then the listed ones)."""
        rope = [n] + [n + d for d in self.depths]
        keys = [[0, n + 1, 0]] + [[0, n + 1, len(b), *(n + 1 + j for j in b)] for b in map(self.branch,
                                                                                         range(len(self)))]
        return rope, keys


# A model-free draft's branch: its tokens from the root, and the measured probability that it is accepted.
Branch = tuple[tuple[int, ...], float]


@dataclass
class Candidates:
    """A head's top-M tokens per draft position ([K, M] each, best first) and their log-probabilities; `free`: any
    node may have children (P-EAGLE's marginals), else only the nodes of the top chain (EAGLE-3). `beside`: a
    model-free draft's branches the shaper may graft on (most probable first, parents first)."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    free: bool
    beside: list[Branch] = field(default_factory=list)

    def cut(self, depth: int) -> "Candidates":
        """The first `depth` positions (a window narrower than the draft)."""
        return Candidates(self.tokens[:depth], self.logprobs[:depth], self.free, self.beside)

    @property
    def chain(self) -> DraftTree:
        """The top candidate of every position."""
        return self.ranked([(0,) * d for d in range(1, len(self.tokens) + 1)])

    def best_first(self, budget: int) -> DraftTree:
        """The `budget` nodes of highest branch probability (the product of the probabilities along the branch),
        found best first: a node's next sibling and first child enter the frontier when it is taken, and each
        is no more probable than it, so the taken nodes always form a tree and come in descending order."""
        depth = len(self.tokens)  # a position may hold fewer candidates than the first
        tokens, parents, probs = [], [], []
        frontier = [(-self.logprobs[0][0], 0, 0, -1, True)] if depth else []  # (-log p, depth, rank, parent, ..)
        while frontier and len(tokens) < budget:
            neg, d, r, parent, on_chain = heapq.heappop(frontier)
            i = len(tokens)
            tokens.append(self.tokens[d][r])
            parents.append(parent)
            probs.append(math.exp(-neg))
            base = neg + self.logprobs[d][r]  # the parent's -log p
            if r + 1 < len(self.tokens[d]):
                heapq.heappush(frontier, (base - self.logprobs[d][r + 1], d, r + 1, parent, False))
            if d + 1 < depth and (self.free or (on_chain and r == 0)):
                heapq.heappush(frontier, (neg - self.logprobs[d + 1][0], d + 1, 0, i, on_chain and r == 0))
        return DraftTree(tuple(tokens), tuple(parents), tuple(probs))

    def ranked(self, paths: list[tuple[int, ...]]) -> DraftTree:
        """A static tree (vLLM's speculative_token_tree): node (r_1, .., r_d) is the rank-r_d candidate at depth d
        below node (r_1, .., r_{d-1}); paths sorted so that parents come first."""
        index = {(): -1}
        tokens, parents, probs = [], [], []
        for path in paths:
            d, r = len(path) - 1, path[-1]
            if d >= len(self.tokens):
                break
            parent = index[path[:-1]]
            index[path] = len(tokens)
            tokens.append(self.tokens[d][r])
            parents.append(parent)
            probs.append((probs[parent] if parent >= 0 else 1.0) * math.exp(self.logprobs[d][r]))
        return DraftTree(tuple(tokens), tuple(parents), tuple(probs))


@dataclass
class ExpandedTree:
    """Candidates the drafter expanded as a tree (EAGLE-2's dynamic tree): each node's token, parent (-1: the root
    x_n; parents first, depth by depth) and branch log-probability, and `chain_nodes`, the drafted chain's node at
    each depth. A child is never more probable than its parent, so the best N nodes always form a tree."""
    tokens: list[int]
    parents: list[int]
    logprobs: list[float]
    chain_nodes: list[int]
    beside: list[Branch] = field(default_factory=list)  # as Candidates'

    @cached_property
    def depths(self) -> list[int]:
        return list(DraftTree(tuple(self.tokens), tuple(self.parents)).depths)

    def cut(self, depth: int) -> "ExpandedTree":
        """The nodes `depth` or fewer below the root (a window narrower than the draft): a prefix, as the nodes come
        depth by depth."""
        n = sum(d <= depth for d in self.depths)
        return ExpandedTree(self.tokens[:n], self.parents[:n], self.logprobs[:n], self.chain_nodes[:depth],
                            self.beside)

    @property
    def chain(self) -> DraftTree:
        nodes = self.chain_nodes
        return DraftTree(tuple(self.tokens[i] for i in nodes), tuple(range(-1, len(nodes) - 1)),
                         tuple(math.exp(self.logprobs[i]) for i in nodes))

    def best_first(self, budget: int) -> DraftTree:
        """The `budget` most probable nodes, in descending order (a parent before its children on a tie)."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.logprobs[i], self.depths[i], i))[:budget]
        index = {-1: -1} | {old: new for new, old in enumerate(order)}
        return DraftTree(tuple(self.tokens[i] for i in order), tuple(index[self.parents[i]] for i in order),
                         tuple(math.exp(self.logprobs[i]) for i in order))


CandidateTree = Candidates | ExpandedTree  # what TreeShaper shapes: best_first(n), chain, cut(depth), beside


def top_candidates(logits: torch.Tensor, to_target, m: int = TREE_TOP_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a head's logits [..., Vd]: the top-m draft tokens as target ids and their log-probabilities,
    [..., m] each, best first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(m, logp.shape[-1]), dim=-1)
    return to_target(top.indices), top.values


CALIBRATION_MEMORY = 0.98  # per-depth calibration counts: about 50 drafting steps


class TreeShaper:
    """Which tree each of the head's windows verifies: a static tree (vLLM's speculative_token_tree), the best
    `nodes` nodes every step, or ("auto") the tree, among the best-first trees and the chains within the window's
    depth, with the most expected tokens per second of the step:

        expected tokens of a tree      1 + sum over its nodes of min(1, c_d p(node))
        its step's seconds             cost(the step's rows with the tree's)

    p(node) is the head's probability of the node's whole branch (the product along it) and c_d a calibration per
    depth d, learnt from every head window (`observe`): the windows whose accepted length reached d over the
    probability their nodes at depth d promised. A chain is one of the candidates, so where rows are dear (4-bit
    weights on VNNI) the chain wins and nothing changes; where rows are cheap (bf16 on AMX, more threads) trees
    win as far as they pay. Without a cost model (the fixed policy) "auto" verifies chains. A model-free draft's
    branches are then grafted on by the same rule (`grow`), with the probabilities its proposer measured."""

    def __init__(self, nodes: int | str, static: list[tuple[int, ...]] | None, cost=None):
        self.nodes, self.static, self.cost = nodes, static, cost
        self.promised: list[float] = []  # per depth: forgotten sums of the probability promised ...
        self.reached: list[float] = []  # ... and of the windows whose accepted length reached it

    @property
    def sizes(self) -> bool:
        """Whether it picks each tree's size ("auto" with a cost model)."""
        return self.static is None and self.nodes == "auto" and self.cost is not None

    @property
    def enabled(self) -> bool:
        return self.static is not None or (self.nodes == "auto" and self.cost is not None) or self.nodes not in (
            0, "auto")

    def shape(self, cands: CandidateTree, tokens: float, rows: int, seconds: Callable[[int], float]) -> DraftTree:
        """The tree for one window from its candidates (cut to its depth): `tokens` and `rows` are the step's
        expected tokens and rows without this window's drafts, seconds(rows) the step's predicted time."""
        chain = cands.chain
        if self.static is not None:
            return cands.ranked(self.static)
        if self.nodes != "auto":
            return cands.best_first(self.nodes) if self.nodes else chain
        price = self.price(rows, seconds)
        best, best_rate = (chain, 0, tokens), -1.0
        for tree in (chain, cands.best_first(len(price) - 1)):
            expected = tokens
            for n, (p, d) in enumerate(zip(tree.probs, tree.depths), start=1):
                expected += min(1.0, self.calibration(d) * p)
                rate = expected / price[n]
                if rate > best_rate:
                    best, best_rate = (tree, n, expected), rate
        tree, n, expected = best
        return self.grow(DraftTree(tree.tokens[:n], tree.parents[:n], tree.probs[:n]), expected, cands.beside, price)

    def price(self, rows: int, seconds: Callable[[int], float]) -> list[float]:
        """price[n]: the step's predicted seconds with a window of n nodes, `rows` the step's rows without it."""
        budget = min(MAX_TREE_NODES, self.cost.max_rows - rows)
        # more rows never cost less: a noisy timing must not make a larger tree look cheaper than a smaller one
        return list(itertools.accumulate((seconds(rows + n) for n in range(budget + 1)), max))

    @staticmethod
    def grow(tree: DraftTree, expected: float, branches: Sequence[Branch], price: list[float]) -> DraftTree:
        """`tree` with the leading `branches` (most probable first, parents first) that bring the step the most
        expected tokens per second: `expected` is the step's with the tree as it is, price[n] the step's seconds
        with n nodes. A branch the tree holds already adds nothing; the tree as it is wins a tie, so grafting never
        makes a window worse by the cost model. The probabilities are the proposer's measured ones: no
        calibration here."""
        if not branches or len(tree) >= len(price):
            return tree
        tokens, parents = list(tree.tokens), list(tree.parents)
        index = {(): -1} | {tuple(tree.tokens[j] for j in tree.branch(i)): i for i in range(len(tree))}
        best, best_rate = len(tree), expected / price[len(tree)]
        for path, p in branches:
            if path in index:
                continue
            if len(tokens) + 1 >= len(price):
                break
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]])
            expected += p
            if expected / price[len(tokens)] > best_rate:
                best, best_rate = len(tokens), expected / price[len(tokens)]
        probs = (*tree.probs, *[0.0] * (best - len(tree))) if tree.probs else ()
        return DraftTree(tuple(tokens[:best]), tuple(parents[:best]), probs)

    def calibration(self, depth: int) -> float:
        """c_d: how far the head's probabilities at depth d are borne out (1 until measured)."""
        if depth > len(self.promised):
            return 1.0
        return (self.reached[depth - 1] + 1.0) / (self.promised[depth - 1] + 1.0)

    def observe(self, tree: DraftTree, path: Sequence[int]) -> None:
        """A verified head window and the nodes its verification accepted: the head's own as far as the path
        follows them (past a grafted node the head's tree alone would have stopped)."""
        if not tree.probs:
            return
        accepted = next((n for n, i in enumerate(path) if not tree.probs[i]), len(path))
        while len(self.promised) < tree.depth:
            self.promised.append(0.0)
            self.reached.append(0.0)
        promised = [0.0] * tree.depth
        for p, d in zip(tree.probs, tree.depths):
            promised[d - 1] += p
        for d in range(tree.depth):
            self.promised[d] = CALIBRATION_MEMORY * self.promised[d] + promised[d]
            self.reached[d] = CALIBRATION_MEMORY * self.reached[d] + (d < accepted)
