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
   the same bits; only the exact integer sums of each block (or K-quant sub-block: a "unit") are made differently,
   by `tdpbssd`: A (activation codes, int8) times B (4-input rows x 16 output columns, int8) into C (int32).
   The qpanels already hold the B rows: chunk t of two neighbouring groups is inputs 4t..4t+3 of 16 columns (low
   nibbles) and 16+4t..19+4t (high ones), as the VNNI path loads them. A column pair's units are unpacked into
   signed int8 B tiles in a small per-thread buffer (Q4_0's codes minus 8 and Q5_0's minus 16, so the sums need no
   -8 sx correction: the same exact integer isum), with their fp16 scales widened to fp32 (exact).

   Every unit's sums must leave the tile before its scale applies (the chain below is fixed by the other paths'
   bits), and a tile store costs the same whatever rows it holds, so C tiles are filled: a product spans J units
   (2 blocks of 32 = 64 inputs, the widest A row; Q6_K 2 or 4 sub-blocks of 16), its A tile stacking them as J h
   rows (row j h + r: row r's codes with all but unit j's bytes zeroed, made once per call by amx_expand_rows), so
   one product and one store give the J units' sums of a row tile of h <= 8 rows (J h <= 16). The row tiles have
   equal heights and run in chunks (their A tiles within L2); a thread runs a chunk's tiles one after the other on
   each of its column pairs, the first unpacking the pair's spans AMX_UNPACK_AHEAD spans before their products (so
   the unpacking, from memory, overlaps the tiles and the B tiles stay in L1), the others reusing them. Span sums go
   through tmm0..3 in turn, AMX_AHEAD spans ahead of the chain, which each row runs in unit order with its
   accumulators in registers:
     acc = fma((float)isum, d * dx, acc);   acc = fma(m, dx * sx, acc)   [Q4_1, Q5_1]
   Activations are quantized per row by quantize_rows_q8 (quantize_rows_q8k for the K-quants), as on the other
   paths. The K-quants: each row adds sc_j times sub-block j's sums (and Q4_K/Q5_K's sum_j m_j bsum32_j, four
   vpdpwssd) in exact int32 vectors before the super-block's fp32 steps, the VNNI path's chain.

   What a row costs is that chain (a conversion, a product and an fma per unit and 16 columns) and its share of the
   tile products and stores; the unpacking costs the same whatever the rows, so few rows run faster on VNNI: the
   entry points send fewer than amx_min_rows rows there (one row always). */

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

#define AMX_AHEAD 3 /* spans whose sums are being made while a span's are read: tmm0..3 in turn */
#define AMX_UNPACK_AHEAD 8 /* spans unpacked before their product (the stores must land before the tile loads) */
#define AMX_A_BYTES (1024 * 1024) /* A tiles a chunk of row tiles reads (qgemm_amx) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} int8_tilecfg;

/* tmm0..3 C (crows rows x 16 int32), tmm4/5 A (crows rows x a span's sw codes), tmm6/7 B (sw / 4 rows of 4 inputs
   x 16 columns): crows = J h, a row tile's h rows times the J units of a span (amx_expand_rows). */
static void config_int8_tiles(int crows, int sw) {
    int8_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 6 ? (uint8_t)crows : (uint8_t)(sw / 4);
        c.colsb[t] = t == 4 || t == 5 ? (uint16_t)sw : 64;
    }
    _tile_loadconfig(&c);
}

/* Groups g and g + 1 (only g when !two; the other's columns are then zero codes and scales) of w, blocks b0..b1-1,
   as B tiles: block b at out + 512 b, row i holding inputs 4i..4i+3 of the 16 columns as signed int8 (Q4_0 q - 8,
   Q5_0 q - 16, else q); the fp16 scales d (and m) as fp32 at d + 16 b (m + 16 b). */
static inline __attribute__((always_inline)) void amx_unpack(const int format, const uint8_t *w, size_t gstride,
                                                             const int two, int b0, int b1, int8_t *out, float *d,
                                                             float *m) {
    const qformat *f = &qformats[format];
    const int rb = f->record_bytes, five = f->high.size != 0;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i offset = _mm512_set1_epi8((char)(format == Q4_0 ? 8 : format == Q5_0 ? 16 : 0));
    for (int b = b0; b < b1; b++) {
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

/* One row's 16 fp32 sums (ncols of them kept, at most 16) as bf16 at y. */
static inline void store_row16(uint16_t *y, __m512 acc, int ncols) {
    store_bf16x8(y, _mm512_castps512_ps256(acc), ncols < QCOLS ? ncols : QCOLS);
    if (ncols > QCOLS)
        store_bf16x8(y + QCOLS, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)),
                     ncols < 2 * QCOLS ? ncols - QCOLS : QCOLS);
}

/* The K-quants with sub-blocks of 32 (Q4_K, Q5_K): super-block b's sub-block j of groups g and g + 1 as B tile
   u = 8 b + j at out + 512 u (codes 0..15 or 0..31, as int8), its 6-bit scale and minimum per column as int32 lanes
   at sc + 16 u, the minimums as int16 pairs in the order of the activations' bsum32 words (kq_sums: word 8 + i
   holds sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) for i = 0..3) at mn + 16 (4 b + i), so a row's msum is four
   vpdpwssd, and d, dmin as fp32 at d + 16 b, dmin + 16 b. */
static inline __attribute__((always_inline)) void amx_unpack_k(const int format, const uint8_t *w, size_t gstride,
                                                               const int two, int b0, int b1, int8_t *out,
                                                               float *d, float *dmin, int32_t *sc, int32_t *mn) {
    const qformat *f = &qformats[format];
    const int rb = f->record_bytes;
    const __m512i low4 = _mm512_set1_epi8(0x0f), m6 = _mm512_set1_epi8(0x3f), top2 = _mm512_set1_epi8(0x30);
    const __m512i one = _mm512_set1_epi8(1), byte = _mm512_set1_epi32(0xff), pairs = _mm512_set1_epi32(0x00ff00ff);
    for (int b = b0; b < b1; b++) {
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
            for (int i = 0; i < 8; i++) {
                __m512i raw = load_groups(rec + 32 * (8 * (j / 2) + i), gstride, two);
                __m512i q = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(raw, 4) : raw, low4);
                if (format == Q5_K)
                    q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(
                        _mm512_srli_epi16(load_groups(rec + f->high.at + 32 * i, gstride, two), j), one), 4));
                _mm512_storeu_si512((void *)(out + (size_t)512 * u + 64 * i), q);
            }
        }
        for (int i = 0; i < 4; i++) /* bytes 0 and 2 (i even) or 1 and 3 of mnl[i / 2]'s lanes */
            _mm512_storeu_si512((void *)(mn + 16 * (4 * b + i)),
                                _mm512_and_si512(_mm512_srli_epi32(mnl[i / 2], 8 * (i % 2)), pairs));
        _mm512_storeu_ps(d + 16 * b, load_scales(rec + f->d.at, gstride, two));
        _mm512_storeu_ps(dmin + 16 * b, load_scales(rec + f->m.at, gstride, two));
    }
}

/* Q6_K: super-block b's sub-block k (16 inputs) of groups g and g + 1 as B tile u = 16 b + k at out + 256 u (4
   rows; codes q - 32 as int8, so the sums need no -32 bsum16 correction: the same exact isum), its int8 scale per
   column as int32 lanes at sc + 16 u, and d as fp32 at d + 16 b. */
static inline __attribute__((always_inline)) void amx_unpack_q6k(const uint8_t *w, size_t gstride, const int two,
                                                                 int b0, int b1, int8_t *out, float *d, int32_t *sc) {
    const qformat *f = &qformats[Q6_K];
    const int rb = f->record_bytes;
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    const __m512i byte = _mm512_set1_epi32(0xff), sign = _mm512_set1_epi32(0x80);
    for (int b = b0; b < b1; b++) {
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

/* The rows' codes as A tiles, one per row tile and span of J units of w inputs (sw = J w bytes a row): tile t's
   span s at out + (t S + s) sw J h, its row j h + r holding row t h + r's codes of the span with all but unit j's
   w bytes zeroed (and whole rows past M, and a last span's units past K). One tile product then gives J units'
   sums of h rows (C row j h + r: unit j of row r): a C tile of J h rows where a unit's own codes would fill h. */
static void amx_expand_rows(const int8_t *qx, int M, int K, int J, int w, int h, int tiles, int8_t *out) {
    const int sw = J * w, S = (K + sw - 1) / sw;
    memset(out, 0, (size_t)tiles * S * sw * J * h);
    for (int t = 0; t < tiles; t++)
        for (int r = 0; r < h && t * h + r < M; r++)
            for (int u = 0; u * w < K; u++) /* unit u: span u / J, j = u % J */
                memcpy(out + ((size_t)t * S + u / J) * sw * J * h + (size_t)sw * ((u % J) * h + r) + (u % J) * w,
                       qx + (size_t)(t * h + r) * K + (size_t)u * w, (size_t)w);
}

/* What a row tile's chain reads: its A tiles, its rows' dx (row r, block b at dx[r Kb + b]) and sums (sx: the
   32-input formats' one per block, the K-quants' kq_sums words), the column pair's unpacked units (B tiles, d, m or
   dmin, the K-quants' sub-block scales and minimums: written here when w is set), the C buffers, and where its rows
   go. */
typedef struct {
    const int8_t *a;
    int8_t *bt;
    const float *dx;
    float *d, *m;
    const int32_t *sx;
    int32_t *sc, *mn;
    const uint8_t *w;          /* the column pair's first group, unpacked span by span; NULL: already unpacked */
    size_t gstride;
    int two;                   /* whether the pair has its second group */
    int32_t (*cbuf)[16][16];
    uint16_t *y;
    size_t ldy;
    int K, rows, ncols;
} amx_rows_args;

/* Unpack the chunk of spans starting at span c: a super-block's spans (per_b / J of them) for the K-quants, a block
   pair (one span) else. */
static inline __attribute__((always_inline)) void amx_unpack_chunk(const int format, const int J, const amx_rows_args *p,
                                                                   int c) {
    const int per_b = format == Q6_K ? 16 : 8, Kb = p->K / block_inputs(format);
    const int b0 = is_kquant(format) ? c * J / per_b : 2 * c;
    const int b1 = is_kquant(format) ? b0 + 1 : (b0 + 2 < Kb ? b0 + 2 : Kb), rb = qformats[format].record_bytes;
    /* the records a few chunks on, from memory (the VNNI path's distance: 8 blocks of 32, or 2 super-blocks) */
    const uint8_t *ahead = p->w + (size_t)(is_kquant(format) ? b0 + 2 : b0 + 8) * rb;
    for (int l = 0; l < (b1 - b0) * rb; l += 64) {
        _mm_prefetch((const char *)(ahead + l), _MM_HINT_T0);
        if (p->two) _mm_prefetch((const char *)(ahead + p->gstride + l), _MM_HINT_T0);
    }
    if (format == Q6_K && p->two) amx_unpack_q6k(p->w, p->gstride, 1, b0, b1, p->bt, p->d, p->sc);
    else if (format == Q6_K) amx_unpack_q6k(p->w, p->gstride, 0, b0, b1, p->bt, p->d, p->sc);
    else if (is_kquant(format) && p->two)
        amx_unpack_k(format, p->w, p->gstride, 1, b0, b1, p->bt, p->d, p->m, p->sc, p->mn);
    else if (is_kquant(format)) amx_unpack_k(format, p->w, p->gstride, 0, b0, b1, p->bt, p->d, p->m, p->sc, p->mn);
    else if (p->two) amx_unpack(format, p->w, p->gstride, 1, b0, b1, p->bt, p->d, p->m);
    else amx_unpack(format, p->w, p->gstride, 0, b0, b1, p->bt, p->d, p->m);
}

/* Span s's sums into tile C, stored to cbuf[C]: A = the row tile's J h rows of span s, B = the span's sw inputs
   (units J s .. J s + J - 1, unpacked 16 sw bytes a span) x 16 columns. */
#define AMX_SPAN_SUM(C, TA, TB, s)                                                                               \
    do {                                                                                                         \
        _tile_zero(C);                                                                                           \
        _tile_loadd(TA, p->a + (size_t)sw * J * R * (s), sw);                                                    \
        _tile_loadd(TB, p->bt + (size_t)16 * sw * (s), 64);                                                      \
        _tile_dpbssd(C, TA, TB);                                                                                 \
        _tile_stored(C, p->cbuf[C], 64);                                                                         \
    } while (0)
/* Span s's sums into tile s % 4 and cbuf[s % 4] (A and B tiles alternating with s's parity). */
#define AMX_SUMS(s)                                                                                              \
    do {                                                                                                         \
        switch ((s) % 4) {                                                                                       \
            case 0: AMX_SPAN_SUM(0, 4, 6, s); break;                                                             \
            case 1: AMX_SPAN_SUM(1, 5, 7, s); break;                                                             \
            case 2: AMX_SPAN_SUM(2, 4, 6, s); break;                                                             \
            default: AMX_SPAN_SUM(3, 5, 7, s); break;                                                            \
        }                                                                                                        \
    } while (0)

/* One row tile of R rows (p->rows of them stored) x the 16 columns whose B tiles and scales were unpacked: span
   s's sums are read while those of the AMX_AHEAD spans after it are made, and each row runs its chain in unit order
   in fp32 registers (R <= 8: the accumulators and sums stay in registers), as on the VNNI path:
     32-input formats (unit = block b):  acc = fma((float)isum, d * dx, acc);  acc = fma(m, dx * sx, acc) [Q4_1, Q5_1]
     Q4_K / Q5_K (unit = sub-block j of super-block b):  isum = sum_j sc_j (q.qx)_j, msum = sum_j m_j bsum32_j in
       exact int32, then acc = fma((float)isum, d * dx, acc);  acc = fnmadd((float)msum, dmin * dx, acc)
     Q6_K (unit = sub-block k of 16):  isum = sum_k sc_k ((q - 32).qx)_k, then acc = fma((float)isum, d * dx, acc). */
static inline __attribute__((always_inline)) void amx_rows(const int format, const int R, const amx_rows_args *p) {
    const int kq = is_kquant(format), per_b = format == Q6_K ? 16 : kq ? 8 : 1;
    const int J = format == Q6_K && R <= 4 ? 4 : 2, sw = J * (format == Q6_K ? 16 : 32); /* as qgemm_amx */
    const int Kb = p->K / block_inputs(format), units = per_b * Kb, S = (units + J - 1) / J;
    const int has_m = qformats[format].m.size != 0;
    __m512 acc[8];
    __m512i isum[8];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), isum[r] = _mm512_setzero_si512();
    const int chunk = kq ? per_b / J : 1; /* spans a chunk unpacks */
    for (int s = 0; s < AMX_UNPACK_AHEAD && s < S; s += chunk)
        if (p->w) amx_unpack_chunk(format, J, p, s);
    for (int s = 0; s < AMX_AHEAD && s < S; s++) AMX_SUMS(s);
    for (int s = 0; s < S; s++) {
        const int next = s + AMX_UNPACK_AHEAD;
        if (next < S && p->w && next % chunk == 0) amx_unpack_chunk(format, J, p, next);
        if (s + AMX_AHEAD < S) AMX_SUMS(s + AMX_AHEAD);
        _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) {
            const int u = J * s + j, b = u / per_b, k = u % per_b;
            const int32_t (*c)[16] = (const int32_t (*)[16])p->cbuf[s % 4][j * R];
            if (!kq) {
                if (u >= units) break; /* an odd block count's last span */
                const __m512 db = _mm512_loadu_ps(p->d + 16 * b), mb = has_m ? _mm512_loadu_ps(p->m + 16 * b) : db;
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                    const float dxr = p->dx[(size_t)r * Kb + b];
                    __m512 is = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)c[r]));
                    acc[r] = _mm512_fmadd_ps(is, _mm512_mul_ps(db, _mm512_set1_ps(dxr)), acc[r]);
                    if (has_m)
                        acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(dxr * (float)p->sx[(size_t)r * Kb + b]), acc[r]);
                }
                continue;
            }
            const __m512i scu = _mm512_loadu_si512((const void *)(p->sc + 16 * u));
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                __m512i prod = _mm512_mullo_epi32(_mm512_loadu_si512((const void *)c[r]), scu);
                isum[r] = k ? _mm512_add_epi32(isum[r], prod) : prod;
            }
            if (k < per_b - 1) continue;
            const __m512 db = _mm512_loadu_ps(p->d + 16 * b);
            if (format == Q6_K) {
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                                             _mm512_mul_ps(db, _mm512_set1_ps(p->dx[(size_t)r * Kb + b])), acc[r]);
                continue;
            }
            const __m512 dminb = _mm512_loadu_ps(p->m + 16 * b);
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                const int32_t *pb = p->sx + ((size_t)r * Kb + b) * QK_PAIRS;
                __m512i msum = _mm512_setzero_si512();
                for (int i = 0; i < 4; i++)
                    msum = _mm512_dpwssd_epi32(msum, _mm512_loadu_si512((const void *)(p->mn + 16 * (4 * b + i))),
                                               _mm512_set1_epi32(pb[8 + i]));
                __m512 dxr = _mm512_set1_ps(p->dx[(size_t)r * Kb + b]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(db, dxr), acc[r]);
                acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dminb, dxr), acc[r]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) /* R, not rows: constant indices keep acc in registers */
        if (r < p->rows) store_row16(p->y + r * p->ldy, acc[r], p->ncols);
}
#undef AMX_SUMS
#undef AMX_SPAN_SUM

/* amx_rows per format and row count (a row tile's height, at most 8), one function each. */
typedef void (*amx_rows_fn)(const amx_rows_args *);
#define AMX_ROWS_FN(F, R) static void amx_rows_##F##_##R(const amx_rows_args *p) { amx_rows(F, R, p); }
#define AMX_ROWS_4(F) AMX_ROWS_FN(F, 1) AMX_ROWS_FN(F, 2) AMX_ROWS_FN(F, 3) AMX_ROWS_FN(F, 4)
#define AMX_ROWS_8(F) AMX_ROWS_4(F) AMX_ROWS_FN(F, 5) AMX_ROWS_FN(F, 6) AMX_ROWS_FN(F, 7) AMX_ROWS_FN(F, 8)
#define AMX_TABLE_4(F) 0, amx_rows_##F##_1, amx_rows_##F##_2, amx_rows_##F##_3, amx_rows_##F##_4
#define AMX_TABLE_8(F) AMX_TABLE_4(F), amx_rows_##F##_5, amx_rows_##F##_6, amx_rows_##F##_7, amx_rows_##F##_8
AMX_ROWS_8(Q4_0) AMX_ROWS_8(Q4_1) AMX_ROWS_8(Q8_0) AMX_ROWS_8(Q5_0) AMX_ROWS_8(Q5_1) AMX_ROWS_8(Q4_K)
AMX_ROWS_8(Q5_K) AMX_ROWS_8(Q6_K)
static const amx_rows_fn amx_rows_table[QFORMATS][9] = {
    [Q4_0] = {AMX_TABLE_8(Q4_0)}, [Q4_1] = {AMX_TABLE_8(Q4_1)}, [Q8_0] = {AMX_TABLE_8(Q8_0)},
    [Q5_0] = {AMX_TABLE_8(Q5_0)}, [Q5_1] = {AMX_TABLE_8(Q5_1)}, [Q4_K] = {AMX_TABLE_8(Q4_K)},
    [Q5_K] = {AMX_TABLE_8(Q5_K)}, [Q6_K] = {AMX_TABLE_8(Q6_K)},
};

/* y[M, N] = x[M, K] @ W^T on AMX (M >= 1; the entry points send one row to VNNI). Rows in ceil(M / 8) row tiles of
   equal height h <= 8, run in chunks; threads split the column pairs, each unpacking its
   pair once per chunk and running the chunk's row tiles on it. Returns 0, or -1 when memory for the quantized activations or the tiles could not
   be allocated (y untouched). */
static inline __attribute__((always_inline)) int qgemm_amx(const int format, const uint16_t *x, long ldx,
                                                           const uint8_t *wp, uint16_t *y, long ldy, int M, int N,
                                                           int K, int nthreads) {
    const int kq = is_kquant(format), Kb = K / block_inputs(format), G = (N + QCOLS - 1) / QCOLS, P = (G + 1) / 2;
    const int words = kq ? QK_PAIRS : 1, q6 = format == Q6_K; /* activation sums per block; Q6_K: sub-blocks of 16 */
    const int tiles = (M + 7) / 8, h = (M + tiles - 1) / tiles, Mp = tiles * h, units = q6 ? 16 * Kb : kq ? 8 * Kb : Kb;
    /* J units of w inputs a span: 2, or Q6_K's 4 sub-blocks of 16 for tiles of up to 4 rows (a product's time grows
       with its width, so taller tiles stack fewer units: J h <= 16 rows of C either way) */
    const int J = q6 && h <= 4 ? 4 : 2, w = q6 ? 16 : 32, sw = J * w, S = (K + sw - 1) / sw;
    const size_t gstride = (size_t)Kb * qformats[format].record_bytes, a_tile = (size_t)S * sw * J * h;
    /* row tiles a chunk: their A tiles (read again for every column pair) within AMX_A_BYTES, so they stay in L2;
       each chunk unpacks the pairs again */
    const int chunk = a_tile < AMX_A_BYTES ? (int)(AMX_A_BYTES / a_tile) : 1;
    /* per thread: B tiles (whole spans), d, m (dmin), and the K-quants' sub-block scales and minimums */
    const size_t scratch = (size_t)S * 16 * sw + (size_t)Kb * 2 * 16 * sizeof(float) +
                           (kq ? (size_t)units * 2 * 16 * sizeof(int32_t) : 0);
    if (nthreads < 1) nthreads = 1;
    /* codes of M rows, dx and sx of Mp rows (zero past M), then the A tiles */
    const size_t qbytes = ((size_t)M * K + (size_t)Mp * Kb * (sizeof(float) + words * sizeof(int32_t)) + 63) / 64 * 64;
    int8_t *qx = aligned_alloc(64, qbytes + a_tile * tiles);
    int8_t *wbuf = aligned_alloc(64, scratch * (size_t)nthreads);
    if (!qx || !wbuf) {
        free(qx);
        free(wbuf);
        return -1;
    }
    float *dx = (float *)(qx + (size_t)M * K);
    int32_t *sx = (int32_t *)(dx + (size_t)Mp * Kb);
    int8_t *at = qx + qbytes;
    if (kq) quantize_rows_q8k(x, ldx, M, K, 1, qx, dx, sx);
    else quantize_rows_q8(x, ldx, M, K, 1, qx, dx, sx);
    memset(dx + (size_t)M * Kb, 0, (size_t)(Mp - M) * Kb * sizeof(float));
    memset(sx + (size_t)M * Kb * words, 0, (size_t)(Mp - M) * Kb * words * sizeof(int32_t));
    amx_expand_rows(qx, M, K, J, w, h, tiles, at);
    const amx_rows_fn rows_fn = amx_rows_table[format][h];
    #pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        int8_t *bt = wbuf + scratch * (size_t)omp_get_thread_num();
#else
        int8_t *bt = wbuf;
#endif
        float *d = (float *)(bt + (size_t)S * 16 * sw), *m = d + (size_t)Kb * 16;
        int32_t *sc = (int32_t *)(m + (size_t)Kb * 16), *mn = sc + (size_t)units * 16;
        int32_t cbuf[4][16][16] __attribute__((aligned(64)));
        memset(bt + (size_t)units * 16 * w, 0, (size_t)(S * J - units) * 16 * w); /* an odd Kb's last span */
        config_int8_tiles(J * h, sw);
        for (int t0 = 0; t0 < tiles; t0 += chunk) { /* a chunk of row tiles on every column pair, then the next */
            #pragma omp for schedule(static)
            for (int pair = 0; pair < P; pair++) {
                const int g = 2 * pair, two = g + 1 < G;
                const int ncols = N - g * QCOLS < 2 * QCOLS ? N - g * QCOLS : 2 * QCOLS;
                for (int t = t0; t < t0 + chunk && t < tiles; t++) {
                    const amx_rows_args args = {at + a_tile * t, bt, dx + (size_t)t * h * Kb, d, m,
                                                sx + (size_t)t * h * Kb * words, sc, mn,
                                                t > t0 ? NULL : wp + g * gstride, gstride, two, cbuf,
                                                y + (size_t)t * h * ldy + g * QCOLS, (size_t)ldy, K,
                                                M - t * h < h ? M - t * h : h, ncols};
                    rows_fn(&args);
                }
            }
        }
        _tile_release();
    }
    free(qx);
    free(wbuf);
    return 0;
}

/* The path's entry points, one per format: amx_min_rows or more rows on tiles, else VNNI's kernel. The unpacking
   and each span's tile product and store cost the same whatever the rows, so a product of 4 rows runs faster on
   VNNI; from 8 rows the tiles win, in the kernel alone and in a whole SmolLM2 forward (docs/performance.md,
   "Block-quantized weights on AMX int8 tiles", has the measurements). The bits are the same either way.
   peagle_qgemm_amx_min_rows sets the threshold (at least 2; 0 leaves it) and returns the one before: the tests run
   every row count on tiles, the benchmarks compare. */
static int amx_min_rows = 8;
int peagle_qgemm_amx_min_rows(int rows) {
    int before = amx_min_rows;
    if (rows > 0) amx_min_rows = rows < 2 ? 2 : rows;
    return before;
}
#define QGEMM_EXPORT_AMX(name, F)                                                                                \
    int peagle_qgemm_amx_##name(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy, int M,   \
                                int N, int K, int nthreads) {                                                    \
        if (M < amx_min_rows)                                                                                    \
            return peagle_qgemm_vnni_##name(x, ldx, wp, y, ldy, M, N, K, nthreads);                              \
        return qgemm_amx(F, x, ldx, (const uint8_t *)wp, y, ldy, M, N, K, nthreads);                             \
    }
QGEMM_EXPORT_AMX(q4_0, Q4_0) QGEMM_EXPORT_AMX(q4_1, Q4_1) QGEMM_EXPORT_AMX(q8_0, Q8_0)
QGEMM_EXPORT_AMX(q5_0, Q5_0) QGEMM_EXPORT_AMX(q5_1, Q5_1)
QGEMM_EXPORT_AMX(q4_k, Q4_K) QGEMM_EXPORT_AMX(q5_k, Q5_K) QGEMM_EXPORT_AMX(q6_k, Q6_K)

#pragma GCC pop_options
#endif /* AMX int8 */
