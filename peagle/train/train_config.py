"""What a training run is asked to do (`peagle train`'s options as one dataclass, checked on creation), and the
per-method defaults. A leaf of the training package: the loop (trainer.py) and the head's construction (head.py)
both read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from peagle.train.objective import LK_ETA, LOSS_CHUNK, LOSSES

# Per-method defaults: the bundled heads' shapes (docs/heads.md).
DEFAULT_LAYERS = {"peagle": 2, "eagle3": 1}
DEFAULT_DEPTHS = {"peagle": 12, "eagle3": 7}


# How the peak learning rate follows the batch (rows per optimizer step): none keeps --lr; sqrt multiplies it by
# sqrt(batch / reference), the rule for Adam-type optimizers (the gradient's noise falls as 1/sqrt(batch)); linear
# by batch / reference (SGD's rule, too hot for Adam at large ratios). The reference is the batch --lr was tuned at.
LR_SCALING = ("none", "sqrt", "linear")


@dataclass
class TrainConfig:
    data: str = "sharegpt"  # a `peagle data prepare` folder, a .jsonl of conversations, or the built-in ShareGPT
    out: str | None = None  # None: ./peagle-<method>-head
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    method: str = "peagle"
    num_layers: int | None = None  # drafter decoder layers (default: DEFAULT_LAYERS[method])
    num_depths: int | None = None  # P-EAGLE COD depths / EAGLE-3 TTT steps (default: DEFAULT_DEPTHS[method])
    draft_vocab_size: int = 8192
    max_seq_len: int = 2048
    partitions: int = 1
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 4  # sequences per optimizer step, all ranks together
    micro_batch_size: int = 1  # rows per forward, teacher and drafter (a step accumulates its micro-batches)
    lr: float = 1e-3
    lr_scaling: str = "none"  # LR_SCALING: how --lr follows --batch-size away from lr_reference_batch
    lr_reference_batch: int = 4  # the batch --lr was tuned at (the bundled recipe's)
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    dtype: str = "auto"  # drafter compute: bf16 (autocast; master weights stay fp32), fp32, or auto (fastest_dtype)
    target_dtype: str | None = None  # default: bf16 (the features it is served) when dtype is auto, else dtype
    target_device_map: str | None = None  # e.g. "auto": split a large frozen target over this process's GPUs
    cod_ratio: float = 0.8
    cod_min_ratio: float = 0.2
    loss: str = "kl"  # LOSSES: kl to the teacher's draft-vocab distribution, ce on its argmax, or lk_hybrid
    lk_eta: float = LK_ETA  # lk_hybrid: KL's weight exp(-eta * acceptance)
    feature_noise: float = 0.0  # uniform noise on the target's features, +-this x each layer's RMS (training only)
    ttt_decay: float = 0.8
    mask_token_id: int | None = None
    eval_fraction: float = 0.02
    eval_data: str | None = None
    eval_every: int = 0  # steps; 0: only at the end
    eval_samples: int = 64
    eval_anchors: int = 256  # per sequence
    eval_depths: int | None = None  # default: num_depths
    save_every: int = 500
    save_total_limit: int = 2
    save_dtype: str = "bf16"
    layout: str = "vllm"
    resume: str | None = None  # "latest" or a checkpoint folder
    init_head: str | None = None  # start from a trained head's weights (fresh optimizer)
    fresh_mask_hidden: bool = False  # with init_head: mask_hidden from N(0, 1), not the head's
    grow_layers: int = 0  # with init_head: decoder layers appended to the head's, adding nothing until trained
    teacher_cache: str | None = None  # folder keeping the target's outputs per training row (epochs 2+ skip it)
    share_teacher_cache: bool = False  # the cache serves exactly two one-pass runs: the second to read a row deletes it
    teacher_ahead: bool = False  # the next step's target outputs are computed in a second thread while this step trains
    seed: int = 0
    time_budget: float | None = None  # seconds: training stops in time to evaluate and save a usable head
    device: str = "auto"
    limit: int | None = None  # use at most this many conversations
    log_every: int = 1
    progress: bool = True
    loss_chunk: int = LOSS_CHUNK
    attn_chunk: int = 2048
    init_from_target: bool = True  # lm_head/norm from the target's
    norm_before_residual: bool = False  # layer 0 adds attention to hidden_norm(h), not h (vLLM reads the flag)
    freeze_lm_head: bool = False  # keep the LM head at the target's rows of the draft vocab
    train_embeddings: bool = False  # train the whole embedding table, not only the mask token's row
    optimizer: str = "adamw"  # adamw, or muon (torch.optim.Muon for the layers' matrices, AdamW for the rest)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in ("peagle", "eagle3"):
            raise ValueError(f"--method must be peagle or eagle3, not {self.method!r}")
        if self.out is None:
            self.out = f"peagle-{self.method}-head"
        if self.num_layers is None:
            self.num_layers = DEFAULT_LAYERS[self.method]
        if self.num_depths is None:
            self.num_depths = DEFAULT_DEPTHS[self.method]
        if self.num_depths < 1:
            raise ValueError("--num-depths must be at least 1")
        if self.grow_layers < 0 or (self.grow_layers and not self.init_head):
            raise ValueError("--grow-layers N appends N >= 0 decoder layers to the --init-head head; give both")
        if self.partitions < 1:
            raise ValueError("--partitions must be at least 1")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"--dtype must be auto, bf16 or fp32, not {self.dtype!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")
        if self.feature_noise < 0:
            raise ValueError("--feature-noise must be >= 0")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"--optimizer must be adamw or muon, not {self.optimizer!r}")
        if self.batch_size < 1 or self.max_seq_len < 3:
            raise ValueError("--batch-size must be >= 1 and --max-seq-len >= 3")
        if self.micro_batch_size < 1:
            raise ValueError("--micro-batch-size must be >= 1")
        if self.micro_batch_size > 1 and self.partitions > 1:
            raise ValueError("--micro-batch-size stacks whole rows and --partitions splits them: use one of the two")
        if self.lr_scaling not in LR_SCALING:
            raise ValueError(f"--lr-scaling must be one of {', '.join(LR_SCALING)}, not {self.lr_scaling!r}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError("--time-budget must be a positive number of seconds")
        if self.share_teacher_cache and not self.teacher_cache:
            raise ValueError("--share-teacher-cache needs --teacher-cache FOLDER: the cache the two runs share")
        if self.eval_depths is None:
            self.eval_depths = self.num_depths
        if self.target_dtype is None:
            self.target_dtype = "bf16" if self.dtype == "auto" else self.dtype
