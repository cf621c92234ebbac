/* peagle's native CPU kernels: batch-invariant bf16 matrix multiply, attention, RMSNorm and RoPE.

   kernels.py compiles this file (one translation unit: the per-instruction-set sources it includes from
   kernels/) once per machine and picks, from the CPU's flags, one of three matrix paths:
     - AVX2 + FMA     (any x86-64 of the last ten years): bf16 weights widened to fp32, fp32 FMAs;
     - AVX-512 BF16   (AMD Zen 4/5, Intel Sapphire Rapids and later): `vdpbf16ps` pair dot products;
     - AMX            (Intel Sapphire Rapids and later): `tdpbf16ps` tiles.
   RMSNorm, RoPE and SiLU use AVX2 + FMA on every machine; attention too, except where the matrix path is AVX-512
   BF16 or AMX: there its scores and weighted values use `vdpbf16ps` (one way per process, chosen by kernels.py).

   Batch invariance is the point (docs/design.md, "Decoding step"): a verify window of K+1 rows must compute each
   row exactly as a one-row decode step does, or greedy speculation drifts from plain greedy decoding. So every
   output element is produced by one fixed sequence of instructions that depends only on that element's own row
   and column, never on how many rows share the call, where the row sits, or how many threads run: rows are blocked
   for speed, but a row's arithmetic is the same in every block shape; threads split columns, never the reduction.
   The file is built with -ffp-contract=off so the compiler cannot fuse or reorder what is written here.

   Matrix layout ("panels", AVX2 and AVX-512 BF16): W [N, K] is packed once into panels of 16 output columns;
   panel p holds, for each pair of input columns (2q, 2q+1), the 16 columns' two weights side by side:
     packed[p][q][c][e] = W[16 p + c][2 q + e]      (zero padded past N and K)
   so one 64-byte load gives 16 columns x 2 inputs, and each panel is one contiguous stream from memory. */


/* The sources, one per instruction set, included in this order (each uses what the ones before it define):
     kernels/common.h  the shared block formats and contracts: layouts, scalar helpers, the row/column loops;
     kernels/avx2.c    AVX2 + FMA: bf16 panels, attention, RMSNorm, RoPE, SiLU, the block-quantized kernels every
                       x86-64 path shares (activation quantization, qpanels, AVX2 dot products), the whole layer;
     kernels/avx512.c  AVX-512 BF16 (`vdpbf16ps` panels and attention) and AVX-512 VNNI (block-quantized);
     kernels/amx.c     AMX: `tdpbf16ps` bf16 tiles and `tdpbssd` int8 tiles for block-quantized weights.
   Compiler flags select sections: -DPEAGLE_NO_AMX, -DPEAGLE_NO_AVX512 (older compilers), PEAGLE_EMULATE_AVX512 and
   PEAGLE_EMULATE_AMX (tests: portable definitions of the instructions). */

#include "kernels/common.h"
#include "kernels/avx2.c"
#include "kernels/avx512.c"
#include "kernels/amx.c"
