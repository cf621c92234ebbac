"""The server at its edges, against a real uvicorn server (and a real `peagle serve` process for the drain): log-
probabilities and n > 1 through the `openai` client, requests too large to take, errors that name their field,
the API key's scope, the first token sent before the step's decode, and a drain whose deadline ends every stream
cleanly."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_util import build_tiny, free_port, make_server, spec_config

REPO = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.getbasetemp() / "serve-tiny")


@pytest.fixture(scope="module")
def server(tiny):
    with make_server(*tiny, max_body_bytes=8 * 1024 * 1024) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# ------------------------------------------------------------------------------------------------------------
# log-probabilities and n


def test_greedy_logprobs_equal_with_and_without_speculation(client):
    args = dict(model="tiny", messages=CHAT, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    spec = client.chat.completions.create(**args)
    plain = client.chat.completions.create(**args, extra_body={"speculation": False})
    assert spec.to_dict()["speculative_decoding"]["num_drafts"] > 0
    assert plain.to_dict()["speculative_decoding"]["method"] == "none"
    a, b = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert len(a) == len(b) == spec.usage.completion_tokens == 16
    assert [t.token for t in a] == [t.token for t in b]
    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)
    for x, y in zip(a, b):
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
    # the tokens spell the text, byte for byte
    assert bytes(v for t in a for v in t.bytes).decode() == spec.choices[0].message.content


def test_top_logprobs_sorted_and_consistent_with_the_sampled_token(client):
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0.9, seed=5,
                                          logprobs=True, top_logprobs=5)
    content = resp.choices[0].logprobs.content
    assert len(content) == 20
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert t.logprob <= tops[0] + 1e-6 and math.isfinite(t.logprob)
        same = [x for x in t.top_logprobs if x.token == t.token]
        if same:
            assert same[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        else:
            assert t.logprob <= tops[-1] + 1e-6  # not among the top 5: less likely than all of them
    # greedy: the chosen token is the most likely one
    greedy = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=2)
    for t in greedy.choices[0].logprobs.content:
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_streamed_logprobs_equal_the_whole_response(client):
    args = dict(model="tiny", messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]


def test_n_with_a_seed_is_reproducible(client):
    args = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=1.0, seed=42, n=3)
    a = client.chat.completions.create(**args)
    b = client.chat.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # each choice has its own seed
    assert a.usage.completion_tokens == 30
    # streamed: the same three texts, told apart by index
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    # completions: two prompts times n=2 -> four choices, prompt-major
    comp = client.completions.create(model="tiny", prompt=["Once", "Twice"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert comp.choices[0].text == comp.choices[1].text and comp.choices[2].text == comp.choices[3].text


def test_completions_echo_with_prompt_logprobs(client, server):
    prompt = "The quick brown fox"
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    n_prompt = resp.usage.prompt_tokens
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
        assert tok in top and 2 <= len(top) <= 3  # the two most likely, and the token itself
    # the prompt's log-probabilities are the model's own, whatever the sampling
    hot = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=1.5, seed=1,
                                    extra_body={"top_k": 3},
                                    echo=True, logprobs=0)
    assert hot.choices[0].logprobs.token_logprobs[1:n_prompt] == pytest.approx(lp.token_logprobs[1:n_prompt],
                                                                               abs=1e-5)
    # streamed: the echo chunk carries the prompt's log-probabilities
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


# ------------------------------------------------------------------------------------------------------------
# errors name their field


def test_engine_validation_error_names_its_parameter(server, client):
    """The engine owns the context-length check; the server maps its parameter onto the request's field."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=100_000)
    assert e.value.body["param"] == "max_completion_tokens" and e.value.body["code"] == "context_length_exceeded"
    assert "max_completion_tokens" in e.value.body["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["fine", "word " * 2000], "max_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt.1" and err["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 10 ** 9], "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    server.wait_idle()


def test_more_prompts_than_the_queue_is_400_not_503(tiny):
    with make_server(*tiny, max_waiting=2, baseline=False) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 400 and "Retry-After" not in r.headers
        assert r.json()["error"]["param"] == "prompt" and "--max-waiting" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------------------------
# large requests


def stream_chunk_times(url: str, times: list[float], stop: threading.Event) -> None:
    body = {"messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())
            if stop.is_set():
                return


def test_large_bodies_do_not_stall_other_streams(server):
    """A 5 MB chat body (over the context: refused by the length check before tokenising) and a 9 MB one (over the
    8 MiB body limit: 413) are answered while a concurrent stream keeps its pace."""
    server.wait_idle()
    times: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=stream_chunk_times, args=(server.url, times, stop))
    t.start()
    while len(times) < 5:
        assert t.is_alive(), "the concurrent stream ended before it started"
        time.sleep(0.01)
    windows = []
    for size, status, param in ((5_000_000, 400, "messages"), (9_000_000, 413, None)):
        body = json.dumps({"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 4}).encode()
        start = time.perf_counter()
        r = httpx.post(server.url + "/v1/chat/completions", content=body,
                       headers={"Content-Type": "application/json"}, timeout=60)
        windows.append((start, time.perf_counter()))
        assert r.status_code == status, r.text[:300]
        assert r.json()["error"]["param"] == param
        if status == 413:
            assert r.json()["error"]["code"] == "request_too_large" and "--max-request-bytes" in r.text
        else:
            assert r.json()["error"]["code"] == "context_length_exceeded"
        health = time.perf_counter()
        assert httpx.get(server.url + "/health").status_code == 200
        assert time.perf_counter() - health < 2.0  # a stalled loop took the whole tokenisation (about 5 s)
    time.sleep(0.2)
    stop.set()
    t.join(60)
    for start, end in windows:
        inside = [x for x in times if start <= x <= end + 0.2]
        gaps = [b - a for a, b in zip(inside, inside[1:])]
        # before requests were bounded, the stream stopped for the whole tokenisation (about 5 s)
        assert inside and max(gaps, default=0.0) < 2.0, gaps
    server.wait_idle()


# ------------------------------------------------------------------------------------------------------------
# API key scope, first token


def test_api_key_can_protect_metrics(tiny):
    with make_server(*tiny, api_key="k", baseline=False, protect_metrics=True) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 401


def test_first_token_is_reported_before_the_decode(server):
    """The engine hands over the first token right after prefill: one token, timed then, before any draft is
    verified (a P-EAGLE step would bring 1 to K+1 more)."""
    from peagle.engine import LLMEngine, SamplingParams

    main = server.aengine.engine  # the same target and head, in an engine of its own that this test steps
    engine = LLMEngine(main.target, main.tokenizer, main.drafter, main.spec, max_num_seqs=1, max_model_len=64,
                       speculation_policy=main.policy.name)
    seen = []
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8))
    outs = engine.step(on_first_tokens=seen.extend)
    assert [len(o.delta_token_ids) for o in seen] == [1] and seen[0].request_id == rid
    assert seen[0].time_to_first_token is not None
    final = {o.request_id: o for o in outs}[rid]
    assert final.token_ids[0] == seen[0].token_ids[0] and len(final.token_ids) >= 2
    assert final.delta_token_ids == final.token_ids[1:]  # the step's own report carries only what followed
    engine.abort(rid)
    engine.step()
    assert not engine.has_work()


# ------------------------------------------------------------------------------------------------------------
# drain


def test_drain_deadline_ends_every_stream_cleanly(tiny, tmp_path):
    """SIGTERM with --drain-timeout: new requests get 503 while streams run on; at the deadline the engine aborts
    them and each stream ends with finish_reason "abort" and [DONE]; nothing is cut and nothing is logged as a
    traceback."""
    model, head = tiny
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "peagle.cli", "serve", str(model), "--port", str(port), "--dtype", "float32",
         "--speculative-config", json.dumps(spec_config(head)), "--max-model-len", "1024", "--drain-timeout", "1.5",
         "--no-baseline"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        end = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < end, "server did not come up"
            time.sleep(0.2)
        body = {"messages": CHAT, "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
        results: list[list[str]] = [[] for _ in range(4)]
        errors: list[BaseException] = []

        def run(i):
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            results[i].append(line[6:])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while sum(len(r) for r in results) < 12:
            assert not errors and any(t.is_alive() for t in threads), (errors, results)
            time.sleep(0.02)
        keep_alive = httpx.Client(timeout=10)
        assert keep_alive.get(url + "/health").status_code == 200  # an idle keep-alive connection
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert keep_alive.get(url + "/health").status_code == 503
        for t in threads:
            t.join(60)
        assert not errors, errors
        for lines in results:
            assert lines[-1] == "[DONE]"
            finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, lines[:-1])
                        if c.get("choices") and c["choices"][0]["finish_reason"]]
            assert finishes == ["abort"]
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        assert "Traceback" not in log and "Cancel" not in log, log[-3000:]
        assert "aborted 4 request(s)" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
