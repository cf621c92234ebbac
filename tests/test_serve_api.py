"""The HTTP API against a real server (uvicorn on 127.0.0.1, a free port) over a tiny random model with a random
P-EAGLE head, driven by the real `openai` client where a client exists and by httpx for raw HTTP."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from tests.serve_util import MAX_MODEL_LEN, SPEC_K, build_tiny, make_server

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.getbasetemp() / "serve-tiny")


@pytest.fixture(scope="module")
def server(tiny):
    with make_server(*tiny) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def extra(obj, name):
    """A field the openai client does not know (peagle's extensions)."""
    return obj.to_dict()[name] if hasattr(obj, "to_dict") else obj.model_extra[name]


def sse(resp: httpx.Response) -> list:
    """The data payloads of an SSE response ([DONE] kept as a string)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def check_spec(stats: dict, completion_tokens: int) -> None:
    assert stats["method"] == "peagle" and stats["num_speculative_tokens"] == SPEC_K
    assert stats["num_drafts"] >= 1
    assert stats["num_draft_tokens"] == SPEC_K * stats["num_drafts"]
    assert sum(stats["accepted_per_position"]) == stats["num_accepted_tokens"]
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"],
                                                            abs=1e-3)
    # every step emits accepted + 1 tokens; the first token comes from prefill
    assert completion_tokens <= 1 + stats["num_drafts"] + stats["num_accepted_tokens"]


# ------------------------------------------------------------------------------------------------------------
# the openai client


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    card = models[0].to_dict()
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["speculative_config"]["num_speculative_tokens"] == SPEC_K
    assert card["speculative_config"]["parallel_drafting"] is True


def test_chat(client):
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == "tiny"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    check_spec(extra(resp, "speculative_decoding"), 8)
    m = extra(resp, "metrics")
    assert m["time_to_first_token"] > 0 and m["elapsed"] >= m["time_to_first_token"]


def test_streamed_chat_with_usage(client):
    alone = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == alone.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    check_spec(extra(last, "speculative_decoding"), 10)


def test_completions(client):
    resp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text
    assert resp.usage.completion_tokens == 6
    check_spec(extra(resp, "speculative_decoding"), 6)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    # several prompts in one request: one choice each, in order
    both = client.completions.create(model="tiny", prompt=["Once upon a time", "The sea"], max_tokens=6,
                                     temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == resp.choices[0].text
    assert both.usage.completion_tokens == 12


def test_sampling_and_stop(client):
    a = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0.8, seed=7)
    b = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0.8, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded sampling is reproducible
    greedy = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    words = greedy.choices[0].message.content.split()
    stop = words[min(2, len(words) - 1)]
    cut = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].message.content
    assert greedy.choices[0].message.content.startswith(cut.choices[0].message.content)


def test_speculation_false_gives_same_greedy_output(server):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 10, "temperature": 0}
    spec = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    base = httpx.post(server.url + "/v1/chat/completions", json={**body, "speculation": False}, timeout=60).json()
    assert base["choices"][0]["message"]["content"] == spec["choices"][0]["message"]["content"]
    assert base["speculative_decoding"]["method"] == "none" and base["speculative_decoding"]["num_drafts"] == 0
    assert spec["speculative_decoding"]["num_drafts"] > 0
    assert spec["speculative_decoding"]["speculation_policy"] == server.aengine.engine.policy.name
    assert base["speculative_decoding"]["speculation_policy"] is None
    assert base["speculative_decoding"].keys() == spec["speculative_decoding"].keys()


def test_speculative_stats_have_one_shape_with_and_without_speculation():
    from types import SimpleNamespace

    from peagle.engine.stats import SpecDecodeStats
    from peagle.serve.app import spec_stats
    from peagle.serve.protocol import SpeculativeStats

    stats = SpecDecodeStats(3)
    stats.record(3, 2)
    stats.record(0, 0)
    speculating = SimpleNamespace(engine=SimpleNamespace(spec=object(), policy=SimpleNamespace(name="fixed")),
                                  method="peagle", k=3)
    plain_server = SimpleNamespace(engine=SimpleNamespace(spec=None, policy=None), method="none", k=0)
    on = spec_stats(speculating, stats)
    off = spec_stats(speculating, stats, speculation=False)
    assert on.keys() == off.keys() == set(SpeculativeStats.model_fields)
    assert spec_stats(plain_server, SpecDecodeStats()) == spec_stats(plain_server, None) == off
    assert on["num_drafts"] == 1 and on["steps_per_k"] == [1, 0, 0, 1] and on["speculation_policy"] == "fixed"
    assert off["method"] == "none" and off["num_speculative_tokens"] == 0 and off["num_drafts"] == 0
    assert off["mean_acceptance_length"] == 1.0 and off["speculation_policy"] is None


def test_invocations(server):
    chat = httpx.post(server.url + "/invocations", json={"messages": CHAT, "max_tokens": 5, "temperature": 0},
                      timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    comp = httpx.post(server.url + "/invocations", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0},
                      timeout=60)
    assert comp.status_code == 200 and comp.json()["object"] == "text_completion"
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


# ------------------------------------------------------------------------------------------------------------
# load


PROMPTS = [(f"Tell me about topic number {i}." + " Please be detailed." * (i % 5), 4 + (i * 5) % 13) for i in range(16)]


def test_32_concurrent_streams_equal_alone(server):
    async def one(client, prompt, max_tokens):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            if c.usage:
                usage = c.usage.completion_tokens
        return text, finish, usage

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        alone = [await one(client, p, n) for p, n in PROMPTS]
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, server.aengine.num_running)
                await asyncio.sleep(0.005)

        w = asyncio.ensure_future(watch())
        together = await asyncio.gather(*(one(client, p, n) for p, n in PROMPTS + PROMPTS))
        w.cancel()
        await client.close()
        return alone, together, peak

    alone, together, peak = asyncio.run(main())
    assert len(together) == 32
    assert together == alone + alone
    assert all(u is not None and u > 0 for _, _, u in together)
    assert peak >= 4, f"continuous batching not exercised (peak running {peak})"
    server.wait_idle()


# ------------------------------------------------------------------------------------------------------------
# faults


LONG = "word " * (MAX_MODEL_LEN + 50)
BAD = [
    # (path, raw body or json, status, param)
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", [1, 2, 3], 400, None),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 5}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10 ** 6}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 10 ** 6}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2 ** 64, "temperature": 1}, 400, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -2 ** 63 - 1, "temperature": 1}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": json.loads("[" * 40 + "]" * 40)}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 100}, 400, "n"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/invocations", {"input": "hi"}, 400, "messages"),
]


def test_bad_inputs_get_openai_errors_and_others_keep_running(server):
    good = {"model": "tiny", "messages": CHAT, "max_tokens": 24, "temperature": 0}
    reference = httpx.post(server.url + "/v1/chat/completions", json=good, timeout=60).json()
    result = {}

    def run_good():  # a streamed request that runs while the bad ones arrive
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**good, "stream": True},
                          timeout=60) as r:
            result["chunks"] = sse(r)

    t = threading.Thread(target=run_good)
    t.start()
    for path, body, status, param in BAD:
        if isinstance(body, bytes):
            r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        else:
            r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == status, (path, body if not isinstance(body, dict) or "content" not in str(body)[:0]
                                         else body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        assert err["param"] == param, (body, r.text)
        if param:
            assert param.split(".")[0] in err["message"] or status == 404 or "context" in err["message"], r.text
    t.join(60)
    chunks = result["chunks"]
    assert chunks[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"])
    assert text == reference["choices"][0]["message"]["content"]
    # unknown routes and methods are errors in the same shape
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    server.wait_idle()


def test_client_disconnect_frees_the_slot(server, monkeypatch):
    server.wait_idle()
    step = server.aengine.engine.step

    def slow_step(*args, **kwargs):  # the client must leave mid-generation, however loaded the machine is
        time.sleep(0.01)
        return step(*args, **kwargs)

    monkeypatch.setattr(server.aengine.engine, "step", slow_step)
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break
        assert server.aengine.num_running == 1
    server.wait_idle(timeout=15)
    # a non-streamed request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    server.wait_idle(timeout=15)
    assert sorted(server.aengine.engine.free_slots) == list(range(server.aengine.engine.max_num_seqs))


# ------------------------------------------------------------------------------------------------------------
# metrics


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[key] = s.value
    return values


def test_metrics_move_with_responses(server, client):
    server.wait_idle()
    before = scrape(server.url)
    responses = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Fact {i}?"}],
                                                max_tokens=5 + 3 * i, temperature=0) for i in range(3)]
    server.wait_idle()
    after = scrape(server.url)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    stats = [extra(r, "speculative_decoding") for r in responses]
    assert d["vllm:spec_decode_num_drafts_total"] == sum(s["num_drafts"] for s in stats) > 0
    assert d["vllm:spec_decode_num_draft_tokens_total"] == sum(s["num_draft_tokens"] for s in stats)
    assert d["vllm:spec_decode_num_accepted_tokens_total"] == sum(s["num_accepted_tokens"] for s in stats)
    for pos in range(SPEC_K):
        assert d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total|position={pos}"] == \
            sum(s["accepted_per_position"][pos] for s in stats)
    assert d["vllm:generation_tokens_total"] == sum(r.usage.completion_tokens for r in responses)
    assert d["vllm:prompt_tokens_total"] == sum(r.usage.prompt_tokens for r in responses)
    assert d["vllm:time_to_first_token_seconds_count"] == 3
    assert d["vllm:e2e_request_latency_seconds_count"] == 3
    assert d["vllm:request_success_total|finished_reason=length"] == 3
    assert d["vllm:inter_token_latency_seconds_count"] == sum(r.usage.completion_tokens - 1 for r in responses)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0


# ------------------------------------------------------------------------------------------------------------
# API key and admission, on a second server: one slot, one waiting place


@pytest.fixture(scope="module")
def small_server(tiny):
    with make_server(*tiny, max_num_seqs=1, max_waiting=1, api_key="sekret", baseline=False) as s:
        yield s


def test_api_key(small_server):
    url = small_server.url
    body = {"messages": CHAT, "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
    # /v1/* (vLLM's scope) and, outside SageMaker, /invocations need the key; health checks and Prometheus stay open
    # (this test used to expect /invocations open on every deployment: a way past the key)
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/ping").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.post(url + "/invocations", json=body, timeout=60).status_code == 401
    assert httpx.post(url + "/invocations", json=body, timeout=60,
                      headers={"Authorization": "Bearer sekret"}).status_code == 200
    good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
    assert good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_full_queue_gets_503_with_retry_after(small_server):
    url, headers = small_server.url, {"Authorization": "Bearer sekret"}
    body = {"messages": CHAT, "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60, headers=headers) as c:
        with c.stream("POST", url + "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()
            # The first request holds the only slot, and has left the queue: it stops counting as waiting when its
            # first token reaches the event loop, a moment after the engine starts running it.
            while small_server.aengine.num_running < 1 or small_server.aengine.num_waiting > 0:
                next(lines)
            with c.stream("POST", url + "/v1/chat/completions", json=body) as waiting:
                next(waiting.iter_lines())  # accepted: it waits for the slot
                assert small_server.aengine.num_waiting == 1
                r = c.post(url + "/v1/chat/completions", json={**body, "stream": False})
                assert r.status_code == 503
                assert int(r.headers["Retry-After"]) >= 1
                err = r.json()["error"]
                assert err["code"] == "queue_full" and err["type"] == "service_unavailable"
    small_server.wait_idle(timeout=15)
    # with the queue empty again, requests are served
    r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3}, headers=headers,
                   timeout=60)
    assert r.status_code == 200
    assert "peagle:requests_rejected_total" in httpx.get(url + "/metrics", headers=headers).text


def test_drain_deadline_aborts_what_is_left(tiny):
    """Draining refuses new work at once, and requests still running at the deadline are aborted (their stream
    ends with finish_reason "abort")."""
    with make_server(*tiny, baseline=False) as srv:
        body = {"messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            while srv.aengine.num_running < 1:
                next(lines)
            drained = asyncio.run_coroutine_threadsafe(srv.aengine.drain(0.5), srv.aengine._loop)
            time.sleep(0.1)
            refused = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert "Retry-After" in refused.headers
            assert httpx.get(srv.url + "/health").status_code == 503
            rest = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
            drained.result(timeout=30)
        assert rest[-1]["choices"][0]["finish_reason"] == "abort"
        assert srv.aengine.num_running == 0 and not srv.aengine.healthy
