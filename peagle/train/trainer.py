"""The training loop: online distillation from a frozen target into a P-EAGLE or EAGLE-3 head (docs/design.md,
"Training objective").

One optimizer step covers `batch_size` sequences (global, across ranks). Each rank takes every world-th sequence of
the step, samples its COD elements (seeded by (seed, epoch, sample index), so the sample gets the same elements
whichever rank holds it, and a resumed run the same ones as an uninterrupted run), runs the target once per
sequence, and runs one forward/backward per unit of work (a COD segment, or a whole TTT unroll). Losses are summed
and divided by the step's global count of supervised elements, so the update is the same for any number of ranks
and partitions. Under torchrun the head is wrapped in DistributedDataParallel (gloo on CPU, NCCL on GPU); only the
last backward of a rank's step all-reduces.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from peagle.config import SpeculativeConfig
from peagle.model.checkpoint import save_head
from peagle.model.loading import EMBEDDED_HUB_ID, torch_dtype
from peagle.train.cod import Elements, Segment, eval_elements, partition, sample_cod
from peagle.train.head import build_head
from peagle.train.objective import TeacherSeq, TrainHead, cod_hidden, export_drafter, stack_rows, ttt_forward
from peagle.train.teacher import Teacher
from peagle.train.train_config import TrainConfig
from peagle.train.vocab import used_ids

BUDGET_TIMED_STEPS = 3  # --time-budget fits the run's end once this many steps are timed (or time runs out)


def scaled_lr(lr: float, batch: int, reference: int, rule: str) -> float:
    """The peak learning rate for `batch` rows per step under `rule` (train_config.LR_SCALING), --lr being right at `reference`."""
    ratio = batch / reference
    return lr * {"none": 1.0, "sqrt": math.sqrt(ratio), "linear": ratio}[rule]


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % (2 ** 62)


def limit_heap_fragmentation(threshold: int = 1 << 17) -> None:
    """Serve every allocation above `threshold` bytes with its own mmap (glibc on Linux).

    glibc raises its mmap threshold each time a large block is freed; tensors of a few MB then come from the heap and
    their pages are rarely returned, so the resident set creeps up segment after segment of a partitioned step
    (measured on an 8K-token step in 4 partitions: 4.4 GiB peak without this, 2.8 GiB with it). A fixed threshold keeps
    the resident set near what is live. It costs speed, though: every large temporary is then a fresh mapping whose
    pages the kernel faults in and zeroes (a 4-sequence SmolLM2 step ran 1.65x slower with it, docs/training.md),
    so the trainer sets it only for partitioned (long-sequence) runs, where memory is what binds. The
    `MALLOC_MMAP_THRESHOLD_` environment variable, when set, wins."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, int(threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc (musl, ...): its allocator has no such knob
        pass


def make_optimizer(drafter: torch.nn.Module, cfg: TrainConfig, lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW over every trainable tensor; or, with `muon`, torch.optim.Muon over the decoder layers' and fc's
    matrices (scaled to AdamW's update size, so one --lr serves both) and AdamW over the rest (embeddings, LM head,
    norms, mask_hidden), as Muon's authors use it."""
    lr = cfg.lr if lr is None else lr
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    adamw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    hidden = [p for n, p in named if p.ndim == 2 and (n.startswith(("midlayer.", "layers.")) or n == "fc.weight")]
    ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in ids]
    return _MuonWithAdamW(torch.optim.Muon(hidden, lr=lr, weight_decay=cfg.weight_decay,
                                           adjust_lr_fn="match_rms_adamw"),
                          torch.optim.AdamW(rest, **adamw))


class _MuonWithAdamW(torch.optim.Optimizer):
    """Two optimizers stepped as one, so the scheduler, clipping and checkpoints see a single optimizer."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.parts = (muon, adamw)
        self.defaults = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @property
    def param_groups(self) -> list[dict]:  # live: load_state_dict replaces the parts' group dicts
        return self.parts[0].param_groups + self.parts[1].param_groups

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    @property
    def state(self):
        return {**self.parts[0].state, **self.parts[1].state}

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for part, sd in zip(self.parts, state_dict["parts"], strict=True):
            part.load_state_dict(sd)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def fastest_dtype(device: torch.device, hidden: int, intermediate: int) -> str:
    """bf16 on GPUs; on a CPU whichever of bf16 and fp32 multiplies the head's matrix shapes faster here.

    Whether bf16 pays on a CPU depends on its matrix unit: AMX tiles exist for bf16 products, while on an Intel Xeon
    with AVX-512 BF16 but no AMX PyTorch's fp32 products run 1.6x faster than its bf16 ones
    (benchmarks/micro.py matmul). A 0.1 s probe decides instead of a table of CPUs."""
    if device.type != "cpu":
        return "bf16"
    x, w = torch.randn(512, hidden), torch.randn(intermediate, hidden)
    pairs = {"fp32": (x, w), "bf16": (x.bfloat16(), w.bfloat16())}
    best = dict.fromkeys(pairs, float("inf"))
    # CPU time, the best of rounds taken in turn: on a busy machine wall time would time the other jobs too
    for _ in range(6):
        for name, (a, b) in pairs.items():
            t0 = time.process_time()
            a @ b.t()
            best[name] = min(best[name], time.process_time() - t0)
    return min(best, key=best.get)


def heldout_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(held-out, training) row indices, each sorted, of n rows: a seeded `fraction` held out (at least one row,
    and never all of them) when no --eval-data is given."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 17)).tolist()
    n_eval = min(n - 1, max(1, round(fraction * n))) if fraction > 0 and n >= 2 else 0
    return sorted(perm[:n_eval]), sorted(perm[n_eval:])


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        if cfg.partitions > 1:
            limit_heap_fragmentation()
        self._setup_distributed()
        torch.manual_seed(cfg.seed)
        from peagle.model.loading import resolve_model

        self.target_dir = resolve_model(cfg.target)
        self.tokenizer = self._load_tokenizer()
        self.teacher = Teacher(self.target_dir, dtype=torch_dtype(cfg.target_dtype), device=self.device,
                               device_map=cfg.target_device_map)
        self._load_data()
        self._build_head()
        self.teacher_cache = None
        if cfg.teacher_cache:
            from peagle.train.teacher_cache import TeacherCache

            self.teacher_cache = TeacherCache(cfg.teacher_cache, self.teacher, shared=cfg.share_teacher_cache)
        # --teacher-ahead: one worker thread runs the target for the next step's rows while this step trains the head
        # (the native kernels and PyTorch's ops release the GIL), so on a CPU the two halves of a step overlap on two
        # cores. Futures are keyed by row; a row not computed ahead is computed in place, as without the flag.
        self._ahead: dict[int, Future] = {}
        self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="teacher") if cfg.teacher_ahead else None
        self.teacher_ahead_hits = 0
        self._build_optimizer()
        self.step = 0
        self.history: list[dict] = []
        if cfg.resume:
            self._resume(cfg.resume)

    # -- setup ---------------------------------------------------------------------------------------------------
    def _setup_distributed(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        want = self.cfg.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda":
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device(want)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.main = self.rank == 0

    def log(self, msg: str):
        if self.main:
            print(f"peagle train: {msg}", file=sys.stderr, flush=True)

    def _load_tokenizer(self):
        try:
            from peagle.model.loading import load_tokenizer

            return load_tokenizer(self.target_dir)
        except Exception:  # noqa: BLE001 - a target without a tokenizer trains from prepared token ids
            return None

    def _load_data(self):
        from peagle.train.data import load_training_rows

        cfg = self.cfg
        rows = load_training_rows(cfg.data, self.tokenizer, cfg.max_seq_len, cfg.limit)
        N = len(rows)
        if cfg.eval_data:
            self.eval_rows = load_training_rows(cfg.eval_data, self.tokenizer, cfg.max_seq_len)
            self.eval_ids = list(range(len(self.eval_rows)))
            self.train_rows, self.train_ids = rows, list(range(N))
        else:
            self.eval_rows = self.train_rows = rows
            self.eval_ids, self.train_ids = heldout_split(N, cfg.eval_fraction, cfg.seed)
        self.eval_ids = self.eval_ids[:cfg.eval_samples]
        if not self.train_ids:
            raise ValueError(f"{cfg.data}: no training rows")
        self.log(f"{len(self.train_ids)} training and {len(self.eval_ids)} evaluation sequences from {cfg.data}")

    def _row(self, rows, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = rows[i]
        T = self.cfg.max_seq_len
        ids = torch.as_tensor(r["input_ids"][:T], dtype=torch.long)
        mask = torch.as_tensor(r["loss_mask"][:T], dtype=torch.bool)
        return ids, mask

    def _build_head(self):
        cfg = self.cfg
        rows = (self._row(self.train_rows, i) for i in self.train_ids)
        self.drafter = build_head(cfg, self.teacher, self.tokenizer, rows, self.log).to(self.device)
        self.head = TrainHead(self.drafter, cfg.method, cfg.num_depths, loss=cfg.loss, ttt_decay=cfg.ttt_decay,
                              loss_chunk=cfg.loss_chunk, attn_chunk=cfg.attn_chunk, lk_eta=cfg.lk_eta)
        self.model = self.head
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.head, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                             broadcast_buffers=False)
        dc = self.drafter.config
        self.compute_dtype = self._resolve_compute_dtype()
        ntrain = sum(p.numel() for p in self.head.parameters() if p.requires_grad)
        self.log(f"{cfg.method} head: {dc.num_layers} layer(s), hidden {dc.hidden_size}, draft vocab "
                 f"{dc.draft_vocab_size}{'' if dc.mask_token_id is None else f', mask token {dc.mask_token_id}'}, "
                 f"{ntrain / 1e6:.1f}M trainable parameters, {self.compute_dtype} compute"
                 f"{' (the faster here)' if cfg.dtype == 'auto' else ''}; target {self.target_dir} "
                 f"({self.teacher.hf_config.model_type}, feature layers {list(self.teacher.feature_layer_ids)})")

    def _resolve_compute_dtype(self) -> str:
        """--dtype, with auto decided by rank 0's probe for every rank (a sum over ranks of rank 0's vote)."""
        if self.cfg.dtype != "auto":
            return self.cfg.dtype
        dc = self.drafter.config
        vote = float(self.main and fastest_dtype(self.device, dc.hidden_size, dc.intermediate_size) == "bf16")
        return "bf16" if self._all_reduce(torch.tensor([vote])).item() > 0 else "fp32"

    def _build_optimizer(self):
        cfg = self.cfg
        self.peak_lr = scaled_lr(cfg.lr, cfg.batch_size, cfg.lr_reference_batch, cfg.lr_scaling)
        if self.peak_lr != cfg.lr:
            self.log(f"peak learning rate {self.peak_lr:.3g}: --lr {cfg.lr:g} at batch {cfg.lr_reference_batch}, "
                     f"scaled ({cfg.lr_scaling}) to batch {cfg.batch_size}")
        self.optimizer = make_optimizer(self.drafter, cfg, self.peak_lr)
        self.steps_per_epoch = math.ceil(len(self.train_ids) / cfg.batch_size)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.planned_steps = self.total_steps  # --time-budget may end the run (and its schedule) sooner
        self.warmup_steps = int(cfg.warmup_ratio * self.total_steps)  # --time-budget may shorten it, once

        def schedule(step: int) -> float:  # reads total_steps at every step: --time-budget moves the end
            warmup = self.warmup_steps
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = (step - warmup) / max(1, self.total_steps - warmup)
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        if not self.main:
            return None
        out = Path(self.cfg.out)
        ck = out / f"checkpoint-{self.step}"
        ck.mkdir(parents=True, exist_ok=True)
        torch.save({"step": self.step, "model": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "config": asdict(self.cfg),
                    "rng": torch.get_rng_state(), "history": self.history, "record": self.training_record()},
                   ck / "trainer_state.pt.tmp")
        os.replace(ck / "trainer_state.pt.tmp", ck / "trainer_state.pt")
        self.save_head(ck / "head")
        cks = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in cks[:-self.cfg.save_total_limit] if self.cfg.save_total_limit > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return ck

    def save_head(self, out: Path) -> Path:
        return save_head(export_drafter(self.drafter), out, layout=self.cfg.layout,
                         verifier=str(self.cfg.target or EMBEDDED_HUB_ID),
                         dtype=torch_dtype(self.cfg.save_dtype))

    def _resume(self, where: str):
        out = Path(self.cfg.out)
        if where == "latest":
            cks = sorted(out.glob("checkpoint-*/trainer_state.pt"), key=lambda p: int(p.parent.name.split("-")[1]))
            if not cks:
                self.log(f"no checkpoint in {out} to resume from; starting fresh")
                return
            path = cks[-1]
        else:
            path = Path(where)
            path = path / "trainer_state.pt" if path.is_dir() else path
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.head.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.history = state.get("history", [])
        self.teacher.used = used_ids(self.drafter.d2t.cpu())
        self.log(f"resumed from {path.parent} at step {self.step}")

    # -- one step ------------------------------------------------------------------------------------------------
    def _elements(self, mask: torch.Tensor, epoch: int, index: int) -> Elements:
        cfg = self.cfg
        g = torch.Generator().manual_seed(_sample_seed(cfg.seed, epoch, index))
        return sample_cod(mask, cfg.num_depths, cfg.cod_ratio, cfg.cod_min_ratio, g,
                          keep_all=cfg.method == "eagle3")

    def _count(self, el: Elements) -> int:
        if self.cfg.method == "peagle":
            return el.num_supervised
        return int(el.supervised[el.depth == 0].sum())  # TTT: every step is divided by the step-0 count

    def _teacher_seq(self, ids: torch.Tensor, row: int | None = None) -> TeacherSeq:
        """The target's outputs for a sequence; training rows (`row` given) go through the cache when there is one."""
        return self._teacher_seqs([ids], [row])[0]

    def _teacher_seqs(self, rows: list[torch.Tensor], indices: list[int | None]) -> list[TeacherSeq]:
        """`_teacher_seq` of several rows: through the cache row by row, or else in one forward of the target."""
        if self.teacher_cache is not None and all(i is not None for i in indices):
            outs = [self.teacher_cache(ids, i) for ids, i in zip(rows, indices)]
        else:
            outs = self.teacher.batch(rows)
        d = self.device
        return [TeacherSeq(ids.to(d), f.to(d), lab.to(d), am.to(d)) for ids, (f, lab, am) in zip(rows, outs)]

    def _noisy(self, seq: TeacherSeq, epoch: int, index: int) -> TeacherSeq:
        """`seq` with --feature-noise on its features: uniform, +-s x the RMS of each feature layer's slice of the
        row (scale-free across targets and layers), seeded per (epoch, sample) so a resumed run sees the same noise.
        Serving feeds the drafter features of its own drafts' context, not the training data's: noise teaches it
        to tolerate the difference (EAGLE adds uniform noise to its features for the same reason)."""
        s = self.cfg.feature_noise
        if not s:
            return seq
        n, width = seq.features.shape
        layers = len(self.teacher.feature_layer_ids) if width % len(self.teacher.feature_layer_ids) == 0 else 1
        f = seq.features.float().view(n, layers, width // layers)
        rms = f.pow(2).mean(-1, keepdim=True).sqrt()
        g = torch.Generator().manual_seed(_sample_seed(self.cfg.seed + 1, epoch, index))
        u = torch.rand(f.shape, generator=g).to(f.device).mul_(2).sub_(1)
        noisy = (f + u * (s * rms)).view(n, width).to(seq.features.dtype)
        return TeacherSeq(seq.input_ids, noisy, seq.labels, seq.argmax)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.compute_dtype == "bf16")

    def batch_indices(self, step: int) -> tuple[int, list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)
        perm = torch.randperm(len(self.train_ids), generator=gen)
        bs = self.cfg.batch_size
        return epoch, [self.train_ids[i] for i in perm[k * bs:(k + 1) * bs].tolist()]

    def _plan(self, epoch: int, indices: list[int]) -> tuple[list[tuple], int, int]:
        """This rank's rows of a step as (ids, elements, segments, index), with their supervised count and tokens."""
        cfg = self.cfg
        work, count, tokens = [], 0, 0
        for index in indices:
            ids, mask = self._row(self.train_rows, index)
            el = self._elements(mask, epoch, index)
            segs = partition(el, ids.numel(), cfg.partitions) if cfg.method == "peagle" else (
                [None] if el.num_supervised else [])
            count += self._count(el)
            tokens += ids.numel()
            work.append((ids, el, segs, index))
        return work, count, tokens

    def micro_batches(self, work: list[tuple]) -> list[list[tuple]]:
        """The step's forwards: its units of work (a row's COD segment, or a row's TTT unroll) as (row, segment),
        --micro-batch-size of them per forward; one empty forward when this rank has nothing to supervise."""
        units = [(w, seg) for w in work for seg in w[2]]
        m = self.cfg.micro_batch_size
        return [units[i:i + m] for i in range(0, len(units), m)] or [[]]

    def _forward(self, units: list[tuple], epoch: int, tally: dict):
        """Loss and stats of one forward over `units` (stack_rows puts several rows side by side)."""
        if not units:  # nothing to do on this rank: still join the gradient all-reduce
            with self._autocast():
                return self.model()
        seqs = self._unit_teacher(units, epoch, tally)
        if len(units) == 1:
            seq, el, seg = seqs[0], units[0][0][1], units[0][1]
        else:
            seq, el = stack_rows(seqs, [w[1] for w, _ in units])
            seg = Segment(torch.arange(len(el)), torch.ones(len(el), dtype=torch.bool)) \
                if self.cfg.method == "peagle" else None
        with self._autocast():
            return self.model(seq, el, seg)

    def _unit_teacher(self, units: list[tuple], epoch: int, tally: dict) -> list[TeacherSeq]:
        """The target's outputs for the rows of `units`: from the --teacher-ahead worker where it computed them, the
        rest in one forward; kept for the next forward when that is the same row's next segment (--partitions)."""
        key = tuple(w[3] for w, _ in units)
        if tally.get("key") == key:
            return tally["seqs"]
        tally["seqs"] = None  # the previous row's outputs go before this row's are made
        t1, c1 = time.time(), time.process_time()
        got, cpu = {}, 0.0
        for index in key:
            ahead = self._ahead.pop(index, None)
            if ahead is not None:
                got[index], c = ahead.result()
                cpu += c
                self.teacher_ahead_hits += 1
        todo = [w for w, _ in units if w[3] not in got]
        c2 = time.process_time()
        got.update(zip([w[3] for w in todo], self._teacher_seqs([w[0] for w in todo], [w[3] for w in todo])))
        seqs = [self._noisy(got[index], epoch, index) for index in key]
        tally["teacher_s"] += time.time() - t1  # with --teacher-ahead: the wait for the worker thread
        tally["teacher_cpu_s"] += cpu + (time.process_time() - c2 if todo else 0.0)
        tally["key"], tally["seqs"] = key, seqs
        return seqs

    def train_step(self) -> dict:
        cfg = self.cfg
        t0 = time.time()
        self.model.train()
        epoch, batch = self.batch_indices(self.step)
        work, count, tokens = self._plan(epoch, batch[self.rank::self.world])
        self._compute_ahead([index for _, _, segs, index in work if segs])
        if self.step + 1 < self.total_steps:
            self._compute_ahead(self.batch_indices(self.step + 1)[1][self.rank::self.world])
        totals = self._all_reduce(torch.tensor([count, tokens], dtype=torch.float64))
        global_count = float(totals[0])
        scale = self.world / max(global_count, 1.0)  # DDP averages gradients over ranks
        forwards = self.micro_batches(work)
        D = cfg.num_depths
        loss_sum, correct, total = 0.0, torch.zeros(D, dtype=torch.long), torch.zeros(D, dtype=torch.long)
        # teacher wall and CPU seconds: on a shared machine only the CPU figure compares runs
        tally = {"teacher_s": 0.0, "teacher_cpu_s": 0.0}
        for f, units in enumerate(forwards):
            last = f == len(forwards) - 1  # only the last backward of a rank's step all-reduces
            with self.model.no_sync() if (self.world > 1 and not last) else contextlib.nullcontext():
                loss, stats = self._forward(units, epoch, tally)
                (loss * scale).backward()
            loss_sum += float(stats.loss_sum)
            correct += stats.correct
            total += stats.total
        tally.pop("seqs", None)
        for _, _, _, index in work:  # a row with nothing to supervise was queued for this step but not used
            self._ahead.pop(index, None)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.max_grad_norm) \
            if cfg.max_grad_norm > 0 else torch.tensor(0.0)
        lr = self.scheduler.get_last_lr()[0]  # this step's; the scheduler then moves on to the next
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        red = self._all_reduce(torch.cat([torch.tensor([loss_sum], dtype=torch.float64), correct.double(),
                                          total.double()]))
        dt = time.time() - t0
        return {"step": self.step, "loss": float(red[0]) / max(global_count, 1.0),
                "acc": (red[1:1 + D] / red[1 + D:].clamp(min=1)).tolist(), "lr": lr, "grad_norm": float(grad_norm),
                "tokens": int(totals[1]), "seconds": dt, "teacher_seconds": tally["teacher_s"],
                "teacher_cpu_seconds": tally["teacher_cpu_s"], "units": max(1, sum(map(len, forwards))),
                "forwards": len(forwards), "tokens_per_s": float(totals[1]) / dt,
                "peak_mem_gib": peak_memory_gib(self.device)}

    def _compute_ahead(self, indices: list[int]) -> None:
        """With --teacher-ahead, queue the target's forward for these training rows on the worker thread."""
        if self._ahead_pool is None:
            return
        for index in indices:
            if index not in self._ahead:
                self._ahead[index] = self._ahead_pool.submit(self._teacher_in_worker, index)

    def _teacher_in_worker(self, index: int) -> tuple[TeacherSeq, float]:
        """A training row's target outputs and the CPU seconds of the thread that computed them."""
        c = time.thread_time()
        seq = self._teacher_seq(self._row(self.train_rows, index)[0], index)
        return seq, time.thread_time() - c

    # -- evaluation ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-position acceptance on held-out sequences: for each evaluation anchor (a position whose next K
        tokens are supervised), drafts at depths 0..K-1 from the serving computation, accepted while each equals the
        target's greedy token. acceptance[k] = share of anchors whose first k+1 drafts are all accepted; the predicted
        mean acceptance length at K is 1 + sum(acceptance[:K]) (vLLM's definition, counting the bonus token).
        Exact for data the target generated greedily; an estimate (teacher-forced on the data) otherwise."""
        cfg = self.cfg
        K = cfg.eval_depths
        self.head.eval()
        accepted = torch.zeros(K, dtype=torch.float64)
        correct_at = torch.zeros(K, dtype=torch.float64)
        anchors_total = 0
        for j, index in enumerate(self.eval_ids[self.rank::self.world]):
            ids, mask = self._row(self.eval_rows, index)
            g = torch.Generator().manual_seed(_sample_seed(cfg.seed + 1, 0, index))
            el, chosen = eval_elements(mask, K, cfg.eval_anchors, g)
            if chosen.numel() == 0:
                continue
            seq = self._teacher_seq(ids)
            drafts = torch.full((chosen.numel(), K), -1, dtype=torch.long)
            with self._autocast():
                if cfg.method == "peagle":
                    for seg in partition(el, ids.numel(), cfg.partitions):
                        sub = el.select(seg.rows)
                        hidden = cod_hidden(self.drafter, seq, sub, cfg.attn_chunk)
                        want = seg.own & torch.isin(sub.anchor, chosen)
                        d = self.drafter.logits(hidden[want.to(hidden.device)]).argmax(-1)
                        d = self.drafter.to_target_ids(d).cpu()
                        drafts[torch.searchsorted(chosen, sub.anchor[want]), sub.depth[want]] = d
                else:
                    for k, A, h in ttt_forward(self.drafter, seq, el, cfg.attn_chunk):
                        if k >= K:
                            break
                        A = A.cpu()
                        sel = torch.isin(A, chosen)
                        d = self.drafter.logits(h[sel.to(h.device)]).argmax(-1)
                        drafts[torch.searchsorted(chosen, A[sel]), k] = self.drafter.to_target_ids(d).cpu()
            truth = seq.argmax.cpu()[chosen[:, None] + torch.arange(K)[None, :] + 1]
            ok = drafts == truth
            accepted += ok.long().cumprod(1).sum(0).double()
            correct_at += ok.sum(0).double()
            anchors_total += chosen.numel()
        red = self._all_reduce(torch.cat([accepted, correct_at, torch.tensor([anchors_total], dtype=torch.float64)]))
        n = max(float(red[-1]), 1.0)
        acceptance = (red[:K] / n).tolist()
        result = {"step": self.step, "anchors": int(red[-1]), "acceptance_per_position": acceptance,
                  "accuracy_per_depth": (red[K:2 * K] / n).tolist(),
                  "mean_acceptance_length": {str(k): 1 + sum(acceptance[:k]) for k in range(1, K + 1)}}
        self.head.train()
        return result

    # -- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg
        bar = None
        if self.main and cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {cfg.method}", dynamic_ncols=True,
                       file=sys.stderr)
        last_eval = None
        log_path = Path(cfg.out) / "train_log.jsonl"
        if self.main:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = {"start": time.time(), "steps": 0, "first": 0.0, "tokens": 0, "eval": 0.0, "paused": 0.0}
        while self.step < self.total_steps:
            m = self.train_step()
            self._fit_budget(m)
            self.history.append({k: m[k] for k in ("step", "loss", "acc", "lr", "tokens_per_s")})
            if self.main:
                with open(log_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
            if bar is not None:
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    bar.set_postfix_str(f"loss={m['loss']:.3f} acc=" + "/".join(f"{a:.2f}" for a in m["acc"])
                                        + f" lr={m['lr']:.1e} {m['tokens_per_s']:.0f} tok/s")
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps and self.eval_ids:
                t = time.time()
                last_eval = self.evaluate()
                self.clock["eval"] = time.time() - t
                self.clock["paused"] += self.clock["eval"]
                self._report_eval(last_eval)
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.total_steps:
                t = time.time()
                self.save_checkpoint()
                self._barrier()
                self.clock["paused"] += time.time() - t
        if bar is not None:
            bar.close()
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown()
        self.clock["end"] = time.time()
        record = self.training_record()
        if self.eval_ids and (last_eval is None or last_eval["step"] != self.step):
            last_eval = self.evaluate()
            self._report_eval(last_eval)
        self.log(f"trained {record['steps']} steps ({record['stopped_by']}): {record['tokens']} tokens in "
                 f"{record['train_seconds']:.1f} s, {record['tokens_per_s']:.0f} tokens/s on {record['device']}")
        self.save_checkpoint()
        if self.main:
            out = Path(cfg.out)
            self.save_head(out)
            (out / "training_args.json").write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
            (out / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
            if last_eval is not None:
                (out / "eval.json").write_text(json.dumps(last_eval, indent=2) + "\n")
            spec = SpeculativeConfig.for_head(str(out), parallel_drafting=cfg.method == "peagle")
            self.log(f"head written to {out}; serve it with --speculative-config '{spec.to_json()}'")
        self._barrier()
        return {"steps": self.step, "eval": last_eval, "history": self.history}

    def _fit_budget(self, m: dict) -> None:
        """Count a step's time and tokens; with --time-budget, end training (the loop's last step, the schedule's
        end: the cosine reaches its floor in time) at the step count that leaves the final evaluation and save
        inside the budget, at this run's mean step time (the first step, which warms up caches and kernels, left
        out once there are others). The final evaluation is reckoned at the last one's duration, or before any at a
        third of a training step per held-out row (a forward without the backward)."""
        c = self.clock
        c["steps"] += 1
        c["tokens"] += m["tokens"]
        c["first"] = c["first"] or m["seconds"]
        budget = self.cfg.time_budget
        if budget is None:
            return
        elapsed = time.time() - c["start"]
        per_step = (elapsed - c["first"]) / (c["steps"] - 1) if c["steps"] > 1 else elapsed
        rows_per_step = self.cfg.batch_size / self.world
        final_eval = c["eval"] or per_step / rows_per_step / 3 * len(self.eval_ids[self.rank::self.world])
        fit = self.step + max(0, math.floor((budget - elapsed - final_eval) / max(per_step, 1e-9)))
        if self.world > 1:  # every rank stops at the same step
            fit = self._min_over_ranks(fit)
        if c["steps"] < BUDGET_TIMED_STEPS and fit > self.step:
            return  # one slow first step (kernels, caches) must not cut the run short while there is time
        settled = self.total_steps == self.planned_steps
        # The end only moves earlier, so the cosine never jumps back up; the warm-up is fitted to it once.
        self.total_steps = max(self.step, min(self.total_steps, fit))
        if settled and self.total_steps < self.planned_steps:
            self.warmup_steps = min(self.warmup_steps, int(self.cfg.warmup_ratio * self.total_steps))

    def _min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def training_record(self) -> dict:
        """What this run did, for the head's training_record.json and its checkpoints: steps, tokens and seconds of
        training (evaluations and saves excluded), tokens per second of this head, and why it stopped."""
        c = getattr(self, "clock", None) or {"start": time.time(), "steps": 0, "tokens": 0, "eval": 0.0}
        seconds = c.get("end", time.time()) - c["start"] - c.get("paused", 0.0)
        budget_hit = self.cfg.time_budget is not None and self.step < self.planned_steps
        return {"method": self.cfg.method, "device": str(self.device), "world_size": self.world,
                "steps": self.step, "steps_this_run": c["steps"], "tokens": c["tokens"], "train_seconds": seconds,
                "tokens_per_s": c["tokens"] / seconds if seconds > 0 else 0.0,
                "batch_size": self.cfg.batch_size, "micro_batch_size": self.cfg.micro_batch_size,
                "peak_lr": self.peak_lr, "time_budget": self.cfg.time_budget,
                "stopped_by": "time budget" if budget_hit else "steps"}

    def _report_eval(self, ev: dict):
        if not self.main:
            return
        acc = " ".join(f"{a:.3f}" for a in ev["acceptance_per_position"])
        K = len(ev["acceptance_per_position"])
        mal = ev["mean_acceptance_length"]
        ks = [k for k in (1, 3, 5, 7, K) if k <= K]
        self.log(f"eval at step {ev['step']} ({ev['anchors']} anchors): acceptance per position [{acc}]; predicted "
                 "mean acceptance length " + ", ".join(f"K={k}: {mal[str(k)]:.2f}" for k in dict.fromkeys(ks)))
        with open(Path(self.cfg.out) / "eval_log.jsonl", "a") as f:
            f.write(json.dumps(ev) + "\n")

    def _barrier(self):
        if self.world > 1:
            dist.barrier()

    def close(self):
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def train(cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()
