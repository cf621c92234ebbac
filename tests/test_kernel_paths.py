"""Which kernel paths run (kernels.resolve): from a choice, a CPU's flags and the library, on pretended CPUs of each
kind, so every machine checks every CPU's choice. PEAGLE_CPU_KERNELS=auto is the default said out loud: it and an
unset variable must resolve alike everywhere (naming "auto" once moved block products from VNNI to AVX2 on a CPU
with VNNI but no AVX-512 BF16)."""
from __future__ import annotations

import pytest

from peagle.model import kernels

ZEN3 = frozenset({"avx2", "fma", "f16c"})
ICE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # VNNI without AVX-512 BF16
ZEN4 = ICE_LAKE | {"avx512_bf16"}  # and Zen 5
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}
CPUS = {"zen3": ZEN3, "ice-lake": ICE_LAKE, "zen4": ZEN4, "sapphire-rapids": SAPPHIRE_RAPIDS}
# What "auto" runs on each: the matrix path, attention's, the block-quantized paths and their default.
AUTO = {"zen3": ("avx2", "avx2", ("avx2",), "avx2"),
        "ice-lake": ("avx2", "avx2", ("avx512-vnni", "avx2"), "avx512-vnni"),
        "zen4": ("avx512-bf16", "avx512-bf16", ("avx512-vnni", "avx2"), "avx512-vnni"),
        "sapphire-rapids": ("amx", "avx512-bf16", ("amx-int8", "avx512-vnni", "avx2"), "amx-int8")}


class FakeLibrary:
    """A kernel library built with every section: each matrix and block-quantized kernel, and an AMX tile state
    request the OS grants or refuses."""

    def __init__(self, grants_amx: bool = True):
        for symbol in kernels._GEMM_SYMBOL.values():
            setattr(self, symbol, object())
        for path in kernels.QUANT_PATHS:
            for fmt in kernels.QUANT_FORMATS:
                setattr(self, kernels.qgemm_symbol(path, fmt), object())
        self.peagle_amx_init = lambda: int(grants_amx)


LIB = FakeLibrary()


def load() -> FakeLibrary:
    return LIB


@pytest.mark.parametrize("cpu", CPUS)
def test_auto_and_unset_resolve_alike(cpu, monkeypatch):
    monkeypatch.delenv("PEAGLE_CPU_KERNELS", raising=False)
    unset = kernels.resolve(kernels.choice_from_environment(), CPUS[cpu], load)
    for spelling in ("auto", " AUTO "):
        monkeypatch.setenv("PEAGLE_CPU_KERNELS", spelling)
        assert kernels.resolve(kernels.choice_from_environment(), CPUS[cpu], load) == unset
    assert (unset.matmul, unset.attention, unset.quant_paths, unset.quant) == AUTO[cpu]
    assert unset.matrix_paths == tuple(p for p in kernels.PATHS if kernels._CPU_FLAGS_NEEDED[p] <= CPUS[cpu])


@pytest.mark.parametrize("cpu, choice, blocks", [
    ("ice-lake", "avx2", "avx2"),  # naming avx2 keeps block products on AVX2 too, as on a Zen 3
    ("zen4", "avx2", "avx2"),
    ("sapphire-rapids", "avx2", "avx2"),
    ("sapphire-rapids", "avx512-bf16", "avx512-vnni"),  # off AMX tiles
    ("sapphire-rapids", "amx", "amx-int8"),
])
def test_naming_a_matrix_path_keeps_block_products_to_its_instructions(cpu, choice, blocks):
    p = kernels.resolve(choice, CPUS[cpu], load)
    assert p.choice == choice and p.matmul == choice and p.quant == blocks
    assert p.attention == ("avx2" if choice == "avx2" else "avx512-bf16")
    assert p.quant_paths == AUTO[cpu][2]  # what runs is the machine's; only the default moves


def test_refused_amx_leaves_both_amx_paths_out():
    p = kernels.resolve("auto", SAPPHIRE_RAPIDS, lambda: FakeLibrary(grants_amx=False))
    assert not p.amx_granted and p.matrix_paths == ("avx512-bf16", "avx2") and p.quant == "avx512-vnni"
    with pytest.raises(ValueError, match="PEAGLE_CPU_KERNELS=amx cannot run on this machine; it runs: "
                                         "avx512-bf16, avx2"):
        kernels.resolve("amx", SAPPHIRE_RAPIDS, lambda: FakeLibrary(grants_amx=False))


def test_a_path_the_cpu_lacks_names_what_it_runs():
    with pytest.raises(ValueError, match="PEAGLE_CPU_KERNELS=avx512-bf16 cannot run on this machine; it runs: "
                                         "avx2$"):
        kernels.resolve("avx512-bf16", ICE_LAKE, load)
    with pytest.raises(ValueError, match=r"it runs: none \(PyTorch only\)"):
        kernels.resolve("avx2", frozenset(), load)
    with pytest.raises(ValueError, match="'fast' is not one of auto, off, amx, avx512-bf16, avx2"):
        kernels.resolve("fast", ZEN3, load)


@pytest.mark.parametrize("choice, flags", [("off", SAPPHIRE_RAPIDS), ("0", ZEN3), ("auto", frozenset())])
def test_pytorch_runs_without_building_where_no_native_path_applies(choice, flags):
    def no_build():
        raise AssertionError("the library was built")

    p = kernels.resolve(choice, flags, no_build)
    assert p == kernels.KernelPaths("off" if choice == "0" else choice)
    assert p.lib is None and p.matmul is None and p.quant is None and p.quant_paths == ()


def test_every_helper_reads_the_one_resolved_value(monkeypatch):
    p = kernels.resolve("auto", ICE_LAKE, load)
    monkeypatch.setattr(kernels, "_resolved", p)
    assert kernels.kernel_paths() is p and kernels.library() is LIB and kernels.available()
    assert (kernels.supported_paths(), kernels.matmul_path(), kernels.attention_path(), kernels.quant_paths(),
            kernels.quant_path()) == (p.matrix_paths, "avx2", "avx2", ("avx512-vnni", "avx2"), "avx512-vnni")
    assert kernels.summary() == {"kernels": "avx2", "greedy_bit_exact": True}
    monkeypatch.setenv("PEAGLE_CPU_KERNELS", "avx2")  # read once: a later change does not move a running process
    assert kernels.quant_path() == "avx512-vnni"
