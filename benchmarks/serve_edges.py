"""Two costs at the server's edges, measured through a real `peagle serve` process (embedded SmolLM2 and its bundled
P-EAGLE head unless told otherwise):

  gap       the longest pause a running stream sees while the server refuses a large request: by default a 5 MB
            one under the body limit (--limit, 8 MB here), which the prompt length check refuses before tokenising
            (400), and one over it (413); with /health latency meanwhile
  logprobs  output tokens/s at concurrency 1 and 8 with and without `logprobs` + `top_logprobs` (streamed chat,
            greedy, ignore_eos, so both sides generate exactly the same tokens), interleaved rounds

    python benchmarks/serve_edges.py gap
    python benchmarks/serve_edges.py gap --limit 4194304 --sizes 5000000 600000   # the default limit
    python benchmarks/serve_edges.py logprobs --rounds 2
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
import threading
import time

import httpx

CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
PROMPTS = ["Explain how a rainbow forms.", "Write a short poem about autumn leaves.", "Why is the sky blue?",
           "Give three tips for learning a new language.", "Describe the water cycle in simple terms.",
           "What causes the seasons on Earth?", "How do vaccines work?", "What is photosynthesis?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "peagle.cli", "serve", "--port", str(port), "--no-baseline",
           "--disable-uvicorn-access-log", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    end = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server failed to start:\n{proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > end:
            raise SystemExit("server did not start in 600 s")
        time.sleep(0.3)


# ------------------------------------------------------------------------------------------------------------


def measure_gap(url: str, size: int) -> dict:
    """Stream a long answer; after 2 s send a `size`-byte chat body; the stream's gaps before and during it."""
    times: list[float] = []
    done = threading.Event()

    def stream():
        body = {"messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    times.append(time.perf_counter())
                if done.is_set():
                    return

    t = threading.Thread(target=stream)
    t.start()
    while len(times) < 3:
        time.sleep(0.01)
    time.sleep(2.0)
    raw = json.dumps({"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 8}).encode()
    health: list[float] = []

    def poll_health():
        while not done.is_set():
            s = time.perf_counter()
            httpx.get(url + "/health", timeout=30)
            health.append(time.perf_counter() - s)
            time.sleep(0.02)

    h = threading.Thread(target=poll_health)
    h.start()
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"},
                   timeout=300)
    answered = time.perf_counter()
    time.sleep(1.0)
    done.set()
    t.join()
    h.join()
    before = [b - a for a, b in zip(times, times[1:]) if b < start]
    during = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= answered]
    return {"body_bytes": len(raw), "status": r.status_code, "error": r.json()["error"]["message"][:90],
            "answered_s": round(answered - start, 3), "median_gap_before_s": round(statistics.median(before), 3),
            "max_gap_before_s": round(max(before), 3), "max_gap_during_s": round(max(during, default=0.0), 3),
            "max_health_s": round(max(health), 3)}


def gap(args) -> list[dict]:
    proc, url = start_server(["--max-request-bytes", str(args.limit), *args.serve_args])
    try:
        rows = []
        for size in args.sizes or (5_000_000, args.limit + 1_000_000):
            rows.append(measure_gap(url, size))
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait()


# ------------------------------------------------------------------------------------------------------------


async def run_load(url: str, concurrency: int, total: int, max_tokens: int, logprobs: bool) -> tuple[float, int]:
    """(wall seconds, output tokens) with `concurrency` clients each sending the next request when one ends."""
    sent = 0
    tokens = 0

    async def client(http: httpx.AsyncClient):
        nonlocal sent, tokens
        while sent < total:
            i = sent
            sent += 1
            body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if logprobs:
                body.update(logprobs=True, top_logprobs=5)
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens += usage["completion_tokens"]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return time.perf_counter() - start, tokens


def logprobs_overhead(args) -> list[dict]:
    proc, url = start_server(["--max-num-seqs", "8", *args.serve_args])
    try:
        asyncio.run(run_load(url, 1, 1, 4, True))  # warm-up
        rows = []
        for c in args.concurrency:
            total = max(2, 2 * c)
            tps = {False: [], True: []}
            for r in range(args.rounds):
                for lp in ((False, True) if r % 2 == 0 else (True, False)):
                    wall, tokens = asyncio.run(run_load(url, c, total, args.max_tokens, lp))
                    tps[lp].append(tokens / wall)
            plain, with_lp = statistics.median(tps[False]), statistics.median(tps[True])
            rows.append({"concurrency": c, "requests": total, "max_tokens": args.max_tokens,
                         "tok_s_plain": round(plain, 2), "tok_s_logprobs": round(with_lp, 2),
                         "overhead_pct": round(100 * (plain / with_lp - 1), 1),
                         "rounds_plain": [round(x, 2) for x in tps[False]],
                         "rounds_logprobs": [round(x, 2) for x in tps[True]]})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["gap", "logprobs"])
    p.add_argument("--limit", type=int, default=8_000_000, help="gap: the server's --max-request-bytes")
    p.add_argument("--sizes", type=int, nargs="+", help="gap: chat bodies to send, in characters of content "
                   "(default: 5 MB and 1 MB over the limit)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    args, args.serve_args = p.parse_known_args()  # the rest are `peagle serve` flags
    rows = gap(args) if args.what == "gap" else logprobs_overhead(args)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
