"""Copy a trained head into peagle/heads/NAME in the compact form the package ships: bf16, and for P-EAGLE only the
learned mask-token row of the embedding table (loading takes every other row from the embedded target;
`peagle export` writes the full table vLLM wants), unless training changed other rows too (--train-embeddings).
Keeps a 2-layer P-EAGLE and a 1-layer EAGLE-3 head at draft vocab 8192 under 60 MB together.

    python3 benchmarks/acceptance.py --peagle-head runs/peagle-head --methods peagle --out runs/acceptance
    python3 scripts/bundle_head.py runs/peagle-head smollm2-135m-peagle --acceptance runs/acceptance/acceptance.json

A new bundle must earn its place: its benchmark acceptance (benchmarks/acceptance.py's acceptance.json for the new
head), at the deepest K both measured, must be no lower on any set and clearly higher on the mean of the sets'
relative gains: above zero at 95% confidence over the prompts (a paired bootstrap), or, for files measured before
acceptance.py kept each prompt's counts, by MIN_GAIN; otherwise nothing is copied (--force copies anyway, e.g. for a
new target). The bundled head's figures are docs/heads/acceptance.json's
unless --baseline gives a measurement made on the same machine as the new head's (greedy outputs, and so acceptance,
differ a little between CPUs whose bf16 kernels round differently: measure both heads on one machine).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from peagle.model.checkpoint import load_head, save_head
from peagle.model.heads import HEADS_DIR
from peagle.model.loading import embedded_model_dir
from peagle.model.export import target_embeddings

BUNDLED_ACCEPTANCE = Path("docs/heads/acceptance.json")
# The mean over the sets of the relative gain in mean acceptance length must be above zero at CONFIDENCE (one-sided),
# resampling each set's prompts with the same draw for both heads: greedy outputs are deterministic, so the spread
# that matters is the prompts', and a head that gains on a few prompts only is not clearly better. Not a gain on
# every set: training data mostly of code moves HumanEval, and heads clearly better there were held back by small
# MT-Bench gains (docs/heads.md); a set may not fall, though.
CONFIDENCE = 0.95
RESAMPLES = 4000
# For files measured before benchmarks/acceptance.py kept each prompt's counts: a fixed rise of 2% averaged over the
# sets (about the spread of similar heads).
MIN_GAIN = 0.02


def deepest_rows(rows: list[dict], method: str) -> dict[str, dict]:
    """Per dataset: `method`'s row at the deepest K measured."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["method"] == method and r["k"] >= out.get(r["dataset"], {"k": 0})["k"]:
            out[r["dataset"]] = r
    return out


def deepest_mal(rows: list[dict], method: str) -> dict[str, tuple[int, float]]:
    """Per dataset: (deepest K, mean acceptance length there) of `method`'s rows."""
    return {ds: (r["k"], r["mean_acceptance_length"]) for ds, r in deepest_rows(rows, method).items()}


def gain_lower_bound(new: dict[str, dict], old: dict[str, dict], confidence: float = CONFIDENCE,
                     resamples: int = RESAMPLES, seed: int = 0) -> float | None:
    """The one-sided `confidence` lower bound of the new head's relative gain in mean acceptance length averaged
    over the sets of `old`, by a paired bootstrap over each set's prompts (deepest_rows' rows); None when a set lacks
    per-prompt counts for either head or the two measured different prompts."""
    gen = torch.Generator().manual_seed(seed)
    mean_gain = torch.zeros(resamples, dtype=torch.float64)
    for dataset, before in sorted(old.items()):
        a, b = new[dataset].get("per_prompt"), before.get("per_prompt")
        if a is None or b is None or len(a) != len(b) or not a:
            return None
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        pick = torch.randint(len(a), (resamples, len(a)), generator=gen)

        def mal(counts: torch.Tensor) -> torch.Tensor:  # [drafting steps, accepted drafts] per prompt
            drawn = counts[pick].sum(dim=1)
            return 1 + drawn[:, 1] / drawn[:, 0].clamp(min=1)

        mean_gain += mal(a) / mal(b) - 1
    return torch.quantile(mean_gain / len(old), 1 - confidence).item()


def not_better(new_rows: list[dict], old_rows: list[dict], method: str, min_gain: float = MIN_GAIN) -> list[str]:
    """Why the new head does not clearly beat the bundled one (empty: it does): a set where it is lower or not
    measured, or a mean relative gain not clearly above zero (min_gain where the files lack per-prompt counts)."""
    new, old = deepest_rows(new_rows, method), deepest_rows(old_rows, method)
    if not new:
        return [f"the new acceptance file has no {method} rows"]
    reasons, gains = [], []
    for dataset, before in sorted(old.items()):
        if dataset not in new:
            reasons.append(f"{dataset}: not measured for the new head")
            continue
        after = new[dataset]
        gains.append(after["mean_acceptance_length"] / before["mean_acceptance_length"] - 1)
        if after["mean_acceptance_length"] < before["mean_acceptance_length"]:
            reasons.append(f"{dataset}: mean acceptance length {after['mean_acceptance_length']:.3f} at "
                           f"K={after['k']} is below the bundle's {before['mean_acceptance_length']:.3f} at "
                           f"K={before['k']}")
    if reasons or not gains:
        return reasons
    gain = sum(gains) / len(gains)
    bound = gain_lower_bound(new, old)
    if bound is None and gain < min_gain:
        reasons.append(f"mean acceptance length {gain:+.1%} against the bundle's, averaged over {len(gains)} set(s) "
                       f"(needs +{min_gain:.0%}; the files have no per-prompt counts)")
    elif bound is not None and bound <= 0:
        reasons.append(f"mean acceptance length {gain:+.1%} against the bundle's, averaged over {len(gains)} set(s), "
                       f"within the spread over prompts (its {CONFIDENCE:.0%} lower bound: {bound:+.1%})")
    return reasons


def head_method(head: Path) -> str:
    return "peagle" if json.loads((head / "config.json").read_text()).get("mask_token_id") is not None else "eagle3"


def bundle(src: Path, name: str) -> Path:
    """Copy the trained head `src` into peagle/heads/NAME (compact bf16), replacing what is there."""
    out = HEADS_DIR / name
    table = target_embeddings(embedded_model_dir())
    head = load_head(src, target_embeddings=table, dtype=torch.bfloat16)
    # A head trained with --train-embeddings changed rows besides the mask token's: it must ship its whole table.
    changed = head.embed_tokens.weight != table.to(torch.bfloat16)
    if head.config.mask_token_id is not None:
        changed[head.config.mask_token_id] = False
    if out.exists():
        shutil.rmtree(out)
    save_head(head, out, include_embeddings=bool(changed.any()), dtype=torch.bfloat16)
    for extra in ("eval.json", "training_args.json"):  # how it was made and what it scored, kept beside it
        if (src / extra).exists():
            shutil.copy(src / extra, out / extra)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2 ** 20
    cfg = json.loads((out / "config.json").read_text())
    print(f"bundled {src} as {out} ({size:.1f} MiB, {cfg['num_hidden_layers']} layer(s), draft vocab "
          f"{cfg['draft_vocab_size']})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head", help="a trained head folder (the output of `peagle train`)")
    ap.add_argument("name", help="the bundled name, e.g. smollm2-135m-peagle")
    ap.add_argument("--acceptance", help="benchmarks/acceptance.py's acceptance.json measured for the new head")
    ap.add_argument("--baseline", default=str(BUNDLED_ACCEPTANCE),
                    help="the bundled head's acceptance.json, ideally measured on the new head's machine "
                         "(default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="bundle without comparing with the bundled head")
    args = ap.parse_args()
    src = Path(args.head)
    if not args.force:
        if not args.acceptance:
            raise SystemExit("give --acceptance (benchmarks/acceptance.py's output for the new head), or --force")
        reasons = not_better(json.loads(Path(args.acceptance).read_text()),
                             json.loads(Path(args.baseline).read_text()), head_method(src))
        if reasons:
            raise SystemExit("not bundled: the new head is not clearly better than the bundled one:\n  "
                             + "\n  ".join(reasons))
    bundle(src, args.name)


if __name__ == "__main__":
    main()
