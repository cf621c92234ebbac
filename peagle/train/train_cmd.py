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
from peagle.train.trainer import DEFAULT_DEPTHS, DEFAULT_LAYERS, TrainConfig


def register(name: str, parser) -> None:
    p = parser
    D = {f.name: f.default for f in dataclasses.fields(TrainConfig)}  # TrainConfig holds every default
    p.add_argument("--target", default=None,
                   help="target model: a Hugging Face folder or cached hub id, any causal LM "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", default="sharegpt",
                   help="a folder from `peagle data prepare`, a .jsonl of conversations, or `sharegpt` "
                        "(rendered with the target's chat template on the fly) [default: sharegpt]")
    p.add_argument("--out", default=None, help="output folder for the head and checkpoints "
                                              "[default: ./peagle-<method>-head]")
    p.add_argument("--method", choices=("peagle", "eagle3"), default="peagle")
    p.add_argument("--num-layers", type=cli_args.positive_int, default=None,
                   help="drafter decoder layers [P-EAGLE {}, EAGLE-3 {}]".format(*DEFAULT_LAYERS.values()))
    p.add_argument("--num-depths", type=cli_args.positive_int, default=None,
                   help="P-EAGLE: COD depths (train more than you serve) [{}]; EAGLE-3: TTT unroll steps [{}]".format(
                       *DEFAULT_DEPTHS.values()))
    p.add_argument("--draft-vocab-size", type=cli_args.positive_int, default=D["draft_vocab_size"],
                   help=f"Vd, capped at the target's vocab [{D['draft_vocab_size']}]")
    p.add_argument("--max-seq-len", type=cli_args.positive_int, default=2048,
                   help="tokens per training sequence (longer are cut) [2048]")
    p.add_argument("--partitions", type=cli_args.positive_int, default=1,
                   help="sequence partitioning: S forward/backward passes per sequence; memory falls as S grows, "
                        "gradients stay exact (P-EAGLE) [1]")
    p.add_argument("--epochs", type=cli_args.positive_float, default=1.0)
    p.add_argument("--max-steps", type=cli_args.positive_int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--batch-size", type=cli_args.positive_int, default=D["batch_size"],
                   help=f"sequences per optimizer step, all ranks together [{D['batch_size']}]")
    p.add_argument("--lr", type=cli_args.positive_float, default=D["lr"], help=f"peak learning rate [{D['lr']}]")
    p.add_argument("--warmup-ratio", type=cli_args.fraction, default=D["warmup_ratio"],
                   help=f"share of the steps spent warming up [{D['warmup_ratio']}]")
    p.add_argument("--min-lr-ratio", type=cli_args.fraction, default=D["min_lr_ratio"],
                   help=f"cosine floor as a fraction of --lr [{D['min_lr_ratio']}]")
    p.add_argument("--weight-decay", type=cli_args.nonnegative_float, default=D["weight_decay"])
    p.add_argument("--max-grad-norm", type=cli_args.positive_float, default=D["max_grad_norm"],
                   help=f"gradient clipping (0: off) [{D['max_grad_norm']}]")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default=D["dtype"],
                   help="the head's compute: bf16 autocast with fp32 master weights, fp32, or auto: bf16 on GPUs, on "
                        "a CPU whichever multiplies faster there (measured at start) [auto]")
    p.add_argument("--target-dtype", choices=("bf16", "fp32", "fp16"), default=None,
                   help="dtype of the frozen target [bf16, or --dtype when that is given]")
    p.add_argument("--target-device-map", default=None,
                   help="load the frozen target with this transformers device_map (e.g. auto) to spread a target "
                        "too large for one GPU over the GPUs this process sees")
    p.add_argument("--cod-ratio", type=cli_args.fraction, default=D["cod_ratio"],
                   help=f"COD retention r: depth d keeps ~N*max(r^d, r_min) [{D['cod_ratio']}]")
    p.add_argument("--cod-min-ratio", type=cli_args.fraction, default=D["cod_min_ratio"],
                   help=f"COD floor r_min [{D['cod_min_ratio']}]")
    p.add_argument("--loss", choices=("kl", "ce"), default="kl",
                   help="kl: forward KL to the target's draft-vocab distribution; ce: cross-entropy on its argmax")
    p.add_argument("--ttt-decay", type=cli_args.fraction, default=0.8, help="EAGLE-3 TTT step weight base (0.8^k)")
    p.add_argument("--mask-token-id", type=cli_args.nonnegative_int, default=None,
                   help="P-EAGLE mask token (default: a special token the data never uses, e.g. 3 for SmolLM2)")
    p.add_argument("--eval-fraction", type=cli_args.fraction, default=0.02,
                   help="share of the data held out for evaluation")
    p.add_argument("--eval-data", default=None, help="separate evaluation data (overrides --eval-fraction)")
    p.add_argument("--eval-every", type=cli_args.nonnegative_int, default=0,
                   help="evaluate every N steps (0: at the end only)")
    p.add_argument("--eval-samples", type=cli_args.positive_int, default=64, help="held-out sequences per evaluation")
    p.add_argument("--eval-anchors", type=cli_args.positive_int, default=256,
                   help="drafting positions measured per sequence")
    p.add_argument("--eval-depths", type=cli_args.positive_int, default=None, help="positions measured [num-depths]")
    p.add_argument("--save-every", type=cli_args.nonnegative_int, default=500,
                   help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--save-total-limit", type=cli_args.positive_int, default=2, help="checkpoints kept")
    p.add_argument("--save-dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of saved heads")
    p.add_argument("--layout", choices=("vllm", "speculators"), default="vllm", help="layout of the final head")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from the latest checkpoint in --out, or from the given checkpoint folder")
    p.add_argument("--init-head", default=None,
                   help="start from this trained head's weights (a folder or bundled name; its layers, draft vocab "
                        "and mask token are kept) instead of a new head: continue or fine-tune a head. The "
                        "optimizer and schedule start fresh (--resume continues an interrupted run instead)")
    p.add_argument("--teacher-cache", default=None,
                   help="folder that keeps the target's outputs for every training row (about (3H + Vd) x 2 bytes "
                        "per token), so epochs after the first, resumed runs and other heads on the same data skip "
                        "the target's forward pass")
    p.add_argument("--seed", type=cli_args.seed, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--limit", type=cli_args.positive_int, default=None, help="use at most this many conversations")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--loss-chunk", type=cli_args.positive_int, default=D["loss_chunk"],
                   help=f"rows per fused LM-head/loss chunk [{D['loss_chunk']}]")
    p.add_argument("--attn-chunk", type=cli_args.positive_int, default=2048,
                   help="anchors per attention chunk in the TTT unroll")
    p.add_argument("--no-init-from-target", action="store_true",
                   help="random lm_head/norm instead of the target's (restricted to the draft vocab)")
    p.add_argument("--norm-before-residual", action="store_true",
                   help="layer 0 adds attention to hidden_norm(h) instead of h (vLLM and speculators read the flag)")
    p.add_argument("--freeze-lm-head", action="store_true",
                   help="keep the LM head at the target's rows of the draft vocab (speculators does)")
    p.add_argument("--train-embeddings", action="store_true",
                   help="train the whole embedding table, not only the mask token's row (the head then ships the "
                        "table: +H x V parameters)")
    p.add_argument("--fresh-mask-hidden", action="store_true",
                   help="with --init-head: start mask_hidden from N(0, 1) instead of the head's (a head trained "
                        "from the old mean-feature start keeps its mask slots flat otherwise)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="adamw, or muon: torch.optim.Muon for the layers' matrices, AdamW for the rest [adamw]")
    p.set_defaults(func=run)


def config_from_args(args) -> TrainConfig:
    """Every flag whose name is a TrainConfig field passes straight through; the three below are derived."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(out=args.out or f"peagle-{args.method}-head", progress=not args.no_progress,
              init_from_target=not args.no_init_from_target)
    return TrainConfig(**kw)


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
