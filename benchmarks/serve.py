"""What the server costs, measured through a real `peagle serve` process on 127.0.0.1 (the embedded SmolLM2 and what
`peagle serve` speculates with by default, unless --model / --speculative-config say otherwise), one subcommand each
(docs/serving.md):

    python3 benchmarks/serve.py http [--concurrency 1 8 32]   # HTTP against the same engine driven directly
    python3 benchmarks/serve.py hostile --random 100           # hostile and careless requests beside a stream
    python3 benchmarks/serve.py gap                            # a running stream while a huge body is refused
    python3 benchmarks/serve.py gap --limit 4194304 --sizes 5000000 600000      # the default body limit
    python3 benchmarks/serve.py logprobs --rounds 2            # tokens/s with and without logprobs
    python3 benchmarks/serve.py memory --max-num-seqs 8 32 --concurrency 1 8 32   # resident memory against load
    python3 benchmarks/serve.py soak --minutes 30 --streams 32  # everything at once, a kill -9 half way
    python3 benchmarks/serve.py restart --restarts 3            # launch, then kill -9 and restart, to /health 200

http: requests/s and output tokens/s at each concurrency through the server (streamed chat completions, as `vllm
bench serve` sends them) and through the same engine configuration in this process, greedy with ignore_eos so the
work is identical, N clients each sending their next request when the last ends, rounds interleaved; and the HTTP
side's CPU (the server's event loop plus this client) as a share of the engine's.
hostile: lone UTF-16 surrogates in every string field, token ids out of range, every body type a web page can send
cross-site, garbage bytes, bad JSON, deep nesting, missing API keys, bodies that declare more than they send (cut at
--body-timeout), then seeded random mutations of valid bodies, each sent while a long stream runs: the answers by
status code, any 5xx, and the longest gap the stream saw against its median (one decode step).
gap: the longest pause a running stream sees while the server refuses a large request: by default a 5 MB one under
the body limit (--limit; the prompt length check refuses it before tokenising: 400) and one over it (413), with
/health latency meanwhile.
logprobs: output tokens/s at each concurrency with and without `logprobs` + `top_logprobs` (streamed chat, greedy,
ignore_eos), interleaved rounds.
memory: the server's resident memory idle (per --max-num-seqs, after one short request) and at its peak while N streams of --max-tokens run
(greedy, ignore_eos, all at once), against the KV cache those tokens in flight need (the model's bytes per token,
target and head, times the streams' prompt and output tokens), and the KV cache the server held at its peak
(vllm:kv_cache_usage_perc times the pool, vllm:cache_config_info); failed requests and preemptions from /metrics.
soak: --streams clients for --minutes, each sending multi-turn chats, code edits and plain questions (greedy, a
tenth cancelled part way), beside a hostile request every 2 s; half way (--kill-at) the server is killed (SIGKILL) and
started again. One line: requests, preemptions, 5xx, streams that ended without [DONE] (other than those the kill
cut), greedy answers that differ from the same prompt's answer alone, hostile requests not refused with a 4xx (a
random mutation may be valid: only its 5xx counts), resident memory's drift after warm-up beside the KV pool's
touched blocks, the prefix cache's (and its budget) and the suffix trees', and with them taken out (least, most, last;
drift), inter-token gaps from the first token on (p50, p99, longest;
the longest with how many streams stalled with them; the restart excluded), time to first token apart, this client's
longest garbage collection, and the restart's time to healthy.
restart: seconds from launch to a 200 from /health, for a first start and then --restarts times after a SIGKILL
(the start-up timings remembered since the first: docs/serving.md, "Restarts"), and the server's CPU seconds by
then (the wall time less what other jobs on the machine took).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["Explain how a rainbow forms.", "Write a short poem about autumn leaves.", "Why is the sky blue?",
           "Give three tips for learning a new language.", "Describe the water cycle in simple terms.",
           "What causes the seasons on Earth?", "How do vaccines work?", "What is photosynthesis?"]
API_KEY = "bench-key"
# Every request from every thread goes through this one client, as a real client's keep-alive pool. httpx's top-level
# calls (httpx.get, httpx.stream) build a client and its TLS context each time, about 40 ms of CPU: 32 streams
# retrying a restarting server every 0.5 s that way took both cores of a 2-core machine from the server they waited for.
HTTP = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64), trust_env=False)


def speculative_json(args) -> str | None:
    """The speculative config as `peagle serve` resolves the flag (None: no speculation)."""
    from peagle.model.speculation import resolve_speculation

    spec = resolve_speculation(args.model, args.speculative_config).config
    return spec.to_json() if spec is not None else None


@contextlib.contextmanager
def server(args, max_num_seqs: int = 8, extra: list[str] | None = None):
    """`peagle serve` in its own process, its log in a temporary folder; yields it (`.url`, `.proc`)."""
    from peagle.bench.loadgen import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        with ServerProcess(args.model, speculative_json(args), max_num_seqs, Path(tmp) / "serve.log",
                           max_model_len=getattr(args, "max_model_len", None), extra_args=extra,
                           threads=args.threads) as proc:
            yield proc


def chat_body(i: int, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}


async def clients(url: str, concurrency: int, total: int, max_tokens: int, **extra) -> tuple[float, int]:
    """(wall seconds, output tokens) with `concurrency` clients each sending the next request when one ends."""
    counter, tokens = iter(range(total)), 0

    async def client(http: httpx.AsyncClient):
        nonlocal tokens
        for i in counter:
            async with http.stream("POST", url + "/v1/chat/completions", json=chat_body(i, max_tokens, **extra),
                                   headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        tokens += json.loads(line[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - t0, tokens


class Stream:
    """A long streamed answer in a thread, the arrival time of every event recorded, until stopped."""

    def __init__(self, url: str, headers: dict | None = None):
        self.times: list[float] = []
        self.done = threading.Event()
        body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
                "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body, headers or {}), daemon=True)
        self.thread.start()
        while len(self.times) < 20:  # past the prefill: one decode step per event
            time.sleep(0.05)

    def _run(self, url: str, body: dict, headers: dict) -> None:
        with HTTP.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.times.append(time.perf_counter())
                if self.done.is_set():
                    return

    def stop(self) -> list[float]:
        """The gaps between events."""
        self.done.set()
        self.thread.join(timeout=60)
        return [b - a for a, b in zip(self.times, self.times[1:])]


# ---- http

def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, from /proc."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            raw = (task / "stat").read_text()
            fields = raw[raw.rindex(")") + 2:].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def run_direct(engine, concurrency: int, total: int, max_tokens: int) -> tuple[float, int]:
    """(wall seconds, output tokens) with `concurrency` requests in flight on the engine itself, stepped in a worker
    thread as the server steps it (torch's intra-op threading behaves differently in the main thread)."""
    from peagle.engine import SamplingParams

    def work():
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        sent = done = tokens = 0
        t0 = time.perf_counter()
        while sent < min(concurrency, total):
            engine.add_request(chat_body(sent, max_tokens)["messages"], params, chat=True)
            sent += 1
        while done < total:
            for out in engine.step():
                if out.finished:
                    done, tokens = done + 1, tokens + out.num_output_tokens
                    if sent < total:
                        engine.add_request(chat_body(sent, max_tokens)["messages"], params, chat=True)
                        sent += 1
        result.append((time.perf_counter() - t0, tokens))

    result: list[tuple[float, int]] = []
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return result[0]


def http_level(engine, proc, c: int, args) -> dict:
    """One concurrency: direct and HTTP rounds interleaved, alternating which goes first."""
    n = args.requests or max(4, 2 * c)
    direct, http, cpu = [], [], []
    for r in range(args.rounds):
        for mode in ("direct", "http") if r % 2 == 0 else ("http", "direct"):
            if mode == "direct":
                wall, toks = run_direct(engine, c, n, args.max_tokens)
                direct.append((n / wall, toks / wall))
                continue
            before, client0 = thread_cpu(proc.proc.pid), time.process_time()
            wall, toks = asyncio.run(clients(proc.url, c, n, args.max_tokens))
            delta = {t: s - before.get(t, 0.0) for t, s in thread_cpu(proc.proc.pid).items()}
            loop = delta.pop(proc.proc.pid, 0.0)  # the main thread runs the event loop; the rest is the engine
            engine_cpu = sum(delta.values())
            http.append((n / wall, toks / wall))
            cpu.append(((loop + time.process_time() - client0) / engine_cpu * 100, loop / engine_cpu * 100))
    (d_req, d_tok), (h_req, h_tok) = ([statistics.median(x) for x in zip(*runs)] for runs in (direct, http))
    cpu_total, cpu_loop = (statistics.median(x) for x in zip(*cpu))
    return {"concurrency": c, "requests": n, "rounds": args.rounds, "direct_req_s": d_req, "direct_tok_s": d_tok,
            "http_req_s": h_req, "http_tok_s": h_tok,  # paired: each round's runs ran back to back
            "http_cost_pct": statistics.median((d[1] - h[1]) / d[1] * 100 for d, h in zip(direct, http)),
            "http_cpu_pct": cpu_total, "loop_cpu_pct": cpu_loop}


def http(args) -> list[dict]:
    import torch

    from peagle.engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with server(args, args.max_num_seqs, ["--dtype", args.dtype, "--max-waiting", "1000"]) as proc:
        engine = LLMEngine.from_pretrained(args.model, speculative_json(args), max_num_seqs=args.max_num_seqs,
                                           max_model_len=args.max_model_len, device="cpu", dtype=args.dtype)
        run_direct(engine, 2, 2, 4)  # warm-up
        asyncio.run(clients(proc.url, 2, 2, 4))
        for c in args.concurrency:
            rows.append(http_level(engine, proc, c, args))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| concurrency | requests | direct req/s | HTTP req/s | direct tok/s | HTTP tok/s | HTTP cost (wall) "
          "| HTTP CPU / engine CPU |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['direct_req_s']:.3f} | {r['http_req_s']:.3f} | "
              f"{r['direct_tok_s']:.1f} | {r['http_tok_s']:.1f} | {r['http_cost_pct']:+.1f}% | "
              f"{r['http_cpu_pct']:.1f}% (loop {r['loop_cpu_pct']:.1f}%) |")
    return rows


# ---- hostile

def hostile_cases() -> list[tuple[str, str, dict, bytes]]:
    """(name, path, headers, raw body)."""
    auth, js, msg, chat = {"Authorization": f"Bearer {API_KEY}"}, {"Content-Type": "application/json"}, \
        [{"role": "user", "content": "hi"}], "/v1/chat/completions"
    out = []
    for field, body in [("content", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
                        ("content part", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                     "text": "\udfff"}]}]}),
                        ("name", {"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}),
                        ("stop", {"messages": msg, "stop": "\ud800"}),
                        ("stop list", {"messages": msg, "stop": ["\ud800"]}),
                        ("model", {"messages": msg, "model": "\udc00"}), ("user", {"messages": msg, "user": "\ud800"}),
                        ("key", {"messages": msg, "\ud800": 1})]:
        out.append((f"surrogate in {field} (chat)", chat, {**auth, **js},
                    json.dumps({**body, "max_tokens": 2}).encode()))
    for path in ("/v1/completions", "/invocations"):
        out.append((f"surrogate in prompt ({path})", path, {**auth, **js}, b'{"prompt": "x\\ud800", "max_tokens": 2}'))
    for field, value in [("prompt ids", {"prompt": [-1]}), ("prompt ids", {"prompt": [10 ** 9]}),
                         ("prompt id lists", {"prompt": [[1], [49152]]}),
                         ("stop_token_ids", {"prompt": "hi", "stop_token_ids": [-1]}),
                         ("stop_token_ids", {"prompt": "hi", "stop_token_ids": [10 ** 9]}),
                         ("stop_token_ids", {"prompt": "hi", "stop_token_ids": [2 ** 70]}),
                         ("prompt [[]]", {"prompt": [[]]}), ("prompt mixed", {"prompt": [1, "a"]})]:
        out.append((f"{field} out of range or malformed", "/v1/completions", {**auth, **js},
                    json.dumps({**value, "max_tokens": 2}).encode()))
    valid = json.dumps({"messages": msg, "max_tokens": 2}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/html"):
        for path in (chat, "/v1/completions", "/invocations"):
            out.append((f"Content-Type {kind.split(';')[0]} on {path}", path, {**auth, "Content-Type": kind}, valid))
    for name, raw in [("garbage bytes", b"\xff\xfe\x00garbage\x81"), ("bad JSON", b'{"messages": [}'),
                      ("empty body", b""), ("JSON array", b"[1, 2]"), ("deep nesting", b"[" * 5000 + b"]" * 5000),
                      ("messages [5]", b'{"messages": [5]}'), ("null content", b'{"messages": [{"role": "user"}]}'),
                      ("n huge", b'{"messages": [{"role": "user", "content": "x"}], "n": 100000}'),
                      ("max_tokens negative", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}')]:
        for path in (chat, "/invocations"):
            out.append((f"{name} ({path})", path, {**auth, **js}, raw))
    for path in (chat, "/v1/completions", "/v1/models", "/invocations"):
        out.append((f"no API key on {path}", path, dict(js), valid))
    return out


def mutated(rng: random.Random) -> bytes:
    """A valid body with one to three fields replaced by something hostile."""
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0.5}
    fields = ["messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
              "stream", "logprobs", "top_logprobs", "model", "response_format"]
    junk = [None, -1, 0, 2 ** 64, -2 ** 70, 1e308, "", "\ud800", [], {}, [[[]]], "x" * 10000, [10 ** 9], True,
            [{"role": "user"}], [{"role": "x", "content": 1}], {"type": "json_object"}]
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(fields)] = rng.choice(junk)
    return json.dumps(body).encode()


def trickle(url: str, timeout: float) -> int:
    """Headers that promise 10,000 bytes, 10 sent: the status the server answers (it must cut the connection)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n{\"message")
        s.settimeout(timeout + 20)
        head = s.recv(64)
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1") else -1


def hostile(args) -> list[dict]:
    rng, counts, fives = random.Random(0), collections.Counter(), []
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    todo = hostile_cases() + [(f"random {i}", "/v1/chat/completions", headers, mutated(rng))
                              for i in range(args.random)]
    with server(args, extra=["--api-key", API_KEY, "--body-timeout", str(args.body_timeout)]) as proc:
        stream = Stream(proc.url, {"Authorization": f"Bearer {API_KEY}"})
        with httpx.Client(timeout=120) as c:
            for name, path, headers, raw in todo:
                method = "GET" if path == "/v1/models" else "POST"
                r = c.request(method, proc.url + path, content=raw if method == "POST" else None, headers=headers)
                counts[r.status_code] += 1
                if r.status_code >= 500:
                    fives.append((name, r.status_code, r.text[:200]))
        for _ in range(3):
            code = trickle(proc.url, args.body_timeout)
            counts[code] += 1
            if code >= 500 or code < 0:
                fives.append(("trickling body", code, ""))
        gaps = stream.stop()
    step = statistics.median(gaps)
    print(f"{sum(counts.values())} requests beside a running stream: "
          + ", ".join(f"{n} x {code}" for code, n in sorted(counts.items())))
    print(f"5xx: {len(fives)}" + "".join(f"\n  {f}" for f in fives))
    print(f"running stream: {len(gaps)} tokens, median gap {step * 1e3:.1f} ms (one decode step), longest "
          f"{max(gaps) * 1e3:.1f} ms ({max(gaps) / step:.1f} steps)")
    return [{"status_counts": dict(counts), "fives": fives, "median_gap_s": step, "max_gap_s": max(gaps)}]


# ---- gap

def refused_gap(url: str, size: int) -> dict:
    """Send a `size`-character chat body beside a running stream; the stream's gaps before and during it."""
    stream = Stream(url)
    time.sleep(2.0)
    raw = json.dumps({"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 8}).encode()
    health: list[float] = []
    done = threading.Event()

    def poll_health():
        while not done.is_set():
            s = time.perf_counter()
            HTTP.get(url + "/health", timeout=30)
            health.append(time.perf_counter() - s)
            time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    start = time.perf_counter()
    r = HTTP.post(url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"},
                   timeout=300)
    answered = time.perf_counter()
    time.sleep(1.0)
    done.set()
    poller.join()
    stream.stop()
    t = stream.times
    before = [b - a for a, b in zip(t, t[1:]) if b < start]
    during = [b - a for a, b in zip(t, t[1:]) if b >= start and a <= answered]
    return {"body_bytes": len(raw), "status": r.status_code, "error": r.json()["error"]["message"][:90],
            "answered_s": round(answered - start, 3), "median_gap_before_s": round(statistics.median(before), 3),
            "max_gap_before_s": round(max(before), 3), "max_gap_during_s": round(max(during, default=0.0), 3),
            "max_health_s": round(max(health), 3)}


def gap(args) -> list[dict]:
    rows = []
    with server(args, extra=["--max-request-bytes", str(args.limit)]) as proc:
        for size in args.sizes or (5_000_000, args.limit + 1_000_000):
            rows.append(refused_gap(proc.url, size))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- logprobs

def logprobs(args) -> list[dict]:
    rows = []
    with server(args) as proc:
        asyncio.run(clients(proc.url, 1, 1, 4, logprobs=True, top_logprobs=5))  # warm-up
        for c in args.concurrency:
            total, tps = max(2, 2 * c), {False: [], True: []}
            for r in range(args.rounds):
                for lp in (False, True) if r % 2 == 0 else (True, False):
                    extra = {"logprobs": True, "top_logprobs": 5} if lp else {}
                    wall, tokens = asyncio.run(clients(proc.url, c, total, args.max_tokens, **extra))
                    tps[lp].append(tokens / wall)
            plain, with_lp = statistics.median(tps[False]), statistics.median(tps[True])
            rows.append({"concurrency": c, "requests": total, "max_tokens": args.max_tokens,
                         "tok_s_plain": round(plain, 2), "tok_s_logprobs": round(with_lp, 2),
                         "overhead_pct": round(100 * (plain / with_lp - 1), 1),
                         "rounds_plain": [round(x, 2) for x in tps[False]],
                         "rounds_logprobs": [round(x, 2) for x in tps[True]]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- memory

def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def kv_bytes_per_token(args) -> int:
    """Keys and values of one position, every layer of the target and of the head `peagle serve` runs."""
    from peagle.model.loading import config_dir
    from peagle.model.speculation import resolve_speculation

    def per_token(folder: Path) -> int:
        cfg = json.loads((folder / "config.json").read_text())
        heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return 2 * cfg["num_hidden_layers"] * heads * dim * 2  # bf16

    chosen = resolve_speculation(args.model, args.speculative_config)
    total = per_token(config_dir(Path(chosen.model_path)))
    if chosen.config is not None and chosen.config.uses_head and chosen.head_path:
        total += per_token(Path(chosen.head_path))
    return total


def samples(text: str, name: str) -> list:
    """The samples of /metrics named `name` (prometheus_client's parser: `.labels`, `.value`)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def metric(text: str, name: str) -> float:
    """A sample's value, summed over its labels (0 when absent)."""
    return sum(s.value for s in samples(text, name))


async def watched_streams(proc, concurrency: int, max_tokens: int) -> dict:
    """`concurrency` streams at once, the server's resident memory and KV usage sampled while they run."""
    peak = {"rss": rss_bytes(proc.proc.pid), "kv": 0.0}
    done = asyncio.Event()

    async def sample(http: httpx.AsyncClient):
        while not done.is_set():
            peak["rss"] = max(peak["rss"], rss_bytes(proc.proc.pid))
            peak["kv"] = max(peak["kv"], metric((await http.get(proc.url + "/metrics")).text,
                                                "vllm:kv_cache_usage_perc"))
            await asyncio.sleep(0.25)

    failed, tokens = 0, 0

    async def stream(http: httpx.AsyncClient, i: int):
        nonlocal failed, tokens
        try:
            async with http.stream("POST", proc.url + "/v1/chat/completions", json=chat_body(i, max_tokens),
                                   headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                if r.status_code != 200:
                    failed += 1
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        usage = json.loads(line[6:])["usage"]
                        tokens += usage["prompt_tokens"] + usage["completion_tokens"]
        except httpx.HTTPError:
            failed += 1

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        sampler = asyncio.create_task(sample(http))
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(http, i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
        done.set()
        await sampler
        text = (await http.get(proc.url + "/metrics")).text
    config = samples(text, "vllm:cache_config_info")
    held = None  # a server from before the paged cache reports no pool
    if config:
        held = peak["kv"] * int(config[0].labels["num_gpu_blocks"]) * int(config[0].labels["peagle_block_bytes"])
    return {"peak_rss": peak["rss"], "peak_kv_bytes": held, "failed": failed, "tokens": tokens,
            "seconds": wall, "preemptions": metric(text, "vllm:num_preemptions_total")}


def memory(args) -> list[dict]:
    per_token, rows, mb = kv_bytes_per_token(args), [], 2**20
    for seqs in args.max_num_seqs:
        extra = ["--max-model-len", str(args.max_model_len)] + (["--kv-cache-gb", str(args.kv_cache_gb)]
                                                                 if args.kv_cache_gb else [])
        with server(args, max_num_seqs=seqs, extra=extra) as proc:
            asyncio.run(clients(proc.url, 1, 1, 4))  # one short request first: the code a request runs, loaded
            time.sleep(1)
            idle = rss_bytes(proc.proc.pid)
            rows.append({"max_num_seqs": seqs, "concurrency": 0, "rss_mb": round(idle / mb)})
            print(json.dumps(rows[-1]), flush=True)
            for c in args.concurrency:
                got = asyncio.run(watched_streams(proc, c, args.max_tokens))
                kv_needed = got["tokens"] * per_token  # every stream's whole context at once (the peak)
                rows.append({"max_num_seqs": seqs, "concurrency": c, "rss_mb": round(got["peak_rss"] / mb),
                             "rss_over_idle_mb": round((got["peak_rss"] - idle) / mb),
                             "kv_in_flight_mb": round(kv_needed / mb),
                             "growth_over_kv": round((got["peak_rss"] - idle) / kv_needed, 2) if kv_needed else None,
                             "kv_held_mb": round(got["peak_kv_bytes"] / mb) if got["peak_kv_bytes"] else None,
                             "held_over_kv": round(got["peak_kv_bytes"] / kv_needed, 2)
                             if kv_needed and got["peak_kv_bytes"] else None,
                             "failed": got["failed"],
                             "preemptions": got["preemptions"], "tokens": got["tokens"],
                             "seconds": round(got["seconds"], 1)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- soak

EDIT = ("Here is a function:\n\ndef area(w, h):\n    return w * h\n\n"
        "Rename it to rectangle_area and add a docstring. Reply with the whole function.")


def soak_prompt(rng: random.Random, history: list[dict]) -> list[dict]:
    """The next conversation a client sends: its last one continued, a code edit, or a fresh question."""
    kind = rng.random()
    if kind < 0.4 and history:
        return history + [{"role": "user", "content": rng.choice(PROMPTS)}]
    if kind < 0.7:
        return [{"role": "user", "content": EDIT}]
    return [{"role": "user", "content": rng.choice(PROMPTS)}]


def preemptions(url: str) -> int:
    return int(metric(HTTP.get(url + "/metrics", timeout=60).text, "vllm:num_preemptions_total"))


def cache_bytes(url: str) -> dict[str, int]:
    """What grows the server's resident memory by design, each to a bound (/metrics; docs/memory.md): the KV pool's
    blocks ever handed out; the prefix cache's blocks (pool blocks, and the target features it keeps beside each)
    and its budget, --prefix-cache-gb; the drafters' suffix trees of finished answers. `outside_pool`: the features
    and the trees, what the cache holds outside the pool's touched blocks."""
    text = HTTP.get(url + "/metrics", timeout=60).text
    config = samples(text, "vllm:cache_config_info")[0].labels
    block, cached = int(config["peagle_block_bytes"]), int(config.get("peagle_prefix_block_bytes", 0))
    prefix_blocks = int(metric(text, "peagle:prefix_cache_blocks"))
    trees = int(metric(text, "peagle:proposer_cached_bytes"))
    return {"kv_touched": int(metric(text, "peagle:kv_cache_touched_blocks")) * block,
            "prefix_cache": prefix_blocks * cached, "proposer": trees,
            "outside_pool": prefix_blocks * max(0, cached - block) + trees,
            "prefix_budget": int(config.get("peagle_prefix_max_blocks", 0)) * cached}


def stalled(spans: list[tuple[float, float]], top: int = 5) -> list[list]:
    """The longest inter-token gaps as [seconds, streams in a gap at least half as long across its middle]: a gap
    many streams share is the whole server pausing; one alone is that stream's (its step, or this client)."""
    out = []
    for a, b in sorted(spans, key=lambda s: s[0] - s[1])[:top]:
        mid, half = (a + b) / 2, (b - a) / 2
        out.append([round(b - a, 3), sum(x < mid < y and y - x >= half for x, y in spans)])
    return out


def soak(args) -> list[dict]:
    import signal

    from peagle.bench.loadgen import ServerProcess

    headers = {"Authorization": f"Bearer {API_KEY}"}
    hostile_todo = hostile_cases()
    stats = collections.Counter()
    gc_pauses, gc_start = [0.0], [0.0]

    def client_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses[0] = max(gc_pauses[0], time.perf_counter() - gc_start[0])

    spans: list[tuple[float, float]] = []  # (a token's arrival, the next one's), per stream
    ttfts: list[float] = []
    rss: list[int] = []
    caches: list[dict[str, int]] = []  # cache_bytes beside each rss sample
    solo: dict[str, str] = {}  # conversation -> its greedy answer alone
    end = time.monotonic() + 60 * args.minutes
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--api-key", API_KEY, "--max-waiting", str(4 * args.streams)]
        proc = ServerProcess(args.model, speculative_json(args), args.streams, Path(tmp) / "serve.log",
                             extra_args=extra + (["--kv-cache-gb", str(args.kv_cache_gb)] if args.kv_cache_gb else []),
                             threads=args.threads).start()
        state = {"url": proc.url, "restarting": False}  # the restarted server listens on the same port

        def ask(messages: list[dict], max_tokens: int, cancel_after: int | None = None) -> tuple[str, bool, list]:
            """(text, ended with [DONE], the time sent and then each chunk's arrival)"""
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            text, done, times = [], False, [time.perf_counter()]
            with HTTP.stream("POST", state["url"] + "/v1/chat/completions", json=body, headers=headers,
                              timeout=600) as r:
                stats[f"status {r.status_code}"] += 1
                if r.status_code != 200:
                    return "", True, []
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        # the role chunk goes out as the request is queued, before any token: not a token's arrival
                        if not any(c["delta"].get("role") for c in chunk["choices"]):
                            times.append(time.perf_counter())
                        text += [c["delta"].get("content") or "" for c in chunk["choices"]]
                    if cancel_after is not None and len(times) >= cancel_after:
                        return "".join(text), True, times
            return "".join(text), done, times

        def client(seed: int) -> None:
            rng, history = random.Random(seed), []
            while time.monotonic() < end:
                messages = soak_prompt(rng, history)
                cancel = rng.randrange(2, 20) if rng.random() < 0.1 else None
                try:
                    text, done, times = ask(messages, args.max_tokens, cancel)
                except httpx.HTTPError:
                    stats["cut by the kill" if state["restarting"] else "connection errors"] += 1
                    time.sleep(0.5)
                    continue
                stats["requests"] += 1
                if not done:
                    stats["streams without [DONE]"] += 1
                if not state["restarting"] and len(times) > 1:
                    ttfts.append(times[1] - times[0])  # queueing and prefill: not an inter-token gap
                    spans.extend(zip(times[1:], times[2:]))
                key = json.dumps(messages)
                if cancel is None and key in solo and solo[key] != text:
                    stats["greedy mismatches"] += 1
                if cancel is None:
                    history = messages + [{"role": "assistant", "content": text}]
                    if len(history) > 6:
                        history = []

        def hostile_loop() -> None:
            rng, i = random.Random(1), 0
            while time.monotonic() < end:
                time.sleep(2)
                name, path, h, raw = hostile_todo[i % len(hostile_todo)] if i % 2 else \
                    ("random", "/v1/chat/completions", {**headers, "Content-Type": "application/json"}, mutated(rng))
                i += 1
                try:
                    method = "GET" if path == "/v1/models" else "POST"
                    r = HTTP.request(method, state["url"] + path, content=raw if method == "POST" else None,
                                      headers=h, timeout=120)
                except httpx.HTTPError:
                    continue
                stats["hostile"] += 1
                # a fixed case is refused; a random mutation may still be a valid request, but never a 5xx
                if r.status_code >= 500 or (name != "random" and not 400 <= r.status_code < 500):
                    stats["hostile not refused"] += 1

        for messages in ([{"role": "user", "content": EDIT}], *([{"role": "user", "content": p}] for p in PROMPTS)):
            solo[json.dumps(messages)] = ask(messages, args.max_tokens)[0]  # each alone, before the load
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.streams)]
        threads.append(threading.Thread(target=hostile_loop, daemon=True))
        # This client is Python too: a full collection here stalls every stream's timestamps at once, as a server
        # pause would. Its start-up heap goes out of the collector's reach, and what collections remain are timed.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(client_gc)
        for t in threads:
            t.start()
        half = time.monotonic() + 60 * args.minutes * args.kill_at if args.kill_at else float("inf")
        warm, restart_s = time.monotonic() + 6 * args.minutes, None
        while time.monotonic() < end:
            time.sleep(5)
            if time.monotonic() > warm and proc.proc.poll() is None and not state["restarting"]:
                rss.append(rss_bytes(proc.proc.pid))
                caches.append(cache_bytes(state["url"]))
            if restart_s is None and time.monotonic() > half:
                stats["preemptions"] += preemptions(state["url"])
                state["restarting"] = True
                proc.proc.send_signal(signal.SIGKILL)
                proc.proc.wait()
                t0 = time.perf_counter()
                proc.start()  # on the same port
                restart_s = time.perf_counter() - t0
                state["restarting"] = False
                warm, rss, caches = time.monotonic() + 60, [], []
        for t in threads:
            t.join(timeout=660)
        stats["preemptions"] += preemptions(state["url"])
        proc.stop()
        gc.callbacks.remove(client_gc)
        gc.unfreeze()
    gaps, ttfts, mb = sorted(b - a for a, b in spans), sorted(ttfts), 2**20
    rest = [r - c["kv_touched"] - c["outside_pool"] for r, c in zip(rss, caches)]
    q = (lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan"))
    row = {"requests": stats["requests"], "preemptions": stats["preemptions"], "5xx": sum(n for k, n in stats.items() if k.startswith("status 5")),
           "without_done": stats["streams without [DONE]"], "cut_by_kill": stats["cut by the kill"],
           "connection_errors": stats["connection errors"], "greedy_mismatches": stats["greedy mismatches"],
           "hostile": stats["hostile"], "hostile_not_refused": stats["hostile not refused"],
           "rss_drift_pct": round(100 * (rss[-1] / rss[0] - 1), 1) if len(rss) > 1 else None,
           # the drift against what the caches hold, first sample and last: a cache filling up to its bound
           "rss_mb": [round(rss[0] / mb), round(rss[-1] / mb)] if rss else None,
           "kv_touched_mb": [round(caches[0]["kv_touched"] / mb), round(caches[-1]["kv_touched"] / mb)]
           if caches else None,
           "prefix_cache_mb": [round(caches[0]["prefix_cache"] / mb), round(caches[-1]["prefix_cache"] / mb)]
           if caches else None, "prefix_cache_budget_mb": round(caches[-1]["prefix_budget"] / mb) if caches else None,
           "suffix_trees_mb": [round(caches[0]["proposer"] / mb), round(caches[-1]["proposer"] / mb)]
           if caches else None,
           # what is left once the bounded caches are taken out: this one should stay flat
           "rss_less_caches_mb": [round(min(rest) / mb), round(max(rest) / mb), round(rest[-1] / mb)] if rest else None,
           "rss_less_caches_drift_pct": round(100 * (rest[-1] / rest[0] - 1), 1) if len(rest) > 1 else None,
           "itl_p50_s": round(q(gaps, 0.5), 3), "itl_p99_s": round(q(gaps, 0.99), 3),
           "itl_max_s": round(gaps[-1], 3) if gaps else None, "longest_gaps": stalled(spans),
           "ttft_p50_s": round(q(ttfts, 0.5), 3), "ttft_p99_s": round(q(ttfts, 0.99), 3),
           "ttft_max_s": round(ttfts[-1], 3) if ttfts else None, "client_gc_max_s": round(gc_pauses[0], 3),
           "restart_s": round(restart_s, 1) if restart_s else None}
    print(json.dumps(row), flush=True)
    return [row]


# ---- restart

def restart(args) -> list[dict]:
    import signal

    from peagle.bench.loadgen import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        proc = ServerProcess(args.model, speculative_json(args), 8, Path(tmp) / "serve.log", threads=args.threads)
        seconds, cpu = [], []
        for i in range(args.restarts + 1):
            if i:
                proc.proc.send_signal(signal.SIGKILL)
                proc.proc.wait()
            proc.start()
            seconds.append(round(proc.startup_s, 1))
            used = proc.cpu_seconds()
            cpu.append(None if used is None else round(used, 1))
        proc.stop()
    row = {"first_start_s": seconds[0], "restarts_s": seconds[1:], "first_start_cpu_s": cpu[0],
           "restarts_cpu_s": cpu[1:]}
    print(json.dumps(row), flush=True)
    return [row]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def command(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
        p.add_argument("--speculative-config", help="JSON, or 'none' [what `peagle serve` picks]")
        p.add_argument("--threads", type=int, default=None, help="torch threads of the server (and of http's engine)")
        p.add_argument("--out", help="also write the results as JSON here")
        p.set_defaults(run=fn)
        return p

    p = command("http", http, "HTTP against the same engine driven directly")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, help="requests per level (default: max(4, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per level; medians are reported")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p = command("hostile", hostile, "hostile and careless requests beside a running stream")
    p.add_argument("--random", type=int, default=100, help="random mutated bodies after the fixed cases")
    p.add_argument("--body-timeout", type=float, default=3.0)
    p = command("gap", gap, "a running stream while the server refuses a large body")
    p.add_argument("--limit", type=int, default=8_000_000, help="the server's --max-request-bytes")
    p.add_argument("--sizes", type=int, nargs="+", help="chat bodies to send, in characters of content "
                   "(default: 5 MB and 1 MB over the limit)")
    p = command("logprobs", logprobs, "output tokens/s with and without logprobs")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p = command("memory", memory, "resident memory idle and under N streams, against the KV cache they need")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[8, 32])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=580, help="output tokens per stream (with a short prompt: "
                   "about 600-token contexts)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-gb", type=float, help="the server's --kv-cache-gb [its default]")
    p = command("soak", soak, "many streams, cancels, hostile requests and a kill -9 half way, for --minutes")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--streams", type=int, default=32, help="concurrent clients (and the server's --max-num-seqs)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-gb", type=float, help="the server's --kv-cache-gb (small: preemptions) [its default]")
    p.add_argument("--kill-at", type=float, default=0.5, help="when to kill -9 and restart the server, as a share of "
                   "--minutes (0: never)")
    p = command("restart", restart, "time to healthy: a first start, then restarts after kill -9")
    p.add_argument("--restarts", type=int, default=3)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    rows = args.run(args)
    if args.out:
        given = {k: v for k, v in vars(args).items() if k != "run"}
        Path(args.out).write_text(json.dumps({"args": given, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
