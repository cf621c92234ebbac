"""Teacher outputs kept on disk, so that every epoch after the first skips the target's forward pass.

The target is frozen, so a training row's features, draft-vocab labels and argmax never change: the first time a
row is seen they are computed and written to DIR/<key>/<row>.safetensors (tmp file + rename, so two trainers may
share a cache); later epochs, resumed runs and other heads trained on the same data read them back, bit for bit.
The folder's key hashes what the outputs depend on besides the tokens (target folder, dtype, feature layers, draft
vocab), and each file keeps its row's token ids, which must match: a cache is never read for the wrong run. A row
costs (3H + Vd) x 2 bytes per token in bf16: about 20 KB per token for SmolLM2 at Vd 8192, so a pass over millions
of tokens would fill tens of GB. Two heads trained on the same data in one pass can therefore *share* a cache:
whichever run reaches a row first computes and writes it, the other reads and deletes it, so every row's forward
runs once and the cache holds only the rows between the two runs.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch


class TeacherCache:
    def __init__(self, root: str | Path, teacher, shared: bool = False):
        self.teacher = teacher
        self.shared = shared
        key = {"target": str(Path(teacher.model_dir).resolve()), "dtype": str(teacher.dtype),
               "feature_layer_ids": list(teacher.feature_layer_ids),
               "draft_vocab": hashlib.sha256(teacher.used.cpu().numpy().tobytes()).hexdigest()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "key.json").write_text(json.dumps(key, indent=1) + "\n")
        self.hits = self.misses = 0

    def __call__(self, input_ids: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file, save_file

        path = self.dir / f"{row}.safetensors"
        try:
            t = load_file(path)
        except FileNotFoundError:  # not computed yet, or (shared) just read by the other run
            t = None
        if t is not None and t["input_ids"].shape == input_ids.shape and torch.equal(t["input_ids"], input_ids.cpu()):
            self.hits += 1
            if self.shared:  # the second reader: nobody needs the row again
                path.unlink(missing_ok=True)
            return t["features"], t["labels"], t["argmax"]
        self.misses += 1
        features, labels, argmax = self.teacher(input_ids)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"input_ids": input_ids.cpu().contiguous(), "features": features.cpu().contiguous(),
                   "labels": labels.cpu().contiguous(), "argmax": argmax.cpu().contiguous()}, tmp)
        os.replace(tmp, path)
        return features, labels, argmax
