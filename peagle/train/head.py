"""The head a training run starts from (docs/training.md, "The head a run starts from").

As the reference trainers do it: the draft vocab is the Vd most frequent supervised tokens; the embedding table is
the target's (frozen except the mask token's row, or wholly trainable); the LM head is the target's rows of the
draft vocab (trained, or frozen there) and the final norm is the target's; `mask_hidden` starts from a standard
normal (norm about sqrt(3*Ht)). Never from target features: their norms reach tens of thousands (the first row of a
sequence), fc of such a placeholder becomes every mask slot's residual stream, AdamW cannot shrink it faster than
lr per element per step, and the slots stop telling depths apart.

`--init-head` starts from a saved head instead (its layers, draft vocab, mask token and `norm_before_residual`); an
EAGLE-3 head may start a P-EAGLE run, which keeps its layers and adds a fresh mask row and `mask_hidden`.
`--fresh-mask-hidden` restarts a P-EAGLE head's `mask_hidden` from the standard normal and keeps the rest.
`--grow-layers N` appends N decoder layers to the saved head's, each a copy of its last decoder layer (a fresh one
after a fusion layer alone) whose output projections (o_proj, down_proj) are zero: each adds nothing to the residual
stream, so the grown head starts exactly where the saved one was, and gradients open the new layers from there.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from peagle.model.drafter import Drafter
from peagle.model.mask_token import choose_mask_token_id
from peagle.train.objective import FrozenEmbedding
from peagle.train.teacher import Teacher, drafter_config_for
from peagle.train.train_config import TrainConfig
from peagle.train.vocab import mapping, select_draft_vocab, used_ids


def build_head(cfg: TrainConfig, teacher: Teacher, tokenizer, rows: Iterable[tuple[torch.Tensor, torch.Tensor]],
               log: Callable[[str], None]) -> Drafter:
    """The fp32 training drafter for `cfg` on CPU; sets `teacher.used` to its draft vocab. `rows` are the training
    (input_ids, loss_mask) pairs the draft vocab and the mask token are chosen from."""
    V = teacher.vocab_size
    init = load_init_head(cfg, teacher, log) if cfg.init_head else None
    if init is not None:  # the head decides the shape: its layers, draft vocab, mask token and residual norm
        num_layers, Vd, mask_id = (init.config.num_layers + cfg.grow_layers, init.config.draft_vocab_size,
                                   init.config.mask_token_id)
        norm_before_residual = init.config.norm_before_residual
        used = used_ids(init.d2t.cpu())
    else:
        num_layers, Vd, mask_id = cfg.num_layers, min(cfg.draft_vocab_size, V), None
        norm_before_residual = cfg.norm_before_residual
    sup_counts, all_counts = _token_counts(rows, V)
    if cfg.method == "peagle" and mask_id is None:
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else choose_mask_token_id(tokenizer, V,
                                                                                              all_counts)
        if not 0 <= mask_id < V:
            raise ValueError(f"--mask-token-id {mask_id} is outside the target's vocabulary ({V})")
    if init is None:
        used = select_draft_vocab(sup_counts, Vd, exclude=[] if mask_id is None else [mask_id])
    teacher.used = used
    dc = drafter_config_for(teacher.config_dir, teacher.hf_config, num_layers, Vd, mask_id)
    dc.norm_before_residual = norm_before_residual
    dc.extra = {**dc.extra, "peagle_training": {"method": cfg.method, "num_depths": cfg.num_depths,
                                                 "max_seq_len": cfg.max_seq_len}}
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dc)
    emb = teacher.input_embeddings().detach().float().cpu()
    if emb.shape != (V, dc.hidden_size):
        raise ValueError(f"target input embeddings have shape {tuple(emb.shape)}, expected {(V, dc.hidden_size)}")
    d2t, t2d = mapping(used, V)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():
        if init is not None:
            drafter.load_state_dict({k: v for k, v in init.state_dict().items()
                                     if not k.startswith("embed_tokens.") and k != "mask_hidden"}, strict=False)
            emb = init.embed_tokens.weight.detach().float() if init.config.parallel_capable else emb
            log(f"starting from the weights of {cfg.init_head}")
            _grow(drafter, init.config.num_layers, log)
        if cfg.train_embeddings:
            drafter.embed_tokens.weight.copy_(emb)
        else:
            drafter.embed_tokens = FrozenEmbedding(emb, mask_id)
        if drafter.mask_hidden is not None:
            if init is not None and init.mask_hidden is not None and not cfg.fresh_mask_hidden:
                drafter.mask_hidden.copy_(init.mask_hidden.float())
            else:
                g = torch.Generator().manual_seed(cfg.seed)
                drafter.mask_hidden.copy_(torch.randn(drafter.mask_hidden.shape, generator=g))
        if init is None and cfg.init_from_target:
            out_emb = teacher.output_embeddings()
            if out_emb is not None and out_emb.shape[-1] == dc.hidden_size:
                drafter.lm_head.weight.copy_(out_emb.detach().float().cpu()[used])
            norm = teacher.final_norm_weight()
            if norm is not None and norm.shape == drafter.norm.weight.shape:
                drafter.norm.weight.copy_(norm.detach().float().cpu())
    drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    return drafter


def _grow(drafter: Drafter, had: int, log: Callable[[str], None]) -> None:
    """Layers `had`.. of `drafter` (past the saved head's): a copy of its last decoder layer, if it had one, with
    the projections that write to the residual stream zeroed, so that each new layer starts as the identity."""
    new = [str(i) for i in range(had, drafter.config.num_layers)]
    if not new:
        return
    last = drafter.layers[str(had - 1)].state_dict() if had > 1 else None
    for name in new:
        layer = drafter.layers[name]
        if last is not None:
            layer.load_state_dict(last)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    log(f"grew the head from {had} to {drafter.config.num_layers} layer(s): layer(s) {', '.join(new)} start as the "
        "identity")


def load_init_head(cfg: TrainConfig, teacher: Teacher, log: Callable[[str], None]) -> Drafter:
    """The head --init-head names, checked against this run: a head for the same target, of the same kind (or an
    EAGLE-3 head warm-starting P-EAGLE)."""
    from peagle.model.checkpoint import load_head
    from peagle.model.heads import resolve_head

    path = resolve_head(cfg.init_head, cfg.target, cfg.method)
    emb = teacher.input_embeddings().detach().float().cpu()
    head = load_head(path, target_embeddings=emb, dtype=torch.float32)
    c = head.config
    if c.parallel_capable and cfg.method == "eagle3":
        raise ValueError(f"--init-head {cfg.init_head} is a P-EAGLE head; --method eagle3 needs an EAGLE-3 head")
    if (c.vocab_size, c.target_hidden_size) != (emb.shape[0], teacher.hf_config.hidden_size) or \
            tuple(c.feature_layer_ids) != tuple(teacher.feature_layer_ids):
        raise ValueError(f"--init-head {cfg.init_head} was trained for another target (vocab {c.vocab_size}, "
                         f"hidden {c.target_hidden_size}, feature layers {list(c.feature_layer_ids)})")
    if cfg.num_layers != c.num_layers and not cfg.grow_layers:
        log(f"--init-head has {c.num_layers} layer(s); --num-layers {cfg.num_layers} is ignored (--grow-layers "
            "adds layers)")
    if cfg.norm_before_residual != c.norm_before_residual:
        log(f"--init-head has norm_before_residual={c.norm_before_residual}; the flag given is ignored")
    return head


def _token_counts(rows: Iterable[tuple[torch.Tensor, torch.Tensor]], V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(how often each id is a supervised token, how often it occurs at all)."""
    sup = torch.zeros(V, dtype=torch.long)
    every = torch.zeros(V, dtype=torch.long)
    for ids, mask in rows:
        if ids.numel() and int(ids.max()) >= V:
            raise ValueError(f"token id {int(ids.max())} is outside the target's vocabulary ({V}); was the data "
                             "prepared with another tokenizer?")
        sup += torch.bincount(ids[mask], minlength=V)
        every += torch.bincount(ids, minlength=V)
    return sup, every
