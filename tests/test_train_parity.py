"""Train/serve parity: what training computes is what the serving drafter computes (docs/design.md)."""
from __future__ import annotations


import pytest
import torch

from peagle.model.layers import BatchLayout
from peagle.train.cod import sample_cod
from peagle.train.objective import cod_forward, export_drafter, forward_rows, ttt_forward

from tests.train_helpers import random_seq, tiny_drafter


pytestmark = pytest.mark.usefixtures("one_thread")


def test_forward_rows_matches_drafter_forward():
    d = tiny_drafter(num_layers=3)
    seq = random_seq(30, d)
    pos = torch.arange(29)
    mask = torch.ones(29, 29, dtype=torch.bool).tril()
    ref = d(seq.input_ids[1:][None], seq.features[:29][None], BatchLayout.dense(pos[None], mask[None]), None)[0]
    got, _ = forward_rows(d, seq.input_ids[1:], seq.features[:29], pos)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _serve_hidden_parallel(d, seq, p, K, split):
    """What draft_parallel computes for anchor p: real rows 0..p (fed in two calls, as a server would after a
    prefill and a decoding step) then K-1 mask slots. Returns (hidden of the last real row and the slots, drafts)."""
    cache = d.new_cache(1, 128)
    slots = torch.zeros(1, dtype=torch.long)
    first = torch.arange(split)
    d(seq.input_ids[first + 1][None], seq.features[first][None], BatchLayout.build(slots, first[None]), cache)
    rest = torch.arange(split, p + 1)
    # the exact inputs draft_parallel builds, so the hidden states can be compared too
    tok = torch.cat([seq.input_ids[rest + 1], torch.full((K - 1,), d.config.mask_token_id)])
    feat = torch.cat([seq.features[rest], d.mask_hidden.reshape(1, -1).expand(K - 1, -1)])
    pos = torch.arange(split, p + K)
    with torch.no_grad():
        hidden = d(tok[None], feat[None], BatchLayout.build(slots, pos[None]), cache)[0][-K:]
    cache2 = d.new_cache(1, 128)
    d(seq.input_ids[first + 1][None], seq.features[first][None], BatchLayout.build(slots, first[None]), cache2)
    drafts = d.draft_parallel(seq.input_ids[rest + 1][None], seq.features[rest][None],
                              torch.tensor([rest.numel()]), torch.tensor([split]), slots, cache2, K)[0]
    return hidden, drafts


def test_cod_forward_matches_draft_parallel():
    K, n = 5, 40
    train = tiny_drafter(num_layers=2, frozen_embedding=True)
    serve = export_drafter(train).eval()
    seq = random_seq(n, train)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[6:] = True
    el = sample_cod(mask, K, keep_all=True)
    with torch.no_grad():
        hidden = cod_forward(train, seq, el)
    for p in (9, 17, 30):
        idx = [int(torch.nonzero((el.anchor == p) & (el.depth == k))[0]) for k in range(K)]
        h_train = hidden[idx]
        h_serve, drafts = _serve_hidden_parallel(serve, seq, p, K, split=p - 3)
        torch.testing.assert_close(h_train, h_serve, rtol=1e-4, atol=1e-4)
        train_drafts = train.to_target_ids(train.logits(h_train).argmax(-1))
        assert torch.equal(train_drafts, drafts), (p, train_drafts, drafts)


def test_partial_cod_sample_matches_draft_parallel():
    """A random COD subset (not full chains) still gives the serving outputs at every element it keeps."""
    K, n = 6, 60
    train = tiny_drafter(num_layers=1, frozen_embedding=True, seed=3)
    serve = export_drafter(train).eval()
    seq = random_seq(n, train, seed=5)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[10:] = True
    el = sample_cod(mask, K, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = cod_forward(train, seq, el)
    deep = torch.nonzero(el.depth == K - 1).flatten()[:3]
    for i in deep.tolist():
        p = int(el.anchor[i])
        idx = [int(torch.nonzero((el.anchor == p) & (el.depth == k))[0]) for k in range(K)]
        h_serve, _ = _serve_hidden_parallel(serve, seq, p, K, split=p)
        torch.testing.assert_close(hidden[idx], h_serve, rtol=1e-4, atol=1e-4)


def test_ttt_steps_match_draft_chain():
    K, n = 4, 36
    d = tiny_drafter(num_layers=2, mask_token_id=None, seed=7)
    seq = random_seq(n, d, seed=2)
    slots = torch.zeros(1, dtype=torch.long)
    for p in (8, 20):
        rows = torch.arange(p + 1)
        cache = d.new_cache(1, 128)
        drafts = d.draft_chain(seq.input_ids[rows + 1][None], seq.features[rows][None], torch.tensor([p + 1]),
                               torch.tensor([0]), slots, cache, K)[0]
        # the chain feeds its own drafts; training feeds ground truth, so make the ground truth those drafts
        ids = seq.input_ids.clone()
        ids[p + 2:p + 1 + K] = drafts[:K - 1]
        s2 = type(seq)(ids, seq.features, seq.labels, seq.argmax)
        el = sample_cod(torch.ones(n, dtype=torch.bool), K, keep_all=True)
        # reference hidden states of the chain, computed the way draft_chain does
        cache = d.new_cache(1, 128)
        with torch.no_grad():
            h = d(ids[rows + 1][None], seq.features[rows][None], BatchLayout.build(slots, rows[None]), cache)[:, -1:]
            ref = [h[0, 0]]
            for k in range(1, K):
                h = d(drafts[k - 1].view(1, 1), h, BatchLayout.build(slots, torch.tensor([[p + k]])), cache)
                ref.append(h[0, 0])
            got = {}
            for k, A, hk in ttt_forward(d, s2, el, chunk=7):
                got[k] = hk[int(torch.nonzero(A == p)[0])]
        for k in range(K):
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-4)
            assert int(d.to_target_ids(d.logits(got[k]).argmax(-1))) == int(drafts[k])


def _reference_loss(logq: torch.Tensor, lab: torch.Tensor, loss: str) -> torch.Tensor:
    """Each loss written the plain way, for autograd (lk_hybrid: KL's weight is a constant of the step)."""
    p = lab.exp()
    kl = (p * (lab - logq)).sum(-1)
    if loss == "kl":
        return kl.sum()
    if loss == "ce":
        return -logq.gather(-1, lab.argmax(-1, keepdim=True)).sum()
    from peagle.train.objective import LK_ETA

    alpha = torch.minimum(p, logq.exp()).sum(-1)
    lam = torch.exp(-LK_ETA * alpha.detach())
    return (lam * kl - (1 - lam) * alpha.log()).sum()


@pytest.mark.parametrize("loss_name", ["kl", "ce", "lk_hybrid"])
@pytest.mark.parametrize("frozen_lm_head", [False, True])
def test_fused_head_loss_equals_autograd(loss_name, frozen_lm_head):
    from peagle.train.objective import head_loss

    d = tiny_drafter(num_layers=1)
    d.lm_head.weight.requires_grad_(not frozen_lm_head)
    seq = random_seq(40, d)
    h = torch.randn(33, d.config.hidden_size, requires_grad=True)
    rows = torch.randint(0, 40, (33,))
    loss, drafts = head_loss(d, h, seq, rows, loss_name, chunk=7)
    loss.backward()
    grads = lambda: (h.grad, d.lm_head.weight.grad, d.norm.weight.grad)  # noqa: E731
    got = tuple(None if g is None else g.clone() for g in grads())
    h.grad = None
    d.zero_grad()
    logq = d.logits(h).log_softmax(-1)
    lab = seq.labels[rows].log_softmax(-1)
    ref = _reference_loss(logq, lab, loss_name)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    assert (got[1] is None) == frozen_lm_head  # a frozen LM head gets no gradient (and none is computed)
    for a, b in zip(got, grads()):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(drafts, d.to_target_ids(d.logits(h).argmax(-1)))


def test_lk_hybrid_is_minus_log_acceptance_once_the_drafter_agrees():
    """With eta = 0 KL's weight is 1 (pure KL); with a large eta and q = p the loss is -log 1 = 0, and where q
    misses p's support it is finite (alpha is floored) with a gradient that moves mass onto p's support."""
    from peagle.train.objective import _lk_hybrid_rows

    lab = torch.log_softmax(torch.randn(6, 50), -1)
    logq = torch.log_softmax(torch.randn(6, 50), -1)
    kl = (lab.exp() * (lab - logq)).sum()
    torch.testing.assert_close(_lk_hybrid_rows(lab, logq, 0.0, False)[0], kl)
    assert abs(float(_lk_hybrid_rows(lab, lab.clone(), 1e3, False)[0])) < 1e-5
    p = torch.zeros(1, 4)
    p[0, 0] = 1.0
    far = torch.log_softmax(torch.tensor([[-30.0, 10.0, 10.0, 10.0]]), -1)
    total, g = _lk_hybrid_rows(p.clamp_min(1e-30).log(), far, 1e3, True)
    assert torch.isfinite(total) and torch.isfinite(g).all()
    assert g[0, 0] < 0 < g[0, 1]  # gradient descent raises the logit of p's token and lowers the others


@pytest.mark.parametrize("chunk", [5, 4096])
def test_cod_hidden_equals_cod_forward(chunk):
    """The cheap training path computes the definition's outputs and gradients (several docs, tiny chunks)."""
    from peagle.train.objective import cod_hidden

    n = 70
    d = tiny_drafter(num_layers=2, frozen_embedding=True, seed=11)
    seq = random_seq(n, d, seed=4)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[5:30] = True
    mask[38:] = True
    docs = (torch.arange(n) >= 35).long()
    el = sample_cod(mask, 5, generator=torch.Generator().manual_seed(2), doc_ids=docs)
    ref = cod_forward(d, seq, el)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    ref_grads = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    got = cod_hidden(d, seq, el, chunk=chunk)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    (got * w).sum().backward()
    for k, p in d.named_parameters():
        if k in ref_grads:  # float32 reduction-order noise, relative to the gradient's scale
            scale = float(ref_grads[k].abs().max())
            torch.testing.assert_close(p.grad, ref_grads[k], rtol=1e-4, atol=1e-5 * scale, msg=k)
