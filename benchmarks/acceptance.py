"""Acceptance of the bundled heads, measured by the engine itself (docs/heads.md).

For every dataset, method and K: all prompts through the chat template, greedy, up to --max-tokens new tokens,
continuously batched by LLMEngine with real speculative decoding; the engine's own counters give the mean
acceptance length (1 + accepted / verification steps, vLLM's definition) and the per-position acceptance. Since
speculation is lossless, every configuration must produce the same tokens for a dataset; the report checks that
too (a free large-scale losslessness test).

    python benchmarks/acceptance.py                       # MT-Bench 80 + HumanEval 164, K = 3,5,7, both heads
    python benchmarks/acceptance.py --num-prompts 8 --out /tmp/acc   # a quick look

Runs are spread over --jobs processes of --threads torch threads each (one per core works best on a shared
machine). Each run is kept in OUT/runs/ as it finishes and skipped when the script is run again (so a sweep can be
stopped, resumed, or split: `--methods peagle` now, `--methods eagle3` later); OUT/acceptance.json and
OUT/acceptance.md report every run present.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

# The mean acceptance lengths the bundled P-EAGLE head aims for at K=7, and at least EAGLE-3's (docs/heads.md).
TARGETS = {"humaneval": 2.0, "mtbench": 1.8}
DATASET_TITLES = {"mtbench": "MT-Bench first turns", "humaneval": "HumanEval"}


def run_one(method: str, k: int, dataset: str, head: str, num_prompts: int | None, max_tokens: int,
            max_num_seqs: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from peagle.bench.datasets import load_dataset
    from peagle.bench.plan import machine
    from peagle.engine.engine import LLMEngine
    from peagle.engine.sampling import SamplingParams

    prompts = load_dataset(dataset, num_prompts)
    spec = {"model": head, "method": "eagle3", "num_speculative_tokens": k}
    if method == "peagle":
        spec["parallel_drafting"] = True
    # fixed: every step drafts K (the adaptive default would choose K from this machine's timings, and a head's
    # acceptance at K is what is measured here)
    engine = LLMEngine.from_pretrained(None, spec, max_num_seqs=max_num_seqs, max_model_len=2048,
                                       speculation_policy="fixed")
    t0 = time.perf_counter()
    outs = engine.generate([p.chat_messages() for p in prompts], SamplingParams(max_tokens=max_tokens), chat=True)
    seconds = time.perf_counter() - t0
    tokens = [o.token_ids for o in outs]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    return {"method": method, "k": k, "dataset": dataset, "head": head, "machine": machine()["summary"],
            "prompts": len(prompts),
            "max_tokens": max_tokens, "max_num_seqs": max_num_seqs,
            "output_tokens": sum(map(len, tokens)), "seconds": round(seconds, 1), "outputs_sha256": digest,
            # each prompt's verify steps that carried drafts and the drafts they accepted, in the set's order: what
            # the re-bundling gate resamples (scripts/bundle_head.py)
            "per_prompt": [[o.spec.num_drafts, o.spec.num_accepted_tokens] for o in outs],
            **engine.stats.as_dict()}


def report(results: list[dict]) -> str:
    from peagle.bench.plan import machine

    # Each run names the machine it ran on (runs are kept and added to over time, not always on one machine).
    where: dict[str, dict[str, list[str]]] = {}
    for r in results:
        where.setdefault(r.get("machine") or machine()["summary"], {}).setdefault(
            "P-EAGLE" if r["method"] == "peagle" else "EAGLE-3", []).append(f"{r['dataset']} K={r['k']}")
    every = {m: sorted(f"{r['dataset']} K={r['k']}" for r in results
                       if ("P-EAGLE" if r["method"] == "peagle" else "EAGLE-3") == m) for m in ("P-EAGLE", "EAGLE-3")}
    on = next(iter(where)) if len(where) == 1 else " and ".join(
        f"{m} ({', '.join(f'the {name} runs' if sorted(runs) == every[name] else f'{name} ' + ', '.join(runs) for name, runs in by.items())})"
        for m, by in where.items())
    lines = [f"Measured by `python benchmarks/acceptance.py` on {on}; greedy, chat template, up to "
             f"{', '.join(sorted({str(r['max_tokens']) for r in results}))} new tokens per prompt.", ""]
    for ds in dict.fromkeys(r["dataset"] for r in results):
        rows = sorted((r for r in results if r["dataset"] == ds), key=lambda r: (r["method"] != "peagle", r["k"]))
        if not rows:
            continue
        kmax = max(r["k"] for r in rows)
        lines += [f"### {DATASET_TITLES.get(ds, ds)} ({rows[0]['prompts']} prompts)", "",
                  "| method | K | mean acceptance length | " + " | ".join(f"pos {i + 1}" for i in range(kmax))
                  + " | steps | output tokens |",
                  "|---|---:|---:|" + "---:|" * kmax + "---:|---:|"]
        for r in rows:
            acc = r["acceptance_per_position"] + [None] * (kmax - r["k"])
            lines.append(f"| {'P-EAGLE' if r['method'] == 'peagle' else 'EAGLE-3'} | {r['k']} | "
                         f"{r['mean_acceptance_length']:.2f} | "
                         + " | ".join("" if a is None else f"{a:.3f}" for a in acc)
                         + f" | {r['num_drafts']} | {r['output_tokens']} |")
        same = len({r["outputs_sha256"] for r in rows}) == 1
        lines += ["", f"Every configuration produced the same tokens: {'yes' if same else 'NO (a losslessness bug)'}."]
        by = {(r["method"], r["k"]): r["mean_acceptance_length"] for r in rows}
        if ("peagle", 7) in by and ds in TARGETS:
            p7 = by[("peagle", 7)]
            lines.append(f"Target: P-EAGLE at K=7 >= {TARGETS[ds]}: {p7:.2f}, "
                         f"{'met' if p7 >= TARGETS[ds] else 'missed'}.")
            if ("eagle3", 7) in by:
                ratio = p7 / by[("eagle3", 7)]
                lines.append(f"Target: P-EAGLE at K=7 at least EAGLE-3's at K=7: {ratio:.2f}x, "
                             f"{'met' if ratio >= 1.0 else 'missed'}.")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    from peagle.model.heads import DEFAULT_HEADS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="mtbench,humaneval")
    ap.add_argument("--methods", default="peagle,eagle3")
    ap.add_argument("--k", default="3,5,7")
    ap.add_argument("--peagle-head", default=DEFAULT_HEADS["peagle"])
    ap.add_argument("--eagle3-head", default=DEFAULT_HEADS["eagle3"])
    ap.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="requests the engine decodes at once")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--out", default="docs/heads")
    args = ap.parse_args()
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    heads = {"peagle": args.peagle_head, "eagle3": args.eagle3_head}
    runs = [(m.strip(), int(k), ds) for ds in args.datasets for m in args.methods.split(",") for k in args.k.split(",")]
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)

    def run_file(m: str, k: int, ds: str) -> Path:
        return out / "runs" / f"{ds}-{m}-k{k}.json"

    todo = [r for r in runs if not run_file(*r).exists()]
    print(f"{len(runs) - len(todo)} of {len(runs)} runs already in {out / 'runs'}; running {len(todo)}", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futs = {pool.submit(run_one, m, k, ds, heads[m], args.num_prompts, args.max_tokens, args.max_num_seqs,
                            args.threads): (m, k, ds) for m, k, ds in todo}
        for n, fut in enumerate(as_completed(futs), 1):
            r = fut.result()
            run_file(r["method"], r["k"], r["dataset"]).write_text(json.dumps(r, indent=1) + "\n")
            print(f"[{n}/{len(todo)} {time.perf_counter() - t0:.0f}s] {r['dataset']} {r['method']} K={r['k']}: mean "
                  f"acceptance length {r['mean_acceptance_length']:.2f}, per position "
                  f"{[round(a, 2) for a in r['acceptance_per_position']]} ({r['output_tokens']} tokens in "
                  f"{r['seconds']}s)", flush=True)
    results = [json.loads(f.read_text()) for f in sorted((out / "runs").glob("*.json"))]
    (out / "acceptance.json").write_text(json.dumps(results, indent=1) + "\n")
    md = report(results)
    (out / "acceptance.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
