"""Start-up timings on scratch rows, which the engine's cost model (forward_cost.ForwardCost: the speculation
policy's and the step budget's) is calibrated from. Every forward writes cache slots that no request holds
yet: their entries are stale the moment a request takes the slot.

A server remembers them (`RememberedTimings`, under $PEAGLE_HOME/calibration): a forward's cost depends on the
shapes, weight formats, kernels, threads and CPU, never on the weights' values, so a restart with the same key
takes the timings of the last start instead of a few seconds of forwards. The cost model keeps correcting itself
from real steps as before, so timings taken under another load converge the same way fresh ones do."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from peagle.engine.timing import timed
from peagle.model.layers import KV_BLOCK_SIZE, BatchLayout
from peagle.model.target import TargetModel

if TYPE_CHECKING:
    from peagle.engine.proposers.heads import HeadProposer


class RememberedTimings:
    """Timings kept in a JSON file named by everything they depend on (`key`); `get` measures what is missing."""

    def __init__(self, folder: Path, key: dict):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
        self.path = Path(folder) / f"{digest}.json"
        self.key = key
        try:
            self.seconds: dict[str, float] = json.loads(self.path.read_text())["seconds"]
        except (OSError, ValueError, KeyError, TypeError):
            self.seconds = {}
        self.measured = 0

    def get(self, name: str, measure: Callable[[], float]) -> float:
        if name not in self.seconds:
            self.seconds[name] = measure()
            self.measured += 1
        return self.seconds[name]

    def save(self) -> None:
        """Write the file when something was measured (atomically: concurrent starts each write a whole file)."""
        if not self.measured:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"key": self.key, "seconds": self.seconds}, f, indent=1, default=str)
        os.replace(f.name, self.path)


def timings_key(target: TargetModel, head: HeadProposer | None) -> dict:
    """What a start-up timing depends on: the models' shapes and formats, the kernels (their build, paths and
    threads), the CPU and the versions. Not the engine's sizes, windows, policy or budgets: they choose which shapes
    are timed, and each timing's name holds its shape (rows, positions), so engines that differ only there share
    a file."""
    from importlib.metadata import PackageNotFoundError, version

    from peagle.model import kernels

    try:
        peagle_version = version("peagle")
    except PackageNotFoundError:
        peagle_version = None

    def config(c) -> object:
        return asdict(c) if is_dataclass(c) else c

    lib = kernels.library()
    drafter = head.drafter if head is not None else None
    return {"target": config(target.config), "weights": target.weights, "device": str(target.device),
            "drafter": config(drafter.config) if drafter is not None else None,
            "drafter_weights": drafter.weights if drafter is not None else None,
            "parallel_drafting": head.parallel if head is not None else None,
            "draft_tree_beams": head.beams if head is not None else None,  # the dynamic tree's passes cost more
            "kernels": kernels.describe(target.device), "kernel_build": Path(lib._name).name if lib else None,
            "threads": torch.get_num_threads(), "cpu": kernels.cpu_model(), "torch": torch.__version__,
            "peagle": peagle_version}


class ScratchTimings:
    def __init__(self, target: TargetModel, target_cache, head: HeadProposer | None, max_num_seqs: int,
                 max_model_len: int, max_rows: int, clock: Callable[[], float],
                 remembered: RememberedTimings | None = None):
        """`max_rows`: the most rows a decode step verifies (spread over the slots when timed)."""
        self.target, self.target_cache, self.head, self.clock = target, target_cache, head, clock
        self.max_num_seqs, self.device = max_num_seqs, target.device
        # Cached positions a decode row attends to: a typical context, as far as a small pool (--kv-cache-gb) holds
        # it in every slot beside the slot's share of the widest step's rows.
        held = target_cache.num_free_blocks // max_num_seqs * KV_BLOCK_SIZE - -(-max_rows // max_num_seqs) - 1
        self.context = max(1, min(128, max_model_len // 2, held))
        self.remembered = remembered

    def _seconds(self, name: str, measure: Callable[[], float]) -> float:
        """measure(), or the seconds remembered under `name` (measured and kept where none are). Every timing's
        scratch blocks go back after it, so the next one finds the pool as a request would."""
        def measured() -> float:
            try:
                return measure()
            finally:
                for cache in (self.target_cache, self.head.cache if self.head else None):
                    for slot in range(self.max_num_seqs if cache is not None else 0):
                        cache.release(slot)

        return measured() if self.remembered is None else self.remembered.get(name, measured)

    # -- decode steps: the verify forward and the head's drafting ----------------------------------
    def target_rows(self, rows: int) -> float:
        """Seconds of the target's forward over `rows` rows, one per batch entry, spread over the cache slots. The
        spread is left out of the timing's name: each row attends to about `context` keys wherever it lies, and 4 to
        32 rows in 1, 2, 4 or 16 slots timed no further apart than two runs of one cell (up to 20%; the embedded
        model, AVX2, one thread). So engines that differ in max_num_seqs share these cells."""
        dev = self.device
        slot_of_row = torch.arange(rows, device=dev) % self.max_num_seqs
        positions = self.context + torch.arange(rows, device=dev) // self.max_num_seqs
        layout = BatchLayout.build(slot_of_row, positions[:, None])
        tokens = torch.ones(rows, 1, dtype=torch.long, device=dev)

        def forward():
            with torch.inference_mode():
                self.target(tokens, layout, self.target_cache, num_logits=None)

        return self._seconds(f"target_rows {rows} at {self.context}", lambda: timed(forward, self.clock))

    def head_draft(self, batch: int, k: int) -> float:
        """Seconds of the head drafting k tokens for `batch` requests (no head: nothing to time)."""
        if not self.head:
            return 0.0
        return self._seconds(f"head_draft {batch} {k} at {self.context}",
                             lambda: self.head.time_draft(batch, k, self.context, self.clock))

    # -- prompt chunks: the target's forward and the drafter's catch-up, in slot 0 ----------------
    def prefill_chunk(self, rows: int, position: int, every_row_logits: bool) -> float:
        """Seconds of the target's forward over one chunk of `rows` prompt rows from `position` (without logits, as
        a chunk that does not end its prompt; or with every row's log-probabilities, as for prompt_logprobs)."""
        tokens, layout = self._chunk(rows, position)

        def forward():
            with torch.inference_mode():
                if every_row_logits:
                    torch.log_softmax(self.target(tokens, layout, self.target_cache, num_logits=None).logits, -1)
                else:
                    self.target.trunk(tokens, layout, self.target_cache)

        return self._seconds(f"prefill_chunk {rows} {position} {every_row_logits}",
                             lambda: timed(forward, self.clock, repeats=1))

    def drafter_rows(self, rows: int, position: int) -> float:
        """Seconds of the drafter's catch-up pass over `rows` real rows from `position`."""
        tokens, layout = self._chunk(rows, position)
        drafter = self.head.drafter
        w = drafter.fc.weight
        feats = torch.zeros(1, rows, w.shape[1], dtype=w.dtype, device=self.device)

        def forward():
            with torch.inference_mode():
                drafter(tokens, feats, layout, self.head.cache)

        return self._seconds(f"drafter_rows {rows} {position}", lambda: timed(forward, self.clock, repeats=1))

    def _chunk(self, rows: int, position: int) -> tuple[torch.Tensor, BatchLayout]:
        dev = self.device
        positions = position + torch.arange(rows, device=dev)[None, :]
        return (torch.ones(1, rows, dtype=torch.long, device=dev),
                BatchLayout.build(torch.zeros(1, dtype=torch.long, device=dev), positions))
