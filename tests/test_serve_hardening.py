"""The server and the command line under hostile and careless use: every bad body gets a 4xx naming the field (never
a 5xx), the API key guards /invocations outside SageMaker, only JSON bodies are taken and cross-origin calls are
refused unless allowed, a trickling client is cut at its deadline while other streams flow, and every numeric flag
of every command refuses values outside its range (docs/serving.md, "Authentication and cross-site calls")."""
from __future__ import annotations

import argparse
import importlib
import json
import socket
import time
from contextlib import redirect_stderr
from io import StringIO

import httpx
import pytest

from peagle import cli_args
from peagle.cli import COMMANDS
from tests.serve_util import build_tiny, make_server

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def server(tiny):
    with make_server(*tiny, api_key="sekret", baseline=False, body_timeout=1.5) as s:
        yield s


AUTH = {"Authorization": "Bearer sekret"}


def post(server, path: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={**AUTH, "Content-Type": "application/json", **headers})


def test_invocations_need_the_key_unless_sagemaker_authenticates(server, tiny):
    body = {"messages": CHAT, "max_tokens": 2}
    assert httpx.post(server.url + "/invocations", json=body, timeout=60).status_code == 401
    assert post(server, "/invocations", body).status_code == 200
    with make_server(*tiny, api_key="sekret", baseline=False, sagemaker=True) as sm:
        assert httpx.post(sm.url + "/invocations", json=body, timeout=60).status_code == 200
        assert httpx.post(sm.url + "/v1/chat/completions", json=body, timeout=60).status_code == 401


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/invocations"])
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_bodies_a_web_page_can_send_cross_site_get_415(server, path, kind):
    body = {"messages": CHAT, "max_tokens": 2} if path != "/v1/completions" else {"prompt": "hi", "max_tokens": 2}
    r = post(server, path, body, **{"Content-Type": kind})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


# Origins are opaque strings to CORS: two made-up app origins, no address anything could fetch.
OTHER_ORIGIN, ALLOWED_ORIGIN = "peagle-test://other-page", "peagle-test://allowed-page"


def test_cors_is_off_unless_origins_are_named(server, tiny):
    pre = {"Origin": OTHER_ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    with make_server(*tiny, baseline=False, allowed_origins=[ALLOWED_ORIGIN]) as s:
        ok = httpx.options(s.url + "/v1/chat/completions", headers={**pre, "Origin": ALLOWED_ORIGIN})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        bad = httpx.options(s.url + "/v1/chat/completions", headers=pre)
        assert bad.headers.get("access-control-allow-origin") != OTHER_ORIGIN


BAD_BODIES = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/completions", b'{"prompt": "a\\udfffb"}', "prompt"),
    ("/invocations", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["x\\ud800"]}', "stop"),
    # a surrogate in a field name: the error quotes it, and its body must still render (ASCII-escaped)
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', "\ud800"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [-1]}',
     "stop_token_ids"),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [1000000000]}', "stop_token_ids"),
    ("/v1/completions", b'{"prompt": [[]]}', "prompt"),
    ("/v1/completions", b'{"prompt": [1, "a"]}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [5]}', "messages.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', "messages.0"),
    ("/invocations", b"\xff\xfe\x00garbage\x81", None),
]


@pytest.mark.parametrize("path,raw,param", BAD_BODIES)
def test_bad_bodies_get_a_400_that_names_the_field(server, path, raw, param):
    r = post(server, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "ChatMessage" not in err["message"] and "codec" not in err["message"]  # no internal names


def test_a_trickling_client_is_cut_while_other_streams_flow(server):
    """Headers promise 10,000 bytes, 10 arrive: the server answers 408 at its body deadline and closes, and a stream
    running beside it never waits more than a moment between tokens."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n{\"message")
    gaps, last = [], None
    body = {"messages": CHAT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            now = time.monotonic()
            if line.startswith("data:") and last is not None:
                gaps.append(now - last)
            last = now
    sock.settimeout(10)
    answer = b""
    try:
        while chunk := sock.recv(4096):
            answer += chunk
    except socket.timeout:
        pass
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - t0 < 10  # cut at the 1.5 s deadline, not held open
    assert gaps and max(gaps) < 1.0


def _numeric_actions():
    """(command, parser, action) for every flag of every command that takes a number."""
    for name, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"peagle {name}")
        importlib.import_module(module).register(name, parser)
        todo = [parser]
        while todo:
            p = todo.pop()
            for action in p._actions:
                if isinstance(action, argparse._SubParsersAction):
                    todo.extend(action.choices.values())
                elif action.type in (int, float):
                    yield name, p, action, "plain"
                elif getattr(action.type, "lo", None) is not None or getattr(action.type, "hi", None) is not None:
                    yield name, p, action, "ranged"


def test_every_numeric_flag_has_a_range():
    plain = [f"peagle {name} {a.option_strings[0]}" for name, _, a, kind in _numeric_actions() if kind == "plain"]
    assert plain == []  # each one takes a peagle.cli_args type, so the checks below cover it


def test_every_numeric_flag_refuses_what_is_out_of_range_or_not_a_number():
    checked = 0
    for name, parser, action, _ in _numeric_actions():
        t, flag = action.type, action.option_strings[0]
        bad = ["many", "nan"] + ([str(t.lo - 1) if t.kind is int else str(t.lo - 0.5)] if t.lo is not None else [])
        if t.lo_open or (t.lo == 1 and t.kind is int):
            bad.append("0")  # zero where zero is meaningless
        if t.hi is not None:
            bad.append(str(t.hi * 1000 + 1))  # a huge value
        for value in bad:
            err = StringIO()
            with redirect_stderr(err), pytest.raises(SystemExit) as e:
                parser.parse_args([flag, value] + _required(parser))
            assert e.value.code == 2, (name, flag, value)
            assert flag in err.getvalue() and "expected" in err.getvalue(), (name, flag, value, err.getvalue())
            checked += 1
    assert checked > 100


def _required(parser: argparse.ArgumentParser) -> list[str]:
    """Values for the parser's required arguments, so that only the flag under test can fail."""
    out = []
    for action in parser._actions:
        if action.required and action.option_strings:
            out += [action.option_strings[0], "x"]
        elif not action.option_strings and action.nargs is None and action.dest not in ("help",):
            out.append("x")
    return out


def test_cli_messages_are_argparse_errors_with_the_range():
    assert cli_args.positive_int.__name__ == "an integer >= 1"
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a number > 0, got 0"):
        cli_args.positive_float("0")
