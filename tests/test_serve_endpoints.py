"""`peagle deploy / endpoints / delete`: detached servers with state under $PEAGLE_HOME, as real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from peagle.model.kernels import build_dir
from tests.serve_util import build_tiny, free_port, spec_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.getbasetemp() / "serve-tiny")


def peagle(home: Path, *argv, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peagle.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PEAGLE_HOME": str(home),
                                                "PEAGLE_KERNELS_DIR": str(build_dir())})


def endpoints(home: Path) -> dict:
    r = peagle(home, "endpoints", "--json")
    assert r.returncode == 0, r.stderr
    return {e["name"]: e for e in json.loads(r.stdout)}


def wait_status(home: Path, name: str, want: str, timeout: float = 120) -> dict:
    end = time.time() + timeout
    while True:
        ep = endpoints(home)[name]
        if ep["status"] == want:
            return ep
        assert ep["status"] in ("Creating", want), ep
        assert time.time() < end, f"{name} still {ep['status']}"
        time.sleep(0.5)


def test_deploy_list_delete(tiny, tmp_path):
    model, head = tiny
    home = tmp_path / "home"
    port = free_port()
    t0 = time.time()
    r = peagle(home, "deploy", str(model), "--name", "tiny-ep", "--port", str(port),
               "--speculative-config", json.dumps(spec_config(head)), "--dtype", "float32", "--max-model-len", "256")
    assert r.returncode == 0, r.stderr
    assert time.time() - t0 < 20  # returns at once; the server starts in the background
    assert "Creating" in r.stdout
    # a deployment that cannot start
    r = peagle(home, "deploy", str(tmp_path / "no-such-model"), "--name", "broken")
    assert r.returncode == 0, r.stderr

    ep = wait_status(home, "tiny-ep", "InService")
    assert ep["url"] == f"http://127.0.0.1:{port}"
    assert ep["speculative_config"]["num_speculative_tokens"] == spec_config(head)["num_speculative_tokens"]
    out = httpx.post(ep["url"] + "/v1/chat/completions", timeout=60,
                     json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).json()
    assert out["usage"]["completion_tokens"] == 4
    # the same name twice is refused while it runs
    again = peagle(home, "deploy", str(model), "--name", "tiny-ep")
    assert again.returncode == 2 and "already exists" in again.stderr

    bad = wait_status(home, "broken", "Failed", timeout=60)
    assert "no-such-model" in bad["reason"] or "error" in bad["reason"].lower(), bad

    table = peagle(home, "endpoints").stdout
    assert "tiny-ep" in table and "InService" in table and "Failed" in table

    r = peagle(home, "delete", "tiny-ep")
    assert r.returncode == 0, r.stderr
    assert "tiny-ep" not in endpoints(home)
    from peagle.serve.endpoints import port_free, process_alive

    assert port_free("127.0.0.1", port)
    assert not process_alive(ep["pid"])
    assert peagle(home, "delete", "broken").returncode == 0
    assert endpoints(home) == {}
    r = peagle(home, "delete", "nothing")
    assert r.returncode == 2 and "no endpoint" in r.stderr
