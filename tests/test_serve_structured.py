"""Structured outputs and tool calls through a live server (uvicorn on 127.0.0.1 over a tiny random model with
SmolLM2's tokenizer and a random P-EAGLE head), driven by the real `openai` client: every answer parses and
validates against its schema (jsonschema), tool calls come back in OpenAI's shape streamed or not, bad schemas get
a 400 naming the field, and a hostile schema neither stalls another stream nor takes the server down."""
from __future__ import annotations

import json
import re
import threading
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve_util import build_tiny, make_server

CHAT = [{"role": "user", "content": "Describe a pet."}]
PET = {"type": "object", "additionalProperties": False, "required": ["kind", "age", "name"],
       "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 30},
                      "name": {"type": "string", "maxLength": 8}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with make_server(*build_tiny(tmp_path_factory.getbasetemp() / "serve-tiny")) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(model="tiny", messages=CHAT, response_format=Pet, max_tokens=60)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), Pet.model_json_schema())
    assert isinstance(choice.message.parsed, Pet)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_and_json_object(client, stream):
    for fmt, check in [({"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}},
                        lambda v: jsonschema.validate(v, PET)),
                       ({"type": "json_object"}, lambda v: isinstance(v, dict))]:
        kwargs = dict(model="tiny", messages=CHAT, response_format=fmt, max_tokens=60, temperature=0)
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
        else:
            done = client.chat.completions.create(**kwargs)
            text, finish = done.choices[0].message.content, done.choices[0].finish_reason
            assert done.to_dict()["speculative_decoding"]["num_forced_tokens"] > 0  # at least the opening brace
        if fmt["type"] == "json_schema":  # bounded: it always ends; json_object may be cut by max_tokens
            assert finish == "stop"
        if finish == "stop":
            check(json.loads(text))


def test_structured_outputs_choice_regex_grammar_and_guided_fields(server, client):
    done = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert done.choices[0].message.content in ("yes", "no", "maybe")
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    done = client.completions.create(model="tiny", prompt="Code:", max_tokens=20,
                                     extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, done.choices[0].text) and done.choices[0].finish_reason == "stop"
    done = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20,
                                          extra_body={"guided_choice": ["red", "blue"]})
    assert done.choices[0].message.content in ("red", "blue")
    done = client.completions.create(model="tiny", prompt="List:", max_tokens=30,
                                     extra_body={"guided_grammar": 'root ::= "(" [a-c]{1,3} ("," [a-c]{1,3})? ")"'})
    assert re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})?\)", done.choices[0].text)
    done = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, extra_body={"guided_json": PET})
    jsonschema.validate(json.loads(done.choices[0].message.content), PET)


def test_cut_by_max_tokens_is_length(client):
    done = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": PET}})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_round_trip(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # one call (a random model would go on adding calls to an open array until max_tokens)
    done = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                          tool_choice=tool_choice, max_tokens=80, parallel_tool_calls=False)
    choice0 = done.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    calls = choice0.message.tool_calls
    assert calls and all(c.type == "function" and c.id for c in calls)
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    if choice == "named":
        assert [c.function.name for c in calls] == ["get_weather"]
    # the round trip: the calls and their results go back, and the model answers in text
    messages += [choice0.message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees, sunny"} for c in calls]
    after = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=8)
    assert after.choices[0].message.content and after.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_tool_calls(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, TIME], stream=True,
                                                tool_choice=tool_choice, max_tokens=80, parallel_tool_calls=False):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or d.id
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        params = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(call["arguments"]), params)
        assert call["id"]
    if choice == "named":
        assert [c["name"] for c in calls.values()] == ["get_time"]


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wibble"}}}},
     "response_format.json_schema.schema", "wibble"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "missing"),
    ({"structured_outputs": {}}, "structured_outputs", "set one of"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "one output constraint"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools.0.function", "name"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param, needle):
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_tool_choice_auto_and_none_answer_in_text(client):
    for tool_choice in ("auto", "none"):
        done = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], tool_choice=tool_choice,
                                              max_tokens=5)
        assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "length"


def hostile_schema(width: int) -> dict:
    """Many properties, each an enum of many strings: large to compile, just under the size limit."""
    return {"type": "object", "additionalProperties": False,
            "properties": {f"p{i}": {"enum": [f"value_{i}_{j}" for j in range(40)]} for i in range(width)}}


def test_hostile_schemas_neither_stall_others_nor_take_the_server_down(server, client):
    """A stream runs while huge and deeply nested schemas arrive: it keeps producing tokens at a steady pace, the
    hostile requests get their answers (a 400 for those over the limits), and the server serves afterwards."""
    gaps, errors = [], []

    def stream():
        last = time.perf_counter()
        try:
            for chunk in client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=120, stream=True,
                                                        extra_body={"ignore_eos": True}):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    deep: dict = {"type": "string"}
    for _ in range(40):  # deeper than any request may nest
        deep = {"type": "object", "properties": {"a": deep}}
    t = threading.Thread(target=stream)
    t.start()
    statuses = []
    for schema in (hostile_schema(3000), deep, hostile_schema(60)):
        r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2,
                                                  "response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "h", "schema": schema}}})
        statuses.append(r.status_code)
        if r.status_code == 400:
            assert r.json()["error"]["param"].startswith("response_format")
    t.join(timeout=120)
    assert not errors and len(gaps) > 100
    assert statuses[0] == 400 and statuses[1] == 400 and statuses[2] == 200
    assert max(gaps[5:]) < 2.0, f"a stream stalled for {max(gaps[5:]):.2f} s"
    done = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20,
                                          extra_body={"guided_choice": ["ok"]})
    assert done.choices[0].message.content == "ok"
