"""Start-up timings remembered across restarts (engine/calibration.py, RememberedTimings): a second engine with the
same shapes, formats, kernels and threads times no forward and plans with the first one's cost models; anything the
timings depend on changing (here the thread count and the head) times them again; a damaged file is measured over;
`peagle serve --recalibrate` forgets them. Outputs never depend on it."""
from __future__ import annotations

import json

import pytest
import torch

from peagle.engine import LLMEngine, SamplingParams, calibration
from peagle.model.checkpoint import random_head
from peagle.model.target import TargetModel
from peagle.config import SpeculativeConfig
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> TargetModel:
    path = make_tiny_model(tmp_path_factory.mktemp("calibration-tiny"), "llama", seed=3)
    return TargetModel.from_pretrained(path, dtype=torch.bfloat16)


@pytest.fixture
def forwards(monkeypatch) -> list:
    """Every start-up timing the engines below take (each call of calibration.timed, or a head's time_draft)."""
    calls = []
    timed = calibration.timed

    def counting(fn, clock, repeats=2):
        calls.append(repeats)
        return timed(fn, clock, repeats)

    monkeypatch.setattr(calibration, "timed", counting)
    return calls


def build(target: TargetModel, folder, head: bool = True) -> LLMEngine:
    if not head:
        return LLMEngine(target, None, max_num_seqs=2, max_model_len=256, calibration_dir=folder)
    drafter = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=1,
                          dtype=target.embed_tokens.weight.dtype)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=3, parallel_drafting=True)
    return LLMEngine(target, None, drafter, spec, max_num_seqs=2, max_model_len=256, calibration_dir=folder)


def plans(engine: LLMEngine) -> tuple:
    """What the cost model holds after calibration."""
    cost = engine.cost
    return list(cost.target), cost.draft, cost.prefill, cost.catch_up


def test_a_restart_takes_the_remembered_timings_and_plans_alike(target, tmp_path, forwards, one_thread):
    first = build(target, tmp_path)
    measured = len(forwards)
    assert measured > 0 and len(list(tmp_path.glob("*.json"))) == 1
    again = build(target, tmp_path)
    assert len(forwards) == measured  # nothing timed the second time
    assert plans(again) == plans(first)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert again.generate([[5, 6, 7, 8]], params)[0].token_ids == first.generate([[5, 6, 7, 8]], params)[0].token_ids


def test_what_the_timings_depend_on_keys_them(target, tmp_path, forwards, one_thread):
    build(target, tmp_path)
    n = len(forwards)
    build(target, tmp_path, head=False)  # no head: other shapes to time
    assert len(forwards) > n and len(list(tmp_path.glob("*.json"))) == 2
    n = len(forwards)
    torch.set_num_threads(2)
    try:
        build(target, tmp_path)
    finally:
        torch.set_num_threads(1)
    assert len(forwards) > n and len(list(tmp_path.glob("*.json"))) == 3


def test_a_damaged_file_is_measured_over(target, tmp_path, forwards, one_thread):
    build(target, tmp_path)
    n = len(forwards)
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    build(target, tmp_path)
    assert len(forwards) == 2 * n
    assert json.loads(path.read_text())["seconds"]


def test_serve_remembers_under_peagle_home_and_recalibrate_forgets(tmp_path, monkeypatch):
    from peagle.serve import cli

    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path))
    parser = __import__("argparse").ArgumentParser()
    cli.add_serve_args(parser)
    args = parser.parse_args(["--recalibrate"])
    folder = cli.engine_options(args)["calibration_dir"]
    assert folder == tmp_path / "calibration"
    assert not parser.parse_args([]).recalibrate
