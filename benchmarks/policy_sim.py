"""The adaptive speculation policy on simulated acceptance, against fixed K and plain decoding: how much of the best
fixed K it keeps when drafts are accepted independently at one rate (where reacting to a request's recent luck can
only lose), and how much it gains when acceptance comes in stretches (where reacting pays). No model runs: step
costs are a table of milliseconds per K for one request (by default this machine's CPU figures for the counting
head at batch 1, docs/benchmarks.md), and the policy learns them from the simulated steps as the engine's does.

    python3 benchmarks/policy_sim.py
    python3 benchmarks/policy_sim.py --cost-ms 25 30 31 32 33 34 35 36 --steps 5000 --seeds 5
    python3 benchmarks/policy_sim.py --cost-ms 15.6 20.5 22.6 24.5   # the embedded model, bf16, this CPU, K <= 3
"""
from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from peagle.engine.policy import AdaptiveK, Candidate

Acceptance = Callable[[int, int], float]  # (step, draft position) -> probability that the draft is accepted
PROCESSES: dict[str, Acceptance] = {
    "independent 0.30": lambda step, i: 0.30,
    "independent 0.55": lambda step, i: 0.55,
    "independent 0.85": lambda step, i: 0.85,
    "stretches of 20 steps, 0.90 / 0.15": lambda step, i: 0.90 if step // 20 % 2 == 0 else 0.15,
    # like the bundled P-EAGLE head on HumanEval and on MT-Bench: the first draft about half the time, deeper ones
    # far less often (docs/heads.md)
    "first 0.48, then 0.25": lambda step, i: 0.48 if i == 0 else 0.25,
    "first 0.38, then 0.20": lambda step, i: 0.38 if i == 0 else 0.20,
}


def simulate(accept: Acceptance, cost_ms: list[float], k: int | None, steps: int, seed: int,
             tokens_per_request: int = 64) -> float:
    """Output tokens per second of one request stream (a new request every `tokens_per_request` tokens); k None:
    the adaptive policy with K at most len(cost_ms) - 1, else that fixed K."""
    max_k = len(cost_ms) - 1
    policy = AdaptiveK(max_k, 1)
    policy.cost.calibrate(lambda rows: cost_ms[0] + (rows - 1) * 0.01 * cost_ms[0],
                          lambda m, w: max(0.0, cost_ms[w] - cost_ms[0] - w * 0.01 * cost_ms[0]))
    rng, tokens, ms, request, left = random.Random(seed), 0, 0.0, 0, tokens_per_request
    for step in range(steps):
        if left <= 0:
            policy.forget(str(request))
            request, left = request + 1, tokens_per_request
        [w] = policy.choose([Candidate(str(request), left)]) if k is None else [k]
        accepted = 0
        while accepted < w and rng.random() < accept(step, accepted):
            accepted += 1
        if k is None:
            if w:
                policy.observe(str(request), w, accepted)
            policy.observe_step(1 + w, 1 if w else 0, w, cost_ms[w])
        emitted = min(accepted + 1, left)  # nothing past the request's last token
        tokens, ms, left = tokens + emitted, ms + cost_ms[w], left - emitted
    return tokens / ms * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost-ms", type=float, nargs="+", default=[25.1, 32.6, 34.5, 35.4, 44.9, 43.1, 45.6, 48.1],
                    help="milliseconds of a step at K = 0, 1, ..: its length sets the largest K")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    ks = range(len(args.cost_ms))
    print("| acceptance | plain | best fixed K | adaptive | adaptive / better |")
    print("|---|---:|---:|---:|---:|")
    for name, accept in PROCESSES.items():
        def rate(k):
            return statistics.mean(simulate(accept, args.cost_ms, k, args.steps, s) for s in range(args.seeds))
        fixed = {k: rate(k) for k in ks}
        best = max((k for k in ks if k), key=fixed.get)
        adaptive = rate(None)
        print(f"| {name} | {fixed[0]:.1f} | {fixed[best]:.1f} (K={best}) | {adaptive:.1f} | "
              f"{adaptive / max(fixed[0], fixed[best]):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
