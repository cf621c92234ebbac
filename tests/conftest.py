"""Shared fixtures: tiny random Hugging Face models of each supported family, saved as real model folders, and
the embedded SmolLM2 (converted once per PEAGLE_HOME)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from peagle.model import kernels
from peagle.model.home import peagle_home
from peagle.threads import default_threads


def _test_home() -> None:
    """What the tests make in $PEAGLE_HOME (tokenizer records and start-up timings of their temporary models) goes to
    a home of the run's own, removed when the run ends; the user's converted embedded model, built kernels and GGUF
    metadata are shared through links (made once: 30 s for the model, 14 s for the Gemma 3 file's metadata).
    xdist's workers inherit the run's home."""
    if os.environ.get("PEAGLE_TEST_HOME"):
        return
    real, home = peagle_home(), Path(tempfile.mkdtemp(prefix="peagle-tests-"))
    for shared in ("models", "kernels", "gguf"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        (home / shared).symlink_to(real / shared, target_is_directory=True)
    os.environ["PEAGLE_HOME"] = os.environ["PEAGLE_TEST_HOME"] = str(home)
    atexit.register(shutil.rmtree, home, True)


_test_home()

# The suite runs in parallel processes (pytest-xdist, pyproject.toml): one per core, at most MAX_WORKERS, each
# on its share of the cores. Two processes of one thread finish it in half the time one process of two threads
# takes on a 2-core machine: most of its tests are small forwards and Python, which a second thread does not speed.
MAX_WORKERS = 4
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, default_threads() // _WORKERS)))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: the cores this process may use (affinity and any cgroup quota), at most MAX_WORKERS (each worker
    holds its own models: the real ones are up to 2 GiB a process)."""
    return max(1, min(MAX_WORKERS, default_threads()))

# Skips by hardware decide on the CPU's instructions, never on what got built: on every x86-64 CPU with AVX2 and FMA
# (Intel with AMX, AMD Zen 4, AMD Zen 3) peagle's kernels must run, so a failed build fails these tests (and
# tests/test_kernels.py says why) instead of skipping them. Off x86-64 the promises they check (batch invariance,
# bit-exact greedy speculation) are not made: PyTorch's kernels run, and they round differently per row count.
needs_native_kernels = pytest.mark.skipif(
    not kernels.cpu_has("avx2"), reason="not an x86-64 CPU with AVX2 and FMA: peagle's kernels do not run here and "
    "PyTorch's are not batch invariant")
# Every matrix path, skipped only where the CPU lacks its instructions (Intel with AMX runs all three, AMD Zen 4
# avx512-bf16 and avx2, Zen 3 avx2).
KERNEL_PATHS = [pytest.param(p, marks=pytest.mark.skipif(not kernels.cpu_has(p),
                                                         reason=f"this CPU lacks the {p} instructions"))
                for p in kernels.PATHS]

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session", autouse=True)
def shared_start_up_timings(tmp_path_factory):
    """Engines of one shape time their forwards once per run, as a server remembers them across restarts
    (peagle/engine/calibration.py): the suite builds hundreds of engines, and their start-up timings were a third of
    its time. Timings steer the policy and the step budget, never an output; a test that needs its own passes
    calibration_dir."""
    from peagle.engine.engine import LLMEngine

    folder, init = tmp_path_factory.mktemp("calibration"), LLMEngine.__init__

    def remembering(self, *args, **kwargs):
        kwargs.setdefault("calibration_dir", folder)
        init(self, *args, **kwargs)

    LLMEngine.__init__ = remembering
    yield
    LLMEngine.__init__ = init


def make_tiny_model(out: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random-weight transformers model of `model_type` saved to `out` (config.json + model.safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if model_type == "qwen2":
        kwargs.setdefault("use_sliding_window", False)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def paged(kc: torch.Tensor, vc: torch.Tensor, seed: int = 0):
    """A contiguous cache [slots, nkv, max_len, D] as a paged layers.LayerKV whose blocks lie in the pool in a
    random order (so a kernel that ignored the block table would read the wrong keys)."""
    from peagle.model.layers import KV_BLOCK_SIZE, LayerKV

    S, nkv, L, D = kc.shape
    nb = -(-L // KV_BLOCK_SIZE)
    ids = torch.randperm(S * nb, generator=torch.Generator().manual_seed(seed)) + 1  # block 0: the null block
    tables = ids.view(S, nb).to(torch.int32)
    pools = []
    for c in (kc, vc):
        pool = torch.zeros(S * nb + 1, nkv, KV_BLOCK_SIZE, D, dtype=c.dtype)
        padded = torch.zeros(S, nkv, nb * KV_BLOCK_SIZE, D, dtype=c.dtype)
        padded[:, :, :L] = c
        pool[tables.long()] = padded.view(S, nkv, nb, KV_BLOCK_SIZE, D).transpose(1, 2)
        pools.append(pool)
    return LayerKV(*pools, tables)


def cache_contents(cache) -> list[torch.Tensor]:
    """Every layer's keys and values of every slot, position by position ([slots, nkv, max_len, D] each): what a
    paged cache holds, wherever its blocks lie."""
    slots = torch.arange(cache.num_slots)
    return [t for layer in cache.layers for t in layer.gather(slots, cache.max_len)]


def on_kernel_path(monkeypatch, path: str) -> None:
    """Run what is built from here on (packed weights, native layers, attention calls) on matrix path `path`, as a
    process started with PEAGLE_CPU_KERNELS=path would (its paths are resolved once per process)."""
    from peagle.model import kernels

    assert path in kernels.supported_paths(), path
    monkeypatch.setattr(kernels, "_resolved", kernels.resolve(path, kernels._cpu_flags(), kernels.library))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices run fastest on one thread, and far faster than on two on a shared, busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from peagle.model.loading import embedded_model_dir

    return embedded_model_dir()


def make_tiny_chat_model(out: Path, tokenizer_dir: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny random model over SmolLM2's vocab, with SmolLM2's tokenizer and chat template copied in, so text,
    chat and stop strings work at a fraction of the real model's cost. Its greedy output is gibberish, but
    deterministic."""
    import shutil

    make_tiny_model(out, model_type, seed=seed, **{"vocab_size": 49152, "eos_token_id": 2, "bos_token_id": 1,
                                                   **overrides})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-llama"), smollm2_dir)
