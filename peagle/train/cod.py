"""COD sampling, the COD attention mask and sequence partitioning (docs/design.md, "Training objective").

A training *element* is (anchor p, depth d) of one sequence of n tokens x_0..x_{n-1}:

    position      p + d
    inputs        d = 0: token x_{p+1}, feature g_p          d >= 1: mask token, mask_hidden
    predicts      token x_{p+d+2}; its label is the target's distribution at position p+d+1
    supervised    p+d+2 < n and x_{p+d+2} is an assistant token (loss_mask)

COD sampling keeps every depth-0 element (anchors 0..n-2; they are the context every deeper element reads) and, for
d = 1..D-1, a random subset of the depth d-1 anchors whose depth-d element is supervised, about
N * max(r^d, r_min) of them, where N is the number of supervised depth-0 elements (the sequence's supervised
length; using N rather than n keeps the depth ratios meaningful for chat data whose prompts are long). So every
anchor present at depth d is present at depth d-1 (the chain property).

Attention: q may see kv iff same document and either (kv has depth 0 and anchor_kv <= anchor_q) or (same anchor and
depth_kv <= depth_q). This is exactly what serving computes: a mask slot at depth d drafted from the last real row
p sees the cached real rows 0..p and the slots 0..d before it.

Sequence partitioning into S segments: positions are cut into S equal ranges; depth-0 and depth-1 elements go by
their position, deeper elements follow their anchor's depth-1 element (position p+1), so chains stay whole. Each
segment also carries every depth-0 element left of its left edge as key/value-only context (it is a row of the
segment's forward, but its loss belongs to the segment that owns it). Every element's visible set lies inside its
segment's rows, so per-segment forwards reproduce the unpartitioned outputs exactly, and summing per-segment losses
divided by the whole sequence's count reproduces the unpartitioned loss and gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Elements:
    """Elements of one sequence, depth-major (all depth 0 by anchor, then depth 1, ...)."""

    anchor: torch.Tensor  # [E] long
    depth: torch.Tensor  # [E] long
    supervised: torch.Tensor  # [E] bool
    doc: torch.Tensor  # [E] long; elements of different documents never see each other

    @property
    def position(self) -> torch.Tensor:
        return self.anchor + self.depth

    def __len__(self) -> int:
        return int(self.anchor.numel())

    def select(self, idx: torch.Tensor) -> "Elements":
        return Elements(self.anchor[idx], self.depth[idx], self.supervised[idx], self.doc[idx])

    def to(self, device) -> "Elements":
        return Elements(self.anchor.to(device), self.depth.to(device), self.supervised.to(device),
                        self.doc.to(device))

    @property
    def num_supervised(self) -> int:
        return int(self.supervised.sum())

    @property
    def num_depths(self) -> int:
        return int(self.depth.max()) + 1 if len(self) else 0


def _supervised_at(loss_mask: torch.Tensor, anchors: torch.Tensor, d: int, doc_ids: torch.Tensor | None):
    n = loss_mask.numel()
    t = anchors + d + 2
    ok = t < n
    tt = t.clamp(max=n - 1)
    ok &= loss_mask[tt]
    if doc_ids is not None:
        ok &= doc_ids[tt] == doc_ids[anchors]
    return ok


def sample_cod(loss_mask: torch.Tensor, num_depths: int, r: float = 0.8, r_min: float = 0.2,
               generator: torch.Generator | None = None, doc_ids: torch.Tensor | None = None,
               keep_all: bool = False) -> Elements:
    """COD sampling for one sequence (see the module docstring). `keep_all` keeps every candidate at every depth
    (the full chains an EAGLE-3 TTT unroll or an evaluation uses). `doc_ids` [n] marks packed documents."""
    loss_mask = torch.as_tensor(loss_mask).bool()
    n = loss_mask.numel()
    if num_depths < 1:
        raise ValueError("num_depths must be at least 1")
    if n < 2:
        z = torch.zeros(0, dtype=torch.long)
        return Elements(z, z, z.bool(), z)
    anchors0 = torch.arange(n - 1)
    sup0 = _supervised_at(loss_mask, anchors0, 0, doc_ids)
    anchors, depths, sups = [anchors0], [torch.zeros(n - 1, dtype=torch.long)], [sup0]
    n_sup = int(sup0.sum())
    prev = anchors0
    for d in range(1, num_depths):
        cand = prev[_supervised_at(loss_mask, prev, d, doc_ids)]
        if not keep_all:
            keep = min(cand.numel(), int(round(n_sup * max(r ** d, r_min))))
            if keep < cand.numel():
                pick = torch.randperm(cand.numel(), generator=generator)[:keep]
                cand = torch.sort(cand[pick]).values
        if cand.numel() == 0:
            break
        anchors.append(cand)
        depths.append(torch.full_like(cand, d))
        sups.append(torch.ones_like(cand, dtype=torch.bool))
        prev = cand
    anchor = torch.cat(anchors)
    doc = doc_ids[anchor].long() if doc_ids is not None else torch.zeros_like(anchor)
    return Elements(anchor, torch.cat(depths), torch.cat(sups), doc)


def eval_elements(loss_mask: torch.Tensor, num_depths: int, max_anchors: int | None = None,
                  generator: torch.Generator | None = None) -> tuple[Elements, torch.Tensor]:
    """Elements for measuring acceptance: every depth-0 element plus the full chain 1..D-1 of evaluation anchors,
    i.e. anchors whose D targets are all supervised (at most `max_anchors` of them, chosen at random).
    Returns (elements, evaluation anchors)."""
    loss_mask = torch.as_tensor(loss_mask).bool()
    n = loss_mask.numel()
    anchors0 = torch.arange(max(n - 1, 0))
    ok = torch.ones_like(anchors0, dtype=torch.bool)
    for d in range(num_depths):
        ok &= _supervised_at(loss_mask, anchors0, d, None)
    chosen = anchors0[ok]
    if max_anchors is not None and chosen.numel() > max_anchors:
        chosen = torch.sort(chosen[torch.randperm(chosen.numel(), generator=generator)[:max_anchors]]).values
    anchor = torch.cat([anchors0] + [chosen] * (num_depths - 1))
    depth = torch.cat([torch.zeros_like(anchors0)] + [torch.full_like(chosen, d) for d in range(1, num_depths)])
    sup = torch.cat([_supervised_at(loss_mask, anchors0, 0, None)]
                    + [torch.ones_like(chosen, dtype=torch.bool)] * (num_depths - 1))
    return Elements(anchor, depth, sup, torch.zeros_like(anchor)), chosen


def cod_mask(q: Elements, k: Elements | None = None) -> torch.Tensor:
    """[Eq, Ek] bool: query element i may attend to key element j (the design's rule, vectorised)."""
    k = q if k is None else k
    same_doc = q.doc[:, None] == k.doc[None, :]
    context = (k.depth[None, :] == 0) & (k.anchor[None, :] <= q.anchor[:, None])
    chain = (k.anchor[None, :] == q.anchor[:, None]) & (k.depth[None, :] <= q.depth[:, None])
    return same_doc & (context | chain)


@dataclass
class Segment:
    rows: torch.Tensor  # [R] indices into the sequence's elements: context depth-0 rows first, then owned rows
    own: torch.Tensor  # [R] bool: the element belongs to this segment (its loss is counted here)


def segment_of(el: Elements, num_positions: int, num_segments: int) -> torch.Tensor:
    """Segment id of every element: depths 0/1 by position, deeper elements by their anchor's depth-1 element."""
    key = torch.where(el.depth <= 1, el.position, el.anchor + 1)
    size = -(-max(num_positions, 1) // num_segments)  # ceil: equal ranges of positions
    return (key // size).clamp(max=num_segments - 1)


def partition(el: Elements, num_positions: int, num_segments: int) -> list[Segment]:
    """The segments of one sequence (only those that own a supervised element: the rest add nothing)."""
    if num_segments <= 1:
        return [Segment(torch.arange(len(el)), torch.ones(len(el), dtype=torch.bool))] if el.num_supervised else []
    seg = segment_of(el, num_positions, num_segments)
    size = -(-max(num_positions, 1) // num_segments)
    out = []
    for s in range(num_segments):
        own = torch.nonzero(seg == s).flatten()
        if not bool(el.supervised[own].any()):
            continue
        left = s * size
        ctx = torch.nonzero((el.depth == 0) & (el.position < left)).flatten()
        rows = torch.cat([ctx, own])
        out.append(Segment(rows, torch.cat([torch.zeros(ctx.numel(), dtype=torch.bool),
                                            torch.ones(own.numel(), dtype=torch.bool)])))
    return out
