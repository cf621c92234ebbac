"""What verify rows cost the target, and how a step should verify windows of different sizes: one forward of
[B, K + 1] rows (every request pays for the widest window), a window for half the requests plus a plain step for the
other half in a second forward (the weights read twice), or one ragged forward with every row its own batch entry
([B/2 (K + 1) + B/2, 1]: no padding, one read of the weights), against a plain step for all (docs/engine.md,
"Choosing K"). Times are CPU time of this thread (one torch thread), the fastest of --repeats.

    python3 benchmarks/verify_cost.py --batch 8 --windows 1 3 7 --threads 1
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--context", type=int, default=200, help="cached positions each request attends to")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from peagle.engine.policy import timed
    from peagle.model.layers import BatchLayout
    from peagle.model.loading import resolve_model
    from peagle.model.target import TargetModel

    target = TargetModel.from_pretrained(resolve_model(None), dtype=torch.bfloat16)
    cache = target.new_cache(args.batch, args.context + max(args.windows) + 2)
    clock = time.thread_time if args.threads == 1 else time.process_time

    def forward(slots: list[int], rows: int):
        layout = BatchLayout.build(torch.tensor(slots), args.context + torch.arange(rows)[None].expand(len(slots), -1))
        return run_on(layout)

    def ragged(windows: list[int]):
        """Request i verifies windows[i] + 1 rows, each row its own batch entry."""
        slots = torch.tensor([i for i, w in enumerate(windows) for _ in range(w + 1)])
        positions = torch.tensor([args.context + j for w in windows for j in range(w + 1)])[:, None]
        return run_on(BatchLayout.build(slots, positions))

    def run_on(layout: BatchLayout):
        tokens = torch.ones(layout.positions.shape, dtype=torch.long)

        def run():
            with torch.inference_mode():
                target(tokens, layout, cache, num_logits=None)
        return run

    b, half = args.batch, args.batch // 2
    plain = timed(forward(list(range(b)), 1), clock, args.repeats)
    results = []
    for w in args.windows:
        one = timed(forward(list(range(b)), w + 1), clock, args.repeats)
        a, rest = forward(list(range(half)), w + 1), forward(list(range(half, b)), 1)
        split = timed(lambda: (a(), rest()), clock, args.repeats)
        rag = timed(ragged([w] * half + [0] * (b - half)), clock, args.repeats)
        flat = timed(ragged([w] * b), clock, args.repeats)
        results.append({"window": w, "one_forward_ms": round(one * 1000, 1), "split_ms": round(split * 1000, 1),
                        "ragged_ms": round(rag * 1000, 1), "one_forward_flat_ms": round(flat * 1000, 1),
                        "plain_ms": round(plain * 1000, 1)})
        print(f"K={w}: one forward [{b}, {w + 1}] {one * 1000:.1f} ms (as [{b * (w + 1)}, 1]: {flat * 1000:.1f}); "
              f"[{half}, {w + 1}] + [{b - half}, 1] {split * 1000:.1f} ms; ragged [{half * (w + 1) + b - half}, 1] "
              f"{rag * 1000:.1f} ms; plain [{b}, 1] {plain * 1000:.1f} ms", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
