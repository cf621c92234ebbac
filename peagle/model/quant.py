"""Block-quantized weights: GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (blocks of 32 inputs of one output row) and its
K-quants Q4_K, Q5_K and Q6_K (super-blocks of 256), kept in the bits they were stored in and multiplied by
the kernels' integer dot products (kernels/common.h, "Block-quantized weights", says what each block holds).

    Q4_0: w = d (q - 8)           18 bytes per 32 inputs (4.5 bits a weight)
    Q4_1: w = d q + m             20 bytes per 32 (5 bits)
    Q5_0: w = d (q - 16)          22 bytes per 32 (5.5 bits)
    Q5_1: w = d q + m             24 bytes per 32 (6 bits)
    Q8_0: w = d q                 34 bytes per 32 (8.5 bits)
    Q4_K: w = d sc q - dmin m     144 bytes per 256 (4.5 bits), 8 sub-blocks with 6-bit sc and m
    Q5_K: w = d sc q - dmin m     176 bytes per 256 (5.5 bits)
    Q6_K: w = d sc (q - 32)       210 bytes per 256 (6.56 bits), 16 sub-blocks with int8 sc
`QuantWeight` holds one matrix regrouped for the kernel (same bytes, 8 output columns side by side); `QuantStack`
several of one input in different formats (a file's q/k/v); `quantize` makes Q4_0 / Q4_1 / Q8_0 blocks from float
weights as llama.cpp's reference quantizers do (`--quantization`); `dequantize` and `QuantEmbedding` compute the
weights in fp32 exactly as gguf's own dequantizer does.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from peagle.model import kernels

BLOCK = 32  # inputs per block of the 32-input formats (and of `--quantization`)
QCOLS = 8  # output columns per group in the kernel's layout (kernels/common.h QCOLS)


class BlockFormat(NamedTuple):
    fid: int  # the kernels' format id (kernels/common.h)
    inputs: int  # inputs per GGUF block
    block_bytes: int  # bytes per GGUF block


_SIZES = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q5_0": (32, 22), "q5_1": (32, 24),
          "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
FORMATS = {name: BlockFormat(fid, *_SIZES[name]) for fid, name in enumerate(kernels.QUANT_FORMATS)}
QUANTIZATIONS = ("q4_0", "q4_1", "q8_0")  # what `--quantization` accepts (quantize_blocks makes these)
# `--quantization` keeps the LM head and the embedding table in 8 bits, as the embedded model's own GGUF does (and
# llama.cpp's quantizer, which keeps its output tensor at 6 bits): on the embedded model a 4-bit LM head takes the
# held-out perplexity from 4.33 to 5.49 (docs/performance.md, "Quantized weights").
EMBEDDING_QUANTIZATION = "q8_0"
# A block-quantized target gets a Q8_0 drafter: on the embedded model its drafting steps take about 20% less time
# and its acceptance is unchanged (docs/performance.md, "Quantized weights"); a bf16 target keeps a bf16 one unless
# the speculative config's "quantization" asks for a block format.
DRAFTER_QUANTIZATION = "q8_0"
QUANTIZATION_HELP = ("quantize a float (safetensors) model's decoder matrices at load into GGUF's q4_0 / q4_1 / q8_0 "
                     "blocks (its LM head and embedding into q8_0), as vLLM's online --quantization (a .gguf model "
                     "runs its own blocks as they are)")


def drafter_quantization(requested: str | None, target_quantized: bool) -> str | None:
    """The drafter's weight format (None: its own floats): the speculative config's `quantization` when set, else
    DRAFTER_QUANTIZATION beside a block-quantized target."""
    if requested is not None:
        require_kernels(f'the speculative config\'s "quantization": "{requested}"')
        return requested
    return DRAFTER_QUANTIZATION if target_quantized else None


def require_kernels(what: str) -> None:
    """Quantized weights run only on peagle's kernels: say so instead of failing inside a matmul."""
    if not kernels.available():
        raise RuntimeError(f"{what} needs peagle's native CPU kernels (x86-64 with AVX2 and a C compiler), which do "
                           "not run here (PEAGLE_CPU_KERNELS=off, or no AVX2 / compiler): use a bf16 model instead")


def _rows_f32(fmt: str, data_ptr: int, out_features: int, in_features: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a qpanel matrix in fp32 (kernels.c dequantize_block: gguf's dequantizer, bit for bit)."""
    ids = rows.to(torch.int64).contiguous()
    out = torch.empty(len(ids), in_features)
    if kernels.library().peagle_qrows_f32(FORMATS[fmt].fid, data_ptr, out_features, in_features, ids.data_ptr(),
                                          len(ids), out.data_ptr()):
        raise IndexError(f"rows must lie in [0, {out_features})")
    return out


@dataclass
class QuantWeight:
    """A matrix W [out_features, in_features] in one block format, regrouped for the kernel (kernels.c "qpanels")."""
    data: torch.Tensor  # flat uint8
    out_features: int
    in_features: int
    format: str
    path: str  # the integer dot products' instruction set (kernels.QUANT_PATHS): the same bits on every one

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, fmt: str, out_features: int, in_features: int,
                    path: str | None = None) -> "QuantWeight":
        """From GGUF's bytes: `blocks` uint8 [out_features, in_features / block inputs * block bytes], rows as in
        the file. `path`: kernels.quant_path() by default."""
        require_kernels(f"{fmt} weights")
        path = path or kernels.quant_path()
        if path not in kernels.quant_paths():
            raise ValueError(f"quantized-weight path {path!r} does not run here; this machine runs "
                             f"{kernels.quant_paths()}")
        if fmt not in FORMATS:
            raise ValueError(f"no kernel for {fmt!r}; supported block formats: {', '.join(FORMATS)}")
        f = FORMATS[fmt]
        if in_features % f.inputs:
            raise ValueError(f"a {fmt} matrix needs a multiple of {f.inputs} inputs, got {in_features}")
        blocks = blocks.contiguous().view(torch.uint8)
        if blocks.numel() != out_features * in_features // f.inputs * f.block_bytes:
            raise ValueError(f"{fmt} data of {blocks.numel()} bytes does not hold a {out_features}x{in_features} "
                             "matrix (truncated or corrupt file)")
        lib = kernels.library()
        data = torch.empty(lib.peagle_qpanels_size(f.fid, out_features, in_features), dtype=torch.uint8)
        lib.peagle_qpack(f.fid, blocks.data_ptr(), out_features, in_features, data.data_ptr())
        return cls(data, out_features, in_features, fmt, path)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str, path: str | None = None) -> "QuantWeight":
        """Quantize a float matrix [N, K] into `fmt` blocks (`--quantization`)."""
        return cls.from_blocks(quantize_blocks(weight, fmt), fmt, *weight.shape, path=path)

    def __post_init__(self) -> None:
        lib = kernels.library()
        self.gemm = getattr(lib, kernels.qgemm_symbol(self.path, self.format))  # looked up once: packed_linear runs every step
        self.gemm_ptr = ctypes.cast(self.gemm, ctypes.c_void_p).value
        self.data_ptr = self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W (or its rows `rows`) as fp32 [n, K], computed as gguf's dequantizer does (bit for bit)."""
        rows = torch.arange(self.out_features) if rows is None else rows
        return _rows_f32(self.format, self.data_ptr, self.out_features, self.in_features, rows)


class _StackLayout(ctypes.Structure):
    """kernels.c's qstack: each part's kernel, qpanels and rows."""
    _fields_ = [("count", ctypes.c_int), ("gemm", ctypes.c_void_p * 4), ("data", ctypes.c_void_p * 4),
                ("rows", ctypes.c_int * 4)]


class QuantStack:
    """Matrices of one input in different block formats stacked by output rows, multiplied in one call (kernels.c
    peagle_qgemm_stack): llama-quantize's mixes give a layer's q, k and v (or gate and up) different formats."""

    def __init__(self, parts: list[QuantWeight]):
        if not 1 < len(parts) <= 4:
            raise ValueError(f"a stack holds 2 to 4 matrices, got {len(parts)}")
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.format = "+".join(dict.fromkeys(p.format for p in parts))
        self.path = parts[0].path
        n = len(parts)
        self._layout = _StackLayout(n, (ctypes.c_void_p * 4)(*[p.gemm_ptr for p in parts], *[None] * (4 - n)),
                                    (ctypes.c_void_p * 4)(*[p.data_ptr for p in parts], *[None] * (4 - n)),
                                    (ctypes.c_int * 4)(*[p.out_features for p in parts], *[0] * (4 - n)))
        self.gemm = kernels.library().peagle_qgemm_stack
        self.gemm_ptr = ctypes.cast(self.gemm, ctypes.c_void_p).value
        self.data_ptr = ctypes.addressof(self._layout)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W (or its rows `rows`) as fp32, as QuantWeight.dequantize."""
        whole = torch.cat([p.dequantize() for p in self.parts])
        return whole if rows is None else whole[rows]


def fuse(parts: list[tuple[str, torch.Tensor]], in_features: int) -> "QuantWeight | QuantStack":
    """Block-quantized matrices of one input (format, GGUF rows as read from a file) stacked by output rows into one:
    a QuantWeight where neighbours share a format, a QuantStack of those runs otherwise (a K-quant mix's q/k/v)."""
    runs: list[tuple[str, list[torch.Tensor]]] = []
    for fmt, data in parts:
        if runs and runs[-1][0] == fmt:
            runs[-1][1].append(data)
        else:
            runs.append((fmt, [data]))
    weights = [QuantWeight.from_blocks(torch.cat(ds), fmt, sum(d.shape[0] for d in ds), in_features)
               for fmt, ds in runs]
    return weights[0] if len(weights) == 1 else QuantStack(weights)


def format_of(packed, weight: torch.Tensor) -> str:
    """The number format a matrix runs in: its block format, or the float dtype of its weights ("bf16", ...)."""
    fmt = getattr(packed, "format", None)
    if fmt is not None and fmt != "bf16":
        return fmt
    return str(weight.dtype).removeprefix("torch.").replace("bfloat16", "bf16")


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS. Loading copies a file's blocks once into the kernel's layout, and
    the engine's start-up calibration runs a full prefill chunk; glibc keeps what they freed mapped, so without
    this the resident size overstates the model by ~150 MB after loading and ~30 MB after calibration."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def quantize_blocks(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF blocks (uint8 [N, K / 32 * block bytes]) of a float matrix, as llama.cpp's reference quantizers make
    them: Q8_0 d = max|w| / 127, q = round(w / d); Q4_0 d = (the signed w of largest magnitude) / -8,
    q = min(15, trunc(w / d + 8.5)); Q4_1 d = (max - min) / 15, m = min, q = min(15, trunc((w - m) / d + 0.5))."""
    if fmt not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(QUANTIZATIONS)}")
    N, K = weight.shape
    if K % BLOCK:
        raise ValueError(f"{fmt} needs a multiple of {BLOCK} inputs per row; this matrix has {K}")
    x = weight.detach().float().reshape(N, K // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = x.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(x * inv[..., None]).to(torch.int8).view(torch.uint8)
        parts = [d.half().view(torch.uint8).reshape(N, -1, 2), q]
    else:
        if fmt == "q4_0":
            idx = x.abs().argmax(-1, keepdim=True)
            d = x.gather(-1, idx)[..., 0] / -8
            inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
            q = torch.clamp(torch.trunc(x * inv[..., None] + 8.5), max=15)
            scales = [d]
        else:
            lo, hi = x.amin(-1), x.amax(-1)
            d = (hi - lo) / 15
            inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
            q = torch.clamp(torch.trunc((x - lo[..., None]) * inv[..., None] + 0.5), max=15)
            scales = [d, lo]
        q = q.to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        parts = [s.half().view(torch.uint8).reshape(N, -1, 2) for s in scales] + [packed]
    return torch.cat(parts, dim=-1).reshape(N, -1).contiguous()


class QuantEmbedding(nn.Module):
    """A token embedding table kept in its block format (a tied model's LM head reads the same bytes): a lookup
    dequantizes only the rows it needs, so no bf16 copy of the table exists."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.quant = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """bf16 rows [..., H] of `tokens` (the kernels' activations are bf16)."""
        flat = tokens.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(len(flat), self.embedding_dim, dtype=torch.bfloat16)
        q = self.quant
        # one native call: a decode step looks up one row, and the torch version above takes a dozen small ops
        if kernels.library().peagle_qrows_bf16(FORMATS[q.format].fid, q.data_ptr, q.out_features, q.in_features,
                                               flat.data_ptr(), len(flat), out.data_ptr()):
            raise IndexError(f"token ids must lie in [0, {q.out_features})")
        return out.reshape(*tokens.shape, self.embedding_dim)

    def table(self) -> torch.Tensor:
        """The whole table in bf16 (for a drafter that shares the target's embeddings)."""
        return self(torch.arange(self.num_embeddings))
