"""Block-quantized weights: GGUF's Q4_0, Q4_1 and Q8_0 (blocks of 32 inputs of one output row), kept in the bits
they were stored in and multiplied by kernels.c's integer dot products (its section "Block-quantized weights").

A block of 32 weights stores a fp16 scale d, for Q4_1 a fp16 minimum m, and 32 codes q:
    Q4_0: w = d * (q - 8),  q in 0..15     18 bytes per block (4.5 bits a weight)
    Q4_1: w = d * q + m,    q in 0..15     20 bytes per block (5 bits)
    Q8_0: w = d * q,        q in -128..127 34 bytes per block (8.5 bits)
`QuantWeight` holds one matrix regrouped for the kernel (same bytes, 8 output columns side by side); `quantize`
makes the blocks from float weights as llama.cpp's reference quantizers do (`--quantization`); `dequantize` and
`QuantEmbedding` compute w = d * q (+ m) in fp32, as gguf's own dequantizer does.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from peagle.model import kernels

BLOCK = 32  # inputs per block
QCOLS = 8  # output columns per group in the kernel's layout (kernels.c QCOLS)
# name -> (kernels.c format id, bytes per GGUF block, bytes per kernel record of QCOLS blocks, code bytes per block)
FORMATS = {"q4_0": (0, 18, 144, 16), "q4_1": (1, 20, 160, 16), "q8_0": (2, 34, 272, 32)}
QUANTIZATIONS = tuple(FORMATS)  # what `--quantization` accepts
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
        """From GGUF's bytes: `blocks` uint8 [out_features, in_features / 32 * block bytes], rows as in the file.
        `path`: kernels.quant_path() by default."""
        require_kernels(f"{fmt} weights")
        path = path or kernels.quant_path()
        if path not in kernels.quant_paths():
            raise ValueError(f"quantized-weight path {path!r} does not run here; this machine runs "
                             f"{kernels.quant_paths()}")
        if fmt not in FORMATS:
            raise ValueError(f"no kernel for {fmt!r}; supported block formats: {', '.join(FORMATS)}")
        fid, block_bytes, _, _ = FORMATS[fmt]
        if in_features % BLOCK:
            raise ValueError(f"a {fmt} matrix needs a multiple of {BLOCK} inputs, got {in_features}")
        blocks = blocks.contiguous().view(torch.uint8)
        if blocks.numel() != out_features * in_features // BLOCK * block_bytes:
            raise ValueError(f"{fmt} data of {blocks.numel()} bytes does not hold a {out_features}x{in_features} "
                             "matrix (truncated or corrupt file)")
        lib = kernels.library()
        data = torch.empty(lib.peagle_qpanels_size(fid, out_features, in_features), dtype=torch.uint8)
        lib.peagle_qpack(fid, blocks.data_ptr(), out_features, in_features, data.data_ptr())
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
        """W (or its rows `rows`) as fp32 [n, K]: d * q (+ m), rounded once as gguf's dequantizer does. Reads the
        kernel's layout (kernels.c, "qpanels"), decoding only the records of the rows asked for."""
        _, _, record, code_bytes = FORMATS[self.format]
        if rows is None:
            rows = torch.arange(self.out_features)
        groups = -(-self.out_features // QCOLS)
        g, c = rows // QCOLS, rows % QCOLS
        rec = self.data.view(groups, self.in_features // BLOCK, record)[g]  # [n, Kb, record]
        col = c[:, None, None]
        scales = rec[..., QCOLS * code_bytes:].contiguous().view(torch.float16).float()  # [n, Kb, 8 or 16]
        d = scales.gather(-1, col.expand(-1, rec.shape[1], 1))
        # code byte j of column c sits in 32-byte chunk j // 4, at lane c's byte j % 4
        j = torch.arange(code_bytes)
        idx = (32 * (j // 4) + j % 4 + 4 * col).expand(-1, rec.shape[1], -1)
        if self.format == "q8_0":  # byte j: input j
            q = rec.gather(-1, idx).view(torch.int8).float()
        else:  # byte j: input j in the low nibble, input j + 16 in the high one
            raw = rec.gather(-1, idx)
            q = torch.cat([raw & 0x0F, raw >> 4], dim=-1).float()
            if self.format == "q4_0":
                q = q - 8
        w = d * q
        if self.format == "q4_1":
            w = w + scales.gather(-1, (col + QCOLS).expand(-1, rec.shape[1], 1))
        return w.reshape(len(rows), self.in_features)


def format_of(packed, weight: torch.Tensor) -> str:
    """The number format a matrix runs in: its block format, or the float dtype of its weights ("bf16", ...)."""
    fmt = getattr(packed, "format", None)
    if fmt is not None and fmt != "bf16":
        return fmt
    return str(weight.dtype).removeprefix("torch.").replace("bfloat16", "bf16")


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS. Loading copies a file's blocks once into the kernel's layout;
    glibc keeps the freed copies mapped, so without this the resident size overstates the model by ~150 MB."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def quantize_blocks(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF blocks (uint8 [N, K / 32 * block bytes]) of a float matrix, as llama.cpp's reference quantizers make
    them: Q8_0 d = max|w| / 127, q = round(w / d); Q4_0 d = (the signed w of largest magnitude) / -8,
    q = min(15, trunc(w / d + 8.5)); Q4_1 d = (max - min) / 15, m = min, q = min(15, trunc((w - m) / d + 0.5))."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(FORMATS)}")
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
        if kernels.library().peagle_qrows_bf16(FORMATS[q.format][0], q.data_ptr, q.out_features, q.in_features,
                                               flat.data_ptr(), len(flat), out.data_ptr()):
            raise IndexError(f"token ids must lie in [0, {q.out_features})")
        return out.reshape(*tokens.shape, self.embedding_dim)

    def table(self) -> torch.Tensor:
        """The whole table in bf16 (for a drafter that shares the target's embeddings)."""
        return self(torch.arange(self.num_embeddings))
