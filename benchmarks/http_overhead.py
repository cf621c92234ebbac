"""What the HTTP layer costs: requests/s and output tokens/s at concurrency 1, 8 and 32, through `peagle serve`
(streamed chat completions, as `vllm bench serve` sends them) against the same engine driven directly.

Both sides run the same engine configuration on the same prompts, greedy with `ignore_eos`, so every request
generates exactly --max-tokens tokens and the work is identical. N clients each send their next request as soon
as the last one ends (docs/design.md, "Benchmark definitions"). The server runs in its own process
(`peagle serve`, access log off) and the client in this one, as a real deployment would have them; on a small
machine they share its cores, which is part of what HTTP costs there.

    python benchmarks/http_overhead.py                       # embedded SmolLM2, its bundled head if installed
    python benchmarks/http_overhead.py --concurrency 8 --max-tokens 32 --speculative-config none
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "Explain how a rainbow forms.", "Write a short poem about autumn leaves.", "What is the capital of Australia?",
    "Give three tips for learning a new language.", "Describe the water cycle in simple terms.",
    "Why is the sky blue?", "Write a Python function that reverses a string.", "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.", "How do vaccines work?", "List four planets in the solar system.",
    "What is photosynthesis?", "Suggest a name for a friendly robot.", "How does a bicycle stay upright?",
    "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------------


def run_direct(engine, concurrency: int, total: int, max_tokens: int) -> tuple[float, int]:
    """(wall seconds, output tokens) with `concurrency` requests kept in flight on the engine itself, stepped in a
    worker thread exactly as the server steps it (torch's intra-op threading behaves differently in the main
    thread, which would make the comparison about threads rather than HTTP)."""
    import threading

    result = []
    t = threading.Thread(target=lambda: result.append(_direct(engine, concurrency, total, max_tokens)))
    t.start()
    t.join()
    return result[0]


def _direct(engine, concurrency: int, total: int, max_tokens: int) -> tuple[float, int]:
    import torch

    torch.set_grad_enabled(False)
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from peagle.engine import SamplingParams

    params = lambda: SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)  # noqa: E731
    sent = done = tokens = 0
    t0 = time.perf_counter()
    while sent < min(concurrency, total):
        engine.add_request(messages(sent), params(), chat=True)
        sent += 1
    while done < total:
        for out in engine.step():
            if out.finished:
                done += 1
                tokens += out.num_output_tokens
                if sent < total:
                    engine.add_request(messages(sent), params(), chat=True)
                    sent += 1
    return time.perf_counter() - t0, tokens


async def run_http(url: str, concurrency: int, total: int, max_tokens: int) -> tuple[float, int]:
    import httpx

    counter = iter(range(total))
    tokens = 0

    async def client(http: httpx.AsyncClient):
        nonlocal tokens
        for i in counter:
            body = {"messages": messages(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        tokens += json.loads(line[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - t0, tokens


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def cpu_split(pid: int, before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    """(event-loop thread, engine threads) CPU seconds between two snapshots of the server. The server's main thread
    runs the event loop (HTTP, JSON, SSE, tokenisation); the engine thread and torch's worker threads do the rest."""
    delta = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = delta.pop(pid, 0.0)
    return loop, sum(delta.values())


def start_server(args, spec_json: str | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "peagle.cli", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--dtype", args.dtype, "--max-waiting", "1000", "--no-baseline", "--disable-uvicorn-access-log",
           "--log-level", "warning", "--speculative-config", spec_json or "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    import httpx

    end = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server failed to start:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.time() > end:
            raise SystemExit("server did not start in 600 s")
        time.sleep(0.3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--speculative-config", help="JSON, or 'none' (default: the bundled P-EAGLE head if installed)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, help="requests per level (default: max(4, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per level; medians are reported")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, help="torch intra-op threads for both sides (OMP_NUM_THREADS for the "
                   "server; default: torch's own choice)")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()

    import torch

    from peagle.engine import LLMEngine
    from peagle.model.speculation import resolve_speculation

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server process inherits it
        torch.set_num_threads(args.threads)
    spec = resolve_speculation(args.model, args.speculative_config).config  # as `peagle serve` resolves it
    spec_json = spec.to_json() if spec is not None else None
    print(f"model {args.model or 'SmolLM2-135M-Instruct (embedded)'}; speculative config {spec_json or 'none'}; "
          f"max_tokens {args.max_tokens}; max_num_seqs {args.max_num_seqs}; torch threads {torch.get_num_threads()}",
          flush=True)

    results = []
    # the server (its own process) and the engine driven directly (this process), same configuration
    port = free_port()
    proc = start_server(args, spec_json, port)
    url = f"http://127.0.0.1:{port}"
    try:
        engine = LLMEngine.from_pretrained(args.model, spec_json, max_num_seqs=args.max_num_seqs,
                                           max_model_len=args.max_model_len, device="cpu", dtype=args.dtype)
        run_direct(engine, 2, 2, 4)  # warm-up
        asyncio.run(run_http(url, 2, 2, 4))
        for c in args.concurrency:
            n = args.requests or max(4, 2 * c)
            d_runs, h_runs, cpu_runs = [], [], []
            for r in range(args.rounds):
                # interleaved, alternating which goes first, so both see the same (shared) machine
                order = ("direct", "http") if r % 2 == 0 else ("http", "direct")
                for mode in order:
                    if mode == "direct":
                        wall, toks = run_direct(engine, c, n, args.max_tokens)
                        d_runs.append((n / wall, toks / wall))
                    else:
                        before, client0 = thread_cpu(proc.pid), time.process_time()
                        wall, toks = asyncio.run(run_http(url, c, n, args.max_tokens))
                        loop_cpu, engine_cpu = cpu_split(proc.pid, before, thread_cpu(proc.pid))
                        client_cpu = time.process_time() - client0
                        h_runs.append((n / wall, toks / wall))
                        cpu_runs.append(((loop_cpu + client_cpu) / engine_cpu * 100, loop_cpu / engine_cpu * 100))
                    print(f"  {mode:<6} c={c:<3} round {r}: {n / wall:7.3f} req/s  {toks / wall:8.1f} tok/s",
                          flush=True)
            d_req, d_tok = (statistics.median(x) for x in zip(*d_runs))
            h_req, h_tok = (statistics.median(x) for x in zip(*h_runs))
            # paired: round r's HTTP run against round r's direct run (they ran back to back), median over rounds
            overhead = statistics.median((d[1] - h[1]) / d[1] * 100 for d, h in zip(d_runs, h_runs))
            cpu_total, cpu_loop = (statistics.median(x) for x in zip(*cpu_runs))
            print(f"c={c}: direct {d_tok:.1f} tok/s, http {h_tok:.1f} tok/s (median of {args.rounds}); "
                  f"HTTP cost {overhead:+.1f}% wall (median of paired rounds); HTTP CPU {cpu_total:.1f}% of engine CPU "
                  f"(server event loop {cpu_loop:.1f}%)", flush=True)
            results.append({"concurrency": c, "requests": n, "rounds": args.rounds, "direct_req_s": d_req,
                            "direct_tok_s": d_tok, "http_req_s": h_req, "http_tok_s": h_tok,
                            "http_cost_pct": overhead, "http_cpu_pct": cpu_total, "loop_cpu_pct": cpu_loop,
                            "direct_runs": d_runs, "http_runs": h_runs})
    finally:
        proc.terminate()
        proc.wait(30)

    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (1 min), on {os.cpu_count()} CPUs")
    print("\n| concurrency | requests | direct req/s | HTTP req/s | direct tok/s | HTTP tok/s | HTTP cost (wall) "
          "| HTTP CPU / engine CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['concurrency']} | {r['requests']} | {r['direct_req_s']:.3f} | {r['http_req_s']:.3f} | "
              f"{r['direct_tok_s']:.1f} | {r['http_tok_s']:.1f} | {r['http_cost_pct']:+.1f}% | "
              f"{r['http_cpu_pct']:.1f}% (loop {r['loop_cpu_pct']:.1f}%) |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
