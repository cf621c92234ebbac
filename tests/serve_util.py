"""Helpers for the serve tests: a tiny random chat model with SmolLM2's tokenizer (text and chat work; greedy
output is gibberish but deterministic), a random P-EAGLE head for it, and a real uvicorn server on 127.0.0.1 at a
free port, running in a thread of the test process (so tests can look at the engine directly)."""
from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import torch

SPEC_K = 3
MAX_MODEL_LEN = 512


def build_tiny(root: Path) -> tuple[Path, Path]:
    """(model folder, P-EAGLE head folder) under root, built once per root."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from peagle.model.checkpoint import random_head, save_head
    from peagle.model.loading import embedded_model_dir
    from peagle.model.target import TargetModel

    model_dir, head_dir = root / "tiny-chat", root / "tiny-peagle-head"
    if (head_dir / "config.json").exists():
        return model_dir, head_dir
    torch.manual_seed(0)
    # 7 layers: feature layers (2, 3, 4) are distinct. Vocab and tokenizer are SmolLM2's.
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(model_dir)
    src = embedded_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, model_dir / name)
    target = TargetModel.from_pretrained(model_dir, dtype=torch.float32)
    head = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=1,
                       dtype=torch.float32)
    save_head(head, head_dir, dtype=torch.float32)
    return model_dir, head_dir


def spec_config(head_dir: Path, k: int = SPEC_K) -> dict:
    return {"model": str(head_dir), "method": "eagle3", "num_speculative_tokens": k, "parallel_drafting": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 in a background thread."""

    def __init__(self, app, aengine):
        import uvicorn

        self.app, self.aengine = app, aengine
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        end = time.time() + 60
        while not self.server.started:
            if time.time() > end or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request is running, waiting or in flight."""
        end = time.time() + timeout
        a = self.aengine
        while a.num_running or a.num_waiting or a.num_in_flight:
            if time.time() > end:
                raise AssertionError(f"server not idle: running={a.num_running} waiting={a.num_waiting} "
                                     f"in_flight={a.num_in_flight}")
            time.sleep(0.02)


def make_server(model_dir: Path, head_dir: Path | None, *, max_num_seqs: int = 8, max_waiting: int = 256,
                api_key: str | None = None, baseline: bool = True, name: str = "tiny", **app_options) -> LiveServer:
    """A live server over the tiny model; `app_options` go to build_app (max_body_bytes, protect_metrics)."""
    from peagle.engine import LLMEngine
    from peagle.serve.app import build_app
    from peagle.serve.async_engine import AsyncEngine
    from peagle.serve.metrics import Metrics

    spec = spec_config(head_dir) if head_dir is not None else None
    engine = LLMEngine.from_pretrained(str(model_dir), spec, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                                       device="cpu", dtype="float32", speculation_policy="fixed")
    base = (LLMEngine(engine.target, engine.tokenizer, max_num_seqs=2, max_model_len=engine.max_model_len,
                      model_name=engine.model_name) if baseline and spec else None)
    aengine = AsyncEngine(engine, base, max_waiting=max_waiting, metrics=Metrics(name, engine.k))
    app = build_app(aengine, [name], api_key=api_key, model_path=str(model_dir), drain_timeout=5, **app_options)
    return LiveServer(app, aengine)
