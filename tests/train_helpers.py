"""Small builders shared by the training tests (not a test module)."""
from __future__ import annotations

import torch

from peagle.model.drafter import Drafter, DrafterConfig
from peagle.train.objective import FrozenEmbedding, TeacherSeq
from peagle.train.vocab import mapping

V, HT = 96, 32


def tiny_drafter(num_layers: int = 2, mask_token_id: int | None = 5, draft_vocab: int = 80, seed: int = 0,
                 frozen_embedding: bool = False) -> Drafter:
    """A random fp32 drafter over a 96-token target with hidden 32; draft vocab = every id except a few."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=HT, intermediate_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                        head_dim=8, rms_norm_eps=1e-6, vocab_size=V, draft_vocab_size=draft_vocab,
                        target_hidden_size=HT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        max_position_embeddings=512, feature_layer_ids=(2, 4, 5), mask_token_id=mask_token_id)
    d = Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    used = torch.sort(torch.randperm(V)[:draft_vocab]).values
    d.d2t, d.t2d = mapping(used, V)
    if frozen_embedding:
        d.embed_tokens = FrozenEmbedding(d.embed_tokens.weight.detach(), mask_token_id)
    return d


def random_seq(n: int, drafter: Drafter, seed: int = 1) -> TeacherSeq:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, V, (n,), generator=g)
    feats = torch.randn(n, 3 * HT, generator=g)
    logp = torch.randn(n, drafter.config.draft_vocab_size, generator=g).log_softmax(-1)
    argmax = torch.randint(0, V, (n,), generator=g)
    return TeacherSeq(ids, feats, logp, argmax)
