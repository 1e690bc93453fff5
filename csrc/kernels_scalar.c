/*
 * kernels_scalar.c - the portable path: plain C, any CPU (x86-64 baseline,
 * aarch64, anything a C99 compiler targets).  It is what the SIMD paths are
 * cross-checked against in the tests (the oracle is a float64 NumPy
 * reference), and what runs where no SIMD path applies.
 *
 * Required features: none.  Instructions: whatever the compiler picks for
 * separate multiplies and adds; the build passes -ffp-contract=off so no
 * compiler fuses them, and the bits are the same on every target.
 *
 * Summation order (one per output element, shared by decode, batch, stack
 * and bank):
 *   project     t[k]  = ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), where lane
 *               l = sum over j = l (mod 8), ascending j, of A[k,j]*x[j]
 *               (8 lanes so the compiler may keep them in two SSE/NEON
 *               registers; the tail j's fall into their own lanes).
 *   accumulate  out[i] = out[i] + ((blk_0 + blk_1) + blk_2 ...), blk_m =
 *               (((0 + M[k,i]u[k]) + M[k+1,i]u[k+1]) + ...) over k in
 *               [16m, 16m+16) ascending (LORA_KBLOCK); then out[i] + s * total
 *               (a multiply, then an add).
 * Tail strategy: the lane index is j mod 8, so the tail needs no special
 * case.  Accumulators: 8 lanes in project, a strip of 64 outputs (block sums
 * and running totals) in accumulate.
 */
#include "kernels.h"

#define STRIP_ 64

static inline void project_(const void *a, int64_t lda, int64_t cols, int64_t k0,
                            int64_t k1, int nb, const float *const *xs, float *t,
                            int64_t ldt, const int dt) {
    for (int64_t k = k0; k < k1; k++) {
        for (int b = 0; b < nb; b++) {
            const float *x = xs[b];
            const int64_t row = k * lda;
            float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t j = 0;
            if (dt == LORA_DTYPE_F32) {
                const float *ak = (const float *)a + row;
                for (; j + 8 <= cols; j += 8)
                    for (int l = 0; l < 8; l++) lane[l] += ak[j + l] * x[j + l];
            }
            for (; j < cols; j++) lane[j & 7] += lora_load_f32(a, row + j, dt) * x[j];
            t[b * ldt + k] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                             ((lane[4] + lane[5]) + (lane[6] + lane[7]));
        }
    }
}

static inline void accumulate_(const void *m, int64_t ldm, int64_t kdim, int64_t i0,
                               int64_t i1, int nb, const float *u, int64_t ldu, float scale,
                               float *const *outs, const int dt) {
    float total[STRIP_], block[STRIP_];
    for (int b = 0; b < nb; b++) {
        const float *ub = u + b * ldu;
        float *out = outs[b];
        for (int64_t i = i0; i < i1; i += STRIP_) {
            const int n = (int)(i1 - i < STRIP_ ? i1 - i : STRIP_);
            for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
                const int64_t k1 = k0 + LORA_KBLOCK < kdim ? k0 + LORA_KBLOCK : kdim;
                for (int l = 0; l < n; l++) block[l] = 0.0f;
                for (int64_t k = k0; k < k1; k++) {
                    const float uk = ub[k];
                    const int64_t row = k * ldm + i;
                    if (dt == LORA_DTYPE_F32) {
                        const float *mk = (const float *)m + row;
                        for (int l = 0; l < n; l++) block[l] += mk[l] * uk;
                    } else {
                        for (int l = 0; l < n; l++) block[l] += lora_load_f32(m, row + l, dt) * uk;
                    }
                }
                for (int l = 0; l < n; l++) total[l] = k0 == 0 ? block[l] : total[l] + block[l];
            }
            for (int l = 0; l < n; l++) out[i + l] += scale * total[l];
        }
    }
}

#define LORA_WRAP_(DT, NAME)                                                                  \
    static void lora_project_##NAME##_scalar(const void *a, int64_t lda, int64_t cols,       \
                                             int64_t k0, int64_t k1, int nb,                 \
                                             const float *const *xs, float *t, int64_t ldt) { \
        project_(a, lda, cols, k0, k1, nb, xs, t, ldt, DT);                                  \
    }                                                                                         \
    static void lora_accumulate_##NAME##_scalar(const void *m, int64_t ldm, int64_t kdim,    \
                                                int64_t i0, int64_t i1, int nb,              \
                                                const float *u, int64_t ldu, float scale,    \
                                                float *const *outs) {                        \
        accumulate_(m, ldm, kdim, i0, i1, nb, u, ldu, scale, outs, DT);                      \
    }
LORA_WRAP_(LORA_DTYPE_F32, f32)
LORA_WRAP_(LORA_DTYPE_F16, f16)
LORA_WRAP_(LORA_DTYPE_BF16, bf16)

static double lora_read_scalar(const float *buf, int64_t n) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = 0; j < n; j++) lane[j & 7] += buf[j];
    double s = 0;
    for (int l = 0; l < 8; l++) s += lane[l];
    return s;
}

static void lora_widen_f16_scalar(const void *src, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = lora_load_f32(src, i, LORA_DTYPE_F16);
}

static void lora_widen_bf16_scalar(const void *src, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = lora_load_f32(src, i, LORA_DTYPE_BF16);
}

const lora_kernel_table lora_kernels_scalar = {
    "scalar",
    {lora_project_f32_scalar, lora_project_f16_scalar, lora_project_bf16_scalar},
    {lora_accumulate_f32_scalar, lora_accumulate_f16_scalar, lora_accumulate_bf16_scalar},
    lora_read_scalar,
    {NULL, lora_widen_f16_scalar, lora_widen_bf16_scalar},
};
