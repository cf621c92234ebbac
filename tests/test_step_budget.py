"""The step budget in time (peagle/engine/step_budget.py): its cost model and planning, and that chunk sizes and
drafter slices chosen by time change no output: a fake clock whose readings are random makes every step's plan
different, and tokens and log-probabilities still equal one pass's."""
from __future__ import annotations

import math
import random

import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.prefix_cache import BLOCK_SIZE
from peagle.engine.forward_cost import CALIBRATION_ROWS, ChunkCost, ForwardCost
from peagle.engine.step_budget import StepBudget
from peagle.model.checkpoint import random_head
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model, needs_native_kernels


def test_the_cost_model_fits_its_calibration_and_follows_measurements():
    # seconds = 0.01 + n * (0.001 + 1e-6 * (ctx + n / 2)), logits 0.0005 a row
    truth = ChunkCost(0.01, 0.001, 1e-6, 0.0005)
    n = CALIBRATION_ROWS
    fit = ChunkCost.fit(truth.predict([(1, 0)]), truth.predict([(n, 0)]),
                          truth.predict([(n, 1000)]), 1000, truth.predict([(n, 0)], logit_rows=n))
    assert fit.predict([(100, 3000)], 100) == pytest.approx(truth.predict([(100, 3000)], 100), rel=0.02)
    for _ in range(40):  # the machine turns twice as slow
        fit.observe(fit.predict([(64, 0)]), 2 * truth.predict([(64, 0)]))
    assert fit.correction == pytest.approx(2.0, rel=0.05)
    noisy = ChunkCost.fit(1.0, 0.5, 0.4, 100)  # timings out of order never give a negative term
    assert min(noisy.fixed, noisy.per_row, noisy.per_row_ctx) >= 0


def test_plans_fill_the_budget_in_whole_blocks_with_a_floor():
    budget = StepBudget(lambda: 0.0, ForwardCost(1, 0), max_step_time_ms=100)
    budget.decode_part_s = 0.02
    cost = lambda n: 0.001 * n  # noqa: E731
    budget.start_step(decoding=True)
    assert budget.largest(cost, 500, floor=True) == 80  # 0.08 s left: 80 rows, 5 blocks
    assert budget.largest(cost, 50, floor=True) == 50  # a prompt's last chunk, whole when it fits
    assert budget.largest(cost, 90, floor=False) == 80  # ... else whole blocks of it
    budget.spend(0.5)  # over budget: nothing, except the floor
    assert budget.largest(cost, 500, floor=False) == 0
    assert budget.largest(cost, 500, floor=True) == BLOCK_SIZE and budget.largest(cost, 5, floor=True) == 5
    budget.start_step(decoding=False)  # nobody waits: the token bound alone
    assert math.isinf(budget.left) and budget.largest(cost, 500, floor=False) == 500
    with pytest.raises(ValueError, match="max_step_time_ms must be positive"):
        StepBudget(lambda: 0.0, ForwardCost(1, 0), max_step_time_ms=0)


def test_the_default_target_is_a_multiple_of_a_decode_step():
    cost = ForwardCost(2, 0)
    cost.calibrate(lambda rows: 0.01 * rows, lambda requests, k: 0.0, lambda rows, pos, logits: 0.001 * rows, None,
                   256)
    budget = StepBudget(lambda: 0.0, cost)
    assert budget.target_s == pytest.approx(budget.multiple * 0.01)
    for _ in range(100):  # a slower machine: plain steps take twice as long, and the budget grows alike
        cost.observe(1, 0, 0, 0.02)
    assert budget.target_s == pytest.approx(2 * budget.multiple * 0.01, rel=0.05)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> TargetModel:
    path = make_tiny_model(tmp_path_factory.mktemp("budget-tiny"), "llama", seed=7)
    return TargetModel.from_pretrained(path, dtype=torch.bfloat16)


def engine(target: TargetModel, method: str | None, **options) -> LLMEngine:
    if method is None:
        return LLMEngine(target, None, max_num_seqs=4, max_model_len=320, **options)
    head = random_head(target.config, target.embed_tokens.weight, method, mask_token_id=3, seed=1,
                       dtype=target.embed_tokens.weight.dtype)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=3, parallel_drafting=method == "peagle")
    return LLMEngine(target, None, head, spec, max_num_seqs=4, max_model_len=320, speculation_policy="fixed",
                     **options)


class RandomClock:
    """Readings that advance by a random amount: every measured cost is noise, so every plan differs."""

    def __init__(self, seed: int):
        self.rng, self.now = random.Random(seed), 0.0

    def __call__(self) -> float:
        self.now += self.rng.expovariate(1.0) * 0.01
        return self.now


def run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """A short stream first, then the long prompts beside it (admitted while it decodes: the budget in time)."""
    ids = [eng.add_request(prompts[0], params[0])]
    eng.step()
    ids += [eng.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]
    final = {}
    while eng.has_work():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    return [final[i] for i in ids]


def outputs(outs):
    return [(o.token_ids, [(x.token_id, x.logprob) for x in o.logprobs or []],
             [(x.token_id, x.logprob) if x else None for x in o.prompt_logprobs or []]) for o in outs]


@needs_native_kernels  # bit-exact chunking rests on the batch-invariant kernels
@pytest.mark.parametrize("method", [None, "peagle", "eagle3"])
def test_chunks_sized_by_a_random_clock_change_no_output(target, method):
    rng = random.Random(11)
    shared = [rng.randrange(20, 500) for _ in range(60)]
    prompts = [[5, 6, 7]] + [shared + [rng.randrange(20, 500) for _ in range(rng.randrange(90, 200))]
                             for _ in range(3)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1) for _ in prompts]
    params[2] = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    want = outputs(run(engine(target, method, enable_prefix_caching=False, enable_chunked_prefill=False,
                              max_num_batched_tokens=4096), prompts, params))
    eng = engine(target, method, max_step_time_ms=30, max_num_batched_tokens=96)
    eng.step_budget.clock = RandomClock(seed=3)
    chunks, slices = [], []
    prefill, run_backlog = eng.prefill.run_chunks, eng.catch_up.run
    eng.prefill.run_chunks = lambda batch: chunks.append([n for _, n in batch]) or prefill(batch)
    eng.catch_up.run = lambda req, rows: slices.append(rows) or run_backlog(req, rows)
    got = outputs(run(eng, prompts, [SamplingParams(**vars(p)) for p in params]))
    assert got == want
    sizes = {n for batch in chunks for n in batch}
    assert len(sizes) >= 3 and max(sizes) <= 96, chunks  # the plans did vary, within the token bound
    if method is not None:
        assert all(r is None or r <= 96 for r in slices)  # the drafter never ran a prompt in one pass


@needs_native_kernels
def test_a_long_prompt_beside_a_stream_goes_in_oldest_first_and_never_stalls_it(target):
    """A budget no chunk fits: the oldest of two long prompts gets one block a step (its rows wait for the drafter
    until its head drafts), the younger waits its turn, and the stream gets a token every step."""
    rng = random.Random(2)
    longs = [[rng.randrange(20, 500) for _ in range(150)] for _ in range(2)]
    eng = engine(target, "peagle", max_step_time_ms=1e-6)
    sid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    eng.step()
    for p in longs:
        eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # both admitted
    older, younger = eng.running[1:]
    for _ in range(4):
        before = older.num_computed
        outs = {o.request_id: o for o in eng.step()}
        assert outs[sid].delta_token_ids
        assert older.num_computed - before == BLOCK_SIZE and younger.num_computed == 0
        assert len(older.backlog) == older.num_computed  # the drafter runs no row before the head drafts
    assert eng.step_budget.last.prefill_tokens == BLOCK_SIZE and eng.step_budget.last.seconds > 0


def test_serve_passes_the_target_and_metrics_show_the_budget_at_work(target):
    import argparse

    from prometheus_client import generate_latest

    from peagle.serve import cli
    from peagle.serve.metrics import Metrics

    p = argparse.ArgumentParser()
    cli.add_serve_args(p)
    cli.apply_env_defaults(p, {"SM_VLLM_MAX_STEP_TIME_MS": "80"})
    assert cli.engine_options(p.parse_args([]))["max_step_time_ms"] == 80
    assert cli.engine_options(p.parse_args(["--max-step-time-ms", "40"]))["max_step_time_ms"] == 40
    with pytest.raises(SystemExit):
        p.parse_args(["--max-step-time-ms", "0"])
    eng = engine(target, None, max_step_time_ms=80)
    metrics = Metrics("tiny")
    eng.add_request([5, 6, 7, 8] * 10, SamplingParams(max_tokens=2, ignore_eos=True))
    steps = 0
    while eng.has_work():
        eng.step()
        metrics.record_step(eng.step_budget)
        steps += 1
    text = generate_latest(metrics.registry).decode()
    assert 'peagle:prefill_tokens_per_step_sum{model_name="tiny"} 40.0' in text
    assert f'peagle:engine_step_time_seconds_count{{model_name="tiny"}} {steps:.1f}' in text
    assert 'peagle:step_time_target_seconds{model_name="tiny"} 0.08' in text
