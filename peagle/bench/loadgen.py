"""Load generators. All of them run N clients, each sending its next prompt as soon as its last one finished (what
`vllm bench serve --max-concurrency N` does), and return per-request timings plus the run's wall time.

- `run_http`: streaming OpenAI requests (chat or text completions) over HTTP with httpx, against any server that
  speaks the protocol (peagle's, or vLLM's). TTFT is the first chunk that carries text; ITL the gaps between
  text-carrying chunks; token counts come from the usage chunk (`stream_options.include_usage`). Acceptance comes
  from each response's `speculative_decoding` field (peagle) or, failing that, from the server's /metrics counters
  (vLLM's names) read before and after the run.
- `run_offline`: the same clients on an `LLMEngine` in this process (no HTTP), stepping the engine in a loop.
- `HFRunner`: transformers' own `generate()` on the same model and prompts: one request at a time at concurrency 1,
  static batches of N (left-padded) above it; and prompt lookup decoding (`prompt_lookup_num_tokens`), which
  transformers only supports at batch 1.
- `ServerProcess`: a `peagle serve` subprocess on a free 127.0.0.1 port, for the default mode.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peagle.bench.datasets import BenchPrompt
from peagle.bench.metrics import RequestResult
from peagle.config import SPECULATIVE_CONFIG_ENV

Progress = Callable[[RequestResult], None] | None


# -- HTTP ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadSettings:
    """What every request of an HTTP run asks for, and the key it sends."""
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None  # request i asks for seed + i; None: unseeded
    chat: bool = True  # chat completions (the chat template) or text completions
    model: str | None = None  # the served model's name; None: the server's only model
    ignore_eos: bool = False
    api_key: str | None = None
    cache_salt: str | None = None  # vLLM's: caches reuse only what requests of the same salt left


def request_body(prompt: BenchPrompt, settings: LoadSettings, index: int) -> dict:
    """The streaming request for the run's `index`-th prompt."""
    body = {"max_tokens": settings.max_tokens, "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if settings.model:
        body["model"] = settings.model
    if settings.seed is not None:
        body["seed"] = settings.seed + index
    if settings.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, which peagle's server also takes
    if settings.cache_salt:
        body["cache_salt"] = settings.cache_salt
    if prompt.response_format is not None:
        body["response_format"] = prompt.response_format
    if settings.chat:
        body["messages"] = prompt.chat_messages()
    else:
        body["prompt"] = prompt.text
    return body


async def _one_http(client, url: str, prompt: BenchPrompt, body: dict, chat: bool, headers: dict) -> RequestResult:
    res = RequestResult(prompt.id)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    chunks = 0
    start = last = time.perf_counter()
    res.start = start
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {_error_message(text)}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(_error_message(json.dumps(obj)))
                now = time.perf_counter()
                for choice in obj.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                if obj.get("speculative_decoding"):
                    res.spec = obj["speculative_decoding"]
        res.latency = last - start
        if not res.output_tokens:
            res.output_tokens = chunks  # no usage chunk: count deliveries
        if res.ttft is None:
            res.ttft = res.latency
    except Exception as e:  # noqa: BLE001 - one failed request is reported, the run goes on
        res.ok, res.error = False, f"{type(e).__name__}: {e}"[:300]
        res.latency = time.perf_counter() - start
    return res


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:200]


async def run_http_async(url: str, prompts: list[BenchPrompt], concurrency: int, settings: LoadSettings, *,
                         progress: Progress = None, timeout: float = 3600.0) -> tuple[list[RequestResult], float]:
    import httpx

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    results: list[RequestResult | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits, trust_env=False) as client:
        async def client_loop():
            for i in next_index:  # a shared iterator: each client takes the next prompt when it is free
                body = request_body(prompts[i], settings, i)
                results[i] = await _one_http(client, url, prompts[i], body, settings.chat, headers)
                if progress:
                    progress(results[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(prompts)))))
        duration = time.perf_counter() - t0
    return list(results), duration


def run_http(url: str, prompts: list[BenchPrompt], concurrency: int, settings: LoadSettings, *,
             progress: Progress = None, timeout: float = 3600.0) -> tuple[list[RequestResult], float]:
    """`concurrency` clients sending `prompts` to the server at `url`, each its next prompt once its last is done."""
    return asyncio.run(run_http_async(url, prompts, concurrency, settings, progress=progress, timeout=timeout))


@functools.cache
def _http_client():
    """One client for every poll (a fresh one per call builds a TLS context, about 40 ms of CPU, which the server
    starting beside the poll would pay for on a small machine)."""
    import httpx

    return httpx.Client(trust_env=False)


def http_get(url: str, path: str, api_key: str | None = None, timeout: float = 10.0):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return _http_client().get(url.rstrip("/") + path, headers=headers, timeout=timeout)


_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaINFA]+)')


def parse_spec_metrics(text: str) -> dict:
    """vLLM's speculative-decoding counters from a Prometheus exposition (summed over label sets)."""
    out = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "accepted_per_position": {}}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        name = name.removesuffix("_total")
        if name in _SPEC_COUNTERS:
            out[_SPEC_COUNTERS[name]] += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                p = int(pos.group(1))
                out["accepted_per_position"][p] = out["accepted_per_position"].get(p, 0.0) + value
    return out


def spec_metrics_delta(before: dict, after: dict) -> dict | None:
    d = {k: int(round(after[k] - before[k])) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    if d["num_drafts"] <= 0:
        return None
    positions = sorted(set(after["accepted_per_position"]))
    k = (max(positions) + 1) if positions else 0
    d["accepted_per_position"] = [int(round(after["accepted_per_position"].get(p, 0)
                                            - before["accepted_per_position"].get(p, 0))) for p in range(k)]
    from peagle.engine.stats import SpecDecodeStats

    return SpecDecodeStats.from_dict(d).as_dict()


def scrape_spec_metrics(url: str, api_key: str | None = None) -> dict | None:
    try:
        r = http_get(url, "/metrics", api_key)
        return parse_spec_metrics(r.text) if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - metrics are optional
        return None


def server_info(url: str, api_key: str | None = None) -> dict:
    """The served model's name and (peagle's extension) speculative config, from /v1/models."""
    r = http_get(url, "/v1/models", api_key)
    r.raise_for_status()
    cards = r.json().get("data") or []
    return cards[0] if cards else {}


# -- offline (engine in this process) ----------------------------------------------------------------------------

def run_offline(engine, prompts: list[BenchPrompt], concurrency: int, params_for: Callable[[int], object],
                chat: bool = True, progress: Progress = None, cache_salt: str = "") -> tuple[list[RequestResult], float]:
    """N clients on the engine directly. `params_for(i)` gives request i's SamplingParams (with the constraint of
    the prompt's response_format, if it has one)."""
    from peagle.bench.structured import constraint_of

    results: list[RequestResult | None] = [None] * len(prompts)
    active: dict[str, tuple[int, RequestResult, list[float]]] = {}  # request id -> (index, result, [last time])
    next_i = 0
    t0 = time.perf_counter()

    def submit(i: int) -> None:
        p = prompts[i]
        res = RequestResult(p.id)
        res.start = time.perf_counter()
        prompt = p.chat_messages() if chat else p.text
        try:
            params = params_for(i)
            params.constraint = constraint_of(p.response_format)
            rid = engine.add_request(prompt, params, request_id=f"bench-{i}-{time.monotonic_ns()}", chat=chat,
                                     cache_salt=cache_salt)
        except ValueError as e:
            res.ok, res.error = False, f"{type(e).__name__}: {e}"[:300]
            results[i] = res
            if progress:
                progress(res)
            return
        active[rid] = (i, res, [res.start])

    while next_i < len(prompts) or active:
        while len(active) < concurrency and next_i < len(prompts):
            submit(next_i)
            next_i += 1
        if not active:
            continue
        for out in engine.step():
            if out.request_id not in active:
                continue
            i, res, last = active[out.request_id]
            now = time.perf_counter()
            if out.delta_token_ids:
                if res.ttft is None:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last[0])
                last[0] = now
            if out.finished:
                res.prompt_tokens = out.num_prompt_tokens
                res.output_tokens = out.num_output_tokens
                res.latency = last[0] - res.start
                if out.finish_reason == "abort":
                    res.ok, res.error = False, "aborted"
                if out.spec_stats is not None and sum(out.spec_stats.steps_per_k):  # it decoded with a drafter
                    res.spec = out.spec_stats.as_dict()
                results[i] = res
                del active[out.request_id]
                if progress:
                    progress(res)
    return list(results), time.perf_counter() - t0


# -- transformers -------------------------------------------------------------------------------------------------

class HFRunner:
    """transformers' generate() on a local model folder (or a GGUF file, which transformers dequantizes), with
    prompts encoded exactly as the engine encodes them."""

    def __init__(self, model_path: str | Path, dtype=None, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        from peagle.model.loading import load_tokenizer, transformers_source

        self.torch = torch
        model_path = Path(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(**transformers_source(model_path),
                                                          dtype=dtype or torch.bfloat16).to(device).eval()
        self.device = device
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            (min(self.eos_ids) if self.eos_ids else 0)

    def encode(self, prompt: BenchPrompt, chat: bool) -> list[int]:
        if not chat:
            return self.tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
        text = self.tokenizer.apply_chat_template(prompt.chat_messages(), add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _gen_kwargs(self, max_tokens: int, temperature: float, ignore_eos: bool) -> dict:
        kw = {"max_new_tokens": max_tokens, "pad_token_id": self.pad_id}
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if ignore_eos:
            kw["min_new_tokens"] = max_tokens  # transformers' nearest equivalent: EOS is suppressed
        return kw

    def run(self, prompts: list[BenchPrompt], concurrency: int, max_tokens: int, temperature: float = 0.0,
            seed: int | None = None, chat: bool = True, ignore_eos: bool = False,
            prompt_lookup: int | None = None, progress: Progress = None) -> tuple[list[RequestResult], float]:
        if prompt_lookup and concurrency > 1:
            raise ValueError("transformers' prompt lookup decoding runs one sequence at a time (batch 1)")
        torch = self.torch
        kw = self._gen_kwargs(max_tokens, temperature, ignore_eos)
        if prompt_lookup:
            kw["prompt_lookup_num_tokens"] = prompt_lookup
        results: list[RequestResult] = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b0 in range(0, len(prompts), concurrency):
                batch = prompts[b0:b0 + concurrency]
                if seed is not None:
                    torch.manual_seed(seed + b0)
                rs = self._one(batch, chat, kw) if len(batch) == 1 else self._batch(batch, chat, kw)
                for r in rs:
                    results.append(r)
                    if progress:
                        progress(r)
        return results, time.perf_counter() - t0

    def _count(self, new_ids: list[int]) -> int:
        """Generated tokens up to and including the first EOS (the rest is padding)."""
        for j, t in enumerate(new_ids):
            if t in self.eos_ids:
                return j + 1
        return len(new_ids)

    def _one(self, batch: list[BenchPrompt], chat: bool, kw: dict) -> list[RequestResult]:
        from transformers.generation.streamers import BaseStreamer

        p = batch[0]
        ids = self.encode(p, chat)
        res = RequestResult(p.id, prompt_tokens=len(ids))
        times: list[float] = []

        class Clock(BaseStreamer):
            first = True

            def put(self, value):
                if self.first:  # generate() hands the prompt to the streamer first
                    self.first = False
                    return
                times.append(time.perf_counter())

            def end(self):
                pass

        res.start = time.perf_counter()
        out = self.model.generate(self.torch.tensor([ids], device=self.device),
                                  attention_mask=self.torch.ones(1, len(ids), dtype=self.torch.long,
                                                                 device=self.device),
                                  streamer=Clock(), **kw)
        end = time.perf_counter()
        new = out[0, len(ids):].tolist()
        res.output_tokens = self._count(new)
        if times:
            res.ttft = times[0] - res.start
            res.itl = [b - a for a, b in zip(times, times[1:])]
            res.latency = times[-1] - res.start
        else:
            res.ttft = res.latency = end - res.start
        return [res]

    def _batch(self, batch: list[BenchPrompt], chat: bool, kw: dict) -> list[RequestResult]:
        """Left-padded static batch; a logits processor stamps the time of every decoding step."""
        from transformers import LogitsProcessor, LogitsProcessorList

        torch = self.torch
        encoded = [self.encode(p, chat) for p in batch]
        width = max(len(e) for e in encoded)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, e in enumerate(encoded):
            input_ids[b, width - len(e):] = torch.tensor(e)
            mask[b, width - len(e):] = 1
        ticks: list[float] = []

        class Tick(LogitsProcessor):
            def __call__(self, input_ids, scores):
                ticks.append(time.perf_counter())
                return scores

        start = time.perf_counter()
        out = self.model.generate(input_ids.to(self.device), attention_mask=mask.to(self.device),
                                  logits_processor=LogitsProcessorList([Tick()]), **kw)
        end = time.perf_counter()
        results = []
        for b, p in enumerate(batch):
            n = self._count(out[b, width:].tolist())
            r = RequestResult(p.id, prompt_tokens=len(encoded[b]), output_tokens=n, start=start)
            t = ticks[:n] if len(ticks) >= n else ticks + [end] * (n - len(ticks))
            if t:
                r.ttft = t[0] - start
                r.itl = [y - x for x, y in zip(t, t[1:])]
                r.latency = t[-1] - start
            else:
                r.ttft = r.latency = end - start
            results.append(r)
        return results


# -- a server subprocess -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


class ServerProcess:
    """`peagle serve` in a subprocess on 127.0.0.1, its output in a log file; a context manager."""

    def __init__(self, model: str | None, speculative_config: str | None, max_num_seqs: int, log_path: Path,
                 max_model_len: int | None = None, dtype: str | None = None, device: str | None = None,
                 extra_args: list[str] | None = None, startup_timeout: float = 600.0, threads: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "peagle.cli", "serve"]
        if model:
            cmd.append(str(model))
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--max-num-seqs", str(max_num_seqs),
                "--speculative-config", speculative_config or "none", "--no-baseline",
                "--disable-uvicorn-access-log", "--log-level", "warning"]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        if dtype:
            cmd += ["--dtype", dtype]
        if device:
            cmd += ["--device", device]
        self.cmd = cmd + list(extra_args or [])
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        env = dict(os.environ)
        env.pop(SPECULATIVE_CONFIG_ENV, None)  # the flag decides, not a stray environment variable
        if self.threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        while True:
            if self.proc.poll() is not None:
                self._log.flush()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                errors = [ln.strip() for ln in tail.splitlines() if "error" in ln.lower()]
                raise ServerError(f"peagle serve exited with code {self.proc.returncode} before it was ready"
                                  f"{': ' + errors[-1] if errors else ''}\n{tail}")
            try:
                if http_get(self.url, "/health", timeout=2.0).status_code == 200:
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            if time.perf_counter() - t0 > self.startup_timeout:
                self.stop()
                raise ServerError(f"peagle serve did not become ready within {self.startup_timeout:.0f} s "
                                  f"(log: {self.log_path})")
            time.sleep(0.25)
        self.startup_s = time.perf_counter() - t0
        return self

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server process so far (Linux /proc); None where it cannot be read."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
