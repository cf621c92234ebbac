/* ---------------------------------------------------------------------------------------------------------------
   AMX: 16x16 fp32 tiles accumulated by `tdpbf16ps` over 32-wide k blocks */

#if !defined(PEAGLE_NO_AMX) && !defined(PEAGLE_EMULATE_AMX)
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
   AMX int8: block-quantized weights (every format: the 32-input ones and the K-quants) in `tdpbssd` tiles, for
   products of many rows

   The same qpanels as AVX2 and VNNI, and the same fp32 chain per output (common.h, "Block-quantized weights"), so
   the same bits; only the exact integer block sums are made differently. A tile of h activation rows (A: h rows x
   one block's 32 int8 codes) times one block of 16 output columns (B: 8 rows of 4 inputs x 16 columns, int8) gives
   every row's and column's block sum in one `tdpbssd` (C: h x 16 int32). The qpanels already hold the B rows: chunk
   t of two neighbouring groups is inputs 4t..4t+3 of 16 columns (low nibbles) and 16+4t..19+4t (high ones), as the
   VNNI path loads them. Each column pair's blocks are unpacked once per call into signed int8 B tiles in a small
   per-thread buffer (Q4_0's codes minus 8 and Q5_0's minus 16, so the sums need no -8 sx correction: the same exact
   integer isum), with their fp16 scales widened to fp32 (exact), and every row tile of the call reuses them. Block
   sums go through tmm0..3 in turn, AMX_AHEAD blocks ahead of the chain, which each row then runs in block order:
     acc = fma((float)isum, d * dx, acc);   acc = fma(m, dx * sx, acc)   [Q4_1, Q5_1]
   with the row's fp32 accumulators (16 columns each) in registers. Activations are quantized per row by
   quantize_rows_q8 (quantize_rows_q8k for the K-quants), as on the other paths; the rows of a call are split into
   tiles of equal height (at most 16).

   A block is only 32 inputs, half of what a tile product can take, and its sums must leave the tile before the
   next block's scale applies; so each block costs a tile product, a store and a reload whatever the rows, and a
   product of few rows is faster on VNNI: the entry points send fewer than amx_min_rows rows there (one row always).
   The K-quants: each sub-block is a tile product as above (Q4_K/Q5_K: 32 codes 0..15 or 0..31 as int8; Q6_K: 16
   codes q - 32, on tiles 16 bytes wide), and each row adds sc_j times the sub-block's sums (and Q4_K/Q5_K's sum_j
   m_j bsum32_j) in exact int32 vectors before the super-block's fp32 steps, the VNNI path's chain. */

#if !defined(PEAGLE_NO_AMX) && !defined(PEAGLE_NO_AVX512)
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef PEAGLE_EMULATE_AMX
/* Tests only (kernels.py, emulated_library): the tile instructions this section uses, in portable C as Intel's
   manual defines them (palette 1: 8 tiles of up to 16 rows x 64 bytes, each with the rows and bytes per row the
   configuration gives it), so the section's logic runs on any x86-64. Loads zero a tile's bytes past its
   configured rows and columns; tdpbssd adds, per row m of C and int32 n, the sums of 4 signed byte products
   a[m][4k..4k+3] . b[k][4n..4n+3] over k < A's bytes per row / 4, in k order (exact here: no sum nears 2^31). */
static __thread struct {
    uint8_t rows[8];
    uint16_t colsb[8];
    int8_t t[8][16][64];
} emulated_tiles;
static void emulated_tile_loadconfig(const void *config) {
    const uint8_t *c = config;
    memset(&emulated_tiles, 0, sizeof emulated_tiles);
    for (int t = 0; t < 8; t++) {
        memcpy(&emulated_tiles.colsb[t], c + 16 + 2 * t, 2);
        emulated_tiles.rows[t] = c[48 + t];
    }
}
static void emulated_tile_release(void) { memset(&emulated_tiles, 0, sizeof emulated_tiles); }
static void emulated_tile_loadd(int t, const void *base, long stride) {
    memset(emulated_tiles.t[t], 0, sizeof emulated_tiles.t[t]);
    for (int r = 0; r < emulated_tiles.rows[t]; r++)
        memcpy(emulated_tiles.t[t][r], (const char *)base + (size_t)r * stride, emulated_tiles.colsb[t]);
}
static void emulated_tile_stored(int t, void *base, long stride) {
    for (int r = 0; r < emulated_tiles.rows[t]; r++)
        memcpy((char *)base + (size_t)r * stride, emulated_tiles.t[t][r], emulated_tiles.colsb[t]);
}
static void emulated_tile_zero(int t) { memset(emulated_tiles.t[t], 0, sizeof emulated_tiles.t[t]); }
static void emulated_tile_dpbssd(int c, int a, int b) {
    for (int m = 0; m < emulated_tiles.rows[c]; m++)
        for (int n = 0; n < emulated_tiles.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &emulated_tiles.t[c][m][4 * n], 4);
            for (int k = 0; k < emulated_tiles.colsb[a] / 4; k++) {
                int32_t dot = 0;
                for (int i = 0; i < 4; i++)
                    dot += (int32_t)emulated_tiles.t[a][m][4 * k + i] * (int32_t)emulated_tiles.t[b][k][4 * n + i];
                acc = (int32_t)((uint32_t)acc + (uint32_t)dot);
            }
            memcpy(&emulated_tiles.t[c][m][4 * n], &acc, 4);
        }
}
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#define _tile_loadconfig emulated_tile_loadconfig
#define _tile_release emulated_tile_release
#define _tile_loadd(t, base, stride) emulated_tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emulated_tile_stored(t, base, stride)
#define _tile_zero(t) emulated_tile_zero(t)
#define _tile_dpbssd(c, a, b) emulated_tile_dpbssd(c, a, b)

int peagle_amx_init(void) { return 1; } /* nothing to ask the OS for */
#endif /* PEAGLE_EMULATE_AMX */

#pragma GCC push_options
#if !defined(PEAGLE_EMULATE_AMX)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#elif !defined(PEAGLE_EMULATE_AVX512)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif

#define AMX_AHEAD 3 /* blocks whose sums are being made while a block's are read: tmm0..3 in turn */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} int8_tilecfg;

/* Tiles of h activation rows and blocks of `width` inputs (32; Q6_K's sub-blocks 16): tmm0..3 C (h rows x 16
   int32), tmm4/5 A (h rows x one block's codes), tmm6/7 B (width / 4 rows of 4 inputs x 16 columns). A tile
   product's time grows with its rows, so a call's row tiles are as tall as its rows need (M <= 16: M rows). */
static void config_int8_tiles(int h, int width) {
    int8_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 6 ? (uint8_t)h : (uint8_t)(width / 4);
        c.colsb[t] = t == 4 || t == 5 ? (uint16_t)width : 64;
    }
    _tile_loadconfig(&c);
}

/* Groups g and g + 1 (only g when !two; the other's columns are then zero codes and scales) of w, all Kb blocks,
   as B tiles: block b at out + 512 b, row i holding inputs 4i..4i+3 of the 16 columns as signed int8 (Q4_0 q - 8,
   Q5_0 q - 16, else q); the fp16 scales d (and m) as fp32 at d + 16 b (m + 16 b). */
static inline __attribute__((always_inline)) void amx_unpack(const int format, const uint8_t *w, size_t gstride,
                                                             const int two, int Kb, int8_t *out, float *d, float *m) {
    const qformat *f = &qformats[format];
    const int rb = f->record_bytes, five = f->high.size != 0;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i offset = _mm512_set1_epi8((char)(format == Q4_0 ? 8 : format == Q5_0 ? 16 : 0));
    for (int b = 0; b < Kb; b++) {
        const uint8_t *rec = w + (size_t)b * rb;
        int8_t *t = out + (size_t)b * 512;
        if (format == Q8_0)
            for (int i = 0; i < 8; i++) _mm512_storeu_si512((void *)(t + 64 * i), load_groups(rec + 32 * i, gstride, two));
        else {
            const __m512i qh = five ? load_groups(rec + f->high.at, gstride, two) : low4;
            for (int i = 0; i < 4; i++) {
                __m512i raw = load_groups(rec + 32 * i, gstride, two);
                __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                if (five) {
                    lo = _mm512_or_si512(lo, fifth_bits_512(qh, i / 2, i % 2));
                    hi = _mm512_or_si512(hi, fifth_bits_512(qh, 2 + i / 2, i % 2));
                }
                _mm512_storeu_si512((void *)(t + 64 * i), _mm512_sub_epi8(lo, offset));
                _mm512_storeu_si512((void *)(t + 64 * (i + 4)), _mm512_sub_epi8(hi, offset));
            }
        }
        _mm512_storeu_ps(d + 16 * b, load_scales(rec + f->d.at, gstride, two));
        if (f->m.size) _mm512_storeu_ps(m + 16 * b, load_scales(rec + f->m.at, gstride, two));
    }
}

/* tdpbssd of block b's A (a: the row tile's codes, K bytes a row; `width` a block) and B tiles (16 width bytes a
   block) into tile C, stored to cbuf[C]. */
#define AMX_BLOCK_SUM(C, TA, TB, b)                                                                              \
    do {                                                                                                         \
        _tile_zero(C);                                                                                           \
        _tile_loadd(TA, a + (size_t)width * (b), K);                                                             \
        _tile_loadd(TB, bt + (size_t)16 * width * (b), 64);                                                      \
        _tile_dpbssd(C, TA, TB);                                                                                 \
        _tile_stored(C, cbuf[C], 64);                                                                            \
    } while (0)
/* Block b's sums into tile b % 4 and cbuf[b % 4] (A and B tiles alternating with b's parity). */
#define AMX_SUMS(b)                                                                                              \
    do {                                                                                                         \
        switch ((b) % 4) {                                                                                       \
            case 0: AMX_BLOCK_SUM(0, 4, 6, b); break;                                                            \
            case 1: AMX_BLOCK_SUM(1, 5, 7, b); break;                                                            \
            case 2: AMX_BLOCK_SUM(2, 4, 6, b); break;                                                            \
            default: AMX_BLOCK_SUM(3, 5, 7, b); break;                                                           \
        }                                                                                                        \
    } while (0)

/* One row tile (the tile's h rows; R: h rounded up to a multiple of 4, the chain's rows past h computed on zeros and
   dropped) x the 16 columns whose B tiles, d and m were unpacked: the chain per row in fp32 registers, block b's
   sums read while those of the AMX_AHEAD blocks after it are made, stored to y (`rows` rows of ncols columns, at
   most 16). */
static inline __attribute__((always_inline)) void amx_row_tile(const int format, const int R, const int8_t *a,
                                                               const float *dx, const int32_t *sx, int K,
                                                               const int8_t *bt, const float *d, const float *m,
                                                               int32_t (*cbuf)[16][16], uint16_t *y, size_t ldy,
                                                               int rows, int ncols) {
    const int Kb = K / QBLOCK, has_m = qformats[format].m.size != 0, width = QBLOCK;
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < AMX_AHEAD && b < Kb; b++) AMX_SUMS(b);
    for (int b = 0; b < Kb; b++) {
        if (b + AMX_AHEAD < Kb) AMX_SUMS(b + AMX_AHEAD);
        const __m512 db = _mm512_loadu_ps(d + 16 * b), mb = has_m ? _mm512_loadu_ps(m + 16 * b) : db;
        for (int r = 0; r < R; r++) {
            float dxr = dx[(size_t)r * Kb + b];
            __m512 isum = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)cbuf[b % 4][r]));
            acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(db, _mm512_set1_ps(dxr)), acc[r]);
            if (has_m) acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(dxr * (float)sx[(size_t)r * Kb + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        store_bf16x8(y + r * ldy, _mm512_castps512_ps256(acc[r]), ncols < QCOLS ? ncols : QCOLS);
        if (ncols > QCOLS)
            store_bf16x8(y + r * ldy + QCOLS, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)),
                         ncols < 2 * QCOLS ? ncols - QCOLS : QCOLS);
    }
}
/* The K-quants with sub-blocks of 32 (Q4_K, Q5_K): super-block b's sub-block j of groups g and g + 1 as B tile
   u = 8 b + j at out + 512 u (codes 0..15 or 0..31, as int8), its 6-bit scale and minimum per column as int32 lanes
   at sc + 16 u and mn + 16 u, and d, dmin as fp32 at d + 16 b, dmin + 16 b. */
static inline __attribute__((always_inline)) void amx_unpack_k(const int format, const uint8_t *w, size_t gstride,
                                                               const int two, int Kb, int8_t *out, float *d,
                                                               float *dmin, int32_t *sc, int32_t *mn) {
    const qformat *f = &qformats[format];
    const int rb = f->record_bytes;
    const __m512i low4 = _mm512_set1_epi8(0x0f), m6 = _mm512_set1_epi8(0x3f), top2 = _mm512_set1_epi8(0x30);
    const __m512i one = _mm512_set1_epi8(1), byte = _mm512_set1_epi32(0xff);
    for (int b = 0; b < Kb; b++) {
        const uint8_t *rec = w + (size_t)b * rb;
        __m512i s0 = load_groups(rec + f->scales.at, gstride, two), s1 = load_groups(rec + f->scales.at + 32, gstride, two);
        __m512i s2 = load_groups(rec + f->scales.at + 64, gstride, two), scl[2], mnl[2];
        scl[0] = _mm512_and_si512(s0, m6);
        scl[1] = _mm512_or_si512(_mm512_and_si512(s2, low4), _mm512_and_si512(_mm512_srli_epi32(s0, 2), top2));
        mnl[0] = _mm512_and_si512(s1, m6);
        mnl[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, 4), low4),
                                 _mm512_and_si512(_mm512_srli_epi32(s1, 2), top2));
        for (int j = 0; j < 8; j++) {
            const int u = 8 * b + j;
            _mm512_storeu_si512((void *)(sc + 16 * u), _mm512_and_si512(_mm512_srli_epi32(scl[j / 4], 8 * (j % 4)), byte));
            _mm512_storeu_si512((void *)(mn + 16 * u), _mm512_and_si512(_mm512_srli_epi32(mnl[j / 4], 8 * (j % 4)), byte));
            for (int i = 0; i < 8; i++) {
                __m512i raw = load_groups(rec + 32 * (8 * (j / 2) + i), gstride, two);
                __m512i q = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(raw, 4) : raw, low4);
                if (format == Q5_K)
                    q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(
                        _mm512_srli_epi16(load_groups(rec + f->high.at + 32 * i, gstride, two), j), one), 4));
                _mm512_storeu_si512((void *)(out + (size_t)512 * u + 64 * i), q);
            }
        }
        _mm512_storeu_ps(d + 16 * b, load_scales(rec + f->d.at, gstride, two));
        _mm512_storeu_ps(dmin + 16 * b, load_scales(rec + f->m.at, gstride, two));
    }
}

/* amx_row_tile for Q4_K / Q5_K: tile u holds sub-block u % 8 of super-block u / 8 (A: the rows' 32 codes at
   a + 32 u); per row isum = sum_j sc_j (q.qx)_j and msum = sum_j m_j bsum32_j in exact int32, then the chain
     acc = fma((float)isum, d * dx, acc);   acc = fnmadd((float)msum, dmin * dx, acc)
   once per super-block, as on the VNNI path. sums: kq_sums' words (bsum32_j in their int16 halves). */
static inline __attribute__((always_inline)) void amx_row_tile_k(const int R, const int8_t *a, const float *dx,
                                                                 const int32_t *sums, int K, const int8_t *bt,
                                                                 const float *d, const float *dmin, const int32_t *sc,
                                                                 const int32_t *mn, int32_t (*cbuf)[16][16],
                                                                 uint16_t *y, size_t ldy, int rows, int ncols) {
    const int Kb = K / QK, units = 8 * Kb, width = QBLOCK;
    __m512 acc[16];
    __m512i isum[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), isum[r] = _mm512_setzero_si512();
    for (int u = 0; u < AMX_AHEAD && u < units; u++) AMX_SUMS(u);
    for (int u = 0; u < units; u++) {
        if (u + AMX_AHEAD < units) AMX_SUMS(u + AMX_AHEAD);
        const int b = u / 8, j = u % 8;
        const __m512i scj = _mm512_loadu_si512((const void *)(sc + 16 * u));
        for (int r = 0; r < R; r++) {
            __m512i p = _mm512_mullo_epi32(_mm512_loadu_si512((const void *)cbuf[u % 4][r]), scj);
            isum[r] = j ? _mm512_add_epi32(isum[r], p) : p;
        }
        if (j < 7) continue;
        const __m512 db = _mm512_loadu_ps(d + 16 * b), dminb = _mm512_loadu_ps(dmin + 16 * b);
        for (int r = 0; r < R; r++) {
            const int32_t *pb = sums + ((size_t)r * Kb + b) * QK_PAIRS;
            __m512i msum = _mm512_setzero_si512();
            for (int jj = 0; jj < 8; jj++) {
                uint32_t word = (uint32_t)pb[8 + 2 * (jj / 4) + jj % 2];
                int bsum = jj % 4 < 2 ? (int16_t)(word & 0xffffu) : (int16_t)(word >> 16);
                msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(_mm512_loadu_si512((const void *)(mn + 16 * (8 * b + jj))),
                                                                 _mm512_set1_epi32(bsum)));
            }
            __m512 dxr = _mm512_set1_ps(dx[(size_t)r * Kb + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(db, dxr), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dminb, dxr), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        store_bf16x8(y + r * ldy, _mm512_castps512_ps256(acc[r]), ncols < QCOLS ? ncols : QCOLS);
        if (ncols > QCOLS)
            store_bf16x8(y + r * ldy + QCOLS, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)),
                         ncols < 2 * QCOLS ? ncols - QCOLS : QCOLS);
    }
}
/* Q6_K: super-block b's sub-block k (16 inputs) of groups g and g + 1 as B tile u = 16 b + k at out + 256 u (4
   rows; codes q - 32 as int8, so the sums need no -32 bsum16 correction: the same exact isum), its int8 scale per
   column as int32 lanes at sc + 16 u, and d as fp32 at d + 16 b. */
static inline __attribute__((always_inline)) void amx_unpack_q6k(const uint8_t *w, size_t gstride, const int two,
                                                                 int Kb, int8_t *out, float *d, int32_t *sc) {
    const qformat *f = &qformats[Q6_K];
    const int rb = f->record_bytes;
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    const __m512i byte = _mm512_set1_epi32(0xff), sign = _mm512_set1_epi32(0x80);
    for (int b = 0; b < Kb; b++) {
        const uint8_t *rec = w + (size_t)b * rb;
        for (int k = 0; k < 16; k++) { /* sub-block k: 128 n + 32 quarter + 16 (k % 2) .. */
            const int n = k / 8, quarter = (k % 8) / 2, u = 16 * b + k;
            __m512i v = load_groups(rec + f->scales.at + 32 * (k / 4), gstride, two);
            __m512i s8 = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (k % 4)), byte); /* the byte, then its sign */
            _mm512_storeu_si512((void *)(sc + 16 * u), _mm512_sub_epi32(_mm512_xor_si512(s8, sign), sign));
            for (int i = 0; i < 4; i++) {
                const int c = 4 * (k % 2) + i; /* the chunk of 4 inputs within the quarter */
                __m512i raw = load_groups(rec + 32 * (16 * n + 8 * (quarter % 2) + c), gstride, two);
                __m512i h = load_groups(rec + f->high.at + 32 * (8 * n + c), gstride, two);
                h = quarter < 2 ? _mm512_slli_epi16(h, 4 - 2 * quarter) : _mm512_srli_epi16(h, 2 * quarter - 4);
                __m512i q = _mm512_or_si512(_mm512_and_si512(quarter / 2 ? _mm512_srli_epi16(raw, 4) : raw, low4),
                                            _mm512_and_si512(h, top2));
                _mm512_storeu_si512((void *)(out + (size_t)256 * u + 64 * i), _mm512_sub_epi8(q, off));
            }
        }
        _mm512_storeu_ps(d + 16 * b, load_scales(rec + f->d.at, gstride, two));
    }
}

/* amx_row_tile for Q6_K: tile u holds sub-block u % 16 of super-block u / 16 (A: the rows' 16 codes at a + 16 u);
   per row isum = sum_k sc_k ((q - 32).qx)_k in exact int32, then acc = fma((float)isum, d * dx, acc) once per
   super-block, as on the VNNI path. */
static inline __attribute__((always_inline)) void amx_row_tile_q6k(const int R, const int8_t *a, const float *dx,
                                                                   int K, const int8_t *bt, const float *d,
                                                                   const int32_t *sc, int32_t (*cbuf)[16][16],
                                                                   uint16_t *y, size_t ldy, int rows, int ncols) {
    const int Kb = K / QK, units = 16 * Kb, width = QBLOCK / 2;
    __m512 acc[16];
    __m512i isum[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), isum[r] = _mm512_setzero_si512();
    for (int u = 0; u < AMX_AHEAD && u < units; u++) AMX_SUMS(u);
    for (int u = 0; u < units; u++) {
        if (u + AMX_AHEAD < units) AMX_SUMS(u + AMX_AHEAD);
        const int b = u / 16, k = u % 16;
        const __m512i sck = _mm512_loadu_si512((const void *)(sc + 16 * u));
        for (int r = 0; r < R; r++) {
            __m512i p = _mm512_mullo_epi32(_mm512_loadu_si512((const void *)cbuf[u % 4][r]), sck);
            isum[r] = k ? _mm512_add_epi32(isum[r], p) : p;
        }
        if (k < 15) continue;
        const __m512 db = _mm512_loadu_ps(d + 16 * b);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(db, _mm512_set1_ps(dx[(size_t)r * Kb + b])),
                                     acc[r]);
    }
    for (int r = 0; r < rows; r++) {
        store_bf16x8(y + r * ldy, _mm512_castps512_ps256(acc[r]), ncols < QCOLS ? ncols : QCOLS);
        if (ncols > QCOLS)
            store_bf16x8(y + r * ldy + QCOLS, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)),
                         ncols < 2 * QCOLS ? ncols - QCOLS : QCOLS);
    }
}
#undef AMX_SUMS
#undef AMX_BLOCK_SUM

/* y[M, N] = x[M, K] @ W^T for a 32-input format on AMX (M >= 1; the entry points send one row to VNNI). Rows in
   ceil(M / 16) tiles of equal height h; threads split the column pairs. Returns 0, or -1 when memory for the
   quantized activations or the tiles could not be allocated (y untouched). */
static inline __attribute__((always_inline)) int qgemm_amx(const int format, const uint16_t *x, long ldx,
                                                           const uint8_t *wp, uint16_t *y, long ldy, int M, int N,
                                                           int K, int nthreads) {
    const int kq = is_kquant(format), Kb = K / block_inputs(format), G = (N + QCOLS - 1) / QCOLS, S = (G + 1) / 2;
    const int words = kq ? QK_PAIRS : 1, q6 = format == Q6_K; /* activation sums per block; Q6_K: sub-blocks of 16 */
    const int units = q6 ? 16 * Kb : kq ? 8 * Kb : Kb, width = q6 ? 16 : 32; /* B tiles; inputs per tile */
    const int tiles = (M + 15) / 16, h = (M + tiles - 1) / tiles, Mp = tiles * h + 3; /* + 3: R's rows past h */
    const size_t gstride = (size_t)Kb * qformats[format].record_bytes;
    /* per thread: B tiles, d, m (dmin), and the K-quants' sub-block scales and minimums */
    const size_t scratch = (size_t)units * 16 * width + (size_t)Kb * 2 * 16 * sizeof(float) +
                           (kq ? (size_t)units * 2 * 16 * sizeof(int32_t) : 0);
    if (nthreads < 1) nthreads = 1;
    /* codes of Mp rows (zero past M), then dx and sx of Mp rows (zero past M) */
    size_t qbytes = (size_t)Mp * K + (size_t)Mp * Kb * (sizeof(float) + words * sizeof(int32_t));
    int8_t *qx = aligned_alloc(64, (qbytes + 63) / 64 * 64);
    int8_t *wbuf = aligned_alloc(64, scratch * (size_t)nthreads);
    if (!qx || !wbuf) {
        free(qx);
        free(wbuf);
        return -1;
    }
    float *dx = (float *)(qx + (size_t)Mp * K);
    int32_t *sx = (int32_t *)(dx + (size_t)Mp * Kb);
    if (kq) quantize_rows_q8k(x, ldx, M, K, 1, qx, dx, sx);
    else quantize_rows_q8(x, ldx, M, K, 1, qx, dx, sx);
    memset(qx + (size_t)M * K, 0, (size_t)(Mp - M) * K);
    memset(dx + (size_t)M * Kb, 0, (size_t)(Mp - M) * Kb * sizeof(float));
    memset(sx + (size_t)M * Kb * words, 0, (size_t)(Mp - M) * Kb * words * sizeof(int32_t));
    #pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        int8_t *bt = wbuf + scratch * (size_t)omp_get_thread_num();
#else
        int8_t *bt = wbuf;
#endif
        float *d = (float *)(bt + (size_t)units * 16 * width), *m = d + (size_t)Kb * 16;
        int32_t *sc = (int32_t *)(m + (size_t)Kb * 16), *mn = sc + (size_t)units * 16;
        int32_t cbuf[4][16][16] __attribute__((aligned(64)));
        memset(cbuf, 0, sizeof cbuf); /* rows past h are read (and dropped), never stored by the tiles */
        config_int8_tiles(h, width);
        #pragma omp for schedule(static)
        for (int s = 0; s < S; s++) {
            const int g = 2 * s, ncols = N - g * QCOLS < 2 * QCOLS ? N - g * QCOLS : 2 * QCOLS;
            if (q6 && g + 1 < G) amx_unpack_q6k(wp + g * gstride, gstride, 1, Kb, bt, d, sc);
            else if (q6) amx_unpack_q6k(wp + g * gstride, gstride, 0, Kb, bt, d, sc);
            else if (kq && g + 1 < G) amx_unpack_k(format, wp + g * gstride, gstride, 1, Kb, bt, d, m, sc, mn);
            else if (kq) amx_unpack_k(format, wp + g * gstride, gstride, 0, Kb, bt, d, m, sc, mn);
            else if (g + 1 < G) amx_unpack(format, wp + g * gstride, gstride, 1, Kb, bt, d, m);
            else amx_unpack(format, wp + g * gstride, gstride, 0, Kb, bt, d, m);
            for (int m0 = 0; m0 < M; m0 += h) {
                const int rows = M - m0 < h ? M - m0 : h;
                const int8_t *a = qx + (size_t)m0 * K;
                const float *dxt = dx + (size_t)m0 * Kb;
                const int32_t *sxt = sx + (size_t)m0 * Kb * words;
                uint16_t *yt = y + (size_t)m0 * ldy + g * QCOLS;
                if (q6) {
                    switch ((h + 3) / 4) {
                        case 1: amx_row_tile_q6k(4, a, dxt, K, bt, d, sc, cbuf, yt, ldy, rows, ncols); break;
                        case 2: amx_row_tile_q6k(8, a, dxt, K, bt, d, sc, cbuf, yt, ldy, rows, ncols); break;
                        case 3: amx_row_tile_q6k(12, a, dxt, K, bt, d, sc, cbuf, yt, ldy, rows, ncols); break;
                        default: amx_row_tile_q6k(16, a, dxt, K, bt, d, sc, cbuf, yt, ldy, rows, ncols); break;
                    }
                } else if (kq) {
                    switch ((h + 3) / 4) {
                        case 1: amx_row_tile_k(4, a, dxt, sxt, K, bt, d, m, sc, mn, cbuf, yt, ldy, rows, ncols); break;
                        case 2: amx_row_tile_k(8, a, dxt, sxt, K, bt, d, m, sc, mn, cbuf, yt, ldy, rows, ncols); break;
                        case 3: amx_row_tile_k(12, a, dxt, sxt, K, bt, d, m, sc, mn, cbuf, yt, ldy, rows, ncols); break;
                        default: amx_row_tile_k(16, a, dxt, sxt, K, bt, d, m, sc, mn, cbuf, yt, ldy, rows, ncols); break;
                    }
                } else switch ((h + 3) / 4) {
                    case 1: amx_row_tile(format, 4, a, dxt, sxt, K, bt, d, m, cbuf, yt, ldy, rows, ncols); break;
                    case 2: amx_row_tile(format, 8, a, dxt, sxt, K, bt, d, m, cbuf, yt, ldy, rows, ncols); break;
                    case 3: amx_row_tile(format, 12, a, dxt, sxt, K, bt, d, m, cbuf, yt, ldy, rows, ncols); break;
                    default: amx_row_tile(format, 16, a, dxt, sxt, K, bt, d, m, cbuf, yt, ldy, rows, ncols); break;
                }
            }
        }
        _tile_release();
    }
    free(qx);
    free(wbuf);
    return 0;
}

/* The path's entry points, one per format: amx_min_rows or more rows on tiles, else VNNI's kernel. A call's tiles
   cost a fixed time per block and column pair, whatever their rows (the tile products' latency, which few rows
   cannot hide), so the kernel alone is faster on VNNI below about 12 rows, and a whole SmolLM2 forward (its small
   matrices, each call's set-up) up to 24 rows; from 32 rows and in prefill the tiles win (docs/performance.md,
   "Block-quantized weights on AMX int8 tiles", has the measurements). The bits are the same either way. peagle_qgemm_amx_min_rows sets the threshold (at least 2; 0
   leaves it) and returns the one before: the tests run every row count on tiles, the benchmarks compare. */
static int amx_min_rows = 32;
int peagle_qgemm_amx_min_rows(int rows) {
    int before = amx_min_rows;
    if (rows > 0) amx_min_rows = rows < 2 ? 2 : rows;
    return before;
}
#define QGEMM_EXPORT_AMX(name, F)                                                                                \
    int peagle_qgemm_amx_##name(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy, int M,   \
                                int N, int K, int nthreads) {                                                    \
        if (M < amx_min_rows)                                                                    \
            return peagle_qgemm_vnni_##name(x, ldx, wp, y, ldy, M, N, K, nthreads);                              \
        return qgemm_amx(F, x, ldx, (const uint8_t *)wp, y, ldy, M, N, K, nthreads);                             \
    }
QGEMM_EXPORT_AMX(q4_0, Q4_0) QGEMM_EXPORT_AMX(q4_1, Q4_1) QGEMM_EXPORT_AMX(q8_0, Q8_0)
QGEMM_EXPORT_AMX(q5_0, Q5_0) QGEMM_EXPORT_AMX(q5_1, Q5_1)
QGEMM_EXPORT_AMX(q4_k, Q4_K) QGEMM_EXPORT_AMX(q5_k, Q5_K) QGEMM_EXPORT_AMX(q6_k, Q6_K)

#pragma GCC pop_options
#endif /* AMX int8 */
