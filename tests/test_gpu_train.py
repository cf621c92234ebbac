"""scripts/gpu_train.sh and peagle.train.transfer: a GPU run's inputs packed as checked parts, the whole run
rehearsed on this CPU, and its heads back as safetensors shards that load as the heads saved."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle.model.checkpoint import load_head
from peagle.train.transfer import PART_BYTES, join_head, pack, shard_head

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_train.sh"


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_the_dry_run_trains_both_heads_in_time_and_its_shards_load_back_equal(tmp_path):
    out = tmp_path / "out"
    # 8 s of training, and slack for a loaded 2-core CI (the run takes about 30 s here)
    env = _env(GPU_TRAIN_KEEP_WORK="1", DRY_DEADLINE_S="90", DRY_RESERVE_S="82")
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((out / "gpu_train.json").read_text())
    assert record["total_s"] < record["deadline_s"]
    assert set(record["seconds"]) == {"pack", "verify_and_join", "install", "target", "train", "shard"}
    for method in ("peagle", "eagle3"):
        shards = sorted((out / method).glob("model-*-of-*.safetensors"))
        assert shards and all(s.stat().st_size <= PART_BYTES for s in shards)
        assert json.loads((out / method / "eval.json").read_text())["anchors"] > 0
        trained = json.loads((out / method / "training_record.json").read_text())
        assert trained["stopped_by"] == "time budget" and trained["tokens_per_s"] > 0
        assert "tokens/s" in (out / f"{method}.log").read_text()
        saved = tmp_path / "out" / ".dry" / "work" / "train" / method
        want = load_file(str(saved / "model.safetensors"))
        got = _tensors(out / method)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # a P-EAGLE head carries its embeddings: the shards load as a head equal to the saved one
    a, b = load_head(out / "peagle", dtype=torch.float32), load_head(saved.parent / "peagle", dtype=torch.float32)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    # several shards, and joined back into one file
    small = shard_head(saved.parent / "peagle", tmp_path / "small", max_bytes=96 * 1024)
    assert len(small) > 1 and all(s.stat().st_size <= 96 * 1024 for s in small)
    joined = join_head(tmp_path / "small", tmp_path / "joined")
    assert [p.name for p in joined.glob("*.safetensors")] == ["model.safetensors"]
    again = load_file(str(joined / "model.safetensors"))
    full = load_file(str(saved.parent / "peagle" / "model.safetensors"))
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)
    assert (joined / "config.json").read_text() == (saved.parent / "peagle" / "config.json").read_text()


def test_parts_and_trips_are_checked_before_anything_runs(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(5000))
    small = tmp_path / "recipe.args"
    small.write_text("--max-steps 1\n")
    manifest = pack(tmp_path / "in", [big, small], part_bytes=1024, trip_bytes=3000)
    assert [len(f["parts"]) for f in manifest["files"]] == [5, 1]
    assert len(manifest["trips"]) == 2 and all(t["bytes"] <= 3000 + 4096 for t in manifest["trips"])
    part = next((tmp_path / "in" / "trip-2").glob("big.bin.part-*"))
    part.write_bytes(b"x" + part.read_bytes()[1:])
    run = subprocess.run(["bash", str(SCRIPT), "--inputs", str(tmp_path / "in"), "--out", str(tmp_path / "o")],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 3 and "a part is damaged" in run.stderr
    import shutil

    shutil.rmtree(tmp_path / "in" / "trip-2")  # a trip that was never carried
    run = subprocess.run(["bash", str(SCRIPT), "--inputs", str(tmp_path / "in"), "--out", str(tmp_path / "o")],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "did not arrive" in run.stderr


def test_a_pack_replaces_only_an_earlier_pack(tmp_path):
    f = tmp_path / "recipe.args"
    f.write_text("--max-steps 1\n")
    mine = tmp_path / "runs"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds no earlier pack"):
        pack(mine, [f])
    assert (mine / "notes.txt").read_text() == "keep me"
    pack(tmp_path / "in", [f])
    pack(tmp_path / "in", [f])  # an earlier pack is replaced
    assert (tmp_path / "in" / "sizes.json").exists()


def test_a_tensor_larger_than_a_shard_is_named(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "h").mkdir()
    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor w"):
        shard_head(tmp_path / "h", tmp_path / "o", max_bytes=8192)
