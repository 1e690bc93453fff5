/*
 * merge.c - the offline merge's element pass: w + sum_t s_t * D_t formed in
 * double, rounded once into w's dtype, checked for overflow.
 *
 * The products D_t = B_t @ A_t are formed in float64 by the caller (NumPy's
 * GEMM, a block of rows at a time); this pass does what would otherwise take
 * a dozen NumPy passes over the block, a chunk of a row at a time: widen w
 * (the active ISA's exact widening), add each term in order (acc = acc +
 * s_t * d, a product then a sum, no fma), round once to nearest even (float16
 * and bfloat16 through a round-to-odd float32, then the ISA's narrowing, so
 * nothing is rounded twice), and find the first element that was finite in w
 * and is not now.  Threads split rows, so the bits never depend on them.
 */
#include <math.h>
#include <string.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* elements of a row handled per step (three small stack buffers) */
#define MERGE_CHUNK 512

/* d rounded to float32 with the sticky bit kept (round to odd): a second
 * rounding of the result to 11 or 8 significant bits is the correct one */
static inline float round_to_odd_f32_(double d) {
    union { float f; uint32_t u; } v = {(float)d};
    const double back = (double)v.f;
    /* rounded away from zero (inf included): one step back toward zero, then
     * the sticky bit; NaN stays NaN */
    v.u -= (uint32_t)(fabs(back) > fabs(d));
    v.u |= (uint32_t)(back != d);
    return v.f;
}

static inline int half_finite_(uint16_t h, int dtype) {
    return dtype == LORA_DTYPE_F16 ? (h & 0x7c00u) != 0x7c00u : (h & 0x7f80u) != 0x7f80u;
}

/* rows [lo, hi): checked (the flat index of the first element finite in w
 * whose result is not, or -1) or written (every result stored; -1) */
static int64_t rows_(const lora_kernel_table *kt, void *w, int dtype, int64_t ldw, int64_t lo,
                     int64_t hi, int64_t cols, int n_terms, const double *const *d,
                     const double *s, int write) {
    float wf[MERGE_CHUNK], r[MERGE_CHUNK];
    double acc[MERGE_CHUNK];
    uint16_t h[MERGE_CHUNK];
    for (int64_t i = lo; i < hi; i++) {
        for (int64_t j0 = 0; j0 < cols; j0 += MERGE_CHUNK) {
            const int64_t n = cols - j0 < MERGE_CHUNK ? cols - j0 : MERGE_CHUNK;
            const int64_t off = i * ldw + j0, k0 = i * cols + j0;
            const float *w0;
            if (dtype == LORA_DTYPE_F32) {
                w0 = (const float *)w + off;
            } else {
                kt->widen[dtype]((const uint16_t *)w + off, n, wf);
                w0 = wf;
            }
            for (int64_t j = 0; j < n; j++) acc[j] = (double)w0[j];
            for (int t = 0; t < n_terms; t++) {
                const double st = s[t], *dt = d[t] + k0;
                for (int64_t j = 0; j < n; j++) acc[j] = acc[j] + st * dt[j];
            }
            if (dtype == LORA_DTYPE_F32)
                for (int64_t j = 0; j < n; j++) r[j] = (float)acc[j];
            else
                for (int64_t j = 0; j < n; j++) r[j] = round_to_odd_f32_(acc[j]);
            if (dtype == LORA_DTYPE_F32) {
                if (write) {
                    memcpy((float *)w + off, r, (size_t)n * sizeof(float));
                    continue;
                }
                for (int64_t j = 0; j < n; j++)
                    if (!isfinite(r[j]) && isfinite(w0[j])) return i * cols + j0 + j;
                continue;
            }
            if (write) {
                kt->narrow[dtype](r, n, (uint16_t *)w + off);
                continue;
            }
            kt->narrow[dtype](r, n, h);
            for (int64_t j = 0; j < n; j++)
                if (!half_finite_(h[j], dtype) && isfinite(w0[j])) return i * cols + j0 + j;
        }
    }
    return -1;
}

int64_t lora_merge_rows(void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols,
                        int n_terms, const double *const *d, const double *scales, int write) {
    if (rows <= 0 || cols <= 0 || w_dtype < 0 || w_dtype > LORA_DTYPE_BF16) return -1;
    const lora_kernel_table *kt = lora_active_kernels();
    const int nt = lora_call_threads(rows * cols * (int64_t)(n_terms + 1));
#ifdef _OPENMP
    if (nt > 1) {
        int64_t first = -1;
#pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi;
            lora_split(rows, omp_get_thread_num(), omp_get_num_threads(), 1, &lo, &hi);
            const int64_t mine =
                rows_(kt, w, w_dtype, ldw, lo, hi, cols, n_terms, d, scales, write);
#pragma omp critical(lora_merge_first)
            if (mine >= 0 && (first < 0 || mine < first)) first = mine;
        }
        return first;
    }
#endif
    (void)nt;
    return rows_(kt, w, w_dtype, ldw, 0, rows, cols, n_terms, d, scales, write);
}

double lora_abs_max(const void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols) {
    const lora_kernel_table *kt = lora_active_kernels();
    float wf[MERGE_CHUNK];
    float m = 0.0f;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j0 = 0; j0 < cols; j0 += MERGE_CHUNK) {
            const int64_t n = cols - j0 < MERGE_CHUNK ? cols - j0 : MERGE_CHUNK;
            const float *v = (const float *)w + i * ldw + j0;
            if (w_dtype != LORA_DTYPE_F32) {
                kt->widen[w_dtype]((const uint16_t *)w + i * ldw + j0, n, wf);
                v = wf;
            }
            float cm = 0.0f;
            int nan = 0;
            for (int64_t j = 0; j < n; j++) {
                const float a = fabsf(v[j]);
                cm = a > cm ? a : cm;
                nan |= a != a;
            }
            if (nan) return NAN;
            m = cm > m ? cm : m;
        }
    return (double)m;
}
