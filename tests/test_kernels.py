"""peagle's native CPU kernels (peagle/model/kernels.c): numerics against a float64 reference and batch invariance,
for every matrix path this machine runs (AVX2 runs on every x86-64 machine these tests target; AVX-512 BF16 and AMX
where the CPU has them).

Skipped only where the CPU lacks the instructions (tests/conftest.py): a path this CPU has but the build lacks
fails here.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from peagle.model import kernels
from tests.conftest import KERNEL_PATHS, needs_native_kernels, paged


def bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def test_every_x86_machine_with_avx2_runs_a_native_path():
    if kernels.cpu_has("avx2"):
        assert "avx2" in kernels.supported_paths(), "the AVX2 path must build and run on every AVX2 machine"
        assert kernels.summary()["greedy_bit_exact"] or kernels.matmul_path() is None
    else:
        assert kernels.supported_paths() == ()


def test_every_path_the_cpu_has_runs_and_the_fastest_is_chosen():
    """Intel with AMX runs all three paths, AMD Zen 4 avx512-bf16 and avx2, Zen 3 avx2: a section the compiler or
    the OS dropped would otherwise only show up as skipped tests."""
    expected = tuple(p for p in kernels.PATHS if kernels.cpu_has(p))
    assert kernels.supported_paths() == expected
    if expected and kernels.kernel_paths().choice == "auto":
        assert kernels.matmul_path() == expected[0]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("N, K", [(960, 576), (576, 1536), (49152, 64), (7, 40), (33, 101), (130, 96), (1, 2)])
def test_packed_linear_matches_float64_and_is_batch_invariant(path, N, K):
    w, x = bf16(N, K, seed=1), bf16(70, K, seed=2)
    packed = kernels.PackedWeight.pack(w, path)
    assert packed.path == path
    with torch.inference_mode():
        full = kernels.packed_linear(x, packed)
        assert full.dtype == torch.bfloat16 and full.shape == (70, N)
        # fp32 accumulation rounded once to bf16: within bf16 rounding (2^-8 relative) of the exact product, plus
        # fp32 summation error relative to the terms' magnitude
        exact = x.double() @ w.double().T
        terms = x.double().abs() @ w.double().abs().T
        assert ((full.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * terms).all()
        # a row's bits never depend on how many rows share the call or where it sits
        for M in (1, 2, 3, 8, 16, 17, 33):
            assert torch.equal(kernels.packed_linear(x[:M], packed), full[:M]), M
        for offset in (1, 5, 30, 67):
            assert torch.equal(kernels.packed_linear(x[offset:offset + 3], packed), full[offset:offset + 3])
            assert torch.equal(kernels.packed_linear(x[offset:offset + 1], packed), full[offset:offset + 1])
        # leading dims and a strided input
        assert torch.equal(kernels.packed_linear(x[:12].view(3, 4, K), packed).view(12, N), full[:12])
        wide = torch.cat([x, x], dim=1)[:, :K]
        assert torch.equal(kernels.packed_linear(wide, packed), full)


@pytest.mark.parametrize("path", [p for p in KERNEL_PATHS if p.values[0] != "amx"])
@pytest.mark.parametrize("N, K", [(7, 40), (33, 101), (16, 3), (32, 6), (1, 1)])
def test_panels_hold_pairs_of_16_rows_zero_padded(path, N, K):
    """The AVX2 and AVX-512 layout: panel p, pair q holds rows 16p..16p+15, each as its elements 2q and 2q+1 side by
    side; rows past N and the element past an odd K are zero."""
    w = bf16(N, K, seed=5)
    NP, K2 = -(-N // 16), -(-K // 2)
    padded = torch.zeros(NP * 16, K2 * 2, dtype=torch.bfloat16)
    padded[:N, :K] = w
    want = padded.view(NP, 16, K2, 2).permute(0, 2, 1, 3).reshape(-1)
    assert torch.equal(kernels.PackedWeight.pack(w, path).data.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_packed_linear_thread_count_does_not_change_bits(path):
    w, x = bf16(300, 200, seed=3), bf16(9, 200, seed=4)
    packed = kernels.PackedWeight.pack(w, path)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = kernels.packed_linear(x, packed)
            torch.set_num_threads(2)
            two = kernels.packed_linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_native_kernels
def test_packed_path_is_skipped_when_it_does_not_apply():
    w = bf16(64, 32)
    packed = kernels.PackedWeight.pack(w)
    assert kernels.packed_linear(bf16(2, 32).float(), packed) is None  # fp32 input
    x = bf16(2, 32).requires_grad_()
    assert kernels.packed_linear(x, packed) is None  # needs gradients
    assert kernels.PackedWeight.pack(w.float()) is None


@needs_native_kernels
def test_a_path_this_machine_cannot_run_is_refused(monkeypatch):
    missing = [p for p in kernels.PATHS if p not in kernels.supported_paths()]
    if not missing:  # a CPU that runs every path: take one away, so the refusal is checked here too
        missing = [kernels.PATHS[0]]
        monkeypatch.setattr(kernels, "_resolved",
                            dataclasses.replace(kernels.kernel_paths(), matrix_paths=kernels.PATHS[1:]))
    with pytest.raises(ValueError, match="does not run here"):
        kernels.PackedWeight.pack(bf16(16, 16), missing[0])


@needs_native_kernels
def test_rms_norm_equals_the_reference_rounding():
    for i in range(20):
        x, w = bf16(3, 5, 576, seed=i, scale=1 + i), bf16(576, seed=100 + i)
        ref = w * torch.rms_norm(x.float(), (576,), None, 1e-5).to(torch.bfloat16)
        with torch.inference_mode():
            out = kernels.rms_norm_bf16(x, w, 1e-5)
        assert (out != ref).float().mean() < 1e-3  # summation order may flip a rare last bit
        assert (out.float() - ref.float()).abs().max() <= 0.01 * ref.float().abs().max()
        with torch.inference_mode():  # a row alone rounds like the same row among others
            assert torch.equal(kernels.rms_norm_bf16(x[1, 2:3], w, 1e-5), out[1, 2:3])


@needs_native_kernels
def test_rope_equals_the_reference_rounding():
    from peagle.model.layers import apply_rope

    x, cos, sin = bf16(2, 5, 12, 64, seed=3), bf16(2, 5, 64, seed=4), bf16(2, 5, 64, seed=5)
    ref = apply_rope(x[:, :, :9], cos, sin)
    y = x.clone()
    with torch.inference_mode():
        assert kernels.rope_bf16_(y, cos, sin, heads=9)
    assert torch.equal(y[:, :, :9], ref) and torch.equal(y[:, :, 9:], x[:, :, 9:])


def _attention_reference(q, kv, slots, positions):
    """float64 causal attention of q [B, T, nh, D] over the paged cache kv (already holding this call's keys)."""
    L = int(positions.max()) + 1
    mask = (torch.arange(L)[None, None, :] <= positions[:, :, None])[:, None]
    keys, values = kv.gather(slots, L)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2).double(), keys.double(), values.double(), attn_mask=mask,
                                         enable_gqa=True)
    return ref.transpose(1, 2)


# The two ways attention scores and weighted values are computed (kernels.attention_path()), each where the CPU has
# its instructions: avx2 on every x86-64 machine, avx512-bf16 on Zen 4 and on Intel with AVX-512 BF16 or AMX.
ATTENTION_PATHS = [pytest.param(p, marks=pytest.mark.skipif(not kernels.cpu_has(p),
                                                            reason=f"this CPU lacks the {p} instructions "
                                                                   "(tests/test_kernels_emulated.py runs these checks "
                                                                   "on the emulated instructions)"))
                   for p in ("avx512-bf16", "avx2")]


@needs_native_kernels
def test_the_attention_path_follows_the_matrix_path():
    assert kernels.attention_path() == ("avx512-bf16" if kernels.matmul_path() in ("amx", "avx512-bf16") else "avx2")


@needs_native_kernels
@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_attention_writes_the_cache_matches_float64_and_is_batch_invariant(path):
    """Through block tables whose blocks lie in the pool out of order."""
    nh, nkv, D, max_len = 9, 3, 64, 256
    kv = paged(bf16(3, nkv, max_len, D, seed=6), bf16(3, nkv, max_len, D, seed=7), seed=1)
    qkv = bf16(2, 8, nh + 2 * nkv, D, seed=8)  # the layout the model's fused projection gives
    q, k, v = qkv.split([nh, nkv, nkv], dim=2)
    slots = torch.tensor([2, 0])
    positions = torch.stack([200 + torch.arange(8), 17 + torch.arange(8)])
    with torch.inference_mode():
        out = kernels.attention_bf16(q, k, v, kv, slots, positions, path=path)
        keys, values = kv.gather(torch.arange(3), max_len)
        for b in range(2):  # this call's keys and values landed at their slots and positions
            written_k, written_v = keys[slots[b]][:, positions[b]], values[slots[b]][:, positions[b]]  # [nkv, T, D]
            assert torch.equal(written_k, k[b].transpose(0, 1)) and torch.equal(written_v, v[b].transpose(0, 1))
        assert (out.double() - _attention_reference(q, kv, slots, positions)).abs().max() < 0.02
        for b in range(2):
            for t in range(8):
                one = kernels.attention_bf16(q[b:b + 1, t:t + 1], k[b:b + 1, t:t + 1], v[b:b + 1, t:t + 1], kv,
                                             slots[b:b + 1], positions[b:b + 1, t:t + 1], path=path)
                assert torch.equal(one[0, 0], out[b, t])


@needs_native_kernels
@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_attention_bits_do_not_depend_on_where_the_blocks_lie(path):
    """The same keys in the pool in two different block orders give the same bits, and a moved table (a sliding
    window's start) reads the keys from there on."""
    nh, nkv, D, max_len = 4, 2, 64, 96
    kc, vc = bf16(2, nkv, max_len, D, seed=30), bf16(2, nkv, max_len, D, seed=31)
    q, k, v = bf16(2, 3, nh, D, seed=32), bf16(2, 3, nkv, D, seed=33), bf16(2, 3, nkv, D, seed=34)
    slots, positions = torch.tensor([1, 0]), torch.stack([70 + torch.arange(3), 40 + torch.arange(3)])
    with torch.inference_mode():
        a = kernels.attention_bf16(q, k, v, paged(kc, vc, seed=2), slots, positions, path=path)
        b = kernels.attention_bf16(q, k, v, paged(kc, vc, seed=3), slots, positions, path=path)
        assert torch.equal(a, b)
        kv = paged(kc, vc, seed=4)
        moved = kernels.attention_bf16(q[:1, :1], k[:1, :1], v[:1, :1], kv.moved(21), slots[:1], positions[:1, :1] - 21,
                                       path=path)
        keys, values = kv.gather(slots[:1], 71)
        window = paged(keys[:, :, 21:].contiguous(), values[:, :, 21:].contiguous(), seed=5)
        alone = kernels.attention_bf16(q[:1, :1], k[:1, :1], v[:1, :1], window, torch.tensor([0]),
                                       positions[:1, :1] - 21, path=path)
    assert torch.equal(moved, alone)


@needs_native_kernels
@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_a_tree_row_reads_its_listed_keys_with_a_chain_rows_bits(path):
    """A draft tree's rows (x_n, then nodes written one after another, each reading the keys before x_n and its own
    branch) give each branch the bits the same rows give as a chain at consecutive positions."""
    nh, nkv, D, max_len, n = 4, 2, 64, 96, 40
    kc, vc = bf16(1, nkv, max_len, D, seed=40), bf16(1, nkv, max_len, D, seed=41)
    q, k, v = bf16(1, 4, nh, D, seed=42), bf16(1, 4, nkv, D, seed=43), bf16(1, 4, nkv, D, seed=44)
    # x_n -> {a, b}, b -> c: rows x_n, a, b, c at positions n..n+3
    keys = torch.tensor([[0, n + 1, 0, 0, 0], [0, n + 1, 1, n + 1, 0], [0, n + 1, 1, n + 2, 0],
                         [0, n + 1, 2, n + 2, n + 3]], dtype=torch.int32)
    slot, positions = torch.tensor([0]), (n + torch.arange(4))[None]
    with torch.inference_mode():
        tree = kernels.attention_bf16(q, k, v, paged(kc, vc, seed=7).reading(keys), slot, positions, path=path)
        for branch in ([0, 1], [0, 2, 3]):
            chain = kernels.attention_bf16(q[:, branch], k[:, branch], v[:, branch], paged(kc, vc, seed=8), slot,
                                           (n + torch.arange(len(branch)))[None], path=path)
            assert torch.equal(chain[0], tree[0, branch]), branch
        with pytest.raises(IndexError):  # a listed key outside the cache is refused, nothing written
            bad = keys.clone()
            bad[3, 4] = max_len
            kernels.attention_bf16(q, k, v, paged(kc, vc).reading(bad), slot, positions, path=path)


@needs_native_kernels
@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("D", [8, 48, 128, 256])
def test_attention_head_sizes(D, path):
    nh, nkv, max_len = 4, 2, 64
    kv = paged(bf16(1, nkv, max_len, D, seed=9), bf16(1, nkv, max_len, D, seed=10))
    q, k, v = bf16(1, 5, nh, D, seed=11), bf16(1, 5, nkv, D, seed=12), bf16(1, 5, nkv, D, seed=13)
    slots, positions = torch.tensor([0]), (20 + torch.arange(5))[None]
    with torch.inference_mode():
        out = kernels.attention_bf16(q, k, v, kv, slots, positions, path=path)
    assert (out.double() - _attention_reference(q, kv, slots, positions)).abs().max() < 0.02


@needs_native_kernels
@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_attention_ignores_stale_cache_entries_past_each_rows_keys(path):
    """Rows with an odd number of keys: the avx512-bf16 path takes values in pairs, and the pair's second row (past
    the row's last key) must count as zeros even when the cache holds inf or NaN there."""
    nh, nkv, D, max_len = 4, 2, 64, 32
    kc, vc = bf16(1, nkv, max_len, D, seed=20), bf16(1, nkv, max_len, D, seed=21)
    kc[:, :, 9:], vc[:, :, 9:] = float("nan"), float("inf")  # this call writes positions 6-8
    kv = paged(kc, vc)
    q, k, v = bf16(1, 3, nh, D, seed=22), bf16(1, 3, nkv, D, seed=23), bf16(1, 3, nkv, D, seed=24)
    slots, positions = torch.tensor([0]), (6 + torch.arange(3))[None]  # 7 to 9 keys
    with torch.inference_mode():
        out = kernels.attention_bf16(q, k, v, kv, slots, positions, path=path)
    assert torch.isfinite(out).all()
    assert (out.double() - _attention_reference(q, kv, slots, positions)).abs().max() < 0.02


@needs_native_kernels
def test_attention_refuses_positions_and_blocks_outside_the_cache():
    kc, vc, x = bf16(1, 1, 16, 8), bf16(1, 1, 16, 8), bf16(1, 1, 1, 8)
    kv = paged(kc, vc)
    with pytest.raises(IndexError, match="outside this cache"):
        kernels.attention_bf16(x, x, x, kv, torch.tensor([0]), torch.tensor([[16]]))
    kv.tables[0, 0] = 5  # a block the pool does not have
    with pytest.raises(IndexError, match="outside this cache"):
        kernels.attention_bf16(x, x, x, kv, torch.tensor([0]), torch.tensor([[3]]))


@needs_native_kernels
def test_silu_mul_equals_the_reference_rounding():
    gate_up = bf16(7, 2 * 1536, seed=14, scale=4)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    with torch.inference_mode():
        out = kernels.silu_mul_bf16(gate_up)
        assert torch.equal(kernels.silu_mul_bf16(gate_up[3:4]), out[3:4])
    assert (out != ref).float().mean() < 0.01  # exp's last bit may differ from PyTorch's
    assert (out.float() - ref.float()).abs().max() <= 0.01 * ref.float().abs().max()


@needs_native_kernels
def test_an_allocation_failure_raises_instead_of_returning_garbage():
    """Under an address-space limit the matmul's activation copy cannot be allocated: MemoryError, output untouched
    (a subprocess, so the limit cannot hurt this test run)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import resource, torch
        from peagle.model import kernels
        torch.set_num_threads(1)
        packed = kernels.PackedWeight.pack(torch.ones(16, 4096, dtype=torch.bfloat16))
        x = torch.ones(12000, 4096, dtype=torch.bfloat16)  # 98 MB; the copy the kernel makes needs as much again
        import re
        vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 64 * 2**20, resource.RLIM_INFINITY))
        try:
            with torch.inference_mode():
                kernels.packed_linear(x, packed)
        except MemoryError as e:
            print("MemoryError:", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "MemoryError: peagle" in r.stdout and "could not allocate" in r.stdout, r.stdout + r.stderr


@needs_native_kernels
def test_summary_names_the_kernels_and_whether_greedy_is_bit_exact(tiny_llama):
    from peagle.engine import LLMEngine
    from peagle.model.target import TargetModel

    s = kernels.summary()
    assert s == {"kernels": kernels.matmul_path(), "greedy_bit_exact": True}
    assert kernels.summary("meta")["greedy_bit_exact"] is False
    engine = LLMEngine(TargetModel.from_pretrained(tiny_llama), max_num_seqs=1, max_model_len=32)
    # and the target's weight format (the thread facts beside them are tests/test_threads.py's)
    assert {k: engine.kernels[k] for k in (*s, "weights")} == {**s, "weights": "bf16"}


def test_a_forced_path_the_cpu_lacks_is_a_clear_error():
    """PEAGLE_CPU_KERNELS names a path this machine cannot run: peagle generate says so and exits 2, no traceback."""
    import os
    import subprocess
    import sys

    missing = [p for p in kernels.PATHS if p not in kernels.supported_paths()]
    taken_away = ""
    if not missing:  # a CPU that runs every path: the child process pretends to lack the first one's instructions
        missing = [kernels.PATHS[0]]
        taken_away = f"kernels._CPU_FLAGS_NEEDED[{missing[0]!r}] = frozenset({{'no-such-flag'}}); "
    child = ("import sys; from peagle.model import kernels; " + taken_away +
             "from peagle.cli import main; sys.exit(main(['generate', 'Hi', '--max-tokens', '1']))")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PEAGLE_CPU_KERNELS": missing[0]})
    assert r.returncode == 2 and f"PEAGLE_CPU_KERNELS={missing[0]} cannot run on this machine" in r.stderr
    assert "Traceback" not in r.stderr
