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
        const int nd, const int NR, const int HN, int h0, const int *n, int nmin, const uint16_t *const *Vr, uint16_t *o0,
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
            __m256 vj = bf16x8_to_f32(Vr[j] + 8 * c);
            const float *p = pt + (size_t)j * W;
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++)
                #pragma GCC unroll 4
                for (int i = 0; i < HN; i++) acc[r][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * HN + i), vj, acc[r][i]);
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            for (int j = nmin; j < n[r]; j++) {
                __m256 vj = bf16x8_to_f32(Vr[j] + 8 * c);
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
   h0..h0+HN-1 of its G over the row's keys 0..n_r-1, key j's D = 8 nd values at Kr[j] (its value's at Vr[j]). Rows and heads are blocked only so
   that each key and value row is loaded and widened once for all of them (a prefill has hundreds of rows per slot);
   every (row, head) does the same arithmetic in every block shape:
     score_j = hsum8(q[0] k_j[0] + q[1] k_j[1] + ... ) * scale, one FMA chain over the D / 8 vectors, hsum8's tree;
     out = (sum_j e^(score_j - max) v_j, in key order) / (sum of the e^ by a fixed tree).
   nd, NR and HN are compile-time constants at each call site, so vectors and accumulators stay in registers. kf:
   scratch for eight widened key rows; pt: for the weights key-major. */
static inline __attribute__((always_inline)) void attend_block(
        const int nd, const int NR, const int HN, int h0, const uint16_t *q0, long q_stride, const int64_t *pos,
        const uint16_t *const *Kr, const uint16_t *const *Vr, uint16_t *o0, long o_stride, int G, int g, float scale,
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
                    _mm256_storeu_ps(kf + e * D + 8 * c, bf16x8_to_f32(Kr[j + e] + 8 * c));
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
    attend_pv_fma(nd, NR, HN, h0, n, nmin, Vr, o0, o_stride, G, g, scores, ld, pt, inv);
}

/* One pass of a path's attend block: nr (<= ROWS_PER_PASS) query rows x hn (<= HEADS_PER_PASS) query heads of key/value
   head g, with nd, nr and hn turned into compile-time constants (D = 64 and 128 get their own code). */
#define ATTEND_PARAMS                                                                                                \
    int nd, int nr, int hn, int h0, const uint16_t *q0, long q_stride, const int64_t *pos,                         \
        const uint16_t *const *Kr, const uint16_t *const *Vr, uint16_t *o0, long o_stride, int G, int g, float scale, float *scores, int ld,          \
        float *kf, float *pt
#define ATTEND_ARGS h0, q0, q_stride, pos, Kr, Vr, o0, o_stride, G, g, scale, scores, ld, kf, pt
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

/* Where key (or value) j of slot s, kv head g lies: row (j + key_offset) of the slot's blocks. */
static inline const uint16_t *kv_row(const peagle_kv *kv, const uint16_t *pool, const int32_t *table, int g, int nkv,
                                     int D, int j) {
    int p = j + kv->key_offset, bs = kv->block_size;
    return pool + (((size_t)table[p / bs] * nkv + g) * bs + (size_t)(p % bs)) * D;
}

/* Write this call's keys and values into each row's cache slot at its positions, then causal attention over the
   slot, each (query row, head) on its own, so the result never depends on which other rows share the call:
   out[b, t, h] = softmax_{j <= pos}(q[b, t, h] . K[slot_b, g, j] * scale) V[slot_b, g, j], g = h / (nh / nkv).
   q, k, v rows: base + (b*T + t) * row_stride, heads contiguous (D each). The cache is paged (peagle_kv): a pass
   first lists where its keys' and values' rows lie, and the arithmetic then reads them through that list, so a
   key's bits never depend on which block holds it. out: [B, T, nh, D] contiguous. D: a multiple of 8, at most 256.
   dpbf16: the scores by `vdpbf16ps` (the AVX-512 BF16 section) instead of fp32 FMAs; a process uses one or the
   other for every call. Returns 0; -2 (nothing written) when a slot, a position or a block it needs lies outside
   the cache; -3 (nothing written) when dpbf16 is asked of a library built without AVX-512 BF16; -1 when a thread's
   scratch could not be allocated (out is incomplete). */
int peagle_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k, const uint16_t *v, long kv_stride,
                          const peagle_kv *kv, const int64_t *slots, const int64_t *positions, uint16_t *out,
                          int B, int T, int nh, int nkv, int D, float scale, int nthreads, int dpbf16) {
    attend_pass_fn attend_pass = attend_pass_avx2;
    if (dpbf16) {
#ifndef PEAGLE_NO_AVX512
        attend_pass = attend_pass_dpbf16;
#else
        return -3;
#endif
    }
    int bs = kv->block_size, max_len = kv->max_blocks * bs;
    for (int b = 0; b < B; b++) { /* every block a row reads or writes is one of the pool's */
        if (slots[b] < 0 || slots[b] >= kv->num_slots) return -2;
        const int32_t *table = kv->tables + (size_t)slots[b] * kv->max_blocks;
        int64_t last = -1;
        for (int t = 0; t < T; t++) {
            int64_t p = positions[(size_t)b * T + t];
            if (p < 0 || p + kv->key_offset >= max_len) return -2;
            last = p > last ? p : last;
        }
        for (int i = kv->key_offset / bs; i <= (last + kv->key_offset) / bs; i++)
            if (table[i] < 0 || table[i] >= kv->num_blocks) return -2;
        for (int t = 0; kv->keys && t < T; t++) { /* a tree's rows read the positions they list */
            const int32_t *r = kv->keys + ((size_t)b * T + t) * kv->keys_stride;
            if (r[0] < 0 || r[1] < r[0] || r[2] < 0 || r[2] > kv->keys_stride - 3) return -2;
            for (int j = 0; j < r[1] - r[0] + r[2]; j++) {
                int64_t p = (j < r[1] - r[0] ? r[0] + j : r[3 + j - (r[1] - r[0])]) + kv->key_offset;
                if (p < 0 || p >= max_len || table[p / bs] < 0 || table[p / bs] >= kv->num_blocks) return -2;
            }
        }
    }
    for (int bt = 0; bt < B * T; bt++) { /* every write lands before any row reads: a window sees its own keys */
        const int32_t *table = kv->tables + (size_t)slots[bt / T] * kv->max_blocks;
        for (int g = 0; g < nkv; g++) {
            memcpy((uint16_t *)kv_row(kv, kv->k, table, g, nkv, D, (int)positions[bt]),
                   k + (size_t)bt * kv_stride + (size_t)g * D, (size_t)D * 2);
            memcpy((uint16_t *)kv_row(kv, kv->v, table, g, nkv, D, (int)positions[bt]),
                   v + (size_t)bt * kv_stride + (size_t)g * D, (size_t)D * 2);
        }
    }
    int G = nh / nkv, nd = D / 8, failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        /* a tree's rows each read their own keys: one row per pass */
        int ld = max_len + 8, per_pass = kv->keys ? 1 : ROWS_PER_PASS, TB = (T + per_pass - 1) / per_pass;
        /* per thread: the score rows of a pass, the same weights key-major, eight widened key rows (D <= 256), and
           where each key and value row lies */
        size_t rows_ld = (size_t)ROWS_PER_PASS * HEADS_PER_PASS * ld;
        float *scores = malloc((2 * rows_ld + 8 * 256) * sizeof(float));
        const uint16_t **Kr = malloc(2 * (size_t)ld * sizeof(*Kr)), **Vr = Kr ? Kr + ld : NULL;
        float *pt = scores ? scores + rows_ld : NULL, *kf = pt ? pt + rows_ld : NULL;
        if (!scores || !Kr) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int btb = 0; btb < B * TB; btb++)
            for (int g = 0; g < nkv; g++) {
                if (!scores || !Kr) continue;
                int b = btb / TB, t0 = btb % TB * per_pass, nr = T - t0 < per_pass ? T - t0 : per_pass;
                size_t bt = (size_t)b * T + t0;
                const int32_t *table = kv->tables + (size_t)slots[b] * kv->max_blocks;
                const int64_t *pos = positions + bt;
                int64_t last_key;
                if (kv->keys) { /* the row's listed keys, then the arithmetic of a row at position (their count - 1) */
                    const int32_t *r = kv->keys + bt * kv->keys_stride;
                    int span = r[1] - r[0];
                    for (int j = 0; j < span + r[2]; j++) {
                        int p = j < span ? r[0] + j : r[3 + j - span];
                        Kr[j] = kv_row(kv, kv->k, table, g, nkv, D, p);
                        Vr[j] = kv_row(kv, kv->v, table, g, nkv, D, p);
                    }
                    last_key = span + r[2] - 1;
                    pos = &last_key;
                } else {
                    int nkeys = 0;
                    for (int r = 0; r < nr; r++)
                        nkeys = positions[bt + r] + 1 > nkeys ? (int)positions[bt + r] + 1 : nkeys;
                    for (int j = 0; j < nkeys; j++) {
                        Kr[j] = kv_row(kv, kv->k, table, g, nkv, D, j);
                        Vr[j] = kv_row(kv, kv->v, table, g, nkv, D, j);
                    }
                }
                const uint16_t *q0 = q + bt * q_stride;
                uint16_t *o0 = out + bt * nh * D;
                long os = (long)nh * D;
                for (int h0 = 0; h0 < G; h0 += HEADS_PER_PASS) {
                    int hn = G - h0 < HEADS_PER_PASS ? G - h0 : HEADS_PER_PASS;
                    attend_pass(nd, nr, hn, h0, q0, q_stride, pos, Kr, Vr, o0, os, G, g, scale, scores, ld, kf,
                                pt);
                }
            }
        free(scores);
        free(Kr);
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


#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")


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
                            int B, int T, const uint16_t *cos_, const uint16_t *sin_, const peagle_kv *kv,
                            const int64_t *slots, const int64_t *positions, int nthreads) {
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
    if ((rc = peagle_attention_bf16(qkv, W, qkv + (size_t)nh * D, qkv + (size_t)(nh + nkv) * D, W, kv, slots,
                                    positions, att, B, T, nh, nkv, D, w->scale, nthreads, w->attention_dpbf16)))
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
                         const uint16_t *sin_, const peagle_kv *kv, const int64_t *slots,
                         const int64_t *positions, int nthreads) {
    return peagle_layer_from_input(w, NULL, w->H, x, y, B, T, cos_, sin_, kv, slots, positions, nthreads);
}

#pragma GCC pop_options
