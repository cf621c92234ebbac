"""Learnability: on a target whose next tokens are certain, a short run teaches every P-EAGLE mask slot (and every
EAGLE-3 TTT step) to predict its depth.

The target is a tiny Llama trained for a few seconds on a repeating 16-token cycle, so the token k steps ahead is a
fixed function of the current one. Like real LLMs, its first position carries a massive activation (the BOS row of
SmolLM2 has a feature norm of about 35,000); a head whose `mask_hidden` starts from target features (their mean
over a sequence) then has one large vector as every mask slot's residual stream, and its slots stay near chance
while depth 0 learns (the last test). See docs/training.md, "The head a run starts from"."""
from __future__ import annotations

import pytest
import torch

from peagle.train.data import save_rows
from peagle.train.trainer import TrainConfig, Trainer
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

V, BOS, PERIOD, LENGTH = 64, 1, 16, 48
MASSIVE = 1e5  # the BOS embedding's scale: its feature norm becomes a few thousand, as in real LLMs


@pytest.fixture(scope="module")
def cycle_target(tmp_path_factory):
    """(target folder, data folder): a tiny Llama that has learned x_{t+1} = next(x_t) on a fixed cycle, and 64
    sequences of BOS + the cycle from every phase."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("cycle")
    target = make_tiny_model(tmp / "target", "llama", num_hidden_layers=8, vocab_size=V, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    cycle = torch.randperm(V - 3, generator=g)[:PERIOD] + 3

    def row(phase: int) -> torch.Tensor:
        return torch.cat([torch.tensor([BOS]), cycle[(phase + torch.arange(LENGTH - 1)) % PERIOD]])

    with torch.no_grad():
        model.model.embed_tokens.weight[BOS] *= MASSIVE
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        batch = torch.stack([row(int(p)) for p in torch.randint(0, PERIOD, (16,), generator=g)])
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.to(torch.bfloat16).save_pretrained(target)
    rows = [{"id": str(i), "input_ids": row(i % PERIOD).tolist(), "loss_mask": [0, 0] + [1] * (LENGTH - 2)}
            for i in range(64)]
    save_rows(rows, tmp / "data", {})
    return target, tmp / "data"


def train_on_cycle(tmp_path, target, data, method: str, mask_hidden_from_features: bool = False) -> list[float]:
    """Held-out accuracy per depth after 100 steps, each one forward of its 8 rows; optionally with mask_hidden set to
    the mean target feature of the first training sequence first (how heads were initialised before)."""
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "out"), target=str(target), method=method, num_layers=1,
                      num_depths=4, draft_vocab_size=V, max_seq_len=LENGTH, batch_size=8, max_steps=100, lr=1e-3,
                      micro_batch_size=8, warmup_ratio=0.05, dtype="fp32", eval_fraction=0.1, save_every=0,
                      progress=False)
    tr = Trainer(cfg)
    if mask_hidden_from_features:
        ids, _ = tr._row(tr.train_rows, tr.train_ids[0])
        with torch.no_grad():
            tr.drafter.mask_hidden.copy_(tr.teacher(ids)[0].float().mean(0).reshape(1, 1, -1))
    for _ in range(cfg.max_steps):
        tr.train_step()
    return tr.evaluate()["accuracy_per_depth"]


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_every_depth_learns_the_cycle(tmp_path, cycle_target, method):
    acc = train_on_cycle(tmp_path, *cycle_target, method)
    assert min(acc) >= 0.9, f"{method}: held-out accuracy per depth {[round(a, 3) for a in acc]}"


def test_a_placeholder_started_from_features_does_not_learn(tmp_path, cycle_target):
    """The same run with mask_hidden at the mean feature (norm in the hundreds here, thousands in SmolLM2): depth 0
    learns, the mask slots do not. This is what the test above guards against."""
    acc = train_on_cycle(tmp_path, *cycle_target, "peagle", mask_hidden_from_features=True)
    assert acc[0] >= 0.9 and max(acc[1:]) < 0.5, [round(a, 3) for a in acc]
