/* peagle's native CPU kernels: batch-invariant bf16 matrix multiply, attention, RMSNorm and RoPE.

   kernels.py compiles this file once per machine and picks, from the CPU's flags, one of three matrix paths:
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

void peagle_pack_panels(const uint16_t *w, int N, int K, uint16_t *out, int nthreads) {
    int K2 = (K + 1) / 2, NP = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int p = 0; p < NP; p++)
        for (int q = 0; q < K2; q++) {
            uint16_t *t = out + ((size_t)p * K2 + q) * 2 * PANEL;
            for (int c = 0; c < PANEL; c++)
                for (int e = 0; e < 2; e++) {
                    int n = p * PANEL + c, k = 2 * q + e;
                    t[2 * c + e] = (n < N && k < K) ? w[(size_t)n * K + k] : 0;
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
   AVX2 + FMA: the path every x86-64 machine has, and attention / RMSNorm / RoPE for all of them */

#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 floats to 8 bf16, rounding exactly like f2bf. */
static inline __m128i f32x8_to_bf16(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)); /* values < 2^16: exact */
}

/* Store the first n (<= 8) of 8 floats as bf16. */
static inline void store_bf16x8(uint16_t *dst, __m256 v, int n) {
    __m128i h = f32x8_to_bf16(v);
    if (n == 8) _mm_storeu_si128((__m128i *)dst, h);
    else {
        uint16_t tmp[8];
        _mm_storeu_si128((__m128i *)tmp, h);
        memcpy(dst, tmp, (size_t)n * 2);
    }
}

/* Horizontal sum of 8 floats, always by the same tree. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0 (softmax arguments), about 1 ulp: 2^n * p(r), r = x - n ln2. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e)); /* n >= -126 here, so 2^n is a normal float */
}

/* One register block: R rows x P panels, accumulating every input pair in order. Each column's sum is
   acc = fma(w_odd, x_odd, fma(w_even, x_even, acc)) over q = 0..K2-1, the same for every R and P. */
static inline __attribute__((always_inline)) void block_avx2(const int R, const int P, const float *x, size_t ldx,
                                                             const uint16_t *w, size_t pstride, int K2, uint16_t *y,
                                                             size_t ldy, int ncols) {
    __m256 acc[MAX_ROWS][MAX_PANELS][2];
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int p = 0; p < P; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    for (int q = 0; q < K2; q++) {
        #pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            const uint16_t *wq = w + p * pstride + (size_t)q * 2 * PANEL;
            /* While FMAs bound the block (several rows), the hardware prefetcher falls behind: ask 4 KB ahead. */
            _mm_prefetch((const char *)(wq + AVX2_PREFETCH_PAIRS * 2 * PANEL), _MM_HINT_T0);
            __m256i lo = _mm256_loadu_si256((const __m256i *)wq), hi = _mm256_loadu_si256((const __m256i *)(wq + 16));
            __m256 even_lo = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
            __m256 odd_lo = _mm256_castsi256_ps(_mm256_and_si256(lo, odd_mask));
            __m256 even_hi = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
            __m256 odd_hi = _mm256_castsi256_ps(_mm256_and_si256(hi, odd_mask));
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m256 x0 = _mm256_broadcast_ss(x + r * ldx + 2 * q), x1 = _mm256_broadcast_ss(x + r * ldx + 2 * q + 1);
                acc[r][p][0] = _mm256_fmadd_ps(odd_lo, x1, _mm256_fmadd_ps(even_lo, x0, acc[r][p][0]));
                acc[r][p][1] = _mm256_fmadd_ps(odd_hi, x1, _mm256_fmadd_ps(even_hi, x0, acc[r][p][1]));
            }
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int p = 0; p < P; p++)
            for (int h = 0; h < 2; h++) {
                int c0 = p * PANEL + 8 * h, n = ncols - c0;
                if (n > 0) store_bf16x8(y + r * ldy + c0, acc[r][p][h], n < 8 ? n : 8);
            }
}

#define AVX2_BLOCK(R, P)                                                                                         \
    static void avx2_block_##R##_##P(const void *x, size_t ldx, const uint16_t *w, size_t pstride, int K2,      \
                                     uint16_t *y, size_t ldy, int ncols) {                                     \
        block_avx2(R, P, (const float *)x, ldx, w, pstride, K2, y, ldy, ncols);                                 \
    }
/* With 16 ymm registers, R x P x 2 accumulators must stay at 8: one row takes four panels, four rows one. */
AVX2_BLOCK(1, 1) AVX2_BLOCK(1, 2) AVX2_BLOCK(1, 3) AVX2_BLOCK(1, 4)
AVX2_BLOCK(2, 1) AVX2_BLOCK(2, 2)
AVX2_BLOCK(3, 1) AVX2_BLOCK(4, 1)
static const block_fn avx2_blocks[MAX_ROWS + 1][MAX_PANELS + 1] = {
    {0},
    {0, avx2_block_1_1, avx2_block_1_2, avx2_block_1_3, avx2_block_1_4},
    {0, avx2_block_2_1, avx2_block_2_2, 0, 0},
    {0, avx2_block_3_1, 0, 0, 0},
    {0, avx2_block_4_1, 0, 0, 0},
};
static const int avx2_panels_per_block[MAX_ROWS + 1] = {0, 4, 2, 1, 1};

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T, W packed by peagle_pack_panels. Returns 0, or -1 when
   memory for the fp32 copy of x could not be allocated (y untouched). */
int peagle_gemm_avx2(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy, int M, int N, int K,
                     int nthreads) {
    size_t ldxf = (size_t)(K + 1) / 2 * 2;
    float *xf = malloc((size_t)M * ldxf * sizeof(float));
    if (!xf) return -1;
    for (int m = 0; m < M; m++) { /* widen x once (zero padded to an even K) */
        for (int k = 0; k < K; k++) xf[(size_t)m * ldxf + k] = bf2f(x[(size_t)m * ldx + k]);
        if (K & 1) xf[(size_t)m * ldxf + K] = 0.0f;
    }
    run_blocks(xf, sizeof(float), ldxf, wp, y, ldy, M, N, K, nthreads, MAX_ROWS, avx2_panels_per_block, avx2_blocks);
    free(xf);
    return 0;
}

/* RMSNorm of `rows` rows of width H, rounding like the reference implementations in bf16:
   y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), statistics in fp32. */
void peagle_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int H, float eps) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * H;
        uint16_t *yr = y + (size_t)r * H;
        __m256 acc = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= H; k += 8) {
            __m256 v = bf16x8_to_f32(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; k < H; k++) ss += bf2f(xr[k]) * bf2f(xr[k]);
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        __m256 iv = _mm256_set1_ps(inv);
        int i = 0;
        for (; i + 8 <= H; i += 8) {
            __m128i t = f32x8_to_bf16(_mm256_mul_ps(bf16x8_to_f32(xr + i), iv));
            __m256 tf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(t), 16));
            _mm_storeu_si128((__m128i *)(yr + i), f32x8_to_bf16(_mm256_mul_ps(bf16x8_to_f32(w + i), tf)));
        }
        for (; i < H; i++) yr[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(xr[i]) * inv)));
    }
}

/* Rotary embedding in place on the first `heads` heads of each [heads_total, D] row, rounding like the reference's
   bf16 ops: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)). cos/sin: [rows, D]. */
void peagle_rope_bf16(uint16_t *x, const uint16_t *cos_, const uint16_t *sin_, int rows, int heads_total, int heads,
                      int D) {
    int half = D / 2;
    for (int r = 0; r < rows; r++) {
        const uint16_t *c = cos_ + (size_t)r * D, *s = sin_ + (size_t)r * D;
        for (int h = 0; h < heads; h++) {
            uint16_t *q = x + ((size_t)r * heads_total + h) * D;
            for (int d = 0; d < half; d++) {
                float x1 = bf2f(q[d]), x2 = bf2f(q[d + half]);
                float a = bf2f(f2bf(x1 * bf2f(c[d]))) + bf2f(f2bf(-x2 * bf2f(s[d])));
                float b = bf2f(f2bf(x2 * bf2f(c[d + half]))) + bf2f(f2bf(x1 * bf2f(s[d + half])));
                q[d] = f2bf(a);
                q[d + half] = f2bf(b);
            }
        }
    }
}

/* hsum8's tree for eight vectors at once: lane e of the result is hsum8(a[e]), bit for bit (the same additions of
   the same operands in the same order), so eight keys' scores cost one transpose-and-add instead of eight trees. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    __m256 b[4];
    for (int e = 0; e < 4; e++) /* lanes l + (l + 4) of keys e (low half) and e + 4 (high half) */
        b[e] = _mm256_add_ps(_mm256_permute2f128_ps(a[e], a[e + 4], 0x20), _mm256_permute2f128_ps(a[e], a[e + 4], 0x31));
    __m256 c01 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x44), _mm256_shuffle_ps(b[0], b[1], 0xee));
    __m256 c23 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], 0x44), _mm256_shuffle_ps(b[2], b[3], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(c01, c23, 0x88), _mm256_shuffle_ps(c01, c23, 0xdd)); /* keys 0-3 | 4-7 */
}

/* The softmax of each (row, head)'s scores in place, the padding to whole vectors exactly 0; inv: 1 / their sum
   (by a fixed tree). The same on every path. */
static inline __attribute__((always_inline)) void attend_softmax(const int NR, const int HN, const int *n,
                                                                 float *scores, int ld,
                                                                 float inv[ROWS_PER_PASS][HEADS_PER_PASS]) {
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int i = 0; i < HN; i++) {
            float *s = scores + (size_t)(r * HEADS_PER_PASS + i) * ld;
            int npad = (n[r] + 7) / 8 * 8;
            for (int j = n[r]; j < npad; j++) s[j] = -INFINITY;
            __m256 mv = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
            for (int j = 0; j < npad; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
            mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1)); /* max of all 8 lanes, in every lane */
            mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0x4e));
            mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0xb1));
            for (int j = 0; j < npad; j += 8) {
                __m256 sj = _mm256_loadu_ps(s + j);
                __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(sj, mv)),
                                         _mm256_cmp_ps(sj, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
                _mm256_storeu_ps(s + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            inv[r][i] = 1.0f / hsum8(sum);
        }
}

/* The weighted values of the AVX2 path, in fp32: out = inv * sum_j p_j v_j, in key order. */
static inline __attribute__((always_inline)) void attend_pv_fma(
        const int nd, const int NR, const int HN, int h0, const int *n, int nmin, const uint16_t *Vg, uint16_t *o0,
        long o_stride, int G, int g, const float *scores, int ld, float *pt,
        float inv[ROWS_PER_PASS][HEADS_PER_PASS]) {
    const int D = 8 * nd;
    /* weighted values: each (row, head, dimension) sums over its keys in order, 8 dimensions per pass, every row's
       accumulators in registers so that each value row is widened once for all rows (the keys all rows share),
       then each row's remaining keys. The weights are first interleaved key-major (pt[j][r, i]) so that one pointer
       reaches all of a key's weights. */
    const int W = NR * HN;
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int i = 0; i < HN; i++) {
            const float *s = scores + (size_t)(r * HEADS_PER_PASS + i) * ld;
            for (int j = 0; j < n[r]; j++) pt[(size_t)j * W + r * HN + i] = s[j];
        }
    for (int c = 0; c < nd; c++) {
        __m256 acc[ROWS_PER_PASS][HEADS_PER_PASS];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int i = 0; i < HN; i++) acc[r][i] = _mm256_setzero_ps();
        for (int j = 0; j < nmin; j++) {
            __m256 vj = bf16x8_to_f32(Vg + (size_t)j * D + 8 * c);
            const float *p = pt + (size_t)j * W;
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++)
                #pragma GCC unroll 4
                for (int i = 0; i < HN; i++) acc[r][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * HN + i), vj, acc[r][i]);
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            for (int j = nmin; j < n[r]; j++) {
                __m256 vj = bf16x8_to_f32(Vg + (size_t)j * D + 8 * c);
                const float *p = pt + (size_t)j * W + r * HN;
                #pragma GCC unroll 4
                for (int i = 0; i < HN; i++) acc[r][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i), vj, acc[r][i]);
            }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int i = 0; i < HN; i++)
                store_bf16x8(o0 + r * o_stride + (size_t)(g * G + h0 + i) * D + 8 * c,
                             _mm256_mul_ps(acc[r][i], _mm256_set1_ps(inv[r][i])), 8);
    }
}

/* Each of a pass's NR rows attends to n[r] = pos[r] + 1 keys; the fewest and the most of them. */
static inline __attribute__((always_inline)) void key_counts(const int NR, const int64_t *pos, int *n, int *nmin,
                                                             int *nmax) {
    *nmin = 1 << 30, *nmax = 0;
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        n[r] = (int)pos[r] + 1;
        *nmax = n[r] > *nmax ? n[r] : *nmax;
        *nmin = n[r] < *nmin ? n[r] : *nmin;
    }
}

/* Attention for NR (<= ROWS_PER_PASS) query rows of one cache slot and one key/value head: query heads
   h0..h0+HN-1 of its G over the row's keys 0..n_r-1 of K/V [*, D], D = 8 nd. Rows and heads are blocked only so
   that each key and value row is loaded and widened once for all of them (a prefill has hundreds of rows per slot);
   every (row, head) does the same arithmetic in every block shape:
     score_j = hsum8(q[0] k_j[0] + q[1] k_j[1] + ... ) * scale, one FMA chain over the D / 8 vectors, hsum8's tree;
     out = (sum_j e^(score_j - max) v_j, in key order) / (sum of the e^ by a fixed tree).
   nd, NR and HN are compile-time constants at each call site, so vectors and accumulators stay in registers. kf:
   scratch for eight widened key rows; pt: for the weights key-major. */
static inline __attribute__((always_inline)) void attend_block(
        const int nd, const int NR, const int HN, int h0, const uint16_t *q0, long q_stride, const int64_t *pos,
        const uint16_t *Kg, const uint16_t *Vg, uint16_t *o0, long o_stride, int G, int g, float scale,
        float *scores, int ld, float *kf, float *pt) {
    int D = 8 * nd, n[ROWS_PER_PASS], nmax, nmin;
    key_counts(NR, pos, n, &nmin, &nmax);
    {
        __m256 qv[ROWS_PER_PASS][HEADS_PER_PASS][32];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int i = 0; i < HN; i++)
                for (int c = 0; c < nd; c++)
                    qv[r][i][c] = bf16x8_to_f32(q0 + r * q_stride + (size_t)(g * G + h0 + i) * D + 8 * c);
        const __m256 sv = _mm256_set1_ps(scale);
        /* scores, eight keys at a time: keys widened once into kf, then per (row, head) eight FMA chains */
        for (int j = 0; j < nmax; j += 8) {
            int nk = nmax - j < 8 ? nmax - j : 8;
            for (int e = 0; e < nk; e++)
                for (int c = 0; c < nd; c++)
                    _mm256_storeu_ps(kf + e * D + 8 * c, bf16x8_to_f32(Kg + (size_t)(j + e) * D + 8 * c));
            for (int e = nk; e < 8; e++) /* past the last key: scores the softmax overwrites with -inf */
                for (int c = 0; c < nd; c++) _mm256_storeu_ps(kf + e * D + 8 * c, _mm256_setzero_ps());
            for (int r = 0; r < NR; r++) {
                if (j >= n[r]) continue;
                for (int i = 0; i < HN; i++) {
                    __m256 a[8];
                    #pragma GCC unroll 8
                    for (int e = 0; e < 8; e++) a[e] = _mm256_mul_ps(qv[r][i][0], _mm256_loadu_ps(kf + e * D));
                    for (int c = 1; c < nd; c++)
                        #pragma GCC unroll 8
                        for (int e = 0; e < 8; e++)
                            a[e] = _mm256_fmadd_ps(qv[r][i][c], _mm256_loadu_ps(kf + e * D + 8 * c), a[e]);
                    _mm256_storeu_ps(scores + (size_t)(r * HEADS_PER_PASS + i) * ld + j,
                                     _mm256_mul_ps(hsum8x8(a), sv));
                }
            }
        }
    }
    float inv[ROWS_PER_PASS][HEADS_PER_PASS];
    attend_softmax(NR, HN, n, scores, ld, inv);
    attend_pv_fma(nd, NR, HN, h0, n, nmin, Vg, o0, o_stride, G, g, scores, ld, pt, inv);
}

/* One pass of a path's attend block: nr (<= ROWS_PER_PASS) query rows x hn (<= HEADS_PER_PASS) query heads of key/value
   head g, with nd, nr and hn turned into compile-time constants (D = 64 and 128 get their own code). */
#define ATTEND_PARAMS                                                                                                \
    int nd, int nr, int hn, int h0, const uint16_t *q0, long q_stride, const int64_t *pos, const uint16_t *Kg,      \
        const uint16_t *Vg, uint16_t *o0, long o_stride, int G, int g, float scale, float *scores, int ld,          \
        float *kf, float *pt
#define ATTEND_ARGS h0, q0, q_stride, pos, Kg, Vg, o0, o_stride, G, g, scale, scores, ld, kf, pt
#define ATTEND_ROWS(BLOCK, ND, HN)                                                                                   \
    switch (nr) {                                                                                                    \
        case 1: BLOCK(ND, 1, HN, ATTEND_ARGS); break;                                                                \
        case 2: BLOCK(ND, 2, HN, ATTEND_ARGS); break;                                                                \
        case 3: BLOCK(ND, 3, HN, ATTEND_ARGS); break;                                                                \
        default: BLOCK(ND, 4, HN, ATTEND_ARGS); break;                                                               \
    }
#define ATTEND_HEADS(BLOCK, ND)                                                                                      \
    switch (hn) {                                                                                                    \
        case 1: ATTEND_ROWS(BLOCK, ND, 1); break;                                                                    \
        case 2: ATTEND_ROWS(BLOCK, ND, 2); break;                                                                    \
        case 3: ATTEND_ROWS(BLOCK, ND, 3); break;                                                                    \
        default: ATTEND_ROWS(BLOCK, ND, 4); break;                                                                   \
    }
#define ATTEND_DISPATCH(BLOCK)                                                                                       \
    if (nd == 8) ATTEND_HEADS(BLOCK, 8) else if (nd == 16) ATTEND_HEADS(BLOCK, 16) else ATTEND_HEADS(BLOCK, nd)

typedef void (*attend_pass_fn)(ATTEND_PARAMS);
static void attend_pass_avx2(ATTEND_PARAMS) { ATTEND_DISPATCH(attend_block) }
#ifndef PEAGLE_NO_AVX512
static void attend_pass_dpbf16(ATTEND_PARAMS); /* the AVX-512 BF16 section's scores */
#endif

/* Write this call's keys and values into each row's cache slot at its positions, then causal attention over the
   slot, each (query row, head) on its own, so the result never depends on which other rows share the call:
   out[b, t, h] = softmax_{j <= pos}(q[b, t, h] . K[slot_b, g, j] * scale) V[slot_b, g, j], g = h / (nh / nkv).
   q, k, v rows: base + (b*T + t) * row_stride, heads contiguous (D each). Cache: [slots, nkv, max_len, D].
   out: [B, T, nh, D] contiguous. D: a multiple of 8, at most 256. dpbf16: the scores by `vdpbf16ps` (the
   AVX-512 BF16 section) instead of fp32 FMAs; a process uses one or the other for every call. Returns 0; -2
   (nothing written) when a slot or position lies outside the cache; -3 (nothing written) when dpbf16 is asked of a
   library built without AVX-512 BF16; -1 when a thread's score buffer could not be allocated (out is incomplete). */
int peagle_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k, const uint16_t *v, long kv_stride,
                          uint16_t *kc, uint16_t *vc, const int64_t *slots, const int64_t *positions, uint16_t *out,
                          int B, int T, int nh, int nkv, int D, int num_slots, int max_len, float scale,
                          int nthreads, int dpbf16) {
    attend_pass_fn attend_pass = attend_pass_avx2;
    if (dpbf16) {
#ifndef PEAGLE_NO_AVX512
        attend_pass = attend_pass_dpbf16;
#else
        return -3;
#endif
    }
    for (int bt = 0; bt < B * T; bt++)
        if (slots[bt / T] < 0 || slots[bt / T] >= num_slots || positions[bt] < 0 || positions[bt] >= max_len)
            return -2;
    for (int bt = 0; bt < B * T; bt++) /* every write lands before any row reads: a window sees its own keys */
        for (int g = 0; g < nkv; g++) {
            size_t at = (((size_t)slots[bt / T] * nkv + g) * max_len + (size_t)positions[bt]) * D;
            memcpy(kc + at, k + (size_t)bt * kv_stride + (size_t)g * D, (size_t)D * 2);
            memcpy(vc + at, v + (size_t)bt * kv_stride + (size_t)g * D, (size_t)D * 2);
        }
    int G = nh / nkv, nd = D / 8, failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        int ld = max_len + 8, TB = (T + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
        /* per thread: the score rows of a pass, the same weights key-major, eight widened key rows (D <= 256) */
        size_t rows_ld = (size_t)ROWS_PER_PASS * HEADS_PER_PASS * ld;
        float *scores = malloc((2 * rows_ld + 8 * 256) * sizeof(float));
        float *pt = scores + rows_ld, *kf = pt + rows_ld;
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int btb = 0; btb < B * TB; btb++)
            for (int g = 0; g < nkv; g++) {
                if (!scores) continue;
                int b = btb / TB, t0 = btb % TB * ROWS_PER_PASS, nr = T - t0 < ROWS_PER_PASS ? T - t0 : ROWS_PER_PASS;
                size_t bt = (size_t)b * T + t0;
                const uint16_t *Kg = kc + ((size_t)slots[b] * nkv + g) * (size_t)max_len * D;
                const uint16_t *Vg = vc + ((size_t)slots[b] * nkv + g) * (size_t)max_len * D;
                const uint16_t *q0 = q + bt * q_stride;
                uint16_t *o0 = out + bt * nh * D;
                long os = (long)nh * D;
                for (int h0 = 0; h0 < G; h0 += HEADS_PER_PASS) {
                    int hn = G - h0 < HEADS_PER_PASS ? G - h0 : HEADS_PER_PASS;
                    attend_pass(nd, nr, hn, h0, q0, q_stride, positions + bt, Kg, Vg, o0, os, G, g, scale, scores,
                                ld, kf, pt);
                }
            }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The MLP's activation, rounding like the reference's bf16 ops: y = bf16(bf16(silu(gate)) * up), where each row
   of gate_up holds [gate (I), up (I)]. silu(g) = g / (1 + e^-g), computed from t = e^-|g| <= 1 (exp8's range):
   g / (1 + t) for g >= 0, g t / (1 + t) below. I: a multiple of 8. */
void peagle_silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int rows, int I) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (size_t)r * 2 * I, *u = g + I;
        uint16_t *yr = y + (size_t)r * I;
        for (int i = 0; i < I; i += 8) {
            __m256 gv = bf16x8_to_f32(g + i);
            __m256 t = exp8(_mm256_or_ps(gv, sign)); /* e^-|g| */
            __m256 num = _mm256_blendv_ps(_mm256_mul_ps(gv, t), gv, _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ));
            __m128i silu = f32x8_to_bf16(_mm256_div_ps(num, _mm256_add_ps(one, t)));
            __m256 sf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(silu), 16));
            _mm_storeu_si128((__m128i *)(yr + i), f32x8_to_bf16(_mm256_mul_ps(sf, bf16x8_to_f32(u + i))));
        }
    }
}

#pragma GCC pop_options

/* ---------------------------------------------------------------------------------------------------------------
   AVX-512 BF16: `vdpbf16ps` adds both products of a bf16 pair into one fp32 lane */

#ifndef PEAGLE_NO_AVX512
#ifdef PEAGLE_EMULATE_AVX512
/* Tests only (kernels.py, emulated_library): the two AVX-512 sections compiled against SIMDe's portable definitions
   of the intrinsics instead of the instructions, so that their logic runs, and is checked against AVX2, on CPUs
   without AVX-512. The whole file is then built with -mavx2 -mfma -mf16c: SIMDe's 512-bit operations use AVX2
   underneath and the AVX2 types stay the real ones. Defined here, lane by lane as Intel's manual defines them: the
   seven intrinsics SIMDe 0.7.4 lacks (masked-off lanes are never read or written), and vdpbf16ps, whose SIMDe
   version adds a lane's even product before its odd one, rounds the product and the sum apart and keeps denormals;
   the manual adds the odd product first, each a fused multiply-add that reads denormals as zero and flushes them. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
static inline __m512i emulated_zextsi256_si512(__m256i a) {
    return _mm512_inserti64x4(_mm512_setzero_si512(), a, 0);
}
static inline __m512 emulated_cvtph_ps(__m256i a) {
    uint16_t h[16];
    float f[16];
    memcpy(h, &a, sizeof h);
    for (int i = 0; i < 16; i++) f[i] = _cvtsh_ss(h[i]);
    __m512 r;
    memcpy(&r, f, sizeof r);
    return r;
}
static inline __m512 emulated_cvtepi32_ps(__m512i a) { /* rounds to nearest even, as vcvtdq2ps does */
    int32_t v[16];
    float f[16];
    memcpy(v, &a, sizeof v);
    for (int i = 0; i < 16; i++) f[i] = (float)v[i];
    __m512 r;
    memcpy(&r, f, sizeof r);
    return r;
}
static inline __m256i emulated_cvtepi32_epi16(__m512i a) { /* truncates, as vpmovdw does */
    int32_t v[16];
    int16_t t[16];
    memcpy(v, &a, sizeof v);
    for (int i = 0; i < 16; i++) t[i] = (int16_t)v[i];
    __m256i r;
    memcpy(&r, t, sizeof r);
    return r;
}
/* Lane i of `lanes` lanes of `size` bytes copied where bit i of k is set (the masked loads and store). */
static inline void emulated_masked_lanes(void *to, const void *from, uint32_t k, int lanes, int size) {
    for (int i = 0; i < lanes; i++)
        if (k >> i & 1) memcpy((char *)to + size * i, (const char *)from + size * i, size);
}
static inline __m512i emulated_maskz_loadu_epi16(__mmask32 k, const void *p) {
    __m512i r = _mm512_setzero_si512();
    emulated_masked_lanes(&r, p, k, 32, 2);
    return r;
}
static inline __m512 emulated_maskz_loadu_ps(__mmask16 k, const void *p) {
    __m512 r = _mm512_setzero_ps();
    emulated_masked_lanes(&r, p, k, 16, 4);
    return r;
}
static inline void emulated_mask_storeu_epi16(void *p, __mmask16 k, __m256i a) {
    emulated_masked_lanes(p, &a, k, 16, 2);
}
static inline float emulated_daz(float f) { return fabsf(f) < 0x1p-126f ? copysignf(0.0f, f) : f; }
static inline __m512 emulated_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
    float acc[16];
    uint16_t x[32], w[32];
    memcpy(acc, &src, sizeof acc);
    memcpy(x, &a, sizeof x);
    memcpy(w, &b, sizeof w);
    for (int i = 0; i < 16; i++)
        for (int e = 1; e >= 0; e--)
            acc[i] = emulated_daz(fmaf(emulated_daz(bf2f(x[2 * i + e])), emulated_daz(bf2f(w[2 * i + e])),
                                       emulated_daz(acc[i])));
    __m512 r;
    memcpy(&r, acc, sizeof r);
    return r;
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps emulated_dpbf16_ps
#define _mm512_zextsi256_si512 emulated_zextsi256_si512
#define _mm512_cvtph_ps emulated_cvtph_ps
#define _mm512_cvtepi32_epi16 emulated_cvtepi32_epi16
#define _mm512_cvtepi32_ps emulated_cvtepi32_ps
#define _mm512_maskz_loadu_epi16 emulated_maskz_loadu_epi16
#define _mm512_maskz_loadu_ps emulated_maskz_loadu_ps
#define _mm256_mask_storeu_epi16 emulated_mask_storeu_epi16
#endif /* PEAGLE_EMULATE_AVX512 */
#pragma GCC push_options
#ifndef PEAGLE_EMULATE_AVX512
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")
#endif

/* 16 floats to 16 bf16, rounding exactly like f2bf. */
static inline __m256i f32x16_to_bf16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* One register block: R rows x P panels. Each column's sum is acc = dpbf16(acc, w_pair, x_pair) over q in order. */
static inline __attribute__((always_inline)) void block_bf16(const int R, const int P, const uint16_t *x, size_t ldx,
                                                             const uint16_t *w, size_t pstride, int K2, uint16_t *y,
                                                             size_t ldy, int ncols) {
    __m512 acc[BF16_MAX_ROWS][MAX_PANELS];
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int q = 0; q < K2; q++) {
        __m512bh wv[MAX_PANELS];
        #pragma GCC unroll 4
        for (int p = 0; p < P; p++) wv[p] = (__m512bh)_mm512_loadu_si512(w + p * pstride + (size_t)q * 2 * PANEL);
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * q, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            #pragma GCC unroll 4
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv[p], xb);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            int n = ncols - p * PANEL;
            if (n > 0)
                _mm256_mask_storeu_epi16(y + r * ldy + p * PANEL, (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u),
                                         f32x16_to_bf16(acc[r][p]));
        }
}

#define BF16_BLOCK(R, P)                                                                                         \
    static void bf16_block_##R##_##P(const void *x, size_t ldx, const uint16_t *w, size_t pstride, int K2,      \
                                     uint16_t *y, size_t ldy, int ncols) {                                     \
        block_bf16(R, P, (const uint16_t *)x, ldx, w, pstride, K2, y, ldy, ncols);                              \
    }
/* 32 zmm registers: up to four rows take four panels (16 accumulators), five to eight rows take two (up to 16), so
   a verify window of up to 8 rows streams each weight from memory once. */
BF16_BLOCK(1, 1) BF16_BLOCK(1, 2) BF16_BLOCK(1, 3) BF16_BLOCK(1, 4)
BF16_BLOCK(2, 1) BF16_BLOCK(2, 2) BF16_BLOCK(2, 3) BF16_BLOCK(2, 4)
BF16_BLOCK(3, 1) BF16_BLOCK(3, 2) BF16_BLOCK(3, 3) BF16_BLOCK(3, 4)
BF16_BLOCK(4, 1) BF16_BLOCK(4, 2) BF16_BLOCK(4, 3) BF16_BLOCK(4, 4)
BF16_BLOCK(5, 1) BF16_BLOCK(5, 2) BF16_BLOCK(6, 1) BF16_BLOCK(6, 2)
BF16_BLOCK(7, 1) BF16_BLOCK(7, 2) BF16_BLOCK(8, 1) BF16_BLOCK(8, 2)
static const block_fn bf16_blocks[BF16_MAX_ROWS + 1][MAX_PANELS + 1] = {
    {0},
    {0, bf16_block_1_1, bf16_block_1_2, bf16_block_1_3, bf16_block_1_4},
    {0, bf16_block_2_1, bf16_block_2_2, bf16_block_2_3, bf16_block_2_4},
    {0, bf16_block_3_1, bf16_block_3_2, bf16_block_3_3, bf16_block_3_4},
    {0, bf16_block_4_1, bf16_block_4_2, bf16_block_4_3, bf16_block_4_4},
    {0, bf16_block_5_1, bf16_block_5_2, 0, 0},
    {0, bf16_block_6_1, bf16_block_6_2, 0, 0},
    {0, bf16_block_7_1, bf16_block_7_2, 0, 0},
    {0, bf16_block_8_1, bf16_block_8_2, 0, 0},
};
static const int bf16_panels_per_block[BF16_MAX_ROWS + 1] = {0, 4, 4, 4, 4, 2, 2, 2, 2};

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T, W packed by peagle_pack_panels. Returns 0, or -1 when
   memory for the padded copy of x could not be allocated (y untouched). */
int peagle_gemm_avx512bf16(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy, int M, int N,
                           int K, int nthreads) {
    size_t ldxp = (size_t)(K + 1) / 2 * 2;
    uint16_t *xp = malloc((size_t)M * ldxp * 2);
    if (!xp) return -1;
    for (int m = 0; m < M; m++) { /* zero padded to an even K so every pair is whole */
        memcpy(xp + (size_t)m * ldxp, x + (size_t)m * ldx, (size_t)K * 2);
        if (K & 1) xp[(size_t)m * ldxp + K] = 0;
    }
    run_blocks(xp, 2, ldxp, wp, y, ldy, M, N, K, nthreads, BF16_MAX_ROWS, bf16_panels_per_block, bf16_blocks);
    free(xp);
    return 0;
}

/* Attention scores by `vdpbf16ps`: score_j = hsum16(dpbf16 chain over the row's D / 32 bf16 vectors of q and k_j),
   the 16 lanes folded to 8 and then hsum8's tree, eight keys at a time (hsum8x8), times scale. Keys are read as they
   lie in the cache (no widening), and a dot product takes a quarter of the FMA chain's instructions. The softmax and
   the weighted values are the AVX2 pass's (attend_softmax_pv). Each (row, head) does the same arithmetic in every
   block shape, so a decode row equals the same row inside a prefill, bit for bit. */

static const uint16_t zero_key[256]; /* a key or value row of zeros (past a row's keys) */

/* Weighted values by `vdpbf16ps`: the weights rounded to bf16 (as flash attention's value product does; the sum
   they are divided by stays the fp32 one), keys taken in pairs (2m, 2m + 1), each pair's two value rows interleaved
   so that one instruction adds both keys' products for 16 dimensions: acc = dpbf16(acc, (v_2m, v_2m+1), (p_2m,
   p_2m+1)), pair by pair in order. A row with an odd number of keys ends on a pair whose second value row is zeros
   (its weight is 0, and a zero row cannot hold a NaN a stale cache entry might). Pairs every row of the pass has in
   full are interleaved once for all of them; each row's last pairs follow, so a row's chain never depends on the
   other rows. Dimensions: 32 per chunk, the last chunk masked. */
static inline __attribute__((always_inline)) void attend_pv_dpbf16(
        const int nd, const int NR, const int HN, int h0, const int *n, int nmin, const uint16_t *Vg, uint16_t *o0,
        long o_stride, int G, int g, const float *scores, int ld, float *pt,
        float inv[ROWS_PER_PASS][HEADS_PER_PASS]) {
    const int D = 8 * nd, nz = (D + 31) / 32, W = NR * HN, full = nmin / 2;
    const __mmask32 last = D % 32 ? (__mmask32)((1u << (D % 32)) - 1u) : (__mmask32)0xffffffffu;
    /* the weights as bf16 pairs, pair-major: pw[m][r, i] = (p_2m, p_2m+1); past a row's keys the scores are 0 */
    uint32_t *pw = (uint32_t *)pt;
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int i = 0; i < HN; i++) {
            const float *sr = scores + (size_t)(r * HEADS_PER_PASS + i) * ld;
            int npairs = (n[r] + 1) / 2;
            for (int m0 = 0; m0 < npairs; m0 += 8) { /* 16 scores (within the row's padding to 8) to 8 pairs */
                uint32_t tmp[8];
                __m512 v = _mm512_maskz_loadu_ps((__mmask16)(2 * m0 + 16 <= (n[r] + 7) / 8 * 8 ? 0xffffu : 0xffu),
                                                 sr + 2 * m0);
                _mm256_storeu_si256((__m256i *)tmp, f32x16_to_bf16(v));
                int m1 = npairs - m0 < 8 ? npairs - m0 : 8;
                for (int m = 0; m < m1; m++) pw[(size_t)(m0 + m) * W + r * HN + i] = tmp[m];
            }
        }
    /* the value product's lanes hold dimensions 0-3, 8-11, 16-19, 24-27 (lo) and 4-7, ... (hi) of a chunk: put them
       back in order for the store */
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i next16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c = 0; c < nz; c++) {
        const __mmask32 mask = c == nz - 1 ? last : 0xffffffffu;
        __m512 lo[ROWS_PER_PASS][HEADS_PER_PASS], hi[ROWS_PER_PASS][HEADS_PER_PASS];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int i = 0; i < HN; i++) lo[r][i] = hi[r][i] = _mm512_setzero_ps();
        for (int m = 0; m < full; m++) {
            __m512i a = _mm512_maskz_loadu_epi16(mask, Vg + (size_t)(2 * m) * D + 32 * c);
            __m512i b = _mm512_maskz_loadu_epi16(mask, Vg + (size_t)(2 * m + 1) * D + 32 * c);
            __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(a, b), vh = (__m512bh)_mm512_unpackhi_epi16(a, b);
            const uint32_t *p = pw + (size_t)m * W;
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++)
                #pragma GCC unroll 4
                for (int i = 0; i < HN; i++) {
                    __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[r * HN + i]);
                    lo[r][i] = _mm512_dpbf16_ps(lo[r][i], vl, w);
                    hi[r][i] = _mm512_dpbf16_ps(hi[r][i], vh, w);
                }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            for (int m = full; m < (n[r] + 1) / 2; m++) {
                __m512i a = _mm512_maskz_loadu_epi16(mask, Vg + (size_t)(2 * m) * D + 32 * c);
                __m512i b = _mm512_maskz_loadu_epi16(mask, 2 * m + 1 < n[r] ? Vg + (size_t)(2 * m + 1) * D + 32 * c
                                                                              : zero_key);
                __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(a, b), vh = (__m512bh)_mm512_unpackhi_epi16(a, b);
                const uint32_t *p = pw + (size_t)m * W + r * HN;
                #pragma GCC unroll 4
                for (int i = 0; i < HN; i++) {
                    __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[i]);
                    lo[r][i] = _mm512_dpbf16_ps(lo[r][i], vl, w);
                    hi[r][i] = _mm512_dpbf16_ps(hi[r][i], vh, w);
                }
            }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int i = 0; i < HN; i++) {
                uint16_t *dst = o0 + r * o_stride + (size_t)(g * G + h0 + i) * D + 32 * c;
                __m512 sc = _mm512_set1_ps(inv[r][i]);
                __m512 d0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo[r][i], first16, hi[r][i]), sc);
                __m512 d1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo[r][i], next16, hi[r][i]), sc);
                _mm256_mask_storeu_epi16(dst, (__mmask16)mask, f32x16_to_bf16(d0));
                _mm256_mask_storeu_epi16(dst + 16, (__mmask16)(mask >> 16), f32x16_to_bf16(d1));
            }
    }
}

static inline __attribute__((always_inline)) void attend_block_dpbf16(
        const int nd, const int NR, const int HN, int h0, const uint16_t *q0, long q_stride, const int64_t *pos,
        const uint16_t *Kg, const uint16_t *Vg, uint16_t *o0, long o_stride, int G, int g, float scale,
        float *scores, int ld, float *kf, float *pt) {
    (void)kf;
    const int D = 8 * nd, nz = (D + 31) / 32;
    const __mmask32 last = D % 32 ? (__mmask32)((1u << (D % 32)) - 1u) : (__mmask32)0xffffffffu;
    int n[ROWS_PER_PASS], nmax, nmin;
    key_counts(NR, pos, n, &nmin, &nmax);
    {
        __m512bh qz[ROWS_PER_PASS][HEADS_PER_PASS][8];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int i = 0; i < HN; i++)
                for (int c = 0; c < nz; c++)
                    qz[r][i][c] = (__m512bh)_mm512_maskz_loadu_epi16(c == nz - 1 ? last : 0xffffffffu,
                                                                    q0 + r * q_stride + (size_t)(g * G + h0 + i) * D + 32 * c);
        const __m256 sv = _mm256_set1_ps(scale);
        for (int j = 0; j < nmax; j += 8) {
            int nk = nmax - j < 8 ? nmax - j : 8;
            const uint16_t *kr[8];
            #pragma GCC unroll 8
            for (int e = 0; e < 8; e++) kr[e] = e < nk ? Kg + (size_t)(j + e) * D : zero_key;
            for (int r = 0; r < NR; r++) {
                if (j >= n[r]) continue;
                for (int i = 0; i < HN; i++) {
                    __m512 a[8];
                    #pragma GCC unroll 8
                    for (int e = 0; e < 8; e++) a[e] = _mm512_setzero_ps();
                    for (int c = 0; c < nz; c++)
                        #pragma GCC unroll 8
                        for (int e = 0; e < 8; e++)
                            a[e] = _mm512_dpbf16_ps(a[e], qz[r][i][c], (__m512bh)_mm512_maskz_loadu_epi16(
                                                        c == nz - 1 ? last : 0xffffffffu, kr[e] + 32 * c));
                    __m256 b[8];
                    #pragma GCC unroll 8
                    for (int e = 0; e < 8; e++) /* lanes l + (l + 8) */
                        b[e] = _mm256_add_ps(_mm512_castps512_ps256(a[e]),
                                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[e]), 1)));
                    _mm256_storeu_ps(scores + (size_t)(r * HEADS_PER_PASS + i) * ld + j,
                                     _mm256_mul_ps(hsum8x8(b), sv));
                }
            }
        }
    }
    float inv[ROWS_PER_PASS][HEADS_PER_PASS];
    attend_softmax(NR, HN, n, scores, ld, inv);
    attend_pv_dpbf16(nd, NR, HN, h0, n, nmin, Vg, o0, o_stride, G, g, scores, ld, pt, inv);
}

static void attend_pass_dpbf16(ATTEND_PARAMS) { ATTEND_DISPATCH(attend_block_dpbf16) }

#pragma GCC pop_options
#endif /* PEAGLE_NO_AVX512 */

/* ---------------------------------------------------------------------------------------------------------------
   AMX: 16x16 fp32 tiles accumulated by `tdpbf16ps` over 32-wide k blocks */

#ifndef PEAGLE_NO_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* AMX tiles need the kernel's permission once per process (oneDNN asks for it the same way). */
int peagle_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void config_tiles(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

#define NG 4 /* n-blocks (of 16 columns) per group: tmm0..3 accumulate, tmm4 = A, tmm5/6 = B */

/* Pack w [N, K] (bf16, rows contiguous) into AMX B tiles, one contiguous stream per group of NG column blocks:
   [G = ceil(N/(16 NG))][Kb = ceil(K/32)][NG][16 pairs][16 n][2], zero padded. */
void peagle_amx_pack(const uint16_t *w, int N, int K, uint16_t *out) {
    int G = (N + 16 * NG - 1) / (16 * NG), Kb = (K + 31) / 32;
    for (int g = 0; g < G; g++)
        for (int kb = 0; kb < Kb; kb++)
            for (int j = 0; j < NG; j++) {
                uint16_t *t = out + (((size_t)g * Kb + kb) * NG + j) * 512;
                for (int p = 0; p < 16; p++)
                    for (int n = 0; n < 16; n++)
                        for (int e = 0; e < 2; e++) {
                            int nn = (g * NG + j) * 16 + n, kk = kb * 32 + 2 * p + e;
                            t[(p * 16 + n) * 2 + e] = (nn < N && kk < K) ? w[(size_t)nn * K + kk] : 0;
                        }
            }
}

size_t peagle_amx_packed_size(int N, int K) {
    return (size_t)((N + 16 * NG - 1) / (16 * NG)) * ((K + 31) / 32) * NG * 512;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T with W packed by peagle_amx_pack. Each output element
   accumulates its K in the same order (k-blocks of 32 in sequence) whatever M is: batch invariant. Returns 0, or
   -1 when memory for the padded copy of x could not be allocated (y untouched). */
int peagle_amx_gemm(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy, int M, int N, int K,
                    int nthreads) {
    int Kb = (K + 31) / 32, Mb = (M + 15) / 16;
    int Kp = Kb * 32;
    /* A: x zero padded to [Mb*16, Kp] so tile loads never read past it. */
    uint16_t *a = aligned_alloc(64, (size_t)Mb * 16 * Kp * 2); /* Kp * 2 is a multiple of 64 */
    if (!a) return -1;
    for (int m = 0; m < Mb * 16; m++) {
        uint16_t *row = a + (size_t)m * Kp;
        if (m < M) {
            memcpy(row, x + (size_t)m * ldx, (size_t)K * 2);
            memset(row + K, 0, (size_t)(Kp - K) * 2);
        } else
            memset(row, 0, (size_t)Kp * 2);
    }
    int ngroups = (N + 16 * NG - 1) / (16 * NG);
    #pragma omp parallel num_threads(nthreads)
    {
        config_tiles();
        float cbuf[16 * 16] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int g = 0; g < ngroups; g++) {
            const uint16_t *wg = wp + (size_t)g * Kb * NG * 512;
            for (int mb = 0; mb < Mb; mb++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t *arow = a + (size_t)mb * 16 * Kp;
                for (int kb = 0; kb < Kb; kb++) {
                    const uint16_t *b = wg + (size_t)kb * NG * 512;
                    if (mb == 0)
                        for (int l = 0; l < NG * 16; l++)
                            _mm_prefetch((const char *)(b + NG * 512) + 64 * l, _MM_HINT_T0);
                    _tile_loadd(4, arow + kb * 32, Kp * 2);
                    _tile_loadd(5, b, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, b + 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(5, b + 1024, 64);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(6, b + 1536, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
                int mrows = M - mb * 16 < 16 ? M - mb * 16 : 16;
                for (int j = 0; j < NG; j++) {
                    int n0 = (g * NG + j) * 16;
                    if (n0 >= N) break;
                    switch (j) {
                        case 0: _tile_stored(0, cbuf, 64); break;
                        case 1: _tile_stored(1, cbuf, 64); break;
                        case 2: _tile_stored(2, cbuf, 64); break;
                        default: _tile_stored(3, cbuf, 64); break;
                    }
                    int ncols = N - n0 < 16 ? N - n0 : 16;
                    __mmask16 mk = (__mmask16)((1u << ncols) - 1u);
                    for (int r = 0; r < mrows; r++)
                        _mm256_mask_storeu_epi16(y + (size_t)(mb * 16 + r) * ldy + n0, mk,
                                                 f32x16_to_bf16(_mm512_load_ps(cbuf + r * 16)));
                }
            }
        }
        _tile_release();
    }
    free(a);
    return 0;
}

#pragma GCC pop_options
#endif /* PEAGLE_NO_AMX */

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

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

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

size_t peagle_qpanels_size(int format, int N, int K) { /* bytes of W [N, K] regrouped into qpanels */
    return (size_t)((N + QCOLS - 1) / QCOLS) * (size_t)(K / block_inputs(format)) *
           (size_t)qformats[format].record_bytes;
}

/* Byte offset in a field of column c's byte j (bytes 4t..4t+3 of each column in chunk t's lane). */
static inline int qcode_offset(int c, int j) { return 32 * (j / 4) + 4 * c + j % 4; }

/* Copy column c's block blk into record rec (to_record), or back (the inverse), field by field. */
static void move_block(int format, uint8_t *rec, int c, uint8_t *blk, int to_record) {
    const qformat *f = &qformats[format];
    const qfield *fields[5] = {&f->codes, &f->high, &f->scales, &f->d, &f->m};
    for (int i = 0; i < 5; i++) {
        const qfield *fd = fields[i];
        for (int j = 0; j < fd->size; j += 4) {
            int n = fd->size == 2 ? 2 : 4;
            uint8_t *r = rec + fd->at + (fd->size == 2 ? 2 * c : qcode_offset(c, j)), *b = blk + fd->from + j;
            memcpy(to_record ? r : b, to_record ? b : r, n);
        }
    }
}

/* Regroup GGUF rows (N rows of K / block_inputs blocks, row-major as in the file) into qpanels. Bytes are copied
   unchanged; padding columns get zero codes and zero scales. */
void peagle_qpack(int format, const uint8_t *src, int N, int K, uint8_t *out) {
    int Kb = K / block_inputs(format), G = (N + QCOLS - 1) / QCOLS;
    int bb = qformats[format].block_bytes, rb = qformats[format].record_bytes;
    memset(out, 0, peagle_qpanels_size(format, N, K));
    for (int g = 0; g < G; g++)
        for (int b = 0; b < Kb; b++)
            for (int c = 0; c < QCOLS && g * QCOLS + c < N; c++)
                move_block(format, out + ((size_t)g * Kb + b) * rb, c,
                           (uint8_t *)src + ((size_t)(g * QCOLS + c) * Kb + b) * bb, 1);
}

/* max |x| over n (a multiple of 8) bf16 values, by a fixed tree. */
static inline float amax_bf16(const uint16_t *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, bf16x8_to_f32(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* 32 bf16 inputs times id, rounded to int8 codes in input order; returns their sum. */
static inline int32_t quantize32(const uint16_t *xb, float id, int8_t *out) {
    __m256 idv = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(bf16x8_to_f32(xb + 8 * i), idv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    /* int32 -> int8 in input order: packs interleave 128-bit lanes, the permute puts them back */
    __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return _mm_cvtsi128_si32(s4);
}

/* Row m's block b in a tile layout of `tile` rows (the register blocks' rows; the last tile may hold fewer), each
   tile block-major: block b of the tile's row r at [b][r], so that a register block finds its rows' codes of one
   block side by side, a block apart (fixed offsets: no register per row). tile = 1 is plain row-major. In blocks. */
static inline size_t tiled(int m, int b, int M, int Kb, int tile) {
    int t0 = m - m % tile, R = M - t0 < tile ? M - t0 : tile;
    return (size_t)t0 * Kb + (size_t)b * R + (m - t0);
}

/* Quantize M rows of x (bf16, row stride ldx, K a multiple of 32) per block of 32: codes qx (M x K), dx and sx
   (M x K/32), tiled. */
static void quantize_rows_q8(const uint16_t *x, long ldx, int M, int K, int tile, int8_t *qx, float *dx,
                             int32_t *sx) {
    int Kb = K / QBLOCK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < Kb; b++) {
            const uint16_t *xb = x + (size_t)m * ldx + b * QBLOCK;
            float a = amax_bf16(xb, QBLOCK);
            size_t at = tiled(m, b, M, Kb, tile);
            dx[at] = a / 127.0f;
            sx[at] = quantize32(xb, a > 0.0f ? 127.0f / a : 0.0f, qx + at * QBLOCK);
        }
}

static inline uint32_t int16_pair(int a, int b) { return (uint16_t)a | (uint32_t)(uint16_t)b << 16; }

/* Quantize M rows of x (K a multiple of 256) per super-block of 256: codes qx, dx, and QK_PAIRS words of sums
   (kq_sums) per super-block, tiled like quantize_rows_q8. The sums come as the int16 pairs that vpmaddwd multiplies
   by a lane's scales: word 2k + e (k < 4, e < 2) pairs the sums of 16 codes 4k+e and 4k+e+2, word 8 + 2k + e
   (k < 2) those of 32 codes 4k+e and 4k+e+2 (a lane's even bytes are scales 4k and 4k+2, its odd ones 4k+1, 4k+3). */
static void quantize_rows_q8k(const uint16_t *x, long ldx, int M, int K, int tile, int8_t *qx, float *dx,
                              int32_t *sums) {
    int Kb = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < Kb; b++) {
            const uint16_t *xb = x + (size_t)m * ldx + b * QK;
            float a = amax_bf16(xb, QK), id = a > 0.0f ? 127.0f / a : 0.0f;
            size_t at = tiled(m, b, M, Kb, tile);
            int8_t *q = qx + at * QK;
            int s16[16], s32[8];
            for (int i = 0; i < QK / QBLOCK; i++) quantize32(xb + QBLOCK * i, id, q + QBLOCK * i);
            for (int i = 0; i < 16; i++) {
                s16[i] = 0;
                for (int j = 0; j < 16; j++) s16[i] += q[16 * i + j];
            }
            for (int i = 0; i < 8; i++) s32[i] = s16[2 * i] + s16[2 * i + 1];
            int32_t *w = sums + at * QK_PAIRS;
            for (int k = 0; k < 4; k++)
                for (int e = 0; e < 2; e++) {
                    w[2 * k + e] = (int32_t)int16_pair(s16[4 * k + e], s16[4 * k + e + 2]);
                    if (k < 2) w[8 + 2 * k + e] = (int32_t)int16_pair(s32[4 * k + e], s32[4 * k + e + 2]);
                }
            dx[at] = a / 127.0f;
        }
}

/* Four activation codes (inputs i..i+3 of one row) in every 4-byte lane. */
static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Per 4-byte lane, byte j of the lane's bytes where a pattern byte is j, zero where it is 0x80 (vpshufb within
   128-bit halves, so each lane's pattern is offset by the lane's first byte). */
static inline __m256i lane_bytes(__m256i v, uint32_t pattern) {
    const __m256i base = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                          0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    return _mm256_shuffle_epi8(v, _mm256_add_epi8(_mm256_set1_epi32((int)pattern), base));
}

/* The fifth bits (0x10 where set) of a Q5 chunk's 4 inputs per lane: bits 4 half .. 4 half + 3 of byte `byte` of
   each lane of qh. */
static inline __m256i fifth_bits(__m256i qh, int byte, int half) {
    const __m256i bit = _mm256_set1_epi32((int)(0x08040201u << (4 * half)));
    __m256i v = _mm256_and_si256(lane_bytes(qh, 0x01010101u * (uint32_t)byte), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

/* AVX2's register block: R rows x one group of 8 columns, over all K/32 blocks (the chain above). vpmaddubsw
   multiplies a lane's unsigned weight bytes by the row's signed activation bytes and adds neighbouring pairs into
   int16; vpmaddwd by ones then adds pairs of those into the lane's int32. Both issue on only two of Zen 3's four
   vector pipes, so a row's cost is their count:
     4-bit: a pair of products is at most 2 x 15 x 127 = 3,810, so all eight vpmaddubsw of a block (4 chunks, low
            and high nibbles) sum in int16 (at most 30,480) before one vpmaddwd: 9 multiplies per row and block
            instead of 12; 5-bit codes (at most 2 x 31 x 127 = 7,874 a pair) take one vpmaddwd per two chunks;
     Q8_0:  |q| times x with q's sign moved onto x (vpsignb); a pair is at most 2 x 128 x 127 = 32,512, so each
            vpmaddubsw needs its own vpmaddwd.
   The weights are loaded and unpacked once per register block; a row adds only its own broadcasts, products and
   the fp32 chain, and its sums (R int16 or int32 vectors and R fp32 accumulators) stay in the 16 registers. */
/* An empty asm that the compiler must assume reads and rewrites v: a row's running sum is then added to chunk by
   chunk, as written, instead of reassociated into a tree whose many live terms (8 per row) spill the registers. */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
static inline __m256i madd_ones(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

static inline __attribute__((always_inline)) void qblock(const int format, const int R, const int8_t *qx,
                                                         const float *dx, const int32_t *sx, int K,
                                                         const uint8_t *w, uint16_t *y, size_t ldy, int ncols) {
    const qformat *f = &qformats[format];
    const int Kb = K / QBLOCK, rb = f->record_bytes, five = f->high.size != 0;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[QMAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < Kb; b++) {
        const uint8_t *rec = w + (size_t)b * rb;
        for (int l = 0; l < rb; l += 64) _mm_prefetch((const char *)(rec + 8 * rb + l), _MM_HINT_T0);
        const int8_t *xb = qx + (size_t)b * R * QBLOCK;
        __m256i isum[QMAX_ROWS];
        if (format == Q8_0) {
            for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(rec + 32 * j)), aw = _mm256_abs_epi8(wv);
                for (int r = 0; r < R; r++) {
                    __m256i xs = _mm256_sign_epi8(broadcast4(xb + r * QBLOCK + 4 * j), wv);
                    isum[r] = _mm256_add_epi32(isum[r], madd_ones(_mm256_maddubs_epi16(aw, xs)));
                    KEEP_IN_REGISTER(isum[r]);
                }
            }
        } else {
            __m256i s16[QMAX_ROWS];
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(rec + f->high.at)) : low4;
            for (int t = 0; t < 4; t++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 32 * t));
                __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                if (five) {
                    lo = _mm256_or_si256(lo, fifth_bits(qh, t / 2, t % 2));
                    hi = _mm256_or_si256(hi, fifth_bits(qh, 2 + t / 2, t % 2));
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xb + r * QBLOCK + 4 * t;
                    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xr)),
                                                 _mm256_maddubs_epi16(hi, broadcast4(xr + 16)));
                    s16[r] = t && !(five && t == 2) ? _mm256_add_epi16(s16[r], p) : p;
                    KEEP_IN_REGISTER(s16[r]);
                    if (five && t == 1) isum[r] = madd_ones(s16[r]);
                }
            }
            for (int r = 0; r < R; r++)
                isum[r] = five ? _mm256_add_epi32(isum[r], madd_ones(s16[r])) : madd_ones(s16[r]);
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + f->d.at)));
        __m256 mn = f->m.size ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + f->m.at)))
                              : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            float dxr = dx[b * R + r];
            __m256i is = isum[r];
            if (format == Q4_0 || format == Q5_0)
                is = _mm256_sub_epi32(is, _mm256_set1_epi32((format == Q4_0 ? 8 : 16) * sx[b * R + r]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, _mm256_set1_ps(dxr)), acc[r]);
            if (f->m.size) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dxr * (float)sx[b * R + r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) store_bf16x8(y + r * ldy, acc[r], ncols < QCOLS ? ncols : QCOLS);
}

/* A K-quant register block: R rows x one group of 8 columns, over all K/256 super-blocks. Written once for both
   paths (a macro: each path compiles it for its own instruction set), which differ only in how a lane's codes
   times a row's activations become int32 and meet the sub-block's scale:
     KQ_DOT(s, first, codes, x):  AVX2 vpmaddubsw into int16 sums s; VNNI vpdpbusd into int32 sums s;
     KQ_SCALE(isum, s, scale):    AVX2 vpmaddwd of s by the scale in both int16 halves of the lane;
                                  VNNI vpmulld of s by the scale in the lane;
     KQ_SCALE_U/S(v, j):          that scale from byte j of each lane of v (unsigned: Q4_K/Q5_K; signed: Q6_K).
   Both give the same exact integers. `group` codes vectors share one int16 sum on AVX2 without overflow (a pair of
   products: 4-bit 3,810, 5-bit 7,874, 6-bit 16,002; at most 32,767), so the scale is applied once per group.
   Per super-block a row adds 64 vpmaddubsw, 64 / group scalings, the minimums' or the -32 offset's 4 to 8 vpmaddwd
   and its two fp32 steps; the unpacking of codes and scales is shared by the block's rows. */
#define DEFINE_KQBLOCK(NAME, MAXR)                                                                               \
static inline __attribute__((always_inline)) void NAME(const int format, const int R, const int8_t *qx,          \
                                                       const float *dx, const int32_t *sums, int K,              \
                                                       const uint8_t *w, uint16_t *y, size_t ldy, int ncols) {   \
    const qformat *f = &qformats[format];                                                                        \
    const int Kb = K / QK, rb = f->record_bytes, group = format == Q4_K ? 8 : format == Q5_K ? 4 : 2;            \
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1), m6 = _mm256_set1_epi8(0x3f);        \
    const __m256i top2 = _mm256_set1_epi8(0x30), even = _mm256_set1_epi32(0x00ff00ff);                           \
    __m256 acc[MAXR];                                                                                            \
    __m256i isum[MAXR], s[MAXR], msum[MAXR];                                                                     \
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                                    \
    for (int b = 0; b < Kb; b++) {                                                                               \
        const uint8_t *rec = w + (size_t)b * rb, *sc = rec + f->scales.at, *hb = rec + f->high.at;               \
        for (int l = 0; l < rb; l += 64) _mm_prefetch((const char *)(rec + 2 * rb + l), _MM_HINT_T0);           \
        const int8_t *xb = qx + (size_t)b * R * QK;                                                              \
        const int32_t *pb = sums + (size_t)b * R * QK_PAIRS;                                                     \
        for (int r = 0; r < R; r++) isum[r] = msum[r] = s[r] = _mm256_setzero_si256();                          \
        if (format != Q6_K) {                                                                                    \
            __m256i s0 = LOAD32(sc), s1 = LOAD32(sc + 32), s2 = LOAD32(sc + 64), scl[2], mnl[2];                 \
            scl[0] = _mm256_and_si256(s0, m6);                                                                   \
            scl[1] = _mm256_or_si256(_mm256_and_si256(s2, low4), _mm256_and_si256(_mm256_srli_epi32(s0, 2), top2)); \
            mnl[0] = _mm256_and_si256(s1, m6);                                                                   \
            mnl[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, 4), low4),                           \
                                     _mm256_and_si256(_mm256_srli_epi32(s1, 2), top2));                          \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) { /* sub-block j: 32j.., low or high nibbles */ \
                const __m256i scale = KQ_SCALE_U(scl[j / 4], j % 4);                                             \
                _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) {                                            \
                    __m256i raw = LOAD32(rec + 32 * (8 * (j / 2) + u));                                          \
                    __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, low4);                 \
                    if (format == Q5_K)                                                                          \
                        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(                               \
                            _mm256_srl_epi16(LOAD32(hb + 32 * u), _mm_cvtsi32_si128(j)), one), 4));              \
                    for (int r = 0; r < R; r++) {                                                                \
                        KQ_DOT(s[r], u % group == 0, q, xb + r * QK + 32 * j + 4 * u);                           \
                        if (u % group == group - 1) KQ_SCALE(isum[r], s[r], scale);                              \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
            for (int k = 0; k < 2; k++) {                                                                        \
                __m256i e = _mm256_and_si256(mnl[k], even), o = _mm256_srli_epi16(mnl[k], 8);                    \
                for (int r = 0; r < R; r++)                                                                      \
                    msum[r] = _mm256_add_epi32(msum[r], _mm256_add_epi32(                                        \
                        _mm256_madd_epi16(e, _mm256_set1_epi32(pb[r * QK_PAIRS + 8 + 2 * k])),                   \
                        _mm256_madd_epi16(o, _mm256_set1_epi32(pb[r * QK_PAIRS + 9 + 2 * k]))));                 \
            }                                                                                                    \
        } else {                                                                                                 \
            _Pragma("GCC unroll 16") for (int k = 0; k < 16; k++) { /* sub-block k: 128 n + 32 quarter + 4 u */  \
                const int n = k / 8, quarter = (k % 8) / 2;                                                      \
                const __m256i scale = KQ_SCALE_S(LOAD32(sc + 32 * (k / 4)), k % 4);                              \
                _Pragma("GCC unroll 4") for (int u = 4 * (k % 2); u < 4 * (k % 2) + 4; u++) {                    \
                    __m256i raw = LOAD32(rec + 32 * (16 * n + 8 * (quarter % 2) + u));                           \
                    __m256i h = LOAD32(hb + 32 * (8 * n + u));                                                   \
                    h = quarter < 2 ? _mm256_slli_epi16(h, 4 - 2 * quarter) : _mm256_srli_epi16(h, 2 * quarter - 4); \
                    __m256i q = _mm256_or_si256(_mm256_and_si256(quarter / 2 ? _mm256_srli_epi16(raw, 4) : raw, low4), \
                                                _mm256_and_si256(h, top2));                                      \
                    for (int r = 0; r < R; r++) {                                                                \
                        KQ_DOT(s[r], u % 2 == 0, q, xb + r * QK + 16 * k + 4 * (u % 4));                         \
                        if (u % 2 == 1) KQ_SCALE(isum[r], s[r], scale);                                          \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
            for (int k = 0; k < 4; k++) { /* the -32 offset: 32 sum_k sc_k bsum16_k */                           \
                __m256i v = LOAD32(sc + 32 * k);                                                                 \
                __m256i e = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), o = _mm256_srai_epi16(v, 8);          \
                for (int r = 0; r < R; r++)                                                                      \
                    msum[r] = _mm256_add_epi32(msum[r], _mm256_add_epi32(                                        \
                        _mm256_madd_epi16(e, _mm256_set1_epi32(pb[r * QK_PAIRS + 2 * k])),                       \
                        _mm256_madd_epi16(o, _mm256_set1_epi32(pb[r * QK_PAIRS + 2 * k + 1]))));                 \
            }                                                                                                    \
            for (int r = 0; r < R; r++) isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(msum[r], 5));      \
        }                                                                                                        \
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + f->d.at)));                           \
        __m256 dmin = format == Q6_K ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + f->m.at)));   \
        for (int r = 0; r < R; r++) {                                                                            \
            __m256 dxr = _mm256_set1_ps(dx[b * R + r]);                                                          \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dxr), acc[r]);                \
            if (format != Q6_K)                                                                                  \
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(dmin, dxr), acc[r]);        \
        }                                                                                                        \
    }                                                                                                            \
    for (int r = 0; r < R; r++) store_bf16x8(y + r * ldy, acc[r], ncols < QCOLS ? ncols : QCOLS);                \
}
#define LOAD32(p) _mm256_loadu_si256((const __m256i *)(p))

#define KQ_DOT(s, first, codes, x)                                                                               \
    do {                                                                                                         \
        __m256i p_ = _mm256_maddubs_epi16(codes, broadcast4(x));                                                 \
        s = (first) ? p_ : _mm256_add_epi16(s, p_);                                                              \
        KEEP_IN_REGISTER(s);                                                                                     \
    } while (0)
#define KQ_SCALE(isum, s, scale) isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s, scale))
#define KQ_SCALE_U(v, j) lane_bytes(v, 0x80008000u | (uint32_t)(j) << 16 | (uint32_t)(j))
#define KQ_SCALE_S(v, j) _mm256_srai_epi16(lane_bytes(v, (uint32_t)(j) << 24 | 0x00800080u | (uint32_t)(j) << 8), 8)
DEFINE_KQBLOCK(kqblock, QMAX_ROWS)
#undef KQ_DOT
#undef KQ_SCALE
#undef KQ_SCALE_U
#undef KQ_SCALE_S

/* A register block of R rows over `span` neighbouring groups (w: the first one's records; gstride bytes apart).
   sx: the activations' sums (K-quants: kq_sums' words). */
typedef void (*qblock_fn)(const int8_t *qx, const float *dx, const int32_t *sx, int K, const uint8_t *w,
                          size_t gstride, uint16_t *y, size_t ldy, int ncols);
#define QBLOCK_FN(F, R)                                                                                          \
    static void qblock_##F##_##R(const int8_t *qx, const float *dx, const int32_t *sx, int K, const uint8_t *w,  \
                                 size_t gstride, uint16_t *y, size_t ldy, int ncols) {                           \
        (void)gstride;                                                                                           \
        if (is_kquant(F)) kqblock(F, R, qx, dx, sx, K, w, y, ldy, ncols);                                        \
        else qblock(F, R, qx, dx, sx, K, w, y, ldy, ncols);                                                      \
    }
#define QBLOCK_ROWS(F) QBLOCK_FN(F, 1) QBLOCK_FN(F, 2) QBLOCK_FN(F, 3) QBLOCK_FN(F, 4)
#define QBLOCK_TABLE(F) {0, qblock_##F##_1, qblock_##F##_2, qblock_##F##_3, qblock_##F##_4}
QBLOCK_ROWS(Q4_0) QBLOCK_ROWS(Q4_1) QBLOCK_ROWS(Q8_0) QBLOCK_ROWS(Q5_0) QBLOCK_ROWS(Q5_1)
QBLOCK_ROWS(Q4_K) QBLOCK_ROWS(Q5_K) QBLOCK_ROWS(Q6_K)
static const qblock_fn qblocks[QFORMATS][QMAX_ROWS + 1] = {
    QBLOCK_TABLE(Q4_0), QBLOCK_TABLE(Q4_1), QBLOCK_TABLE(Q8_0), QBLOCK_TABLE(Q5_0),
    QBLOCK_TABLE(Q5_1), QBLOCK_TABLE(Q4_K), QBLOCK_TABLE(Q5_K), QBLOCK_TABLE(Q6_K)};

/* y[M, N] (row stride ldy) = x[M, K] (bf16, row stride ldx) @ W^T, W in qpanels of `format`; K a multiple of the
   format's block; register blocks of up to max_rows rows and `span` groups from `blocks` (a lone last group of an
   odd count from `tail`). Threads split the spans; each span's weights (a few KB) stay in cache while every row
   block passes. Returns 0, or -1 when memory for the quantized activations could not be allocated (y untouched). */
static int qgemm(int format, const uint16_t *x, long ldx, const uint8_t *wp, uint16_t *y, long ldy, int M, int N,
                 int K, int nthreads, int max_rows, int span, const qblock_fn *blocks, const qblock_fn *tail) {
    const int kq = is_kquant(format), words = kq ? QK_PAIRS : 1;
    int Kb = K / block_inputs(format), G = (N + QCOLS - 1) / QCOLS, S = (G + span - 1) / span;
    size_t gstride = (size_t)Kb * qformats[format].record_bytes;
    int8_t *qx = malloc((size_t)M * K + (size_t)M * Kb * (sizeof(float) + words * sizeof(int32_t)));
    if (!qx) return -1;
    float *dx = (float *)(qx + (size_t)M * K);
    int32_t *sx = (int32_t *)(dx + (size_t)M * Kb);
    if (kq) quantize_rows_q8k(x, ldx, M, K, max_rows, qx, dx, sx);
    else quantize_rows_q8(x, ldx, M, K, max_rows, qx, dx, sx);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int s = 0; s < S; s++) {
        int g = s * span;
        const qblock_fn *fns = g + span > G ? tail : blocks;
        for (int m = 0; m < M; m += max_rows) {
            int R = M - m < max_rows ? M - m : max_rows;
            fns[R](qx + (size_t)m * K, dx + (size_t)m * Kb, sx + (size_t)m * Kb * words, K, wp + g * gstride,
                   gstride, y + (size_t)m * ldy + g * QCOLS, (size_t)ldy, N - g * QCOLS);
        }
    }
    free(qx);
    return 0;
}

#define QGEMM_EXPORT(NAME, F, MAXR, SPAN, BLOCKS, TAIL)                                                          \
    int NAME(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy, int M, int N, int K,        \
             int nthreads) {                                                                                     \
        return qgemm(F, x, ldx, (const uint8_t *)wp, y, ldy, M, N, K, nthreads, MAXR, SPAN, BLOCKS, TAIL);      \
    }
#define QGEMM_EXPORT_AVX2(name, F) QGEMM_EXPORT(peagle_qgemm_##name, F, QMAX_ROWS, 1, qblocks[F], qblocks[F])
QGEMM_EXPORT_AVX2(q4_0, Q4_0) QGEMM_EXPORT_AVX2(q4_1, Q4_1) QGEMM_EXPORT_AVX2(q8_0, Q8_0)
QGEMM_EXPORT_AVX2(q5_0, Q5_0) QGEMM_EXPORT_AVX2(q5_1, Q5_1)
QGEMM_EXPORT_AVX2(q4_k, Q4_K) QGEMM_EXPORT_AVX2(q5_k, Q5_K) QGEMM_EXPORT_AVX2(q6_k, Q6_K)

/* Several matrices of one input stacked by output rows, each in its own format (a file's q/k/v or gate/up in
   different block types, as llama-quantize's mixes write them): one call runs each part's kernel into its rows. */
typedef int (*qgemm_fn)(const uint16_t *, long, const uint16_t *, uint16_t *, long, int, int, int, int);
#define QSTACK_PARTS 4
typedef struct {
    int count;
    qgemm_fn gemm[QSTACK_PARTS];
    const uint16_t *data[QSTACK_PARTS];
    int rows[QSTACK_PARTS];
} qstack;
int peagle_qgemm_stack(const uint16_t *x, long ldx, const uint16_t *stack, uint16_t *y, long ldy, int M, int N, int K,
                       int nthreads) {
    const qstack *st = (const qstack *)stack;
    int rc = 0, row = 0;
    for (int i = 0; i < st->count && !rc; row += st->rows[i++])
        rc = st->gemm[i](x, ldx, st->data[i], y + row, ldy, M, st->rows[i], K, nthreads);
    return row == N || rc ? rc : -1;
}

/* Column c's block of record rec as GGUF stores it, dequantized to fp32 as gguf's reference dequantizer computes
   it (the same fp32 operations in the same order). out: the block's block_inputs(format) weights. */
static void dequantize_block(int format, const uint8_t *rec, int c, float *out) {
    uint8_t blk[256];
    move_block(format, (uint8_t *)rec, c, blk, 0);
    const qformat *f = &qformats[format];
    uint16_t h;
    memcpy(&h, blk + f->d.from, 2);
    float d = _cvtsh_ss(h), m = 0.0f;
    if (f->m.size) memcpy(&h, blk + f->m.from, 2), m = _cvtsh_ss(h);
    const uint8_t *qs = blk + f->codes.from, *qh = blk + f->high.from;
    if (format == Q6_K)
        for (int i = 0; i < QK; i++) {
            int n = i / 128, l = i % 32, quarter = (i % 128) / 32;
            int lo = qs[64 * n + 32 * (quarter % 2) + l] >> (4 * (quarter / 2)) & 0xf;
            int q = lo | (qh[32 * n + l] >> (2 * quarter) & 3) << 4;
            float dk = d * (float)(int8_t)blk[f->scales.from + i / 16];
            out[i] = dk * (float)(q - 32);
        }
    else if (is_kquant(format))
        for (int i = 0; i < QK; i++) {
            int j = i / 32, l = i % 32;
            const uint8_t *s = blk + f->scales.from;
            int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xf) | (s[j - 4] >> 6) << 4;
            int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
            int q = qs[32 * (j / 2) + l] >> (4 * (j % 2)) & 0xf;
            if (format == Q5_K) q |= (qh[l] >> j & 1) << 4;
            float dj = d * (float)sc, mj = m * (float)mn;
            out[i] = dj * (float)q - mj;
        }
    else
        for (int i = 0; i < QBLOCK; i++) {
            float q, w;
            if (format == Q8_0) q = (float)(int8_t)qs[i];
            else {
                int code = qs[i % 16] >> (4 * (i / 16)) & 0xf;
                if (f->high.size) code |= (qh[i / 8] >> (i % 8) & 1) << 4;
                q = (float)(code - (format == Q4_0 ? 8 : format == Q5_0 ? 16 : 0));
            }
            w = d * q;
            out[i] = f->m.size ? w + m : w;
        }
}

/* Rows ids[0..n-1] of W [N, K] in qpanels, dequantized (dequantize_block) to fp32 (out32) or bf16 (out16, rounded
   once): the embedding lookup of a block-quantized table, and the tests' view of the weights. Returns -2 for an
   id outside [0, N), else 0. */
static int qrows(int format, const uint8_t *wp, int N, int K, const int64_t *ids, int n, float *out32,
                 uint16_t *out16) {
    int bi = block_inputs(format), Kb = K / bi, rb = qformats[format].record_bytes;
    float blk[QK];
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= N) return -2;
        int g = (int)(ids[i] / QCOLS), c = (int)(ids[i] % QCOLS);
        for (int b = 0; b < Kb; b++) {
            dequantize_block(format, wp + ((size_t)g * Kb + b) * rb, c, blk);
            for (int j = 0; j < bi; j++) {
                size_t at = (size_t)i * K + (size_t)b * bi + j;
                if (out32) out32[at] = blk[j];
                else out16[at] = f2bf(blk[j]);
            }
        }
    }
    return 0;
}
int peagle_qrows_f32(int format, const uint8_t *wp, int N, int K, const int64_t *ids, int n, float *out) {
    return qrows(format, wp, N, K, ids, n, out, NULL);
}
int peagle_qrows_bf16(int format, const uint8_t *wp, int N, int K, const int64_t *ids, int n, uint16_t *out) {
    return qrows(format, wp, N, K, ids, n, NULL, out);
}

/* The quantized activations of M rows as the kernels compute them (for the tests' float64 reference): per block of
   32 (sums: sx, one per block) or, with kquant, per super-block of 256 (sums: QK_PAIRS words per super-block). */
void peagle_quantize_rows_q8(const uint16_t *x, long ldx, int M, int K, int kquant, int8_t *qx, float *dx,
                             int32_t *sums) {
    if (kquant) quantize_rows_q8k(x, ldx, M, K, 1, qx, dx, sums);
    else quantize_rows_q8(x, ldx, M, K, 1, qx, dx, sums);
}

#pragma GCC pop_options

/* AVX-512 VNNI on 512-bit registers: two neighbouring qpanel groups (16 output columns) per vector, one column
   per int32 lane as on AVX2, so that each activation broadcast, each vpdpbusd and each step of the fp32 chain
   serves 16 columns instead of 8; 32 registers hold register blocks of QMAX_ROWS_VNNI rows. Per lane the chain is
   the section's, so the bits are AVX2's. Two changes of integer arithmetic only, exact either way: Q8_0 codes are
   made unsigned by flipping their sign bit (q + 128; vpdpbusd sums into int32, so no int16 saturation to avoid)
   and the sum is corrected by -128 sx, in place of AVX2's |q| and sign moved onto the activations; and Q4_0's
   -8 sx (Q5_0's -16 sx) starts the sum instead of ending it. The K-quants run DEFINE_KQBLOCK on 256-bit registers
   (AVX-512 VL) with vpdpbusd, 8 rows a register block. */
#ifndef PEAGLE_NO_AVX512
#pragma GCC push_options
#ifndef PEAGLE_EMULATE_AVX512 /* emulated: SIMDe, included before the AVX-512 BF16 section */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif

/* 32 bytes of group g's record (and of group g + 1's, at gstride further, in the upper half when two). */
static inline __m512i load_groups(const uint8_t *p, size_t gstride, const int two) {
    __m512i v = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    return two ? _mm512_inserti64x4(v, _mm256_loadu_si256((const __m256i *)(p + gstride)), 1) : v;
}

/* The 16 fp16 scales at offset `at` of both groups' records, as floats. */
static inline __m512 load_scales(const uint8_t *p, size_t gstride, const int two) {
    __m128i lo = _mm_loadu_si128((const __m128i *)p);
    __m128i hi = two ? _mm_loadu_si128((const __m128i *)(p + gstride)) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

static inline __m512i broadcast4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* fifth_bits on both groups' lanes. */
static inline __m512i fifth_bits_512(__m512i qh, int byte, int half) {
    const __m512i base = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    __m512i v = _mm512_shuffle_epi8(qh, _mm512_add_epi8(_mm512_set1_epi8((char)byte), base));
    __mmask64 set = _mm512_test_epi8_mask(v, _mm512_set1_epi32((int)(0x08040201u << (4 * half))));
    return _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10));
}

/* R rows x the 16 columns of groups g and g + 1 (only g's 8 when !two: the last group of an odd count). */
static inline __attribute__((always_inline)) void qblock_vnni(const int format, const int R, const int two,
                                                              const int8_t *qx, const float *dx, const int32_t *sx,
                                                              int K, const uint8_t *w, size_t gstride, uint16_t *y,
                                                              size_t ldy, int ncols) {
    const qformat *f = &qformats[format];
    const int Kb = K / QBLOCK, rb = f->record_bytes, five = f->high.size != 0;
    const int two_sums = R <= 2; /* few rows: two sums per row, so a row is not one chain of dependent adds */
    const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[QMAX_ROWS_VNNI];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < Kb; b++) {
        const uint8_t *rec = w + (size_t)b * rb;
        for (int l = 0; l < rb; l += 64) {
            _mm_prefetch((const char *)(rec + 8 * rb + l), _MM_HINT_T0);
            if (two) _mm_prefetch((const char *)(rec + gstride + 8 * rb + l), _MM_HINT_T0);
        }
        const int8_t *xb = qx + (size_t)b * R * QBLOCK;
        __m512i isum[QMAX_ROWS_VNNI], isum2[QMAX_ROWS_VNNI];
        for (int r = 0; r < R; r++) {
            int32_t s = sx[b * R + r];
            isum[r] = _mm512_set1_epi32(format == Q4_0 ? -8 * s : format == Q5_0 ? -16 * s
                                        : format == Q8_0 ? -128 * s : 0);
            isum2[r] = _mm512_setzero_si512();
        }
        if (format == Q8_0)
            for (int j = 0; j < 8; j += 2) {
                __m512i wv = _mm512_xor_si512(load_groups(rec + 32 * j, gstride, two), flip);
                __m512i wv2 = _mm512_xor_si512(load_groups(rec + 32 * j + 32, gstride, two), flip);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xb + r * QBLOCK + 4 * j;
                    isum[r] = _mm512_dpbusd_epi32(isum[r], wv, broadcast4_512(xr));
                    if (two_sums) isum2[r] = _mm512_dpbusd_epi32(isum2[r], wv2, broadcast4_512(xr + 4));
                    else isum[r] = _mm512_dpbusd_epi32(isum[r], wv2, broadcast4_512(xr + 4));
                }
            }
        else {
            const __m512i qh = five ? load_groups(rec + f->high.at, gstride, two) : low4;
            for (int t = 0; t < 4; t++) {
                __m512i raw = load_groups(rec + 32 * t, gstride, two);
                __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                if (five) {
                    lo = _mm512_or_si512(lo, fifth_bits_512(qh, t / 2, t % 2));
                    hi = _mm512_or_si512(hi, fifth_bits_512(qh, 2 + t / 2, t % 2));
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xb + r * QBLOCK + 4 * t;
                    isum[r] = _mm512_dpbusd_epi32(isum[r], lo, broadcast4_512(xr));
                    if (two_sums) isum2[r] = _mm512_dpbusd_epi32(isum2[r], hi, broadcast4_512(xr + 16));
                    else isum[r] = _mm512_dpbusd_epi32(isum[r], hi, broadcast4_512(xr + 16));
                }
            }
        }
        __m512 d = load_scales(rec + f->d.at, gstride, two);
        __m512 mn = f->m.size ? load_scales(rec + f->m.at, gstride, two) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            float dxr = dx[b * R + r];
            __m512i is = two_sums ? _mm512_add_epi32(isum[r], isum2[r]) : isum[r];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(dxr)), acc[r]);
            if (f->m.size) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dxr * (float)sx[b * R + r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        store_bf16x8(y + r * ldy, _mm512_castps512_ps256(acc[r]), ncols < QCOLS ? ncols : QCOLS);
        if (two && ncols > QCOLS)
            store_bf16x8(y + r * ldy + QCOLS, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)),
                         ncols < 2 * QCOLS ? ncols - QCOLS : QCOLS);
    }
}

#define KQ_DOT(s, first, codes, x) s = _mm256_dpbusd_epi32((first) ? _mm256_setzero_si256() : s, codes, broadcast4(x))
#define KQ_SCALE(isum, s, scale) isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(s, scale))
#define KQ_SCALE_U(v, j) lane_bytes(v, 0x80808000u | (uint32_t)(j))
#define KQ_SCALE_S(v, j) _mm256_srai_epi32(lane_bytes(v, (uint32_t)(j) << 24 | 0x00808080u), 24)
DEFINE_KQBLOCK(kqblock_vnni, QMAX_ROWS_VNNI)
#undef KQ_DOT
#undef KQ_SCALE
#undef KQ_SCALE_U
#undef KQ_SCALE_S

#define QBLOCK_VNNI_FN(F, R, TWO)                                                                                \
    static void qblock_vnni_##F##_##R##_##TWO(const int8_t *qx, const float *dx, const int32_t *sx, int K,       \
                                              const uint8_t *w, size_t gstride, uint16_t *y, size_t ldy,         \
                                              int ncols) {                                                       \
        if (is_kquant(F)) kqblock_vnni(F, R, qx, dx, sx, K, w, y, ldy, ncols);                                   \
        else qblock_vnni(F, R, TWO, qx, dx, sx, K, w, gstride, y, ldy, ncols);                                   \
    }
#define QBLOCK_VNNI_ROWS(F, TWO)                                                                                 \
    QBLOCK_VNNI_FN(F, 1, TWO) QBLOCK_VNNI_FN(F, 2, TWO) QBLOCK_VNNI_FN(F, 3, TWO) QBLOCK_VNNI_FN(F, 4, TWO)      \
    QBLOCK_VNNI_FN(F, 5, TWO) QBLOCK_VNNI_FN(F, 6, TWO) QBLOCK_VNNI_FN(F, 7, TWO) QBLOCK_VNNI_FN(F, 8, TWO)
#define QBLOCK_VNNI_TABLE(F, TWO)                                                                                \
    {0, qblock_vnni_##F##_1_##TWO, qblock_vnni_##F##_2_##TWO, qblock_vnni_##F##_3_##TWO,                         \
     qblock_vnni_##F##_4_##TWO, qblock_vnni_##F##_5_##TWO, qblock_vnni_##F##_6_##TWO,                            \
     qblock_vnni_##F##_7_##TWO, qblock_vnni_##F##_8_##TWO}
/* 32-input formats: two groups per register block (and one for a lone last group); K-quants: one group. */
#define QGEMM_EXPORT_VNNI(name, F)                                                                               \
    QBLOCK_VNNI_ROWS(F, 1) QBLOCK_VNNI_ROWS(F, 0)                                                                \
    static const qblock_fn qblocks_vnni_##F[2][QMAX_ROWS_VNNI + 1] = {QBLOCK_VNNI_TABLE(F, 1),                   \
                                                                      QBLOCK_VNNI_TABLE(F, 0)};                  \
    QGEMM_EXPORT(peagle_qgemm_vnni_##name, F, QMAX_ROWS_VNNI, is_kquant(F) ? 1 : 2, qblocks_vnni_##F[0],         \
                 qblocks_vnni_##F[1])
QGEMM_EXPORT_VNNI(q4_0, Q4_0) QGEMM_EXPORT_VNNI(q4_1, Q4_1) QGEMM_EXPORT_VNNI(q8_0, Q8_0)
QGEMM_EXPORT_VNNI(q5_0, Q5_0) QGEMM_EXPORT_VNNI(q5_1, Q5_1)
QGEMM_EXPORT_VNNI(q4_k, Q4_K) QGEMM_EXPORT_VNNI(q5_k, Q5_K) QGEMM_EXPORT_VNNI(q6_k, Q6_K)

#pragma GCC pop_options
#endif /* PEAGLE_NO_AVX512 */

/* ---------------------------------------------------------------------------------------------------------------
   A whole Llama decoder layer in one call: the target's forward on the CPU, and the drafter's. The same kernels in
   the same order as layers.py's DecoderLayer, with the reference's bf16 rounding at every step (so both give
   identical bits), minus the Python between them: a one-row decode step makes a dozen small calls per layer, whose
   fixed cost adds up over 30 layers to a sixth of the step (docs/performance.md), and to half the drafter's. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")

typedef int (*gemm_fn)(const uint16_t *, long, const uint16_t *, uint16_t *, long, int, int, int, int);

typedef struct {
    gemm_fn gemm_qkv, gemm_o, gemm_gate_up, gemm_down; /* the matrix kernel each weight is packed for */
    const uint16_t *input_norm, *post_norm;   /* RMSNorm weights [H] */
    const uint16_t *qkv, *o, *gate_up, *down; /* packed [(nh + 2 nkv) D, H], [H, nh D], [2 I, H], [H, I] */
    int H, I, nh, nkv, D;
    float eps, scale;                          /* RMSNorm epsilon; attention scale D^-0.5 */
    int attention_dpbf16;                      /* peagle_attention_bf16's dpbf16 */
} peagle_layer;

/* y = bf16(a + b) elementwise, like PyTorch's bf16 add (fp32 sum, one rounding). y may be a. */
static void add_bf16(const uint16_t *a, const uint16_t *b, uint16_t *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), f32x8_to_bf16(_mm256_add_ps(bf16x8_to_f32(a + i), bf16x8_to_f32(b + i))));
    for (; i < n; i++) y[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
}

/* y [B*T, H] = the layer from its attention input: `in` [B*T, Kin] is what q, k and v multiply (the drafter's fusion
   layer's [normed embedding, normed feature], Kin = 2H; NULL for a decoder layer: RMSNorm(res), Kin = H) and
   `res` [B*T, H] what the attention output is added to (x; the fusion layer's feature). Writes this step's keys
   and values into the cache like peagle_attention_bf16. Returns 0; -1 when scratch memory could not be allocated;
   -2 when a slot or position lies outside the cache (y is then incomplete). */
int peagle_layer_from_input(const peagle_layer *w, const uint16_t *in, int Kin, const uint16_t *res, uint16_t *y,
                            int B, int T, const uint16_t *cos_, const uint16_t *sin_, uint16_t *kc, uint16_t *vc,
                            const int64_t *slots, const int64_t *positions, int num_slots, int max_len,
                            int nthreads) {
    size_t M = (size_t)B * T;
    int H = w->H, I = w->I, nh = w->nh, nkv = w->nkv, D = w->D, W = (nh + 2 * nkv) * D;
    uint16_t *buf = malloc(M * ((size_t)2 * H + W + (size_t)nh * D + 3 * (size_t)I) * 2);
    if (!buf) return -1;
    uint16_t *normed = buf, *qkv = normed + M * H, *att = qkv + M * W, *out = att + M * nh * D, *gu = out + M * H;
    uint16_t *act = gu + M * 2 * I;
    int rc;
    if (!in) { /* a decoder layer: its own input norm (normed is free again once q, k and v are computed) */
        peagle_rms_norm_bf16(res, w->input_norm, normed, (int)M, H, w->eps);
        in = normed, Kin = H;
    }
    if ((rc = w->gemm_qkv(in, Kin, w->qkv, qkv, W, (int)M, W, Kin, nthreads))) goto done;
    peagle_rope_bf16(qkv, cos_, sin_, (int)M, nh + 2 * nkv, nh + nkv, D);
    if ((rc = peagle_attention_bf16(qkv, W, qkv + (size_t)nh * D, qkv + (size_t)(nh + nkv) * D, W, kc, vc, slots,
                                    positions, att, B, T, nh, nkv, D, num_slots, max_len, w->scale, nthreads,
                                    w->attention_dpbf16)))
        goto done;
    if ((rc = w->gemm_o(att, (long)nh * D, w->o, out, H, (int)M, H, nh * D, nthreads))) goto done;
    add_bf16(res, out, y, M * H);
    peagle_rms_norm_bf16(y, w->post_norm, normed, (int)M, H, w->eps);
    if ((rc = w->gemm_gate_up(normed, H, w->gate_up, gu, 2 * I, (int)M, 2 * I, H, nthreads))) goto done;
    peagle_silu_mul_bf16(gu, act, (int)M, I);
    if ((rc = w->gemm_down(act, I, w->down, out, H, (int)M, H, I, nthreads))) goto done;
    add_bf16(y, out, y, M * H);
done:
    free(buf);
    return rc;
}

/* y [B*T, H] = the decoder layer applied to x [B*T, H] (rows of B requests with T query tokens each). Returns as
   peagle_layer_from_input. */
int peagle_decoder_layer(const peagle_layer *w, const uint16_t *x, uint16_t *y, int B, int T, const uint16_t *cos_,
                         const uint16_t *sin_, uint16_t *kc, uint16_t *vc, const int64_t *slots,
                         const int64_t *positions, int num_slots, int max_len, int nthreads) {
    return peagle_layer_from_input(w, NULL, w->H, x, y, B, T, cos_, sin_, kc, vc, slots, positions, num_slots,
                                   max_len, nthreads);
}

#pragma GCC pop_options
