"""Data parallelism: two-process torchrun (gloo on CPU) trains exactly like one process on the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle.train.data import save_rows
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("method", ["peagle"])
def test_two_process_torchrun_equals_one_process(tmp_path, method):
    target = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=8, vocab_size=128)
    g = torch.Generator().manual_seed(0)
    rows = [{"id": str(i), "input_ids": torch.randint(3, 128, (30 + 5 * i,), generator=g).tolist(),
             "loss_mask": [0] * 5 + [1] * (25 + 5 * i)} for i in range(6)]
    save_rows(rows, tmp_path / "data", {})
    args = ["train", "--target", str(target), "--data", str(tmp_path / "data"), "--method", method,
            "--max-steps", "2", "--batch-size", "3", "--num-depths", "3", "--partitions", "2", "--dtype", "fp32",
            "--save-dtype", "fp32", "--eval-fraction", "0", "--no-progress", "--lr", "1e-2", "--max-seq-len", "64",
            "--save-every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    one = subprocess.run([sys.executable, "-m", "peagle.cli", *args, "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "peagle.cli", *args, "--out", str(tmp_path / "two")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a = torch.load(tmp_path / "one" / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    b = torch.load(tmp_path / "two" / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 2
    # Adam is blind to a uniform gradient scale, so check the scale directly: the loss and the (pre-clipping)
    # gradient norm of every step, both reduced over ranks, equal the one-process values.
    log_a = [json.loads(x) for x in (tmp_path / "one" / "train_log.jsonl").read_text().splitlines()]
    log_b = [json.loads(x) for x in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    for x, y in zip(log_a, log_b, strict=True):
        assert x["tokens"] == y["tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)
        assert x["acc"] == pytest.approx(y["acc"])
    # and the weights after two steps agree to float noise (which Adam amplifies on near-zero gradients: lr is 1e-2)
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, rtol=1e-4, atol=2e-5, msg=k)
