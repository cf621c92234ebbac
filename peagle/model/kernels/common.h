/* peagle's kernels: what every instruction set's source shares (kernels.c includes this first). The matrix
   layouts, the scalar helpers, the loops every bf16 matrix path runs its register blocks in, and the block formats
   of quantized weights with the arithmetic contract every quantized path keeps (bit-identical results). */
#ifndef PEAGLE_KERNELS_COMMON_H
#define PEAGLE_KERNELS_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PANEL 16      /* output columns per panel */
#define MAX_ROWS 4    /* rows per register block */
#define MAX_PANELS 4  /* panels per register block (a "column block" of 64 outputs) */
#define BF16_MAX_ROWS 8  /* rows per register block on the AVX-512 BF16 path */
#define AVX2_PREFETCH_PAIRS 64  /* AVX2 path: prefetch the panel this many input pairs (64-byte lines) ahead */
#define ROW_BLOCK 64  /* rows per cache block of the activations (prefill) */
#define HEADS_PER_PASS 4  /* attention: query heads of one key/value head computed together */
#define ROWS_PER_PASS 4   /* attention: query rows of one cache slot computed together */

/* One layer's paged KV cache, as the attention kernels read and write it. Keys and values lie in pools
   [num_blocks, nkv, block_size, D]; position p of slot s is row p % block_size of block
   tables[s * max_blocks + p / block_size] (block_size a power of two). key_offset: every query of the call reads
   and writes its keys that many positions on (where a sliding window starts; 0 otherwise).
   keys: NULL, or where each query row's keys lie when they are not simply positions 0..its own (a draft tree, whose
   nodes are written one after another but each sees only its ancestors): row r reads positions
   keys[r * keys_stride] .. keys[r * keys_stride + 1] - 1, then the keys[r * keys_stride + 2] positions listed after
   that, in that order (its own among them). A row's arithmetic is the same over the same keys in the same order,
   so a tree node computes the bits its branch would as a chain. */
typedef struct {
    uint16_t *k, *v;
    const int32_t *tables;
    int num_slots, max_blocks, block_size, num_blocks, key_offset;
    const int32_t *keys;
    int keys_stride;
} peagle_kv;

/* ---------------------------------------------------------------------------------------------------------------
   Scalar helpers (no ISA needed) */

static inline uint16_t f2bf(float f) { /* round to nearest even, NaN stays NaN: c10::BFloat16's rounding */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

size_t peagle_panels_size(int N, int K) { /* elements (bf16) of W packed into panels */
    return (size_t)((N + PANEL - 1) / PANEL) * (size_t)((K + 1) / 2) * 2 * PANEL;
}

/* Panel p holds rows p*PANEL.. as PANEL pairs (k, k+1) side by side for each pair q: row by row, each row's pairs
   go to column c of consecutive 2*PANEL-element groups, so reads are sequential and a panel's writes (K2 * 64
   bytes) stay in cache; padding (rows past N, k = K when K is odd) is zero. */
void peagle_pack_panels(const uint16_t *w, int N, int K, uint16_t *out, int nthreads) {
    int K2 = (K + 1) / 2, NP = (N + PANEL - 1) / PANEL;
    size_t panel = (size_t)K2 * 2 * PANEL;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int p = 0; p < NP; p++) {
        uint16_t *t = out + (size_t)p * panel;
        int rows = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        if (rows < PANEL || K % 2) memset(t, 0, panel * sizeof *t);
        for (int c = 0; c < rows; c++) {
            const uint16_t *row = w + (size_t)(p * PANEL + c) * K;
            uint16_t *dst = t + 2 * c;
            for (int q = 0; q < K / 2; q++)
                memcpy(dst + (size_t)q * 2 * PANEL, row + 2 * q, 4);
            if (K % 2) dst[(size_t)(K / 2) * 2 * PANEL] = row[K - 1];
        }
    }
}

/* A register block of R rows x P panels: x rows (the path's own element type) times P panels of W -> y. */
typedef void (*block_fn)(const void *x, size_t ldx, const uint16_t *w, size_t pstride, int K2, uint16_t *y,
                         size_t ldy, int ncols);

/* The loops every matrix path shares: rows in cache blocks of ROW_BLOCK, column blocks of MAX_PANELS panels split
   across threads (never a reduction), register blocks of up to max_rows rows inside; blocks[R][P] computes R rows x
   P panels, and a block of R rows covers panels_for_rows[R] panels at a time. x: M rows of ldx elements of
   x_size bytes, each row a whole number of input pairs. */
static void run_blocks(const void *x, size_t x_size, size_t ldx, const uint16_t *wp, uint16_t *y, long ldy, int M,
                       int N, int K, int nthreads, int max_rows, const int *panels_for_rows,
                       const block_fn blocks[][MAX_PANELS + 1]) {
    int K2 = (K + 1) / 2, NP = (N + PANEL - 1) / PANEL, NB = (NP + MAX_PANELS - 1) / MAX_PANELS;
    size_t pstride = (size_t)K2 * 2 * PANEL;
    #pragma omp parallel num_threads(nthreads)
    for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int mend = M - m0 < ROW_BLOCK ? M : m0 + ROW_BLOCK;
        #pragma omp for schedule(static)
        for (int nb = 0; nb < NB; nb++) {
            int pend = (nb + 1) * MAX_PANELS < NP ? (nb + 1) * MAX_PANELS : NP;
            for (int m = m0; m < mend; m += max_rows) {
                int R = mend - m < max_rows ? mend - m : max_rows, step = panels_for_rows[R];
                for (int p = nb * MAX_PANELS; p < pend; p += step) {
                    int P = pend - p < step ? pend - p : step;
                    blocks[R][P]((const char *)x + (size_t)m * ldx * x_size, ldx, wp + (size_t)p * pstride, pstride,
                                 K2, y + (size_t)m * ldy + (size_t)p * PANEL, (size_t)ldy, N - p * PANEL);
                }
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------------
   Block-quantized weights: GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (blocks of 32 inputs) and its K-quants Q4_K,
   Q5_K and Q6_K (super-blocks of 256), integer dot products: AVX2 on every x86-64 path, AVX-512 VNNI where the CPU
   has it (AMD Zen 4, Intel Ice Lake and later)

   A GGUF block holds consecutive inputs of one output row. Blocks of 32: Q4_0 a fp16 scale d and 32 4-bit codes q
   (w = d (q-8)); Q4_1 d, a fp16 minimum m and 32 codes (w = d q + m); Q5_0 / Q5_1 the same with a fifth bit per
   code in 4 bytes qh (w = d (q-16), w = d q + m); Q8_0 d and 32 int8 codes (w = d q). Byte j of a 4-bit block
   holds input j in its low nibble and input j+16 in its high one; bit j of qh is input j's fifth bit.
   K-quants (super-blocks of 256 inputs, sub-blocks each with an integer scale): Q4_K d, dmin, 8 6-bit scales sc and
   minimums m packed in 12 bytes, and 4-bit codes (w = d sc_j q - dmin m_j, sub-blocks of 32); Q5_K the same with
   fifth bits qh; Q6_K 6-bit codes (low nibbles ql, two high bits qh), 16 int8 scales and d (w = d sc_j (q - 32),
   sub-blocks of 16). The bytes are kept exactly as in the file, only regrouped ("qpanels") so that one 32-byte load
   holds QCOLS = 8 output columns side by side, four consecutive bytes of one column in each 4-byte lane: a dot
   product that sums groups of four bytes into an int32 lane (vpdpbusd, or vpmaddubsw then vpmaddwd) then leaves
   each column's partial sum in that column's lane, with no horizontal additions, whatever the number of activation
   rows that share the loaded weights. A record holds the 8 columns' blocks at one input block, field by field
   (qformats): a field of 4n bytes (codes, fifth or high bits, packed scales) as n 32-byte chunks, chunk t lane c
   holding bytes 4t..4t+3 of column c's field; a fp16 scalar (d, m, dmin) as the 8 columns' values in column order.
   Each group of 8 columns is one contiguous stream (N is zero padded to a multiple of 8).

   Activations are quantized per row, as llama.cpp does: per block of 32 for the 32-input formats (dx = max|x| / 127,
   qx = rint(x / dx) in [-127, 127], sx = sum(qx)), per super-block of 256 for the K-quants (one dx, and the sums of
   each 16 and 32 codes, bsum). A block's dot product is then exact integer arithmetic (unsigned codes, or |q8| with
   q8's sign moved onto the activations, times signed activations), and each output column accumulates its blocks
   in order in one fp32 lane:
     acc = fma((float)isum, d * dx, acc)          [Q4_0: isum = q.qx - 8 sx; Q5_0: q.qx - 16 sx; Q8_0: q.qx]
     acc = fma(m, dx * sx, acc)                   [Q4_1, Q5_1 only, after the line above with isum = q.qx]
   and for a K-quant super-block, with (q.qx)_j the codes' dot product over sub-block j:
     isum = sum_j sc_j (q.qx)_j                   [Q6_K: minus 32 sum_j sc_j bsum16_j]
     acc = fma((float)isum, d * dx, acc)
     acc = fnmadd((float)(sum_j m_j bsum32_j), dmin * dx, acc)     [Q4_K, Q5_K]
   Nothing in that chain depends on the other rows, the thread count or the instruction set (isum is exact however
   it is summed), so a verify window computes each row exactly as a one-row decode step does (batch invariance), and
   the AVX2 and VNNI paths give the same bits. What the paths change is the cost of each further row, which is the
   arithmetic alone: the weights are loaded and unpacked once per register block, the activations quantized once
   per call into tiles of the register block's rows (block-major, so a row's codes sit at a fixed offset from one
   pointer), and a row adds only its broadcasts and dot products. VNNI does 32 multiply-adds in one vpdpbusd instead
   of vpmaddubsw, vpmaddwd and an add, and its 32 registers hold register blocks of 8 rows (a K = 7 verify window in
   one pass over the weights). */

#define QCOLS 8        /* output columns per qpanel group */
#define QBLOCK 32      /* inputs per quantization block */
#define QK 256         /* inputs per K-quant super-block */
#define QK_PAIRS 12    /* int32 words of activation sums per K-quant super-block (kq_sums) */
#define QMAX_ROWS 4    /* rows per register block on AVX2 (16 registers) */
#define QMAX_ROWS_VNNI 8  /* rows per register block with AVX-512 VNNI (32 registers) */

enum { Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, QFORMATS };
static inline int is_kquant(int format) { return format >= Q4_K; }

/* Where a field sits in a GGUF block (from, size bytes) and in a qpanel record (at); size 0: the format has none. */
typedef struct { short from, size, at; } qfield;
typedef struct {
    short block_bytes, record_bytes;
    qfield codes, high, scales, d, m; /* high: Q5 fifth bits, Q6_K's two high bits; m: Q4_1/Q5_1 m, K-quant dmin */
} qformat;
static const qformat qformats[QFORMATS] = {
    [Q4_0] = {18, 144, {2, 16, 0}, {0, 0, 0}, {0, 0, 0}, {0, 2, 128}, {0, 0, 0}},
    [Q4_1] = {20, 160, {4, 16, 0}, {0, 0, 0}, {0, 0, 0}, {0, 2, 128}, {2, 2, 144}},
    [Q8_0] = {34, 272, {2, 32, 0}, {0, 0, 0}, {0, 0, 0}, {0, 2, 256}, {0, 0, 0}},
    [Q5_0] = {22, 176, {6, 16, 0}, {2, 4, 128}, {0, 0, 0}, {0, 2, 160}, {0, 0, 0}},
    [Q5_1] = {24, 192, {8, 16, 0}, {4, 4, 128}, {0, 0, 0}, {0, 2, 160}, {2, 2, 176}},
    [Q4_K] = {144, 1152, {16, 128, 0}, {0, 0, 0}, {4, 12, 1024}, {0, 2, 1120}, {2, 2, 1136}},
    [Q5_K] = {176, 1408, {48, 128, 0}, {16, 32, 1024}, {4, 12, 1280}, {0, 2, 1376}, {2, 2, 1392}},
    [Q6_K] = {210, 1680, {0, 128, 0}, {128, 64, 1024}, {192, 16, 1536}, {208, 2, 1664}, {0, 0, 0}},
};
static inline int block_inputs(int format) { return is_kquant(format) ? QK : QBLOCK; }

#endif /* PEAGLE_KERNELS_COMMON_H */
