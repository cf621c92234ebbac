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
        const int nd, const int NR, const int HN, int h0, const int *n, int nmin, const uint16_t *const *Vr, uint16_t *o0,
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
            __m512i a = _mm512_maskz_loadu_epi16(mask, Vr[2 * m] + 32 * c);
            __m512i b = _mm512_maskz_loadu_epi16(mask, Vr[2 * m + 1] + 32 * c);
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
                __m512i a = _mm512_maskz_loadu_epi16(mask, Vr[2 * m] + 32 * c);
                __m512i b = _mm512_maskz_loadu_epi16(mask, 2 * m + 1 < n[r] ? Vr[2 * m + 1] + 32 * c
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
        const uint16_t *const *Kr, const uint16_t *const *Vr, uint16_t *o0, long o_stride, int G, int g, float scale,
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
            for (int e = 0; e < 8; e++) kr[e] = e < nk ? Kr[j + e] : zero_key;
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
    attend_pv_dpbf16(nd, NR, HN, h0, n, nmin, Vr, o0, o_stride, G, g, scores, ld, pt, inv);
}

static void attend_pass_dpbf16(ATTEND_PARAMS) { ATTEND_DISPATCH(attend_block_dpbf16) }

#pragma GCC pop_options
#endif /* PEAGLE_NO_AVX512 */



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

