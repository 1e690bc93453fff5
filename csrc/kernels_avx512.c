/*
 * kernels_avx512.c - the AVX-512 path (Skylake-SP and later, Zen 4).
 *
 * Required features: AVX512F, AVX512BW + AVX512VL (16-bit masked loads for
 * the half-precision tails), FMA, F16C (dispatch.c checks all of them).
 * Instructions: vfmadd231ps on 16-lane zmm registers; float16 storage is
 * widened with vcvtph2ps, bfloat16 with vpmovzxwd + vpslld 16 (exact).
 *
 * Summation order (one per output element, shared by decode, batch, stack
 * and bank):
 *   project     t[k] = reduce16(lanes), lane l = fma-chain over
 *               j = l (mod 16), ascending, the last partial vector loaded
 *               with a mask (masked-off lanes add 0*0); reduce16 is GCC's
 *               _mm512_reduce_add_ps tree (halves 256, 128, 64, 32 bits).
 *   accumulate  out[i] = out[i] + fma-chain from 0 over k ascending of
 *               M[k,i]*u[k]; the tail is the same chain in masked lanes.
 * Tail strategy: masked loads and stores, no scalar tail.
 * Accumulators: project keeps 4 ranks x up to 4 positions = 16 zmm chains
 * (FMA latency 4 x 2 ports needs 8; 16 also amortises each x load over 4
 * ranks and each A load over 4 positions); accumulate keeps 4 row vectors x
 * up to 4 positions = 16 chains, 21 of the 32 zmm registers.
 */
#include "kernels.h"

#if defined(LORA_HAVE_X86)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#endif

#define INLINE_ static inline __attribute__((always_inline))

INLINE_ __m512 widen_f32x16_(__m256i h, const int dt) {
    if (dt == LORA_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE_ __m512 load_f32x16_(const void *p, int64_t i, const int dt) {
    if (dt == LORA_DTYPE_F32) return _mm512_loadu_ps((const float *)p + i);
    return widen_f32x16_(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)), dt);
}

INLINE_ __m512 load_masked_f32x16_(const void *p, int64_t i, __mmask16 mask, const int dt) {
    if (dt == LORA_DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    return widen_f32x16_(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i), dt);
}

INLINE_ __mmask16 tail_mask_(int64_t n) { return (__mmask16)((1u << n) - 1u); }

/* nr ranks (k .. k+nr) x nb positions; nr in {1, 4}, nb in 1..4 */
INLINE_ void project_tile_(const void *a, int64_t lda, int64_t cols, int64_t k, const int nr,
                           const int nb, const float *const *xs, float *t, int64_t ldt,
                           const int dt) {
    __m512 acc_f32x16[4][4];
    for (int r = 0; r < nr; r++)
        for (int b = 0; b < nb; b++) acc_f32x16[r][b] = _mm512_setzero_ps();
    const int64_t body = cols & ~(int64_t)15;
    for (int64_t j = 0; j < body; j += 16) {
        __m512 x_f32x16[4];
        for (int b = 0; b < nb; b++) x_f32x16[b] = _mm512_loadu_ps(xs[b] + j);
        for (int r = 0; r < nr; r++) {
            const __m512 a_f32x16 = load_f32x16_(a, (k + r) * lda + j, dt);
            for (int b = 0; b < nb; b++)
                acc_f32x16[r][b] = _mm512_fmadd_ps(a_f32x16, x_f32x16[b], acc_f32x16[r][b]);
        }
    }
    if (body < cols) {
        const __mmask16 mask = tail_mask_(cols - body);
        __m512 x_f32x16[4];
        for (int b = 0; b < nb; b++) x_f32x16[b] = _mm512_maskz_loadu_ps(mask, xs[b] + body);
        for (int r = 0; r < nr; r++) {
            const __m512 a_f32x16 = load_masked_f32x16_(a, (k + r) * lda + body, mask, dt);
            for (int b = 0; b < nb; b++)
                acc_f32x16[r][b] = _mm512_fmadd_ps(a_f32x16, x_f32x16[b], acc_f32x16[r][b]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int b = 0; b < nb; b++) t[b * ldt + k + r] = _mm512_reduce_add_ps(acc_f32x16[r][b]);
}

INLINE_ void project_nb_(const void *a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                         const int nb, const float *const *xs, float *t, int64_t ldt,
                         const int dt) {
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) project_tile_(a, lda, cols, k, 4, nb, xs, t, ldt, dt);
    for (; k < k1; k++) project_tile_(a, lda, cols, k, 1, nb, xs, t, ldt, dt);
}

INLINE_ void project_(const void *a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                      int nb, const float *const *xs, float *t, int64_t ldt, const int dt) {
    switch (nb) {  /* constant nb lets the compiler keep every accumulator in a register */
    case 1: project_nb_(a, lda, cols, k0, k1, 1, xs, t, ldt, dt); break;
    case 2: project_nb_(a, lda, cols, k0, k1, 2, xs, t, ldt, dt); break;
    case 3: project_nb_(a, lda, cols, k0, k1, 3, xs, t, ldt, dt); break;
    default: project_nb_(a, lda, cols, k0, k1, 4, xs, t, ldt, dt); break;
    }
}

/* outputs i .. i + 16*nv of nb positions (the last vector masked by `last`);
 * nv in 1..4, nb in 1..4 */
INLINE_ void accumulate_tile_(const void *m, int64_t ldm, int64_t kdim, int64_t i, const int nv,
                              __mmask16 last, const int nb, const float *u, int64_t ldu,
                              float *const *outs, const int dt) {
    __m512 acc_f32x16[4][4];
    for (int v = 0; v < nv; v++)
        for (int b = 0; b < nb; b++) acc_f32x16[v][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kdim; k++) {
        __m512 m_f32x16[4];
        for (int v = 0; v < nv; v++)
            m_f32x16[v] = v == nv - 1 ? load_masked_f32x16_(m, k * ldm + i + 16 * v, last, dt)
                                      : load_f32x16_(m, k * ldm + i + 16 * v, dt);
        for (int b = 0; b < nb; b++) {
            const __m512 u_f32x16 = _mm512_set1_ps(u[b * ldu + k]);
            for (int v = 0; v < nv; v++)
                acc_f32x16[v][b] = _mm512_fmadd_ps(m_f32x16[v], u_f32x16, acc_f32x16[v][b]);
        }
    }
    for (int b = 0; b < nb; b++) {
        for (int v = 0; v < nv; v++) {
            float *o = outs[b] + i + 16 * v;
            const __mmask16 mask = v == nv - 1 ? last : (__mmask16)0xffff;
            const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), acc_f32x16[v][b]);
            _mm512_mask_storeu_ps(o, mask, sum);
        }
    }
}

INLINE_ void accumulate_nb_(const void *m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                            const int nb, const float *u, int64_t ldu, float *const *outs,
                            const int dt) {
    int64_t i = i0;
    for (; i + 64 <= i1; i += 64)
        accumulate_tile_(m, ldm, kdim, i, 4, (__mmask16)0xffff, nb, u, ldu, outs, dt);
    for (; i + 16 <= i1; i += 16)
        accumulate_tile_(m, ldm, kdim, i, 1, (__mmask16)0xffff, nb, u, ldu, outs, dt);
    if (i < i1) accumulate_tile_(m, ldm, kdim, i, 1, tail_mask_(i1 - i), nb, u, ldu, outs, dt);
}

INLINE_ void accumulate_(const void *m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                         int nb, const float *u, int64_t ldu, float *const *outs, const int dt) {
    switch (nb) {
    case 1: accumulate_nb_(m, ldm, kdim, i0, i1, 1, u, ldu, outs, dt); break;
    case 2: accumulate_nb_(m, ldm, kdim, i0, i1, 2, u, ldu, outs, dt); break;
    case 3: accumulate_nb_(m, ldm, kdim, i0, i1, 3, u, ldu, outs, dt); break;
    default: accumulate_nb_(m, ldm, kdim, i0, i1, 4, u, ldu, outs, dt); break;
    }
}

#define LORA_WRAP_(DT, NAME)                                                                  \
    static void lora_project_##NAME##_avx512(const void *a, int64_t lda, int64_t cols,       \
                                             int64_t k0, int64_t k1, int nb,                 \
                                             const float *const *xs, float *t, int64_t ldt) { \
        project_(a, lda, cols, k0, k1, nb, xs, t, ldt, DT);                                  \
    }                                                                                         \
    static void lora_accumulate_##NAME##_avx512(const void *m, int64_t ldm, int64_t kdim,    \
                                                int64_t i0, int64_t i1, int nb,              \
                                                const float *u, int64_t ldu,                 \
                                                float *const *outs) {                        \
        accumulate_(m, ldm, kdim, i0, i1, nb, u, ldu, outs, DT);                             \
    }
LORA_WRAP_(LORA_DTYPE_F32, f32)
LORA_WRAP_(LORA_DTYPE_F16, f16)
LORA_WRAP_(LORA_DTYPE_BF16, bf16)

/* 4 independent adds in flight: two 64-byte loads per cycle from L1 */
static double lora_read_avx512(const float *buf, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(buf + j));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(buf + j + 16));
        s2 = _mm512_add_ps(s2, _mm512_loadu_ps(buf + j + 32));
        s3 = _mm512_add_ps(s3, _mm512_loadu_ps(buf + j + 48));
    }
    double s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    for (; j < n; j++) s += buf[j];
    return s;
}

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

const lora_kernel_table lora_kernels_avx512 = {
    "avx512",
    {lora_project_f32_avx512, lora_project_f16_avx512, lora_project_bf16_avx512},
    {lora_accumulate_f32_avx512, lora_accumulate_f16_avx512, lora_accumulate_bf16_avx512},
    lora_read_avx512,
};

#endif /* LORA_HAVE_X86 */
