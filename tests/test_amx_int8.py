"""The "amx-int8" quantized-weight path (kernels/amx.c): block sums in AMX int8 tiles (`tdpbssd`) for products of
many rows of every block format (the 32-input ones and the K-quants); VNNI's kernels for fewer rows. Its promise is the other paths': each row
of an M-row product is the AVX2 library's one-row result, bit for bit, whatever M, the row's place and the threads.

Checked twice: on the real instructions where this CPU has AMX int8 and the OS grants the tile state, and on the
emulated library everywhere (kernels.emulated_library(): the tile instructions in portable C, the AVX-512 ones from
SIMDe), so the tiles' logic is tested on any x86-64 with AVX2. Without SIMDe's headers the emulated half fails on a
CPU without AMX (nothing else would check the path there) and skips where the real one runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle.model import kernels, quant
from tests.conftest import needs_native_kernels
from tests.test_kernels import bf16
from tests.test_kernels_emulated import FP16_AT, blocks_of, qgemm

pytestmark = needs_native_kernels

# (N, K): an odd number of 8-column groups with a ragged last one (a lone group in the last column pair), a single
# group; K/32 blocks of 18 (4 tile spans of 4 and 2 more), 5 (one span and one), 3 (no full span) and 1.
SHAPES = [(197, 576), (24, 160), (40, 96), (8, 32)]
# K-quants: 24, 16 and 8 sub-block tiles (3, 2 and 1 super-blocks of 256)
SHAPES_256 = [(197, 768), (40, 512), (8, 256)]
ROWS = 33  # every row count 1..33: one, two and three row tiles of 16 with every remainder


def real_amx():
    if "amx-int8" in kernels.quant_paths():
        return kernels.library()
    if kernels.cpu_has("amx-int8") and kernels.available():
        pytest.fail("this CPU has AMX int8 but the amx-int8 path does not run (library built without it, or the "
                    "tile state refused)")
    pytest.skip("this CPU lacks AMX int8 (the emulated library checks the path here)")


def emulated_amx():
    lib = kernels.emulated_library()
    if lib is None:
        message = "SIMDe's headers are missing (apt-get install libsimde-dev): the AMX section cannot be emulated here"
        if "amx-int8" in kernels.quant_paths():
            pytest.skip(message + ", and this CPU checks it natively")
        pytest.fail(message + ", and this CPU lacks AMX int8, so nothing else checks the path")
    return lib


LIBRARIES = {"real": real_amx, "emulated": emulated_amx}


@pytest.fixture
def on_tiles():
    """lib -> lib with every product of 2 or more rows on tiles (the path's default sends fewer than 8 rows to VNNI,
    which is faster there), restored after the test."""
    changed = []

    def every_row_count(lib):
        changed.append((lib, lib.peagle_qgemm_amx_min_rows(2)))
        return lib
    yield every_row_count
    for lib, before in reversed(changed):
        lib.peagle_qgemm_amx_min_rows(before)


def assert_amx_gives_avx2_bits(lib, qw: quant.QuantWeight, x: torch.Tensor, row_counts) -> None:
    alone = torch.cat([qgemm(kernels.library(), "avx2", qw, x[r:r + 1]) for r in range(len(x))])
    for M in row_counts:
        assert torch.equal(qgemm(lib, "amx-int8", qw, x[:M]), alone[:M]), f"{qw.format} {qw.out_features}x{qw.in_features}: {M} rows"
        assert torch.equal(qgemm(lib, "amx-int8", qw, x[-M:]), alone[-M:]), f"{qw.format}: last {M} rows"


@pytest.mark.parametrize("which", LIBRARIES)
@pytest.mark.parametrize("fmt", kernels.AMX_INT8_FORMATS)
def test_amx_int8_gives_avx2_bits_for_every_row_count(which, fmt, one_thread, on_tiles):
    lib = on_tiles(LIBRARIES[which]())
    for i, (N, K) in enumerate(SHAPES_256 if quant.FORMATS[fmt].inputs == 256 else SHAPES):
        qw = quant.QuantWeight.from_blocks(blocks_of(fmt, N, K, seed=i), fmt, N, K, path="avx2")
        x = bf16(ROWS, K, seed=10 + i)
        # every row count on the first shape; the others at the tile edges
        assert_amx_gives_avx2_bits(lib, qw, x, range(1, ROWS + 1) if i == 0 else (1, 2, 3, 5, 15, 16, 17, 33))


@pytest.mark.parametrize("which", LIBRARIES)
def test_amx_int8_threads_split_columns_without_changing_bits(which, on_tiles):
    lib = on_tiles(LIBRARIES[which]())
    for fmt, K in (("q4_0", 576), ("q5_1", 576), ("q5_k", 768), ("q6_k", 768)):
        qw = quant.QuantWeight.from_blocks(blocks_of(fmt, 197, K, seed=5), fmt, 197, K, path="avx2")
        x = bf16(21, K, seed=6)
        assert torch.equal(qgemm(lib, "amx-int8", qw, x, threads=2), qgemm(kernels.library(), "avx2", qw, x))


@pytest.mark.parametrize("which", LIBRARIES)
@pytest.mark.parametrize("fmt", kernels.AMX_INT8_FORMATS)
def test_amx_int8_sums_of_the_largest_codes_are_exact(which, fmt, one_thread, on_tiles):
    """Every code, scale and minimum at an extreme (all bits set, or Q8_0's -128; all zero, or Q8_0's 127, in the
    other half of the columns) times activations of the largest magnitude of both signs: the largest block sums the tiles make, still
    AVX2's bits."""
    lib = on_tiles(LIBRARIES[which]())
    f = quant.FORMATS[fmt]
    N, K = 24, 512 if f.inputs == 256 else 96
    blocks = np.full((N, K // f.inputs, f.block_bytes), 0xFF, dtype=np.uint8)
    blocks[N // 2:] = 0x7F if fmt == "q8_0" else 0x00
    if fmt == "q8_0":
        blocks[: N // 2, :, 2:] = 0x80
    for at in FP16_AT[fmt]:
        blocks[:, :, at:at + 2] = np.array([2 ** -10], dtype=np.float16).view(np.uint8)
    qw = quant.QuantWeight.from_blocks(torch.from_numpy(blocks.reshape(N, -1)), fmt, N, K, path="avx2")
    x = torch.ones(34, K).bfloat16()
    x[1::2] = -1
    assert_amx_gives_avx2_bits(lib, qw, x, (2, 16, 17, 34))


@pytest.mark.parametrize("which", LIBRARIES)
def test_amx_int8_default_threshold_gives_the_same_bits(which, one_thread):
    """At the library's own threshold (VNNI below it, tiles from it) the rows around it are AVX2's bits too."""
    lib = LIBRARIES[which]()
    threshold = lib.peagle_qgemm_amx_min_rows(0)
    assert 2 <= threshold <= 64
    qw = quant.QuantWeight.from_blocks(blocks_of("q4_0", 40, 96, seed=12), "q4_0", 40, 96, path="avx2")
    assert_amx_gives_avx2_bits(lib, qw, bf16(threshold + 1, 96, seed=13), (threshold - 1, threshold, threshold + 1))


def test_amx_int8_is_the_block_path_where_the_cpu_has_it():
    if kernels.cpu_has("amx-int8") and kernels.available():
        assert kernels.quant_paths()[0] == "amx-int8"
        assert kernels.quant_path() == "amx-int8" or kernels.kernel_paths().choice in ("avx2", "avx512-bf16")
    else:
        assert "amx-int8" not in kernels.quant_paths()


def test_greedy_speculation_equals_plain_greedy_with_every_window_on_tiles(smollm2_dir, one_thread, on_tiles):
    """A Q4_0 model whose verify windows and prefills all run on tiles (every product of 2 or more rows), while its
    plain one-row decoding runs VNNI: greedy speculation must still give plain decoding's tokens."""
    from transformers import AutoTokenizer

    from peagle.model.target import TargetModel
    from tests.test_quant import _assert_lossless

    on_tiles(real_amx())
    target = TargetModel.from_pretrained(smollm2_dir, quantization="q4_0")
    assert target.layers[0].mlp.gate_up.packed.path == "amx-int8"
    _assert_lossless(target, AutoTokenizer.from_pretrained(smollm2_dir), [("peagle", 3, 4), ("eagle3", 7, 2)],
                     drafter_quantization="q8_0")
