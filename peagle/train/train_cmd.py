"""`peagle train`: train a P-EAGLE or EAGLE-3 drafter head for a Hugging Face causal LM.

    peagle train --data data/sharegpt-regen --out heads/my-peagle
    peagle train --method eagle3 --data conversations.jsonl --out heads/my-eagle3
    torchrun --nproc-per-node 4 -m peagle.cli train --data data/x --out heads/x     # DistributedDataParallel

See docs/training.md.
"""
from __future__ import annotations

import dataclasses
import sys

from peagle import cli_args
from peagle.train.objective import LOSSES
from peagle.train.train_config import DEFAULT_DEPTHS, DEFAULT_LAYERS, LR_SCALING, TrainConfig

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

def _option(p, field_name: str, flag: str | None = None, **kw) -> None:
    """The flag of TrainConfig field `field_name` (--field-name unless `flag` names another), defaulting to the
    field's default, so that TrainConfig states every training default once; help text shows it as %(default)s."""
    p.add_argument(flag or "--" + field_name.replace("_", "-"), dest=field_name,
                   default=_FIELDS[field_name].default, **kw)


def register(name: str, parser) -> None:
    for add in (_add_input_args, _add_optimizer_args, _add_objective_args, _add_eval_args, _add_checkpoint_args,
                _add_runtime_args, _add_head_args):
        add(parser)
    parser.set_defaults(func=run)


def _add_input_args(p) -> None:
    """The target, the data and the head's shape."""
    _option(p, "target", help="target model: a Hugging Face folder or cached hub id, any causal LM "
                              "(default: the embedded SmolLM2-135M-Instruct)")
    _option(p, "data", help="a folder from `peagle data prepare`, a .jsonl of conversations, or `sharegpt` "
                            "(rendered with the target's chat template on the fly) [default: %(default)s]")
    _option(p, "out", help="output folder for the head and checkpoints [default: ./peagle-<method>-head]")
    _option(p, "method", choices=("peagle", "eagle3"))
    _option(p, "num_layers", type=cli_args.positive_int,
            help=f"drafter decoder layers [P-EAGLE {DEFAULT_LAYERS['peagle']}, EAGLE-3 {DEFAULT_LAYERS['eagle3']}]")
    _option(p, "num_depths", type=cli_args.positive_int,
            help=f"P-EAGLE: COD depths (train more than you serve) [{DEFAULT_DEPTHS['peagle']}]; "
                 f"EAGLE-3: TTT unroll steps [{DEFAULT_DEPTHS['eagle3']}]")
    _option(p, "draft_vocab_size", type=cli_args.positive_int, help="Vd, capped at the target's vocab [%(default)s]")
    _option(p, "max_seq_len", type=cli_args.positive_int,
            help="tokens per training sequence (longer are cut) [%(default)s]")
    _option(p, "partitions", type=cli_args.positive_int,
            help="sequence partitioning: S forward/backward passes per sequence; memory falls as S grows, "
                 "gradients stay exact (P-EAGLE) [%(default)s]")


def _add_optimizer_args(p) -> None:
    """How long, how fast and in which dtypes."""
    _option(p, "epochs", type=cli_args.positive_float)
    _option(p, "max_steps", type=cli_args.positive_int, help="stop after this many optimizer steps")
    _option(p, "batch_size", type=cli_args.positive_int,
            help="sequences per optimizer step, all ranks together [%(default)s]")
    _option(p, "micro_batch_size", type=cli_args.positive_int,
            help="rows per forward of the target and the head; a step accumulates gradients over "
                 "batch-size / micro-batch-size forwards (several rows per forward keep a GPU busy) [%(default)s]")
    _option(p, "lr", type=cli_args.positive_float,
            help="peak learning rate at --lr-reference-batch rows per step [%(default)s]")
    _option(p, "lr_scaling", choices=LR_SCALING,
            help="how the peak learning rate follows --batch-size: none, sqrt (x sqrt(batch / reference), for "
                 "Adam) or linear (x batch / reference); the log prints the rate used [%(default)s]")
    _option(p, "lr_reference_batch", type=cli_args.positive_int,
            help="the batch --lr was tuned at (the bundled recipe's) [%(default)s]")
    _option(p, "warmup_ratio", type=cli_args.fraction, help="share of the steps spent warming up [%(default)s]")
    _option(p, "min_lr_ratio", type=cli_args.fraction, help="cosine floor as a fraction of --lr [%(default)s]")
    _option(p, "weight_decay", type=cli_args.nonnegative_float)
    _option(p, "max_grad_norm", type=cli_args.positive_float, help="gradient clipping (0: off) [%(default)s]")
    _option(p, "dtype", choices=("auto", "bf16", "fp32"),
            help="the head's compute: bf16 autocast with fp32 master weights, fp32, or auto: bf16 on GPUs, on a CPU "
                 "whichever multiplies faster there (measured at start) [%(default)s]")
    _option(p, "target_dtype", choices=("bf16", "fp32", "fp16"),
            help="dtype of the frozen target [bf16, or --dtype when that is given]")
    _option(p, "target_device_map",
            help="load the frozen target with this transformers device_map (e.g. auto) to spread a target too large "
                 "for one GPU over the GPUs this process sees")


def _add_objective_args(p) -> None:
    _option(p, "cod_ratio", type=cli_args.fraction,
            help="COD retention r: depth d keeps ~N*max(r^d, r_min) [%(default)s]")
    _option(p, "cod_min_ratio", type=cli_args.fraction, help="COD floor r_min [%(default)s]")
    _option(p, "loss", choices=LOSSES,
            help="kl: forward KL to the target's draft-vocab distribution; ce: cross-entropy on its argmax; "
                 "lk_hybrid: acceptance itself (-log sum min(p, q)), KL-weighted while acceptance is low "
                 "[%(default)s]")
    _option(p, "lk_eta", type=cli_args.nonnegative_float,
            help="lk_hybrid: KL's weight is exp(-eta x acceptance) [%(default)s]")
    _option(p, "feature_noise", type=cli_args.nonnegative_float,
            help="uniform noise on the target's features while training, +- this x each feature layer's RMS "
                 "[%(default)s]")
    _option(p, "ttt_decay", type=cli_args.fraction, help="EAGLE-3 TTT step weight base (%(default)s^k)")
    _option(p, "mask_token_id", type=cli_args.nonnegative_int,
            help="P-EAGLE mask token (default: a special token the data never uses, e.g. 3 for SmolLM2)")


def _add_eval_args(p) -> None:
    _option(p, "eval_fraction", type=cli_args.fraction, help="share of the data held out for evaluation")
    _option(p, "eval_data", help="separate evaluation data (overrides --eval-fraction)")
    _option(p, "eval_every", type=cli_args.nonnegative_int, help="evaluate every N steps (0: at the end only)")
    _option(p, "eval_samples", type=cli_args.positive_int, help="held-out sequences per evaluation")
    _option(p, "eval_anchors", type=cli_args.positive_int, help="drafting positions measured per sequence")
    _option(p, "eval_depths", type=cli_args.positive_int, help="positions measured [num-depths]")


def _add_checkpoint_args(p) -> None:
    """What is saved, and what a run starts from."""
    _option(p, "save_every", type=cli_args.nonnegative_int, help="checkpoint every N steps (0: only at the end)")
    _option(p, "save_total_limit", type=cli_args.positive_int, help="checkpoints kept")
    _option(p, "save_dtype", choices=("bf16", "fp32"), help="dtype of saved heads")
    _option(p, "layout", choices=("vllm", "speculators"), help="layout of the final head")
    _option(p, "resume", nargs="?", const="latest",
            help="resume from the latest checkpoint in --out, or from the given checkpoint folder")
    _option(p, "init_head",
            help="start from this trained head's weights (a folder or bundled name; its layers, draft vocab and mask "
                 "token are kept) instead of a new head: continue or fine-tune a head. The optimizer and schedule "
                 "start fresh (--resume continues an interrupted run instead)")
    _option(p, "teacher_cache",
            help="folder that keeps the target's outputs for every training row (about (3H + Vd) x 2 bytes per "
                 "token), so epochs after the first, resumed runs and other heads on the same data skip the "
                 "target's forward pass")
    _option(p, "share_teacher_cache", action="store_true",
            help="with --teacher-cache: the cache serves exactly two one-pass runs on the same data (two heads); "
                 "whichever reaches a row first computes and writes it, the other reads and deletes it, so the "
                 "cache holds only the rows between them (a later epoch recomputes)")
    _option(p, "teacher_ahead", action="store_true",
            help="run the target for the next step's rows in a second thread while this step trains the head: on a "
                 "CPU the two halves of a step overlap on two cores (the same weights as without it)")


def _add_runtime_args(p) -> None:
    _option(p, "seed", type=cli_args.seed)
    _option(p, "device", help="auto, cpu or cuda")
    _option(p, "time_budget", type=cli_args.positive_float,
            help="seconds for this run's training and its final evaluation: the run (and its learning-rate "
                 "schedule) ends at the step that leaves the evaluation and the save in time, so a time slot always "
                 "ends with a usable head")
    _option(p, "limit", type=cli_args.positive_int, help="use at most this many conversations")
    _option(p, "progress", "--no-progress", action="store_false", help="no progress bar")
    _option(p, "loss_chunk", type=cli_args.positive_int, help="rows per fused LM-head/loss chunk [%(default)s]")
    _option(p, "attn_chunk", type=cli_args.positive_int, help="anchors per attention chunk in the TTT unroll")


def _add_head_args(p) -> None:
    """Which parts of the head start from the target and which train, and the optimizer."""
    _option(p, "init_from_target", "--no-init-from-target", action="store_false",
            help="random lm_head/norm instead of the target's (restricted to the draft vocab)")
    _option(p, "norm_before_residual", action="store_true",
            help="layer 0 adds attention to hidden_norm(h) instead of h (vLLM and speculators read the flag)")
    _option(p, "freeze_lm_head", action="store_true",
            help="keep the LM head at the target's rows of the draft vocab (speculators does)")
    _option(p, "train_embeddings", action="store_true",
            help="train the whole embedding table, not only the mask token's row (the head then ships the table: "
                 "+H x V parameters)")
    _option(p, "fresh_mask_hidden", action="store_true",
            help="with --init-head: start mask_hidden from N(0, 1) instead of the head's (a head trained from the "
                 "old mean-feature start keeps its mask slots flat otherwise)")
    _option(p, "grow_layers", type=cli_args.int_range(0),
            help="with --init-head: append N decoder layers to the head's, each a copy of its last with the output "
                 "projections zeroed, so the head drafts as before until they train [%(default)s]")
    _option(p, "optimizer", choices=("adamw", "muon"),
            help="adamw, or muon: torch.optim.Muon for the layers' matrices, AdamW for the rest [%(default)s]")


def config_from_args(args) -> TrainConfig:
    """Every flag is a TrainConfig field and passes straight through."""
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in _FIELDS})


def run(args) -> int:
    from peagle.train.data import HeldOutDataError
    from peagle.train.trainer import train

    try:
        cfg = config_from_args(args)
        train(cfg)
    except (HeldOutDataError, FileNotFoundError, ValueError) as e:
        print(f"peagle train: {e}", file=sys.stderr)
        return 2
    return 0
