"""Hostile and careless requests against a real `peagle serve` (embedded SmolLM2, bundled P-EAGLE head, an API key),
each sent while a long stream runs: the count of answers by status code, any 5xx, and the longest gap the running
stream saw against its median gap (one decode step).

Cases: lone UTF-16 surrogates in every string field; token ids out of range in every id field; every body type a
web page can send cross-site; garbage bytes; bad JSON; deep nesting; bodies that declare more than they send
(cut at --body-timeout); missing keys on every guarded route; then seeded random mutations of valid bodies.

    python benchmarks/hostile_inputs.py --random 100
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

from peagle.bench.loadgen import free_port

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
MSG = [{"role": "user", "content": "hi"}]


def cases() -> list[tuple[str, str, dict, bytes]]:
    """(name, path, headers, raw body)."""
    out = []
    chat = "/v1/chat/completions"
    for field, body in [("content", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
                        ("content part", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                     "text": "\udfff"}]}]}),
                        ("name", {"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}),
                        ("stop", {"messages": MSG, "stop": "\ud800"}),
                        ("stop list", {"messages": MSG, "stop": ["\ud800"]}),
                        ("model", {"messages": MSG, "model": "\udc00"}), ("user", {"messages": MSG, "user": "\ud800"}),
                        ("key", {"messages": MSG, "\ud800": 1})]:
        out.append((f"surrogate in {field} (chat)", chat, {**AUTH, **JSON},
                    json.dumps({**body, "max_tokens": 2}).encode()))
    for path in ("/v1/completions", "/invocations"):
        out.append((f"surrogate in prompt ({path})", path, {**AUTH, **JSON},
                    b'{"prompt": "x\\ud800", "max_tokens": 2}'))
    for field, value in [("prompt ids", {"prompt": [-1]}), ("prompt ids", {"prompt": [10 ** 9]}),
                         ("prompt id lists", {"prompt": [[1], [49152]]}), ("stop_token_ids", {"prompt": "hi",
                                                                                             "stop_token_ids": [-1]}),
                         ("stop_token_ids", {"prompt": "hi", "stop_token_ids": [10 ** 9]}),
                         ("stop_token_ids", {"prompt": "hi", "stop_token_ids": [2 ** 70]}),
                         ("prompt [[]]", {"prompt": [[]]}), ("prompt mixed", {"prompt": [1, "a"]})]:
        out.append((f"{field} out of range or malformed", "/v1/completions", {**AUTH, **JSON},
                    json.dumps({**value, "max_tokens": 2}).encode()))
    valid = json.dumps({"messages": MSG, "max_tokens": 2}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/html"):
        for path in (chat, "/v1/completions", "/invocations"):
            out.append((f"Content-Type {kind.split(';')[0]} on {path}", path, {**AUTH, "Content-Type": kind}, valid))
    for name, raw in [("garbage bytes", b"\xff\xfe\x00garbage\x81"), ("bad JSON", b'{"messages": [}'),
                      ("empty body", b""), ("JSON array", b"[1, 2]"), ("deep nesting", b"[" * 5000 + b"]" * 5000),
                      ("messages [5]", b'{"messages": [5]}'), ("null content", b'{"messages": [{"role": "user"}]}'),
                      ("n huge", b'{"messages": [{"role": "user", "content": "x"}], "n": 100000}'),
                      ("max_tokens negative", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}')]:
        for path in (chat, "/invocations"):
            out.append((f"{name} ({path})", path, {**AUTH, **JSON}, raw))
    for path in (chat, "/v1/completions", "/v1/models", "/invocations"):
        out.append((f"no API key on {path}", path, dict(JSON), valid))
    return out


def mutate(rng: random.Random) -> bytes:
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
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n{\"message")
        s.settimeout(timeout + 20)
        head = s.recv(64)
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1") else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=100, help="random mutated bodies after the fixed cases")
    ap.add_argument("--body-timeout", type=float, default=3.0)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, "-m", "peagle.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--body-timeout", str(args.body_timeout), "--log-level", "warning",
                             "--disable-uvicorn-access-log"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open("hostile-server.log", "w"))
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        gaps: list[float] = []
        done = threading.Event()

        def stream():
            body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}
            last = None
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600) as r:
                for line in r.iter_lines():
                    now = time.monotonic()
                    if line.startswith("data:") and last is not None:
                        gaps.append(now - last)
                    last = now
                    if done.is_set():
                        break

        runner = threading.Thread(target=stream, daemon=True)
        runner.start()
        while len(gaps) < 20:
            time.sleep(0.1)
        counts, fives, rng = collections.Counter(), [], random.Random(0)
        todo = cases() + [(f"random {i}", "/v1/chat/completions", {**AUTH, **JSON}, mutate(rng))
                          for i in range(args.random)]
        with httpx.Client(timeout=120) as c:
            for name, path, headers, raw in todo:
                method = "GET" if path == "/v1/models" else "POST"
                r = c.request(method, url + path, content=raw if method == "POST" else None, headers=headers)
                counts[r.status_code] += 1
                if r.status_code >= 500:
                    fives.append((name, r.status_code, r.text[:200]))
        for i in range(3):
            code = trickle(url, args.body_timeout)
            counts[code] += 1
            if code >= 500 or code < 0:
                fives.append(("trickling body", code, ""))
        done.set()
        runner.join(timeout=30)
        step = statistics.median(gaps)
        total = sum(counts.values())
        print(f"{total} requests beside a running stream: "
              + ", ".join(f"{n} x {code}" for code, n in sorted(counts.items())))
        print(f"5xx: {len(fives)}" + "".join(f"\n  {f}" for f in fives))
        print(f"running stream: {len(gaps)} tokens, median gap {step * 1e3:.1f} ms (one decode step), longest "
              f"{max(gaps) * 1e3:.1f} ms ({max(gaps) / step:.1f} steps)")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
