"""The trainer end to end on tiny random targets: families, exact resume, acceptance gains, the saved head."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle.model.checkpoint import load_head
from peagle.train.data import save_rows
from peagle.train.trainer import TrainConfig, Trainer
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_rows(n_rows: int, n_tokens: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"id": str(i), "input_ids": torch.randint(3, vocab, (n_tokens,), generator=g).tolist(),
             "loss_mask": [0] * 6 + [1] * (n_tokens - 6)} for i in range(n_rows)]


def _cfg(tmp: Path, target: Path, data: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(tmp / "out"), target=str(target), batch_size=2, num_depths=3, num_layers=1,
                max_seq_len=64, dtype="fp32", progress=False, eval_fraction=0.0, save_every=0, lr=1e-3)
    base.update(kw)
    return TrainConfig(**base)


FAMILIES = {
    "llama": {},
    "qwen3": {},
    "gpt2": {"n_inner": 128},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_produces_features_and_trains(tmp_path, family):
    target = make_tiny_model(tmp_path / family, family, num_hidden_layers=8, vocab_size=128, **FAMILIES[family])
    save_rows(_random_rows(6, 40, 128), tmp_path / "data", {})
    tr = Trainer(_cfg(tmp_path, target, tmp_path / "data", max_steps=3))
    feats, labels, argmax = tr.teacher(torch.arange(3, 30))
    H = tr.teacher.hf_config.hidden_size
    assert feats.shape == (27, 3 * H) and labels.shape == (27, tr.drafter.config.draft_vocab_size)
    assert tr.teacher.feature_layer_ids == (2, 4, 5)
    before = {k: v.clone() for k, v in tr.head.state_dict().items()}
    losses = [tr.train_step()["loss"] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    after = tr.head.state_dict()
    for name in ("drafter.fc.weight", "drafter.mask_hidden", "drafter.embed_tokens.mask_row", "drafter.lm_head.weight"):
        assert not torch.equal(before[name], after[name]), name
    head_dir = tr.save_head(tmp_path / "head")
    head = load_head(head_dir, dtype=torch.float32)
    assert head.config.mask_token_id == tr.drafter.config.mask_token_id
    assert head.config.feature_layer_ids == (2, 4, 5)


def test_eagle3_trains_with_ttt(tmp_path):
    target = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(6, 40, 128), tmp_path / "data", {})
    tr = Trainer(_cfg(tmp_path, target, tmp_path / "data", method="eagle3", max_steps=2, attn_chunk=8))
    m = tr.train_step()
    assert len(m["acc"]) == 3 and m["loss"] > 0
    assert tr.drafter.mask_hidden is None
    head = load_head(tr.save_head(tmp_path / "head"), target_embeddings=tr.teacher.input_embeddings().float(),
                     dtype=torch.float32)
    assert not head.config.parallel_capable


@pytest.mark.parametrize("method,optimizer,extra", [
    ("peagle", "adamw", {}), ("eagle3", "adamw", {}), ("peagle", "muon", {}),
    ("peagle", "adamw", {"loss": "lk_hybrid", "feature_noise": 0.1}),
    ("eagle3", "adamw", {"loss": "lk_hybrid", "feature_noise": 0.1})])
def test_resume_is_exact(tmp_path, method, optimizer, extra):
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(10, 40, 128, seed=3), tmp_path / "data", {})
    kw = dict(method=method, max_steps=4, partitions=2, optimizer=optimizer, **extra)
    straight = Trainer(_cfg(tmp_path / "a", target, tmp_path / "data", **kw))
    for _ in range(4):
        straight.train_step()
    first = Trainer(_cfg(tmp_path / "b", target, tmp_path / "data", **kw))
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    resumed = Trainer(_cfg(tmp_path / "b", target, tmp_path / "data", resume="latest", **kw))
    assert resumed.step == 2
    for _ in range(2):
        resumed.train_step()
    a, b = straight.head.state_dict(), resumed.head.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert len(straight.optimizer.state) == len(resumed.optimizer.state) > 0


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_init_head_continues_from_a_saved_head(tmp_path, method):
    """--init-head starts a new run from a saved head's weights, draft vocab and mask token (not the data's)."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(6, 40, 128, seed=4), tmp_path / "data", {})
    first = Trainer(_cfg(tmp_path / "a", target, tmp_path / "data", method=method, max_steps=2, num_layers=2,
                         draft_vocab_size=64))
    for _ in range(2):
        first.train_step()
    head = first.save_head(tmp_path / "head")
    save_rows(_random_rows(6, 40, 128, seed=5), tmp_path / "other", {})  # other data: a different draft vocab
    second = Trainer(_cfg(tmp_path / "b", target, tmp_path / "other", method=method, max_steps=2, num_layers=1,
                          draft_vocab_size=32, init_head=str(head)))
    assert second.drafter.config.num_layers == 2 and second.drafter.config.draft_vocab_size == 64
    saved = load_head(head, target_embeddings=second.teacher.input_embeddings().float(), dtype=torch.float32)
    for name, value in saved.state_dict().items():
        if not name.startswith("embed_tokens."):
            assert torch.allclose(second.drafter.state_dict()[name].float(), value.float(), atol=1e-2), name
    if method == "peagle":
        mask_id = saved.config.mask_token_id
        assert torch.allclose(second.drafter.embed_tokens.mask_row[0], saved.embed_tokens.weight[mask_id], atol=1e-2)
    assert torch.isfinite(torch.tensor(second.train_step()["loss"]))
    if method == "peagle":
        with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
            Trainer(_cfg(tmp_path / "c", target, tmp_path / "other", method="eagle3", max_steps=1,
                         init_head=str(head)))
    else:  # an EAGLE-3 head warm-starts P-EAGLE: its layers, plus a fresh mask row and mask_hidden
        warm = Trainer(_cfg(tmp_path / "c", target, tmp_path / "other", method="peagle", max_steps=1,
                            init_head=str(head)))
        assert warm.drafter.config.parallel_capable and warm.drafter.config.num_layers == 2
        assert torch.allclose(warm.drafter.fc.weight, saved.fc.weight.float(), atol=1e-2)
        assert warm.drafter.mask_hidden.std() > 0.5  # standard normal, not zeros or a feature
        assert torch.isfinite(torch.tensor(warm.train_step()["loss"]))


def test_a_grown_head_starts_where_the_saved_head_was(tmp_path):
    """--grow-layers appends decoder layers that start as the identity (a copy of the last layer with its output
    projections zeroed): the grown head computes exactly what the saved one did, and the new layer then trains."""
    from peagle.model.layers import BatchLayout

    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(6, 40, 128, seed=4), tmp_path / "data", {})
    first = Trainer(_cfg(tmp_path / "a", target, tmp_path / "data", method="peagle", max_steps=2, num_layers=2,
                         draft_vocab_size=64))
    for _ in range(2):
        first.train_step()
    head = first.save_head(tmp_path / "head")
    grown = Trainer(_cfg(tmp_path / "b", target, tmp_path / "data", method="peagle", max_steps=2,
                         init_head=str(head), grow_layers=1))
    d = grown.drafter
    assert d.config.num_layers == 3 and set(d.layers) == {"1", "2"}
    assert torch.equal(d.layers["2"].self_attn.q_proj.weight, d.layers["1"].self_attn.q_proj.weight)
    assert not d.layers["2"].self_attn.o_proj.weight.any() and not d.layers["2"].mlp.down_proj.weight.any()
    saved = load_head(head, target_embeddings=grown.teacher.input_embeddings().float(), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 128, (1, 6), generator=g)
    tokens[tokens == saved.config.mask_token_id] = 5
    features = torch.randn(1, 6, 3 * saved.config.target_hidden_size, generator=g)
    layout = BatchLayout.build(torch.tensor([0]), torch.arange(6)[None])
    with torch.no_grad():
        torch.testing.assert_close(d(tokens, features, layout, None), saved(tokens, features, layout, None))
    assert torch.isfinite(torch.tensor(grown.train_step()["loss"]))
    assert d.layers["2"].mlp.down_proj.weight.any()  # the new layer opens
    with pytest.raises(ValueError, match="--grow-layers"):
        _cfg(tmp_path / "c", target, tmp_path / "data", grow_layers=1)  # nothing to grow from


def test_teacher_cache_gives_identical_training(tmp_path):
    """A run reading the target's outputs from --teacher-cache trains exactly as one computing them, and a second
    epoch (or another run on the same data) is served from the cache."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(4, 40, 128, seed=6), tmp_path / "data", {})
    plain = Trainer(_cfg(tmp_path / "a", target, tmp_path / "data", max_steps=4))
    cached = Trainer(_cfg(tmp_path / "b", target, tmp_path / "data", max_steps=4,
                          teacher_cache=str(tmp_path / "cache")))
    for _ in range(4):  # 2 epochs of 2 steps
        assert plain.train_step()["loss"] == cached.train_step()["loss"]
    assert (cached.teacher_cache.misses, cached.teacher_cache.hits) == (4, 4)
    for k, v in plain.head.state_dict().items():
        assert torch.equal(v, cached.head.state_dict()[k]), k
    again = Trainer(_cfg(tmp_path / "c", target, tmp_path / "data", max_steps=1,
                         teacher_cache=str(tmp_path / "cache")))
    again.train_step()
    assert again.teacher_cache.misses == 0 and again.teacher_cache.hits == 2


def test_teacher_ahead_trains_identically_on_a_second_thread(tmp_path):
    """--teacher-ahead runs the target for the next step's rows on a worker thread: the same losses and weights as
    computing them in place, every row after the first step computed by the worker, through a teacher cache too."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=4, vocab_size=128)
    save_rows(_random_rows(6, 40, 128, seed=8), tmp_path / "data", {})
    plain = Trainer(_cfg(tmp_path / "a", target, tmp_path / "data", max_steps=6))
    ahead = Trainer(_cfg(tmp_path / "b", target, tmp_path / "data", max_steps=6, teacher_ahead=True,
                         teacher_cache=str(tmp_path / "cache")))
    for _ in range(6):  # 2 epochs of 3 steps
        assert plain.train_step()["loss"] == ahead.train_step()["loss"]
    assert ahead.teacher_ahead_hits == 12
    for k, v in plain.head.state_dict().items():
        assert torch.equal(v, ahead.head.state_dict()[k]), k
    assert not ahead._ahead  # nothing left queued past the last step


def test_a_shared_teacher_cache_computes_each_row_once_and_ends_empty(tmp_path):
    """Two heads on one pass of the same data sharing a cache (--share-teacher-cache) each train exactly as a plain
    run; whichever reaches a row first computes it, the other reads and deletes it, so the cache ends empty."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(4, 40, 128, seed=6), tmp_path / "data", {})
    shared = dict(teacher_cache=str(tmp_path / "cache"), share_teacher_cache=True, max_steps=2)
    first = Trainer(_cfg(tmp_path / "a", target, tmp_path / "data", **shared))
    second = Trainer(_cfg(tmp_path / "b", target, tmp_path / "data", method="eagle3", **shared))
    plain = Trainer(_cfg(tmp_path / "c", target, tmp_path / "data", method="eagle3", max_steps=2))
    cache_dir = first.teacher_cache.dir
    first.train_step()                     # rows of step 1 computed and kept
    assert len(list(cache_dir.glob("*.safetensors"))) == 2
    assert second.train_step()["loss"] == plain.train_step()["loss"]   # read and deleted
    assert second.train_step()["loss"] == plain.train_step()["loss"]   # the second run ahead: it computes step 2
    first.train_step()                     # ... and the first reads those
    assert (first.teacher_cache.misses, first.teacher_cache.hits) == (2, 2)
    assert (second.teacher_cache.misses, second.teacher_cache.hits) == (2, 2)
    assert list(cache_dir.glob("*.safetensors")) == []
    for k, v in plain.head.state_dict().items():
        assert torch.equal(v, second.head.state_dict()[k]), k
    with pytest.raises(ValueError, match="--teacher-cache"):
        TrainConfig(target=str(target), data=str(tmp_path / "data"), share_teacher_cache=True)


# ---------------------------------------------------------------------------------------------------------------
# a short real run raises acceptance
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def repetitive(tmp_path_factory):
    """A tiny random Llama (tied embeddings, 64-token vocab) and its own greedy continuations of random prompts:
    random models fall into short loops, so this is self-distilled, repetitive data."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("rep")
    target = make_tiny_model(tmp / "target", "llama", num_hidden_layers=8, vocab_size=64, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 64, (112, 8), generator=g)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=40, do_sample=False, pad_token_id=0)
    rows = [{"id": str(i), "input_ids": o.tolist(), "loss_mask": [0] * 8 + [1] * 40} for i, o in enumerate(out)]
    save_rows(rows, tmp / "data", {})
    return target, tmp / "data", model, prompts


def _speculative_acceptance(model, drafter, prompt: torch.Tensor, K: int, new_tokens: int = 40) -> float:
    """Mean acceptance length of greedy speculative decoding with `drafter.draft_parallel` (fresh cache per step).
    The target's greedy continuation is computed once; verification against it is exactly what the engine does."""
    with torch.no_grad():
        full = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0]
        hs = model(full[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in drafter.config.feature_layer_ids], -1)
    n, steps, advanced = prompt.numel() + 1, 0, 0  # x_n (the first generated token) is committed
    slots = torch.zeros(1, dtype=torch.long)
    while n + K < full.numel():
        rows = torch.arange(n)
        drafts = drafter.draft_parallel(full[rows + 1][None], feats[rows][None], torch.tensor([n]),
                                        torch.tensor([0]), slots, drafter.new_cache(1, 128), K)[0]
        a = 0
        while a < K and int(drafts[a]) == int(full[n + 1 + a]):
            a += 1
        steps += 1
        advanced += a + 1
        n += a + 1
    return advanced / steps


def test_short_training_raises_acceptance(tmp_path, repetitive):
    target, data, model, prompts = repetitive
    cfg = _cfg(tmp_path, target, data, max_steps=70, batch_size=8, num_depths=4, lr=3e-3, loss="ce",
               eval_fraction=0.12, warmup_ratio=0.05)
    tr = Trainer(cfg)
    untrained = tr.evaluate()
    for _ in range(cfg.max_steps):
        tr.train_step()
    trained = tr.evaluate()
    K = "4"
    assert untrained["mean_acceptance_length"][K] < 1.3
    assert trained["acceptance_per_position"][0] > 0.6
    assert trained["mean_acceptance_length"][K] > untrained["mean_acceptance_length"][K] + 1.5
    # the saved head, loaded the way the engine loads it, drafts well on held-out prompts with parallel drafting
    head = load_head(tr.save_head(tmp_path / "head"), dtype=torch.float32)
    held_out = [prompts[i] for i in tr.eval_ids[:4]]
    got = sum(_speculative_acceptance(model, head, p, 4) for p in held_out) / len(held_out)
    assert got > 2.5, got


def test_feature_noise_is_bounded_seeded_and_training_only(tmp_path):
    """Noise stays within +-s x each feature layer's RMS, is the same for the same (epoch, sample) and differs
    between epochs; evaluation reads clean features."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(6, 40, 128), tmp_path / "data", {})
    tr = Trainer(_cfg(tmp_path, target, tmp_path / "data", feature_noise=0.2))
    ids, _ = tr._row(tr.train_rows, 0)
    clean = tr._teacher_seq(ids, 0)
    a, b, c = tr._noisy(clean, 0, 0), tr._noisy(clean, 0, 0), tr._noisy(clean, 1, 0)
    assert torch.equal(a.features, b.features) and not torch.equal(a.features, c.features)
    n, width = clean.features.shape
    layers = len(tr.teacher.feature_layer_ids)
    f = clean.features.float().view(n, layers, -1)
    bound = 0.2 * f.pow(2).mean(-1, keepdim=True).sqrt()
    diff = (a.features.float().view(n, layers, -1) - f).abs()
    assert bool((diff <= bound * 1.0001 + 1e-6).all()) and float(diff.max()) > 0.5 * float(bound.max())
    assert torch.equal(a.labels, clean.labels) and torch.equal(a.argmax, clean.argmax)
    tr.cfg.feature_noise = 0.0
    assert tr._noisy(clean, 0, 0) is clean


def test_a_one_step_run_steps_at_the_full_learning_rate(tmp_path):
    """The schedule never spends a step at learning rate 0: a one-step run takes its step at --lr (and reports the
    rate the step used, not the next one)."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(4, 40, 128, seed=7), tmp_path / "data", {})
    tr = Trainer(_cfg(tmp_path, target, tmp_path / "data", max_steps=1, warmup_ratio=0.05))
    before = tr.drafter.fc.weight.detach().clone()
    m = tr.train_step()
    assert m["lr"] == pytest.approx(1e-3)
    # AdamW's first update moves every weight with a gradient by about lr
    assert float((tr.drafter.fc.weight.detach() - before).abs().max()) == pytest.approx(1e-3, rel=0.05)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_bare_peagle_train_uses_the_bundled_heads_recipe(method):
    """`peagle train --data D --method M` with nothing else trains what the bundled head of that method is."""
    import argparse
    import json

    from peagle.model.heads import DEFAULT_HEADS, HEADS_DIR
    from peagle.train import train_cmd

    parser = argparse.ArgumentParser()
    train_cmd.register("train", parser)
    cfg = train_cmd.config_from_args(parser.parse_args(["--data", "D", "--method", method]))
    head = HEADS_DIR / DEFAULT_HEADS[method]
    recipe = json.loads((head / "training_args.json").read_text())
    assert cfg.num_layers == json.loads((head / "config.json").read_text())["num_hidden_layers"]
    # (--dtype is how the arithmetic runs, not the recipe: auto takes bf16 or fp32, whichever is faster here)
    keys = ["num_depths", "draft_vocab_size", "max_seq_len", "batch_size", "warmup_ratio", "min_lr_ratio",
            "weight_decay", "max_grad_norm", "cod_ratio", "cod_min_ratio", "loss", "ttt_decay"]
    # a head continued from an earlier one (--init-head) was last trained with a continuation's settings: a lower
    # learning rate, and in the campaign's rounds the cheapest step that learns as much (fewer COD depths at a higher
    # ratio, longer sequences for the multi-turn histories, one packed row of up to 4,096 tokens a step instead of
    # four conversations); the from-scratch recipe is the first stage's, which docs/heads.md records
    if recipe.get("init_head"):
        keys = [k for k in keys if k not in ("num_depths", "cod_ratio", "max_seq_len", "batch_size")]
    else:
        keys.append("lr")
    for key in keys:
        assert getattr(cfg, key) == recipe[key], key


@pytest.mark.parametrize("fastest", ["bf16", "fp32"])
def test_auto_dtype_computes_in_the_faster_dtype_and_keeps_the_target_in_bf16(tmp_path, monkeypatch, fastest):
    """--dtype auto (the default) runs the head in whichever dtype the probe found faster, and the frozen target in
    bf16 either way (the features the head is served)."""
    from peagle.train import trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "fastest_dtype", lambda device, h, i: calls.append((h, i)) or fastest)
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_random_rows(4, 40, 128, seed=3), tmp_path / "data", {})
    tr = Trainer(_cfg(tmp_path, target, tmp_path / "data", max_steps=1, dtype="auto"))
    assert calls == [(tr.drafter.config.hidden_size, tr.drafter.config.intermediate_size)]
    assert tr.compute_dtype == fastest
    with tr._autocast():
        y = tr.drafter.fc(torch.randn(2, tr.drafter.fc.in_features))
    assert y.dtype == (torch.bfloat16 if fastest == "bf16" else torch.float32)
    assert tr.teacher(torch.arange(3, 9))[0].dtype == torch.bfloat16
    assert torch.isfinite(torch.tensor(tr.train_step()["loss"]))


def test_fastest_dtype_measures_on_a_cpu():
    from peagle.train.trainer import fastest_dtype

    assert fastest_dtype(torch.device("cpu"), 64, 128) in ("bf16", "fp32")
