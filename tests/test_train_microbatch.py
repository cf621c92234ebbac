"""Training that fits a GPU and a time slot: several rows per forward (--micro-batch-size), no CPU-kernel build off
the CPU, the learning rate scaled with the batch, and --time-budget (docs/training.md, "Training on a GPU machine")."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from peagle.model import kernels
from peagle.model.checkpoint import load_head
from peagle.train.cod import Segment, sample_cod
from peagle.train.data import save_rows
from peagle.train.objective import TrainHead, forward_rows, stack_rows
from peagle.train.trainer import TrainConfig, Trainer, scaled_lr
from tests.conftest import make_tiny_model
from tests.train_helpers import random_seq, tiny_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(head: TrainHead, pairs, method: str, bf16: bool) -> tuple[float, dict]:
    head.zero_grad()
    total = 0.0
    for seq, el in pairs:
        seg = Segment(torch.arange(len(el)), torch.ones(len(el), dtype=torch.bool)) if method == "peagle" else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = head(seq, el, seg)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("bf16", [False, True])
def test_stacked_rows_give_the_loss_and_gradients_of_one_row_at_a_time(method, bf16):
    """Rows of different lengths stacked into one forward (each its own document, positions restarting) against
    the same rows one forward each: equal in fp32 up to summation order, within bf16 rounding under autocast."""
    drafter = tiny_drafter(mask_token_id=5 if method == "peagle" else None, frozen_embedding=method == "peagle")
    head = TrainHead(drafter, method, 4, attn_chunk=16)  # small chunks: deeper elements span rows
    pairs = []
    for r, n in enumerate((40, 23, 33)):
        mask = torch.cat([torch.zeros(5, dtype=torch.bool), torch.ones(n - 5, dtype=torch.bool)])
        el = sample_cod(mask, 4, 0.8, 0.2, torch.Generator().manual_seed(r), keep_all=method == "eagle3")
        pairs.append((random_seq(n, drafter, seed=r + 1), el))
    one_loss, one = _grads(head, pairs, method, bf16)
    stacked_loss, stacked = _grads(head, [stack_rows(*map(list, zip(*pairs)))], method, bf16)
    rtol = 2e-2 if bf16 else 1e-5
    assert stacked_loss == pytest.approx(one_loss, rel=rtol)
    assert one.keys() == stacked.keys() and len(one) > 5
    for name in one:
        scale = one[name].abs().max().clamp(min=1e-6)
        assert float((one[name] - stacked[name]).abs().max() / scale) < rtol, name


def _rows(n_rows: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_rows):
        n = int(torch.randint(24, 41, (1,), generator=g))  # uneven lengths: the teacher pads, the head stacks
        out.append({"id": str(i), "input_ids": torch.randint(3, vocab, (n,), generator=g).tolist(),
                    "loss_mask": [0] * 6 + [1] * (n - 6)})
    return out


def _cfg(tmp: Path, target: Path, data: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(tmp / "out"), target=str(target), batch_size=4, num_depths=3, num_layers=1,
                max_seq_len=64, dtype="fp32", progress=False, eval_fraction=0.0, save_every=0, lr=1e-3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_micro_batches_train_like_one_row_per_forward(tmp_path, method):
    """A step of 4 rows as forwards of 3 + 1 rows (the teacher padding them, the head stacking them) trains the
    head as 4 forwards of one row do: the same losses and, after 3 steps, the same weights up to rounding."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_rows(8, 128, seed=2), tmp_path / "data", {})
    runs = {}
    for m in (1, 3):
        tr = Trainer(_cfg(tmp_path / f"m{m}", target, tmp_path / "data", method=method, max_steps=3,
                          micro_batch_size=m))
        steps = [tr.train_step() for _ in range(3)]
        assert [s["forwards"] for s in steps] == [4 if m == 1 else 2] * 3
        runs[m] = ([s["loss"] for s in steps], tr.head.state_dict())
    assert runs[3][0] == pytest.approx(runs[1][0], rel=1e-4)
    for name, value in runs[1][1].items():
        assert torch.allclose(runs[3][1][name], value, rtol=1e-3, atol=1e-5), name


def test_the_teacher_gives_each_padded_row_its_own_outputs(tmp_path):
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_rows(4, 128, seed=3), tmp_path / "data", {})
    tr = Trainer(_cfg(tmp_path, target, tmp_path / "data", max_steps=1))
    rows = [torch.arange(3, 3 + n) for n in (30, 17, 25)]
    for row, batched in zip(rows, tr.teacher.batch(rows)):
        for one, many in zip(tr.teacher(row), batched):
            assert one.shape == many.shape
            assert torch.allclose(one.float(), many.float(), rtol=1e-4, atol=1e-4)


def test_a_model_off_the_cpu_never_builds_the_cpu_kernels(tmp_path, monkeypatch):
    """The drafter's training forward in bf16 on a device that is not the CPU ('meta' stands in for a GPU), the
    teacher's choice of forward and the dtype probe never reach the kernel build (a CUDA run once spent 96 s
    compiling them); on a CPU tensor the same call does reach it."""
    def no_build():
        raise AssertionError("the CPU kernels were built")

    monkeypatch.setattr(kernels, "_build", no_build)
    monkeypatch.setattr(kernels, "_resolved", None)
    monkeypatch.delenv("PEAGLE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    drafter = tiny_drafter(mask_token_id=5).to("meta", torch.bfloat16)
    n = 12
    with torch.no_grad():
        h, _ = forward_rows(drafter, torch.zeros(n, dtype=torch.long, device="meta"),
                            torch.zeros(n, 3 * drafter.config.target_hidden_size, dtype=torch.bfloat16, device="meta"),
                            torch.arange(n, device="meta"))
    assert h.shape == (n, drafter.config.hidden_size) and h.device.type == "meta"
    from peagle.train.teacher import Teacher
    from peagle.train.trainer import fastest_dtype

    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    teacher = Teacher(target, dtype=torch.bfloat16, device="meta")
    assert teacher.target is None and teacher.device.type == "meta"  # transformers' forward, not the engine's
    assert fastest_dtype(torch.device("meta"), 32, 64) == "bf16"
    assert kernels._resolved is None
    with pytest.raises(AssertionError, match="were built"):  # the check itself can fail
        kernels.rms_norm_bf16(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), 1e-6)


def test_the_learning_rate_follows_the_batch_where_asked(tmp_path):
    assert scaled_lr(1e-3, 16, 4, "none") == 1e-3
    assert scaled_lr(1e-3, 16, 4, "sqrt") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 16, 4, "linear") == pytest.approx(4e-3)
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_rows(10, 128, seed=4), tmp_path / "data", {})
    tr = Trainer(_cfg(tmp_path, target, tmp_path / "data", batch_size=8, lr_scaling="sqrt", lr_reference_batch=2,
                      max_steps=1, warmup_ratio=0.0))
    assert tr.peak_lr == pytest.approx(2e-3)
    assert tr.train_step()["lr"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="--lr-scaling"):
        _cfg(tmp_path, target, tmp_path / "data", lr_scaling="cubic")


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_a_time_budget_stops_evaluates_and_saves_in_time(tmp_path, method):
    """A run planned for far more steps than fit ends inside its budget with the schedule run out, a held-out
    evaluation and a loadable head, and its record says how many tokens it trained per second and why it stopped."""
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    save_rows(_rows(24, 128, seed=5), tmp_path / "data", {})
    budget = 3.0
    cfg = _cfg(tmp_path, target, tmp_path / "data", method=method, max_steps=100_000, eval_fraction=0.2,
               micro_batch_size=2, time_budget=budget)
    tr = Trainer(cfg)
    t0 = time.time()
    result = tr.train()
    took = time.time() - t0
    assert took < budget + 2.0  # the final save is the only part the budget does not reckon
    assert 1 <= result["steps"] < 100_000 and tr.total_steps == result["steps"]
    assert result["history"][-1]["lr"] == pytest.approx(1e-3 * cfg.min_lr_ratio, rel=0.2)  # the cosine ran out
    out = Path(cfg.out)
    record = json.loads((out / "training_record.json").read_text())
    assert record["stopped_by"] == "time budget" and record["steps"] == result["steps"]
    assert record["tokens"] > 0 and math.isclose(record["tokens_per_s"], record["tokens"] / record["train_seconds"])
    assert json.loads((out / "eval.json").read_text())["anchors"] > 0
    head = load_head(out, target_embeddings=tr.teacher.input_embeddings().float(), dtype=torch.float32)
    assert head.config.num_layers == 1
    state = torch.load(out / f"checkpoint-{result['steps']}" / "trainer_state.pt", weights_only=False)
    assert state["record"]["tokens"] == record["tokens"]


def test_a_slow_first_step_neither_ends_the_run_nor_spikes_the_learning_rate(monkeypatch):
    """--time-budget fits the run's end only once BUDGET_TIMED_STEPS steps are timed: a first step that warms up
    kernels for 30 s of a 480 s budget (then 1 s a step) leaves about 440 steps, with a warm-up fitted to them once,
    and the end only ever moves earlier."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(time_budget=480.0, batch_size=1, warmup_ratio=0.05)
    tr = SimpleNamespace(cfg=cfg, world=1, rank=0, eval_ids=[], step=0, planned_steps=5000, total_steps=5000,
                         warmup_steps=250, clock={"start": 0.0, "steps": 0, "tokens": 0, "first": None, "eval": 1.0})
    now = [0.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    for seconds in [30.0] + [1.0] * 5:
        now[0] += seconds
        tr.step += 1
        Trainer._fit_budget(tr, {"tokens": 10, "seconds": seconds})
        if tr.step < 3:
            assert tr.total_steps == 5000 and tr.warmup_steps == 250  # not cut on one slow step
    assert 430 <= tr.total_steps <= 450 and tr.warmup_steps == int(0.05 * tr.total_steps)
    ends = [tr.total_steps]
    for seconds in [0.5] * 10:  # faster steps never push the end back out
        now[0] += seconds
        tr.step += 1
        Trainer._fit_budget(tr, {"tokens": 10, "seconds": seconds})
        ends.append(tr.total_steps)
    assert ends == sorted(ends, reverse=True)
