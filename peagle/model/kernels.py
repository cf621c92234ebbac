"""Native CPU kernels for decoding: a batch-invariant AMX matrix multiply over pre-packed bf16 weights, a
batch-invariant attention over the per-row KV cache, and bf16 RMSNorm / rotary embedding in one call each.

Why: decoding multiplies a handful of activation rows by every weight matrix, so it is memory-bound, and PyTorch's
CPU path (oneDNN via F.linear) streams plain bf16 weights slowly for few rows: it re-lays the weights out on every
call. Packing each weight once into AMX tile layout and streaming it through `tdpbf16ps` reads it about twice as
fast for 1-16 rows (docs/performance.md).

Batch invariance: every output element of the matrix multiply accumulates its K dimension in the same order
(32-wide blocks in sequence) whatever the number of rows, and attention computes every query row on its own, so a
token's logits do not depend on which rows share the forward. That keeps speculative decoding token-for-token equal
to plain decoding: a verify step (K+1 rows per request) computes each row exactly as a one-row decode step would.
(oneDNN's result for a row changes with the number of rows computed with it, e.g. between a few rows and a
prefill-sized batch, and CPU flash attention rounds one query row differently from several.) The packed path is
used for every row count, prefill included, so it never mixes with F.linear's rounding inside one model.

The library is compiled once per machine with the system C compiler into $PEAGLE_HOME/kernels (about a second)
and loaded with ctypes. It needs AVX-512 BF16 (attention, RMSNorm, RoPE) and AMX for the matrix multiply (Intel
Sapphire Rapids and later). Where these are missing, no compiler is found, the build fails, or
PEAGLE_CPU_KERNELS=0, the functions here return None / False and callers use PyTorch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline uint16_t f2bf(float f) {  /* round to nearest even, NaN stays NaN: c10::BFloat16's rounding */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* 16 floats to 16 bf16, rounding exactly like f2bf. */
static inline __m256i f2bf16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* RMSNorm of `rows` rows of width H, rounding like the reference implementations in bf16:
   y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), statistics in fp32. */
void peagle_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int H, float eps) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * H; uint16_t *yr = y + (size_t)r * H;
        __m512 acc = _mm512_setzero_ps();
        int k = 0;
        for (; k + 16 <= H; k += 16) {
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xr + k))), 16));
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float ss = _mm512_reduce_add_ps(acc);
        for (; k < H; k++) { float v = bf2f(xr[k]); ss += v * v; }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int i = 0; i < H; i++) yr[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(xr[i]) * inv)));
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

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* e^x for x <= 0 (softmax arguments), ~1 ulp: 2^n * p(r), r = x - n ln2 */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}


#define SHUF4(a, b, i) _mm512_shuffle_f32x4(a, b, i)
#define PAIR1(a, b) _mm512_add_ps(SHUF4(a, b, 0x44), SHUF4(a, b, 0xEE))
#define PAIR2(a, b) _mm512_add_ps(SHUF4(a, b, 0x88), SHUF4(a, b, 0xDD))
#define PAIR3(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE))
#define PAIR4(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD))
/* The 16 horizontal sums of v0..v15, in order, each by the same fixed tree. */
static inline __attribute__((always_inline)) __m512 reduce16(
        __m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4, __m512 v5, __m512 v6, __m512 v7,
        __m512 v8, __m512 v9, __m512 v10, __m512 v11, __m512 v12, __m512 v13, __m512 v14, __m512 v15) {
    __m512 w0 = PAIR1(v0, v1), w1 = PAIR1(v2, v3), w2 = PAIR1(v4, v5), w3 = PAIR1(v6, v7);
    __m512 w4 = PAIR1(v8, v9), w5 = PAIR1(v10, v11), w6 = PAIR1(v12, v13), w7 = PAIR1(v14, v15);
    __m512 x0 = PAIR2(w0, w1), x1 = PAIR2(w2, w3), x2 = PAIR2(w4, w5), x3 = PAIR2(w6, w7);
    __m512 y0 = PAIR3(x0, x1), y1 = PAIR3(x2, x3);
    __m512 z = PAIR4(y0, y1);
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, z);
}

/* Scores of one query (bf16, D = 32 * nd2) against keys j0..j0+15 of K (rows of D), via bf16 dot products:
   always the same instruction sequence per (query, key), so a score never depends on its neighbours. */
static inline __m512 scores16(const uint16_t *qv, const uint16_t *K, int j0, int nvalid, int D) {
    __m512 a[16];
    for (int jj = 0; jj < 16; jj++) {
        a[jj] = _mm512_setzero_ps();
        if (jj < nvalid)
            for (int c = 0; c < D; c += 32) {
                __mmask32 mk = D - c >= 32 ? 0xffffffffu : ((1u << (D - c)) - 1u);
                a[jj] = _mm512_dpbf16_ps(a[jj], (__m512bh)_mm512_maskz_loadu_epi16(mk, K + (size_t)(j0 + jj) * D + c),
                                         (__m512bh)_mm512_maskz_loadu_epi16(mk, qv + c));
            }
    }
    return reduce16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]);
}

#define MAXG 8  /* query heads per kv head handled together */

/* Causal attention over a per-row KV cache, each query row on its own (the result never depends on which other
   rows share the call): out[b, t, h] = softmax_j<=pos(q[b, t, h] . K[slot_b, g, j] * scale) V[slot_b, g, j],
   g = h / (nh / nkv). q rows: q + (b*T + t) * q_stride, heads contiguous (D each). Cache: [slots, nkv, max_len, D].
   out: [B, T, nh, D] contiguous. D must be a multiple of 16 (<= 256). */
void peagle_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *kc, const uint16_t *vc,
                           const int64_t *slots, const int64_t *positions, uint16_t *out, int B, int T, int nh,
                           int nkv, int D, int max_len, float scale, int nthreads) {
    int G = nh / nkv;
    int nd = D / 16;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = aligned_alloc(64, (size_t)MAXG * ((max_len + 15) / 16 * 16) * 4);
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int bt = 0; bt < B * T; bt++)
            for (int g = 0; g < nkv; g++) {
                int b = bt / T;
                long pos = positions[bt];
                int n = (int)pos + 1;
                const uint16_t *K = kc + ((size_t)slots[b] * nkv + g) * (size_t)max_len * D;
                const uint16_t *V = vc + ((size_t)slots[b] * nkv + g) * (size_t)max_len * D;
                int gh = G < MAXG ? G : MAXG;
                for (int h0 = 0; h0 < G; h0 += gh) {
                    int hn = G - h0 < gh ? G - h0 : gh;
                    for (int i = 0; i < hn; i++) {
                        const uint16_t *qv = q + (size_t)bt * q_stride + (size_t)(g * G + h0 + i) * D;
                        float *s = scores + (size_t)i * max_len;
                        __m512 sc = _mm512_set1_ps(scale);
                        for (int j0 = 0; j0 < n; j0 += 16) {
                            int nv = n - j0 < 16 ? n - j0 : 16;
                            __m512 v = _mm512_mul_ps(scores16(qv, K, j0, nv, D), sc);
                            _mm512_mask_storeu_ps(s + j0, (__mmask16)((1u << nv) - 1u), v);
                        }
                    }
                    float inv[MAXG];
                    for (int i = 0; i < hn; i++) {
                        float *s = scores + (size_t)i * max_len;
                        float m = -INFINITY;
                        for (int j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
                        __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
                        int j = 0;
                        for (; j + 16 <= n; j += 16) {
                            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
                            _mm512_storeu_ps(s + j, e);
                            sum = _mm512_add_ps(sum, e);
                        }
                        if (j < n) {
                            __mmask16 mk = (__mmask16)((1u << (n - j)) - 1u);
                            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), mv));
                            e = _mm512_maskz_mov_ps(mk, e);
                            _mm512_mask_storeu_ps(s + j, mk, e);
                            sum = _mm512_add_ps(sum, e);
                        }
                        inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
                    }
                    __m512 acc[MAXG][16];
                    for (int i = 0; i < hn; i++) for (int c = 0; c < nd; c++) acc[i][c] = _mm512_setzero_ps();
                    for (int j = 0; j < n; j++) {
                        __m512 vv[16];
                        for (int c = 0; c < nd; c++) vv[c] = bf16x16_to_f32(V + (size_t)j * D + c * 16);
                        for (int i = 0; i < hn; i++) {
                            __m512 p = _mm512_set1_ps(scores[(size_t)i * max_len + j]);
                            for (int c = 0; c < nd; c++) acc[i][c] = _mm512_fmadd_ps(p, vv[c], acc[i][c]);
                        }
                    }
                    for (int i = 0; i < hn; i++) {
                        uint16_t *o = out + ((size_t)bt * nh + g * G + h0 + i) * D;
                        __m512 iv = _mm512_set1_ps(inv[i]);
                        for (int c = 0; c < nd; c++) {
                            float tmp[16];
                            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[i][c], iv));
                            for (int e = 0; e < 16; e++) o[c * 16 + e] = f2bf(tmp[e]);
                        }
                    }
                }
            }
        free(scores);
    }
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* AMX tiles need the kernel's permission once per process (oneDNN asks for it the same way). */
int peagle_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 0;
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

static void config_tiles(void) {
    tilecfg c; memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}


#define NG 4  /* n-blocks (of 16 columns) per group: tmm0..3 accumulate, tmm4 = A, tmm5/6 = B */

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
   accumulates its K in the same order (k-blocks of 32 in sequence) whatever M is: batch invariant. */
void peagle_amx_gemm(const uint16_t *x, int ldx, const uint16_t *wp, uint16_t *y, int ldy, int M, int N, int K,
                     int nthreads) {
    int Kb = (K + 31) / 32, Mb = (M + 15) / 16;
    int Kp = Kb * 32;
    /* A: x zero padded to [Mb*16, Kp] so tile loads never read past it. */
    uint16_t *a = aligned_alloc(64, (size_t)Mb * 16 * Kp * 2);  /* Kp * 2 is a multiple of 64 */
    if (!a) return;
    for (int m = 0; m < Mb * 16; m++) {
        uint16_t *row = a + (size_t)m * Kp;
        if (m < M) { memcpy(row, x + (size_t)m * ldx, (size_t)K * 2); memset(row + K, 0, (size_t)(Kp - K) * 2); }
        else memset(row, 0, (size_t)Kp * 2);
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
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                const uint16_t *arow = a + (size_t)mb * 16 * Kp;
                for (int kb = 0; kb < Kb; kb++) {
                    const uint16_t *b = wg + (size_t)kb * NG * 512;
                    if (mb == 0)
                        for (int l = 0; l < NG * 16; l++) _mm_prefetch((const char *)(b + NG * 512) + 64 * l, _MM_HINT_T0);
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
                                                 f2bf16(_mm512_load_ps(cbuf + r * 16)));
                }
            }
        }
        _tile_release();
    }
    free(a);
}
"""

_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fPIC",
          "-shared"]
_LIBS = ["-lm"]

_lock = threading.Lock()
_lib = None
_amx = False
_tried = False


def _cpu_flags() -> set[str]:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split())


def _build() -> Path | None:
    from peagle.model.loading import peagle_home

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + compiler).encode()).hexdigest()[:16]
    out_dir = peagle_home() / "kernels"
    target = out_dir / f"peagle_kernels_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(_SOURCE)
        lib = Path(tmp) / "kernels.so"
        # With OpenMP the library links libgomp.so.1, which resolves to the copy PyTorch already loaded, so both
        # share one thread pool. Without OpenMP support it still builds, single-threaded.
        for extra in (["-fopenmp"], []):
            r = subprocess.run([compiler, *_FLAGS, *extra, str(src), "-o", str(lib), *_LIBS], capture_output=True,
                               text=True)
            if r.returncode == 0:
                os.replace(lib, target)  # atomic: concurrent first uses each build, one wins
                return target
    print(f"peagle: could not build the CPU kernels ({r.stderr.strip()[:300]}); using PyTorch's", file=sys.stderr)
    return None


def library():
    """The loaded kernel library (ctypes), or None where it is unavailable (built and loaded on first call)."""
    global _lib, _amx, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            flags = _cpu_flags()
            if os.environ.get("PEAGLE_CPU_KERNELS", "1") != "0" and {"avx512f", "avx512bw", "avx512vl",
                                                                      "avx512_bf16"} <= flags:
                path = _build()
                if path is not None:
                    lib = ctypes.CDLL(str(path))
                    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
                    for name, args, res in (
                            ("peagle_rms_norm_bf16", [p, p, p, i, i, f], None),
                            ("peagle_rope_bf16", [p, p, p, i, i, i, i], None),
                            ("peagle_amx_init", [], ctypes.c_int),
                            ("peagle_amx_packed_size", [i, i], ctypes.c_size_t),
                            ("peagle_amx_pack", [p, i, i, p], None),
                            ("peagle_amx_gemm", [p, i, p, p, i, i, i, i, i], None),
                            ("peagle_attention_bf16", [p, ctypes.c_long, p, p, p, p, p, i, i, i, i, i, i, f, i],
                             None)):
                        fn = getattr(lib, name)
                        fn.argtypes, fn.restype = args, res
                    _amx = {"amx_tile", "amx_bf16"} <= flags and bool(lib.peagle_amx_init())
                    _lib = lib
        except Exception as e:  # noqa: BLE001 - any failure means "use PyTorch"
            print(f"peagle: CPU kernels unavailable ({e}); using PyTorch's", file=sys.stderr)
            _lib, _amx = None, False
        _tried = True
    return _lib


def available() -> bool:
    return library() is not None


def amx_available() -> bool:
    """Whether packed weights (and so the batch-invariant AMX matrix multiply) can be used on this machine."""
    library()
    return _amx


def _no_grad(*tensors: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _usable(*tensors: torch.Tensor) -> bool:
    return (all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors) and _no_grad(*tensors)
            and available())


@dataclass
class PackedWeight:
    """A bf16 weight [N, K] packed once into AMX tile layout (a separate copy; the plain weight is untouched)."""
    data: torch.Tensor  # flat bf16
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "PackedWeight | None":
        """None where packed weights cannot be used (no AMX, not bf16 on CPU)."""
        if not (amx_available() and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.dim() == 2):
            return None
        w = weight.detach().contiguous()
        N, K = w.shape
        data = torch.empty(_lib.peagle_amx_packed_size(N, K), dtype=torch.bfloat16)
        _lib.peagle_amx_pack(w.data_ptr(), N, K, data.data_ptr())
        return cls(data, N, K)


def packed_linear(x: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """x [..., K] @ W^T for a packed W, or None when the packed path does not apply (then use F.linear)."""
    if packed is None or not _usable(x) or x.shape[-1] != packed.in_features:
        return None
    K, N = packed.in_features, packed.out_features
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M:
        _lib.peagle_amx_gemm(x2.data_ptr(), x2.stride(0), packed.data.data_ptr(), y.data_ptr(), N, M, N, K,
                             torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm with the reference's bf16 rounding in one call, or None when the kernel does not apply."""
    if not _usable(x, weight) or not weight.is_contiguous() or x.shape[-1] != weight.shape[0]:
        return None
    H = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if xc.numel():
        _lib.peagle_rms_norm_bf16(xc.data_ptr(), weight.data_ptr(), y.data_ptr(), xc.numel() // H, H, eps)
    return y


def rope_bf16_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> bool:
    """Rotate the first `heads` heads of x [B, T, heads_total, D] (contiguous) in place, cos/sin [B, T, D]; False
    (x untouched) when the kernel does not apply."""
    if not _usable(x, cos, sin) or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        return False
    B, T, heads_total, D = x.shape
    if cos.shape != (B, T, D) or sin.shape != (B, T, D):
        return False
    _lib.peagle_rope_bf16(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, heads_total, heads, D)
    return True


def attention_bf16(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor | None:
    """Causal attention of q [B, T, nh, D] (heads contiguous, rows evenly strided) over the per-row cache
    [slots, nkv, max_len, D]: row (b, t) attends to keys 0..positions[b, t] of slot slots[b]. Each row is computed
    alone, so the result never depends on T or B (batch invariance). None when the kernel does not apply."""
    if not _usable(q, cache_k, cache_v) or not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        return None
    B, T, nh, D = q.shape
    S, nkv, max_len, Dc = cache_k.shape
    if Dc != D or D % 16 or D > 256 or nh % nkv:
        return None
    if q.stride(3) != 1 or q.stride(2) != D or q.stride(0) != T * q.stride(1):
        q = q.contiguous()
    slots = slots.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    if positions.shape != (B, T) or slots.shape != (B,):
        return None
    lo, hi = torch.aminmax(positions)
    if int(lo) < 0 or int(hi) >= max_len or int(slots.min()) < 0 or int(slots.max()) >= S:
        raise IndexError(f"positions must lie in [0, {max_len}) and slots in [0, {S}) for this cache")
    out = torch.empty(B, T, nh, D, dtype=torch.bfloat16)
    _lib.peagle_attention_bf16(q.data_ptr(), q.stride(1), cache_k.data_ptr(), cache_v.data_ptr(), slots.data_ptr(),
                               positions.data_ptr(), out.data_ptr(), B, T, nh, nkv, D, max_len, D ** -0.5,
                               torch.get_num_threads())
    return out
