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
 * and bank, and by every dtype of x and out: x is widened exactly first, a
 * half-precision out is widened into a float32 strip and rounded once after
 * the last term):
 *   project     t[k]  = ((r_0 + r_1) + r_2) ..., one r_m per column block m
 *               ([m, m+1) x LORA_JBLOCK; a row of up to 4096 columns is one
 *               block), r_m = ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), where
 *               lane l = sum from 0 over the block's j = l (mod 8), ascending
 *               j, of A[k,j]*x[j] (8 lanes so the compiler may keep them in
 *               two SSE/NEON registers; the tail j's fall into their own
 *               lanes).
 *   accumulate  out[i] = out[i] + ((blk_0 + blk_1) + blk_2 ...), blk_m =
 *               (((0 + M[k,i]u[k]) + M[k+1,i]u[k+1]) + ...) over k in
 *               [16m, 16m+16) ascending (LORA_KBLOCK); then out[i] + s * total
 *               (a multiply, then an add), term by term in stack order.
 *   by_row      out[i] = out[i] + s * (((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))),
 *               lane l = sum over k = l (mod 8), ascending, of M^T[i,k]*u[k].
 * Tail strategy: the lane index is j mod 8, so the tail needs no special
 * case.  Accumulators: 8 lanes in project, a strip of LORA_STRIP outputs
 * (block sums and running totals) in accumulate.
 */
#include "kernels.h"

/* The one place this file reads a factor's format: value e of a run as
 * float32 (exact), the portable reader of formats.h (a Q8_0 value is d * q,
 * one exact product, then summed as a float32 value is). */
LORA_FORMATS_HANDLED(4, scalar_loads_know_f32_f16_bf16_q8_0);
static inline float run_f32_(lora_run r, int64_t e, const int f) { return lora_run_load(r, e, f); }

/* values e .. e + n of a factor as float32 (the table's load entry) */
static inline void load_run_(lora_run r, int64_t e, int64_t n, float *dst, const int f) {
    for (int64_t k = 0; k < n; k++) dst[k] = run_f32_(r, e + k, f);
}

/* t[b*ldt + k] for k in [k0, k1): x widened element by element */
static inline void project_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                            int nb, const void *const *xs, float *t, int64_t ldt, const int f,
                            const int xt) {
    for (int64_t k = k0; k < k1; k++) {
        for (int b = 0; b < nb; b++) {
            const void *x = xs[b];
            const int64_t row = k * lda;
            float sum = 0.0f; /* the finished column blocks' sums */
            for (int64_t jb = 0; jb < cols; jb += LORA_JBLOCK) {
                const int64_t je = jb + LORA_JBLOCK < cols ? jb + LORA_JBLOCK : cols;
                float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int64_t j = jb;
                if (f == LORA_FMT_F32 && xt == LORA_DTYPE_F32) {
                    const float *ak = (const float *)a.v + row, *xf = (const float *)x;
                    for (; j + 8 <= je; j += 8)
                        for (int l = 0; l < 8; l++) lane[l] += ak[j + l] * xf[j + l];
                }
                for (; j < je; j++)
                    lane[j & 7] += run_f32_(a, row + j, f) * lora_load_f32(x, j, xt);
                const float block = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                                    ((lane[4] + lane[5]) + (lane[6] + lane[7]));
                sum = jb == 0 ? block : sum + block;
            }
            t[b * ldt + k] = sum;
        }
    }
}

/* o[l] += s * (sum over k of M[k, i+l] u[k]) for l < n, the blocked order of
 * the header */
static inline void term_strip_(const lora_term *tm, int b, int64_t i, int n, float *o) {
    float total[LORA_STRIP], block[LORA_STRIP];
    const float *ub = tm->u + b * tm->ldu;
    const int f = tm->fmt;
    for (int64_t k0 = 0; k0 < tm->kdim; k0 += LORA_KBLOCK) {
        const int64_t k1 = k0 + LORA_KBLOCK < tm->kdim ? k0 + LORA_KBLOCK : tm->kdim;
        for (int l = 0; l < n; l++) block[l] = 0.0f;
        for (int64_t k = k0; k < k1; k++) {
            const float uk = ub[k];
            const int64_t row = k * tm->ldm + i;
            if (f == LORA_FMT_F32) {
                const float *mk = (const float *)tm->m.v + row;
                for (int l = 0; l < n; l++) block[l] += mk[l] * uk;
            } else {
                for (int l = 0; l < n; l++) block[l] += run_f32_(tm->m, row + l, f) * uk;
            }
        }
        for (int l = 0; l < n; l++) total[l] = k0 == 0 ? block[l] : total[l] + block[l];
    }
    const float s = tm->scale[b];
    for (int l = 0; l < n; l++) o[l] += s * total[l];
}

/* the same for a term held by output (by_row): o[l] += s * dot(M^T[i+l, :], u), the dot
 * product in 8 lanes as project's */
static inline void term_rows_(const lora_term *tm, int b, int64_t i, int n, float *o) {
    const float *ub = tm->u + b * tm->ldu;
    const float s = tm->scale[b];
    for (int l = 0; l < n; l++) {
        const int64_t row = (i + l) * tm->ldm;
        float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k = 0; k < tm->kdim; k++)
            lane[k & 7] += run_f32_(tm->m, row + k, tm->fmt) * ub[k];
        const float total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                            ((lane[4] + lane[5]) + (lane[6] + lane[7]));
        o[l] += s * total;
    }
}

/* output i of position b at outs[b] + (i - obase) */
static inline void accumulate_(const lora_term *terms, int n_terms, int64_t i0, int64_t i1,
                               int nb, void *const *outs, int64_t obase, const int ot) {
    float strip[LORA_STRIP];
    for (int b = 0; b < nb; b++) {
        int touched = 0;
        for (int q = 0; q < n_terms; q++) touched |= terms[q].scale[b] != 0.0f;
        if (!touched) continue;  /* no term adds here: the element keeps its bits */
        for (int64_t i = i0; i < i1; i += LORA_STRIP) {
            const int n = (int)(i1 - i < LORA_STRIP ? i1 - i : LORA_STRIP);
            float *o = ot == LORA_DTYPE_F32 ? (float *)outs[b] + (i - obase) : strip;
            if (ot != LORA_DTYPE_F32)
                for (int l = 0; l < n; l++) o[l] = lora_load_f32(outs[b], i - obase + l, ot);
            for (int q = 0; q < n_terms; q++)
                if (terms[q].scale[b] != 0.0f) {
                    if (terms[q].by_row) term_rows_(&terms[q], b, i, n, o);
                    else term_strip_(&terms[q], b, i, n, o);
                }
            if (ot != LORA_DTYPE_F32)
                for (int l = 0; l < n; l++) lora_store_f32(outs[b], i - obase + l, o[l], ot);
        }
    }
}

static inline double read_(const float *buf, int64_t n) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = 0; j < n; j++) lane[j & 7] += buf[j];
    double s = 0;
    for (int l = 0; l < 8; l++) s += lane[l];
    return s;
}

/* the compute probe: 32 independent chains of a * m + c (a multiply and an
 * add: this file is built without contraction), vectorised or not as the
 * compiler sees fit; each reaches exactly 1 (as in kernels_read.h) */
static inline double peak_(int64_t n, int64_t *flops) {
    float a[32];
    for (int i = 0; i < 32; i++) a[i] = (float)i;
    for (int64_t s = 0; s < n; s++)
        for (int i = 0; i < 32; i++) a[i] = a[i] * 0.5f + 0.5f;
    double sum = 0;
    for (int i = 0; i < 32; i++) sum += a[i];
    *flops = n * 32 * 2;
    return sum;
}

static inline void widen_(const void *src, int64_t n, float *dst, const int dt) {
    for (int64_t i = 0; i < n; i++) dst[i] = lora_load_f32(src, i, dt);
}

static inline void narrow_(const float *src, int64_t n, void *dst, const int ot) {
    for (int64_t i = 0; i < n; i++) lora_store_f32(dst, i, src[i], ot);
}

#include "kernels_merge.h"

LORA_KERNEL_TABLE(scalar, 0u)
