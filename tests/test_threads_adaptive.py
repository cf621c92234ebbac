"""The thread count chosen step by step (peagle/engine/thread_count.py): its decisions on synthetic step times (no
clocks here: benchmarks/threads.py measures the real thing), and greedy output unchanged when the count switches."""
from __future__ import annotations

import pytest
import torch

from peagle import threads
from peagle.engine import thread_count
from peagle.engine.thread_count import ThreadCount
from tests.conftest import needs_native_kernels

SHAPE = (1, 0, 0, False)  # a plain decode step of one request


def run(choice: ThreadCount, seconds, steps: int, shape=lambda n: SHAPE) -> list[int]:
    """Feed `steps` decode steps whose wall time is seconds(count) and shape shape(count); the counts they ran on."""
    counts = []
    for _ in range(steps):
        n = choice.next_count()
        counts.append(n)
        choice.observe(shape(n), seconds(n))
    return counts


QUIET = {1: 0.050, 2: 0.028}.get  # two threads 1.8x one
BUSY = {1: 0.030, 2: 0.045}.get  # another process holds one core: two threads wait for the one that shares it


def time_lost(counts: list[int], seconds) -> float:
    """How much longer the steps took than on the best fixed count: 0.01 is 1% slower."""
    return sum(map(seconds, counts)) / (len(counts) * min(seconds(1), seconds(2))) - 1


def test_a_quiet_machine_keeps_every_core_and_probes_rarely():
    choice = ThreadCount(2)
    counts = run(choice, QUIET, 20000)  # 9 minutes of decoding
    assert choice.current == 2 and choice.moves == 0
    assert time_lost(counts, QUIET) < 0.006
    assert time_lost(counts[-4000:], QUIET) < 0.004  # settled: 4 steps on one thread per 32 s of decoding


def test_a_busy_machine_moves_to_one_thread_soon_and_stays():
    choice = ThreadCount(2)
    counts = run(choice, BUSY, 5000)
    assert choice.current == 1 and choice.moves == 1
    assert counts.index(1) < 0.5 / BUSY(2) + 1  # the first probe, after half a second of decoding
    assert time_lost(counts, BUSY) < 0.01 and time_lost(counts[-2000:], BUSY) < 0.005


def test_the_count_follows_the_load_both_ways():
    choice = ThreadCount(2)
    run(choice, QUIET, 2000)
    counts = run(choice, BUSY, 400)  # other work starts: the steps get DRIFT slower, a probe soon
    assert choice.current == 1 and counts.index(1) <= thread_count.DRIFT_AFTER_S / BUSY(2) + thread_count.DRIFT_STEPS
    counts = run(choice, QUIET, 2000)  # it ends: a later probe finds two threads faster again
    assert choice.current == 2 and counts.count(1) < 16 / QUIET(1) / 2


def test_a_small_gain_does_not_move_the_count():
    choice = ThreadCount(2)
    run(choice, {1: 0.0291, 2: 0.030}.get, 5000)  # 3% faster on one thread: inside the margin
    assert choice.current == 2 and choice.moves == 0 and choice.probes > 3


def test_load_that_comes_and_goes_costs_little():
    burst = [1.6 if i % 8 < 3 else 1.0 for i in range(20000)]  # other work slows 3 steps in 8
    slowed = iter(burst)
    choice = ThreadCount(2)
    counts = run(choice, lambda n: QUIET(n) * next(slowed), len(burst))
    took = sum(QUIET(n) * b for n, b in zip(counts, burst))
    assert choice.current == 2 and took / sum(QUIET(2) * b for b in burst) < 1.03  # against two threads throughout


def test_noise_does_not_flap_the_count():
    import random

    rng = random.Random(0)
    choice = ThreadCount(2)
    run(choice, lambda n: BUSY(n) * rng.uniform(0.8, 1.25), 5000)
    assert choice.current == 1 and choice.moves <= 3


def test_only_steps_of_the_same_shape_are_compared():
    choice = ThreadCount(2)
    # every step on one thread verifies 4 rows, every step on two 1: never a pair to compare, so nothing moves
    run(choice, {1: 0.001, 2: 0.028}.get, 2000, shape=lambda n: (4 if n == 1 else 1, 0, 0, False))
    assert choice.current == 2 and choice.moves == 0 and choice.probes > 3


def test_more_cores_climb_one_count_at_a_time():
    choice = ThreadCount(4)
    run(choice, {1: 0.10, 2: 0.06, 3: 0.04, 4: 0.09}.get, 3000)  # one core taken: three threads are best
    assert choice.current == 3


def test_one_core_never_probes():
    choice = ThreadCount(1)
    assert set(run(choice, QUIET, 1000)) == {1} and choice.probes == 0


def test_a_count_set_by_anyone_else_stays():
    before = torch.get_num_threads()
    try:
        threads.set_threads(2, "default")
        assert threads.adaptive()
        threads.set_adaptive_count(1)
        assert threads.adaptive() and torch.get_num_threads() == 1
        torch.set_num_threads(2)  # not peagle's doing: the count is now the caller's
        assert not threads.adaptive()
        threads.set_threads(2)  # --threads
        assert not threads.adaptive()
    finally:
        threads.set_threads(before, "default")


def test_a_new_engine_starts_on_the_default_count():
    from peagle.engine.thread_count import StepThreads

    before = torch.get_num_threads()
    try:
        threads.set_threads(threads.default_threads(), "default")
        threads.set_adaptive_count(1)  # where another engine in the process moved it
        StepThreads(switchable=True)
        assert torch.get_num_threads() == threads.default_threads() and threads.adaptive()
        threads.set_adaptive_count(1)
        StepThreads(switchable=False)  # PyTorch's kernels: nothing is chosen, nothing changes
        assert torch.get_num_threads() == 1
    finally:
        threads.set_threads(before, "default")


class EveryStep(ThreadCount):
    """Switches the count at every decode step: 1, 2, 1, 2, ..."""

    def __init__(self):
        super().__init__(2)
        self.ran = []

    def next_count(self) -> int:
        self.current = 3 - self.current
        self.ran.append(self.current)
        return self.current


@needs_native_kernels
@pytest.mark.parametrize("quantization", [None, "q4_0"])
def test_greedy_output_is_the_same_when_the_count_switches_every_step(smollm2_dir, quantization):
    from peagle.config import SpeculativeConfig
    from peagle.engine import LLMEngine, SamplingParams
    from peagle.model.checkpoint import random_head
    from peagle.model.target import TargetModel

    target = TargetModel.from_pretrained(smollm2_dir, quantization=quantization)
    head = random_head(target.config, target.input_embeddings(), "peagle", mask_token_id=3, seed=0)
    prompts = [list(range(100, 120)), list(range(300, 307))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        outputs = {}
        for name in ("1 thread", "switching"):
            threads.set_threads(2, "default") if name == "switching" else threads.set_threads(1)
            spec = SpeculativeConfig(model="random", num_speculative_tokens=3, parallel_drafting=True)
            for drafter in (None, head):
                engine = LLMEngine(target, None, drafter, spec if drafter else None, max_num_seqs=2,
                                   max_model_len=256)
                if name == "switching":
                    engine.step_threads.choice = EveryStep()
                outputs[name, drafter is None] = [o.token_ids for o in engine.generate(prompts, params)]
                if name == "switching":  # every decode step ran on the count it was given
                    assert set(engine.step_threads.choice.ran) == {1, 2} and threads.adaptive()
        assert outputs["1 thread", True] == outputs["switching", True]
        assert outputs["1 thread", False] == outputs["switching", False] == outputs["1 thread", True]
    finally:
        threads.set_threads(before, "default")
