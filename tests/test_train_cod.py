"""COD sampling, the COD mask and sequence partitioning (docs/design.md, "Training objective")."""
from __future__ import annotations


import pytest
import torch

from peagle.train.cod import cod_mask, partition, sample_cod
from peagle.train.objective import TrainHead

from tests.train_helpers import random_seq, tiny_drafter


pytestmark = pytest.mark.usefixtures("one_thread")


def _loss_mask(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(n, dtype=torch.bool)
    pos = 0
    while pos < n:  # alternating prompt / answer spans of random length
        prompt, answer = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(3, 20, (1,), generator=g))
        m[pos + prompt:pos + prompt + answer] = True
        pos += prompt + answer
    return m


def test_cod_mask_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    el = sample_cod(_loss_mask(40), num_depths=5, generator=g)
    el.doc = (el.anchor >= 25).long()  # two documents, to exercise the document rule
    m = cod_mask(el)
    E = len(el)
    for i in range(E):
        for j in range(E):
            aq, dq, ak, dk = int(el.anchor[i]), int(el.depth[i]), int(el.anchor[j]), int(el.depth[j])
            same_doc = int(el.doc[i]) == int(el.doc[j])
            expect = same_doc and ((dk == 0 and ak <= aq) or (ak == aq and dk <= dq))
            assert bool(m[i, j]) == expect, (i, j)


def test_cod_sampling_respects_loss_mask_and_chain():
    n, D, r, r_min = 300, 8, 0.8, 0.2
    mask = _loss_mask(n, seed=3)
    el = sample_cod(mask, D, r, r_min, torch.Generator().manual_seed(1))
    d0 = el.depth == 0
    assert torch.equal(el.anchor[d0], torch.arange(n - 1))  # depth 0 at every position
    sup0 = el.supervised[d0]
    expect_sup0 = torch.tensor([p + 2 < n and bool(mask[p + 2]) for p in range(n - 1)])
    assert torch.equal(sup0, expect_sup0)
    N = int(sup0.sum())
    present = {(int(a), int(d)) for a, d in zip(el.anchor, el.depth)}
    prev_count = N
    for d in range(1, D):
        at = el.anchor[el.depth == d]
        for p in at.tolist():
            assert (p, d - 1) in present  # chain property
            assert p + d + 2 < n and bool(mask[p + d + 2])  # every deeper element has a supervised target
        cand = [p for (p, dd) in present if dd == d - 1 and p + d + 2 < n and bool(mask[p + d + 2])]
        assert at.numel() == min(len(cand), round(N * max(r ** d, r_min)))
        assert len(set(at.tolist())) == at.numel()
        assert at.numel() <= prev_count
        prev_count = at.numel()
    assert bool(el.supervised[~d0].all())
    # different generators give different subsets, the same generator the same one
    again = sample_cod(mask, D, r, r_min, torch.Generator().manual_seed(1))
    assert torch.equal(again.anchor, el.anchor)
    other = sample_cod(mask, D, r, r_min, torch.Generator().manual_seed(2))
    assert not torch.equal(other.anchor, el.anchor)


def test_partition_covers_dependencies():
    mask = _loss_mask(120, seed=5)
    el = sample_cod(mask, 6, generator=torch.Generator().manual_seed(0))
    full = cod_mask(el)
    owned = torch.zeros(len(el), dtype=torch.long)
    for seg in partition(el, 120, 4):
        owned[seg.rows[seg.own]] += 1
        rows = set(seg.rows.tolist())
        for i in seg.rows[seg.own].tolist():
            assert set(torch.nonzero(full[i]).flatten().tolist()) <= rows  # everything it attends to is present
        assert bool((el.depth[seg.rows[~seg.own]] == 0).all())  # context rows are depth-0 only
    assert bool((owned[el.supervised] == 1).all())  # each supervised element is owned exactly once


def _loss_and_grads(head: TrainHead, seq, el, segments: int, n: int):
    head.zero_grad(set_to_none=True)
    total = 0.0
    count = el.num_supervised
    for seg in partition(el, n, segments):
        loss, _ = head(seq, el, seg)
        (loss / count).backward()
        total += float(loss.detach()) / count
    return total, {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}


def test_partitioned_loss_and_grads_equal_unpartitioned():
    from peagle.train.objective import cod_forward, head_loss

    n = 90
    drafter = tiny_drafter(num_layers=2, frozen_embedding=True)
    head = TrainHead(drafter, "peagle", num_depths=6, loss_chunk=37, attn_chunk=16)
    seq = random_seq(n, drafter)
    el = sample_cod(_loss_mask(n, 7), 6, generator=torch.Generator().manual_seed(4))
    # the definition: one dense Drafter.forward over every element under the COD mask
    hidden = cod_forward(drafter, seq, el)
    rows = (el.anchor + el.depth + 1)[el.supervised]
    ref, _ = head_loss(drafter, hidden[el.supervised], seq, rows)
    ((ref + head._touch()) / el.num_supervised).backward()
    g_ref = {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}
    loss1, g1 = _loss_and_grads(head, seq, el, 1, n)
    assert abs(loss1 - float(ref.detach()) / el.num_supervised) < 1e-5 * max(1.0, abs(loss1))
    for k in g_ref:
        torch.testing.assert_close(g1[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    for S in (2, 5):
        lossS, gS = _loss_and_grads(head, seq, el, S, n)
        assert abs(loss1 - lossS) < 1e-5 * max(1.0, abs(loss1))
        assert g1.keys() == gS.keys() and "drafter.mask_hidden" in g1 and "drafter.embed_tokens.mask_row" in g1
        for k in g1:
            torch.testing.assert_close(gS[k], g1[k], rtol=1e-4, atol=1e-6, msg=k)
