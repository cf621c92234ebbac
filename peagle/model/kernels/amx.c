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

