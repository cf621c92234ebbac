"""The training forward and loss of both methods, on the serving Drafter module itself.

P-EAGLE: the COD elements of a segment under the COD mask. `cod_forward` is the definition: one `Drafter.forward`
over all elements with the explicit mask (BatchLayout.dense), which is what `Drafter.draft_parallel` computes at
serve time (tested). `cod_hidden` computes the same outputs cheaply (depth 0 as a causal pass, deeper elements in
anchor chunks over the depth-0 keys) and is what training runs (tested equal to `cod_forward`).

EAGLE-3: the training-time-test unroll. Step 0 runs every real row; step k (k = 1..K-1) runs, for each chain anchor
p, one row at position p+k whose feature is step k-1's pre-norm output at p and whose token is the ground-truth token
x_{p+1+k} (what EAGLE-3 and SpecForge feed: it equals the chain's own draft whenever that draft is accepted). Step k
attends to the real rows 0..p and to steps 1..k of its own chain: the serve-time view of `Drafter.draft_chain`.
(The original EAGLE-3 code also hides real rows p-k+1..p from step k; that disagrees with what the serving chain
sees, so we follow serving.) Keys and values of earlier steps are kept per layer and fed to later steps, so the
unroll costs K passes over the anchors, computed in anchor chunks so attention never builds an n x Kn mask.
Step k's loss is weighted 0.8^k.

Loss (LOSSES), summed over supervised elements; the caller divides by the global count:
  kl         forward KL(p || q) from the teacher's draft-vocab distribution p to the drafter's q
  ce         cross-entropy on the teacher's argmax
  lk_hybrid  acceptance itself: the chance that a draft sampled from q survives verification against p is
             alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q). Per element: lambda * KL - (1 - lambda) * log alpha with
             lambda = exp(-eta * alpha), alpha not differentiated in lambda: KL steers while the drafter is far from
             the target (where log alpha's gradient is weak), -log alpha takes over as acceptance grows (the LK losses
             of Samarin et al. 2026; the weighting here is ours). The LM head and the loss are fused and chunked: each
chunk's logits produce the loss and the gradients at once, so [elements x Vd] logits never all live at once and
are never recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peagle.model.drafter import Drafter
from peagle.model.layers import BatchLayout, apply_rope
from peagle.train.cod import Elements, Segment, cod_mask


@dataclass
class TeacherSeq:
    """One sequence with its teacher outputs."""

    input_ids: torch.Tensor  # [n] long
    features: torch.Tensor  # [n, 3Ht]
    labels: torch.Tensor  # [n, Vd]: target logits at position t over the draft vocab (any dtype; the loss
    #                       renormalises them in fp32): the label of the element predicting token t+1
    argmax: torch.Tensor  # [n] long: the target's full-vocab argmax at position t
    positions: torch.Tensor | None = None  # [n] long: each token's position in its row (None: 0..n-1, one row)

    def token_rows(self) -> torch.Tensor | None:
        """[n] long: which stacked row each token belongs to (None for a single row)."""
        return None if self.positions is None else (self.positions == 0).long().cumsum(0) - 1


def element_positions(seq: TeacherSeq, anchor: torch.Tensor, depth: torch.Tensor | int = 0) -> torch.Tensor:
    """RoPE positions of elements (anchor, depth): the anchor's position in its own row, plus the depth."""
    return (anchor if seq.positions is None else seq.positions[anchor]) + depth


def stack_rows(seqs: list[TeacherSeq], els: list[Elements]) -> tuple[TeacherSeq, Elements]:
    """Several training rows as one sequence for one forward (--micro-batch-size): tokens end to end, each row's
    positions restarting at 0, its elements' anchors shifted to the stacked tokens and their document set to the
    row, so no element sees another row (cod_mask) and every loss equals the row's own. Depth-major, as one row's."""
    if len(seqs) == 1:
        return seqs[0], els[0]
    offsets = [0]
    for s in seqs[:-1]:
        offsets.append(offsets[-1] + s.input_ids.numel())
    dev = seqs[0].input_ids.device
    seq = TeacherSeq(*(torch.cat([getattr(s, f) for s in seqs]) for f in ("input_ids", "features", "labels", "argmax")),
                     positions=torch.cat([torch.arange(s.input_ids.numel(), device=dev) for s in seqs]))
    docs, base = [], 0  # a row's own documents stay apart too
    for e in els:
        docs.append(e.doc + base)
        base += int(e.doc.max()) + 1 if len(e) else 1
    el = Elements(torch.cat([e.anchor + o for e, o in zip(els, offsets)]), torch.cat([e.depth for e in els]),
                  torch.cat([e.supervised for e in els]), torch.cat(docs))
    return seq, el.select(torch.argsort(el.depth, stable=True))


class FrozenEmbedding(nn.Module):
    """The target's embedding table, frozen, with one trainable row: P-EAGLE's mask token."""

    def __init__(self, weight: torch.Tensor, mask_token_id: int | None):
        super().__init__()
        self.register_buffer("weight", weight.detach().float().clone(), persistent=False)
        self.mask_token_id = mask_token_id
        self.mask_row = (nn.Parameter(self.weight[mask_token_id].clone()[None])
                         if mask_token_id is not None else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = F.embedding(tokens, self.weight)
        if self.mask_row is not None:
            e = torch.where((tokens == self.mask_token_id)[..., None], self.mask_row.to(e.dtype), e)
        return e

    def folded(self) -> torch.Tensor:
        w = self.weight.clone()
        if self.mask_row is not None:
            w[self.mask_token_id] = self.mask_row.detach()[0].to(w.dtype)
        return w


def export_drafter(drafter: Drafter) -> Drafter:
    """A plain Drafter (nn.Embedding with the learned mask row folded in) from a training drafter."""
    out = Drafter(drafter.config)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}
    emb = drafter.embed_tokens
    state["embed_tokens.weight"] = emb.folded() if isinstance(emb, FrozenEmbedding) else emb.weight.detach()
    out.load_state_dict({k: v.detach().float() if v.is_floating_point() else v for k, v in state.items()})
    return out


# ---------------------------------------------------------------------------------------------------------------
# element inputs and the loss
# ---------------------------------------------------------------------------------------------------------------
def element_inputs(drafter: Drafter, seq: TeacherSeq, el: Elements):
    """Tokens, features and positions of COD elements: real inputs at depth 0, mask inputs deeper."""
    d0 = el.depth == 0
    nxt = (el.anchor + 1).clamp(max=seq.input_ids.numel() - 1)
    mask_id = drafter.config.mask_token_id
    if mask_id is None:
        if bool((~d0).any()):
            raise ValueError("deeper COD elements need a P-EAGLE head (mask token + mask_hidden)")
        tokens = seq.input_ids[nxt]
        feats = seq.features[el.anchor].float()
    else:
        tokens = torch.where(d0, seq.input_ids[nxt], torch.full_like(nxt, mask_id))
        feats = torch.where(d0[:, None], seq.features[el.anchor].float(),
                            drafter.mask_hidden.reshape(1, -1).float())
    return tokens, feats, element_positions(seq, el.anchor, el.depth)


LOSSES = ("kl", "ce", "lk_hybrid")
LK_ETA = 3.0  # lk_hybrid's lambda = exp(-eta * alpha): 0.74 at alpha 0.1, 0.22 at 0.5
ALPHA_FLOOR = 1e-6  # -log alpha and its gradient 1 / alpha stay finite where the drafter puts no mass on p's support


def _lk_hybrid_rows(lab: torch.Tensor, logq: torch.Tensor, eta: float, need: bool):
    """lk_hybrid's summed loss over a chunk's rows and its gradient with respect to the logits.

    With q = softmax(z), m = [q < p] and S = sum_x q(x) m(x): d alpha / d z = q * (m - S), so
    d(-log alpha) / d z = -q * (m - S) / alpha, and KL's gradient is q - p."""
    p, q = lab.exp(), logq.exp()
    alpha = torch.minimum(p, q).sum(-1).clamp_min(ALPHA_FLOOR)
    lam = torch.exp(-eta * alpha)
    kl_rows = (p * (lab - logq)).sum(-1)
    total = (lam * kl_rows - (1 - lam) * alpha.log()).sum()
    if not need:
        return total, None
    m = (q < p).to(q.dtype)
    s = (q * m).sum(-1, keepdim=True)
    g = (q - p).mul_(lam[:, None]) - q.mul_(m.sub_(s)).mul_(((1 - lam) / alpha)[:, None])
    return total, g


# Rows per fused LM-head + loss chunk: a [256 x Vd] fp32 chunk stays in cache through the passes over it, where 1024
# rows did not (docs/training.md, "Throughput per core").
LOSS_CHUNK = 256


class _FusedHeadLoss(torch.autograd.Function):
    """Summed loss (LOSSES) of lm_head logits against teacher rows, computed chunk by chunk with the gradients made
    in the same pass (the loss is linear in its upstream gradient), so neither logits nor a recompute are ever kept:
    for KL and CE d loss / d logits = softmax(logits) - p (p: the label distribution, or one-hot for CE)."""

    @staticmethod
    def forward(ctx, x, weight, labels, rows, loss: str, chunk: int, cdt: torch.dtype, eta: float):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need = need_x or need_w
        with torch.autocast(x.device.type, enabled=False):
            W = weight.to(cdt)
            gx = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_x else None
            # a frozen LM head (--freeze-lm-head) skips its weight gradient: a third of the head's products
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            preds = []
            for a in range(0, x.shape[0], chunk):
                xc = x[a:a + chunk].to(cdt)
                logits = (xc @ W.t()).float()
                preds.append(logits.argmax(-1))
                logq = logits.log_softmax(-1)
                del logits
                lab = labels[rows[a:a + chunk]].log_softmax(-1, dtype=torch.float32)
                # passes over [chunk x Vd] cost as much as the product itself: each op below is one pass, in place
                # where it can be
                if loss == "lk_hybrid":
                    part, g = _lk_hybrid_rows(lab, logq, eta, need)
                    total += part
                elif loss == "kl":
                    p = lab.exp()
                    total += lab.sub_(logq).mul_(p).sum()
                    g = logq.exp_().sub_(p) if need else None
                else:
                    tgt = lab.argmax(-1)
                    total -= logq.gather(-1, tgt[:, None]).sum()
                    if need:
                        g = logq.exp_()
                        g[torch.arange(tgt.numel(), device=g.device), tgt] -= 1
                if need:
                    gc = g.to(cdt)
                    if need_x:
                        gx[a:a + chunk] = (gc @ W).float()
                    if need_w and gc.dtype == gw.dtype:
                        gw.addmm_(gc.t(), xc)  # in place: no [Vd x H] temporary per chunk
                    elif need_w:
                        gw += (gc.t() @ xc).float()
        pred = torch.cat(preds) if preds else rows.new_zeros(0)
        ctx.mark_non_differentiable(pred)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.save_for_backward(gx, gw)
        return total, pred

    @staticmethod
    def backward(ctx, g_loss, _g_pred):
        gx, gw = ctx.saved_tensors
        gx = None if gx is None or not ctx.needs_input_grad[0] else (gx * g_loss).to(ctx.dtypes[0])
        gw = None if gw is None or not ctx.needs_input_grad[1] else (gw * g_loss).to(ctx.dtypes[1])
        return gx, gw, None, None, None, None, None, None


def head_loss(drafter: Drafter, h: torch.Tensor, seq: TeacherSeq, label_rows: torch.Tensor, loss: str = "kl",
              chunk: int = LOSS_CHUNK, eta: float = LK_ETA) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss of rows `h` [M, H] (pre-norm) against the teacher rows `label_rows`, and the drafts as target
    ids. For KL equal to summing `(p * (log p - log_softmax(drafter.logits(h)))).sum(-1)` with
    log p = log_softmax(seq.labels[label_rows]), at the cost of one pass."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, not {loss!r}")
    x = drafter.norm(h)
    dev = x.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else drafter.lm_head.weight.dtype
    total, pred = _FusedHeadLoss.apply(x, drafter.lm_head.weight, seq.labels, label_rows, loss, chunk, cdt, eta)
    return total, drafter.to_target_ids(pred)


@dataclass
class Stats:
    loss_sum: torch.Tensor  # scalar fp32, detached
    correct: torch.Tensor  # [D] long: draft == target argmax, per depth / TTT step
    total: torch.Tensor  # [D] long: supervised elements per depth / step


def _depth_counts(depth: torch.Tensor, ok: torch.Tensor, D: int):
    depth, ok = depth.cpu(), ok.cpu()
    correct = torch.bincount(depth[ok], minlength=D)[:D]
    total = torch.bincount(depth, minlength=D)[:D]
    return correct.cpu(), total.cpu()


# ---------------------------------------------------------------------------------------------------------------
# P-EAGLE: COD segment
# ---------------------------------------------------------------------------------------------------------------
def cod_forward(drafter: Drafter, seq: TeacherSeq, el: Elements) -> torch.Tensor:
    """Pre-norm hidden [E, H] of elements `el` (which must hold every element they attend to)."""
    el = el.to(seq.input_ids.device)
    tokens, feats, pos = element_inputs(drafter, seq, el)
    layout = BatchLayout.dense(pos[None], cod_mask(el)[None])
    return drafter(tokens[None], feats[None], layout, None)[0]


def cod_hidden(drafter: Drafter, seq: TeacherSeq, el: Elements, chunk: int = 2048) -> torch.Tensor:
    """`cod_forward`'s output, computed the cheap way (used for training and evaluation).

    Depth-0 elements only ever see depth-0 elements of lower anchors, so they run first as a plain causal pass
    (flash attention skips the masked half); deeper elements then run in chunks of about `chunk` rows grouped by
    anchor, as queries over the depth-0 keys/values up to the chunk's last anchor plus their own chunk under the COD
    mask. Every query sees exactly the keys the COD mask allows, so outputs (and gradients) equal `cod_forward`'s
    while attention costs about n^2/2 + E*n/2 instead of E^2, and no E x E mask is built."""
    dev = seq.input_ids.device
    el = el.to(dev)
    ids = seq.input_ids
    E = len(el)
    d0 = el.depth == 0
    idx0 = torch.nonzero(d0).flatten()
    idx0 = idx0[torch.argsort(el.anchor[idx0], stable=True)]
    a0, doc0 = el.anchor[idx0], el.doc[idx0]
    one_doc = bool((el.doc == el.doc[0]).all()) if E else True
    h_in = drafter.fc(seq.features[a0].to(drafter.fc.weight.dtype))
    h0, kv0 = forward_docs(drafter, ids[(a0 + 1).clamp(max=ids.numel() - 1)], h_in, element_positions(seq, a0),
                           None if one_doc else doc0)
    sorted_docs = one_doc or bool((doc0[1:] >= doc0[:-1]).all())  # then a chunk's keys start at its first document
    idxd = torch.nonzero(~d0).flatten()
    if idxd.numel() == 0:
        out = h0
        order = idx0
    else:
        if drafter.config.mask_token_id is None:
            raise ValueError("deeper COD elements need a P-EAGLE head (mask token + mask_hidden)")
        D = int(el.depth.max()) + 1
        idxd = idxd[torch.argsort(el.anchor[idxd] * D + el.depth[idxd], stable=True)]
        anchors_d = el.anchor[idxd]
        mask_in = drafter.fc(drafter.mask_hidden.reshape(1, -1).to(drafter.fc.weight.dtype))
        outs, start, M = [], 0, idxd.numel()
        while start < M:
            end = min(start + chunk, M)
            if end < M:  # keep each anchor's chain in one chunk
                end = int(torch.searchsorted(anchors_d, anchors_d[end - 1], right=True))
            rows = idxd[start:end]
            sub = el.select(rows)
            hi = int(sub.anchor.max())
            j = int(torch.searchsorted(a0, hi, right=True))
            i = 0 if one_doc or not sorted_docs else int(torch.searchsorted(doc0, sub.doc.min()))
            ext_mask = (a0[i:j][None, :] <= sub.anchor[:, None]) & (doc0[i:j][None, :] == sub.doc[:, None])
            ext = [(k[:, :, i:j], v[:, :, i:j]) for k, v in kv0]
            tok = torch.full_like(sub.anchor, drafter.config.mask_token_id)
            h, _ = forward_rows(drafter, tok, mask_in.expand(rows.numel(), -1),
                                element_positions(seq, sub.anchor, sub.depth), cod_mask(sub), ext, ext_mask)
            outs.append(h)
            start = end
        out = torch.cat([h0] + outs)
        order = torch.cat([idx0, idxd])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=dev)
    return out[inverse]


def cod_segment_loss(drafter: Drafter, seq: TeacherSeq, el: Elements, seg: Segment, num_depths: int,
                     loss: str = "kl", chunk: int = LOSS_CHUNK, attn_chunk: int = 2048,
                     eta: float = LK_ETA) -> tuple[torch.Tensor, Stats]:
    dev = seq.input_ids.device
    sub = el.select(seg.rows).to(dev)
    hidden = cod_hidden(drafter, seq, sub, attn_chunk)
    sel = seg.own.to(dev) & sub.supervised
    rows = (sub.anchor + sub.depth + 1)[sel]
    summed, drafts = head_loss(drafter, hidden[sel], seq, rows, loss, chunk, eta)
    correct, total = _depth_counts(sub.depth[sel], drafts == seq.argmax[rows], num_depths)
    return summed, Stats(summed.detach(), correct, total)


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3: training-time test
# ---------------------------------------------------------------------------------------------------------------
def _attention(attn, x: torch.Tensor, rope, self_mask, ext, ext_mask, causal: bool):
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, *rope).transpose(1, 2), apply_rope(k, *rope).transpose(1, 2)
    v = v.transpose(1, 2)
    if ext is not None:
        keys, values = torch.cat([ext[0].to(k.dtype), k], 2), torch.cat([ext[1].to(v.dtype), v], 2)
        mask = torch.cat([ext_mask, self_mask], -1)[None, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=attn.num_kv_heads != attn.num_heads)
    elif causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.num_kv_heads != attn.num_heads)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask[None, None],
                                             enable_gqa=attn.num_kv_heads != attn.num_heads)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)


def forward_rows(drafter: Drafter, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                 self_mask: torch.Tensor | None = None, ext: list | None = None, ext_mask: torch.Tensor | None = None):
    """`Drafter.forward` for one sequence of T rows that may also attend to given keys/values; or, given tokens
    [B, T], for B sequences at once, each causal on its own.

    self_mask [T, T] (None: causal); ext: per layer (k, v) [1, kv_heads, L, D] after RoPE; ext_mask [T, L].
    Returns (hidden [T, H] (or [B, T, H]), per-layer (k, v) of these rows)."""
    single = tokens.dim() == 1
    if single:
        tokens, feats, positions = tokens[None], feats[None], positions[None]
    h = drafter.fc(feats) if feats.shape[-1] != drafter.config.hidden_size else feats
    rope = drafter.rotary(positions, h.dtype)
    causal = self_mask is None
    kvs = []
    mid = drafter.midlayer
    x, residual = mid.inputs(drafter.embed_tokens(tokens), h)
    a, kv = _attention(mid.self_attn, x, rope, self_mask, None if ext is None else ext[0], ext_mask, causal)
    kvs.append(kv)
    x = residual + a
    h = x + mid.mlp(mid.post_attention_layernorm(x))
    for i, layer in enumerate(drafter.layers.values(), start=1):
        a, kv = _attention(layer.self_attn, layer.input_layernorm(h), rope, self_mask,
                           None if ext is None else ext[i], ext_mask, causal)
        kvs.append(kv)
        x = h + a
        h = x + layer.mlp(layer.post_attention_layernorm(x))
    return (h[0] if single else h), kvs


def forward_docs(drafter: Drafter, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                 doc: torch.Tensor | None):
    """`forward_rows` of N rows in anchor order, causal within each document (`doc` [N]; None: one document).
    Documents run side by side as one padded batch [docs, longest], so stacked rows cost a causal pass each rather
    than one masked pass over all of them; padding sits after each document's rows, where no real row sees it.
    Returns (hidden [N, H], per-layer (k, v) [1, kv_heads, N, D]) in the rows' order."""
    if doc is None:
        return forward_rows(drafter, tokens, feats, positions)
    order = torch.argsort(doc, stable=True)  # stable: each document's rows keep their anchor order
    _, counts = torch.unique_consecutive(doc[order], return_counts=True)
    B, T = counts.numel(), int(counts.max())
    b = torch.repeat_interleave(torch.arange(B, device=doc.device), counts)
    t = torch.arange(order.numel(), device=doc.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    padded = []
    for x in (tokens, feats, positions):
        p = x.new_zeros((B, T) + x.shape[1:])
        p[b, t] = x[order]
        padded.append(p)
    h, kvs = forward_rows(drafter, *padded)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    b, t = b[inverse], t[inverse]
    return h[b, t], [(k[b, :, t].transpose(0, 1)[None], v[b, :, t].transpose(0, 1)[None]) for k, v in kvs]


def ttt_forward(drafter: Drafter, seq: TeacherSeq, el: Elements, chunk: int = 2048, step_tokens=None):
    """The TTT unroll over chain elements `el` (full chains, e.g. `sample_cod(..., keep_all=True)`).

    Yields (step k, anchors [M], hidden [M, H]) for k = 0..K-1; step 0 covers every real row. `step_tokens(k,
    anchors)` overrides the ground-truth tokens fed at step k >= 1 (tests feed the chain's own drafts)."""
    ids = seq.input_ids
    el = el.to(ids.device)
    a0, doc0 = el.anchor[el.depth == 0], el.doc[el.depth == 0]
    rows = seq.token_rows()
    real = torch.arange(ids.numel() - 1, device=ids.device)  # every token but each row's last
    real = real if rows is None else real[rows[1:] == rows[:-1]]
    if a0.numel() != real.numel() or not bool((a0 == real).all()):
        raise ValueError("the TTT unroll needs every real row at step 0")
    one_doc = bool((doc0 == doc0[0]).all()) if a0.numel() else True
    sorted_docs = not one_doc and bool((doc0[1:] >= doc0[:-1]).all())
    h_prev, kv0 = forward_docs(drafter, ids[a0 + 1], seq.features[a0].float(), element_positions(seq, a0),
                               None if one_doc else doc0)
    yield 0, a0, h_prev
    prev_anchor = a0
    chains: list[tuple[torch.Tensor, list]] = []  # (anchors of step j, per-layer kv), j = 1..k-1
    K = int(el.depth.max()) + 1 if len(el) else 0
    for k in range(1, K):
        A = el.anchor[el.depth == k]
        if A.numel() == 0:
            break
        feat = h_prev[torch.searchsorted(prev_anchor, A)]
        tok = ids[A + 1 + k] if step_tokens is None else step_tokens(k, A)
        pos = element_positions(seq, A, k)
        docA = doc0[torch.searchsorted(a0, A)]
        outs, kv_parts = [], []
        for c0 in range(0, A.numel(), chunk):
            Ac, dc = A[c0:c0 + chunk], docA[c0:c0 + chunk]
            lo, hi = int(Ac[0]), int(Ac[-1])
            # real keys: from the first row of the chunk's first document (stacked rows: docs ascend with anchors)
            i = 0 if not sorted_docs else int(torch.searchsorted(doc0, dc[0]))
            j = int(torch.searchsorted(a0, hi, right=True))
            ext, masks = [], [(a0[i:j][None, :] <= Ac[:, None]) & (doc0[i:j][None, :] == dc[:, None])]
            spans = []
            for anchors_j, _ in chains:
                s, e = int(torch.searchsorted(anchors_j, lo)), int(torch.searchsorted(anchors_j, hi, right=True))
                spans.append((s, e))
                masks.append(anchors_j[s:e][None, :] == Ac[:, None])
            for layer in range(len(kv0)):
                ks = [kv0[layer][0][:, :, i:j]] + [kv[layer][0][:, :, s:e] for (_, kv), (s, e) in zip(chains, spans)]
                vs = [kv0[layer][1][:, :, i:j]] + [kv[layer][1][:, :, s:e] for (_, kv), (s, e) in zip(chains, spans)]
                ext.append((torch.cat(ks, 2), torch.cat(vs, 2)))
            eye = torch.eye(Ac.numel(), dtype=torch.bool, device=A.device)
            h_c, kv_c = forward_rows(drafter, tok[c0:c0 + chunk], feat[c0:c0 + chunk], pos[c0:c0 + chunk], eye,
                                     ext, torch.cat(masks, -1))
            outs.append(h_c)
            kv_parts.append(kv_c)
        h_prev = torch.cat(outs)
        kv_k = [(torch.cat([p[layer][0] for p in kv_parts], 2), torch.cat([p[layer][1] for p in kv_parts], 2))
                for layer in range(len(kv0))]
        chains.append((A, kv_k))
        prev_anchor = A
        yield k, A, h_prev


def ttt_loss(drafter: Drafter, seq: TeacherSeq, el: Elements, num_steps: int, decay: float = 0.8,
             loss: str = "kl", chunk: int = LOSS_CHUNK, attn_chunk: int = 2048,
             eta: float = LK_ETA) -> tuple[torch.Tensor, Stats]:
    """Sum over steps of decay^k * (summed loss of step k's supervised rows)."""
    total = torch.zeros((), dtype=torch.float32, device=seq.labels.device)
    correct = torch.zeros(num_steps, dtype=torch.long)
    count = torch.zeros(num_steps, dtype=torch.long)
    sup0 = el.supervised[el.depth == 0].to(seq.input_ids.device)
    for k, A, h in ttt_forward(drafter, seq, el, attn_chunk):
        sel = sup0 if k == 0 else torch.ones_like(A, dtype=torch.bool)
        rows = (A + k + 1)[sel]
        summed, drafts = head_loss(drafter, h[sel], seq, rows, loss, chunk, eta)
        total = total + (decay ** k) * summed
        correct[k] = int((drafts == seq.argmax[rows]).sum())
        count[k] = int(sel.sum())
    return total, Stats(total.detach(), correct, count)


class TrainHead(nn.Module):
    """What DistributedDataParallel wraps: one call = one unit of work (a COD segment or a TTT sequence), returning
    its summed loss. Every trainable parameter joins every call (with weight 0 when unused), so DDP's gradient
    all-reduce always covers all of them."""

    def __init__(self, drafter: Drafter, method: str, num_depths: int, loss: str = "kl", ttt_decay: float = 0.8,
                 loss_chunk: int = LOSS_CHUNK, attn_chunk: int = 2048, lk_eta: float = LK_ETA):
        super().__init__()
        if method not in ("peagle", "eagle3"):
            raise ValueError(f"method must be peagle or eagle3, not {method!r}")
        self.drafter, self.method, self.num_depths = drafter, method, num_depths
        self.loss, self.ttt_decay, self.loss_chunk, self.attn_chunk = loss, ttt_decay, loss_chunk, attn_chunk
        self.lk_eta = lk_eta

    def _touch(self) -> torch.Tensor:
        z = torch.zeros((), dtype=torch.float32, device=self.drafter.fc.weight.device)
        for p in self.parameters():
            if p.requires_grad:
                z = z + 0.0 * p.reshape(-1)[:1].float().sum()
        return z

    def forward(self, seq: TeacherSeq | None = None, elements: Elements | None = None,
                segment: Segment | None = None):
        D = self.num_depths
        if seq is None:  # nothing to do on this rank: still join the gradient all-reduce
            z = self._touch()
            return z, Stats(z.detach(), torch.zeros(D, dtype=torch.long), torch.zeros(D, dtype=torch.long))
        if self.method == "peagle":
            loss, stats = cod_segment_loss(self.drafter, seq, elements, segment, D, self.loss, self.loss_chunk,
                                           self.attn_chunk, self.lk_eta)
        else:
            loss, stats = ttt_loss(self.drafter, seq, elements, D, self.ttt_decay, self.loss, self.loss_chunk,
                                   self.attn_chunk, self.lk_eta)
        return loss + self._touch(), stats
