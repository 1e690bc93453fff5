/*
 * merge.c - the offline merge's element pass: w + sum_t s_t * D_t formed in
 * double, rounded once into w's dtype, checked for overflow.
 *
 * The products D_t = B_t @ A_t are formed in float64 by the caller (NumPy's
 * GEMM, a block of rows at a time); this pass does what would otherwise take
 * a dozen NumPy passes over the block: widen w, add each term in order
 * (acc = acc + s_t * d, two roundings, no fma), round once to nearest even
 * (float16 and bfloat16 through a round-to-odd float32, so nothing is rounded
 * twice), and find the first element that was finite in w and is not now.
 * It is memory-bound; threads split rows, so the bits never depend on them.
 */
#include <math.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

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

/* w + sum_t s_t * d_t at one element, rounded into dtype (the stored bits) */
static inline uint32_t merged_(float w0, int n_terms, const double *const *d, const double *s,
                               int64_t k, const int dtype) {
    double acc = (double)w0;
    for (int t = 0; t < n_terms; t++) acc = acc + s[t] * d[t][k];
    if (dtype == LORA_DTYPE_F32) {
        union { float f; uint32_t u; } v = {(float)acc};
        return v.u;
    }
    const float r = round_to_odd_f32_(acc);
    return dtype == LORA_DTYPE_F16 ? lora_f32_to_f16(r) : lora_f32_to_bf16(r);
}

static inline int finite_bits_(uint32_t bits, const int dtype) {
    if (dtype == LORA_DTYPE_F32) return (bits & 0x7f800000u) != 0x7f800000u;
    if (dtype == LORA_DTYPE_F16) return (bits & 0x7c00u) != 0x7c00u;
    return (bits & 0x7f80u) != 0x7f80u;
}

/* the first column of a row whose result is not finite while w's element was, or -1 */
static inline int64_t check_row_(const void *w, int64_t off, int64_t cols, int n_terms,
                                 const double *const *d, const double *s, int64_t k0,
                                 const int dtype) {
    for (int64_t j = 0; j < cols; j++) {
        const float w0 = lora_load_f32(w, off + j, dtype);
        if (!finite_bits_(merged_(w0, n_terms, d, s, k0 + j, dtype), dtype) && isfinite(w0))
            return j;
    }
    return -1;
}

static inline void write_row_(void *w, int64_t off, int64_t cols, int n_terms,
                              const double *const *d, const double *s, int64_t k0,
                              const int dtype) {
    for (int64_t j = 0; j < cols; j++) {
        const uint32_t r = merged_(lora_load_f32(w, off + j, dtype), n_terms, d, s, k0 + j, dtype);
        if (dtype == LORA_DTYPE_F32) {
            union { uint32_t u; float f; } v = {r};
            ((float *)w)[off + j] = v.f;
        } else {
            ((uint16_t *)w)[off + j] = (uint16_t)r;
        }
    }
}

/* rows [lo, hi): checked (the first bad element's flat index, or -1) or written */
static int64_t rows_(void *w, int dtype, int64_t ldw, int64_t lo, int64_t hi, int64_t cols,
                     int n_terms, const double *const *d, const double *s, int write) {
    for (int64_t i = lo; i < hi; i++) {
        const int64_t off = i * ldw, k0 = i * cols;
        if (write) {
            switch (dtype) {
            case LORA_DTYPE_F32: write_row_(w, off, cols, n_terms, d, s, k0, LORA_DTYPE_F32); break;
            case LORA_DTYPE_F16: write_row_(w, off, cols, n_terms, d, s, k0, LORA_DTYPE_F16); break;
            default: write_row_(w, off, cols, n_terms, d, s, k0, LORA_DTYPE_BF16); break;
            }
            continue;
        }
        int64_t j;
        switch (dtype) {
        case LORA_DTYPE_F32: j = check_row_(w, off, cols, n_terms, d, s, k0, LORA_DTYPE_F32); break;
        case LORA_DTYPE_F16: j = check_row_(w, off, cols, n_terms, d, s, k0, LORA_DTYPE_F16); break;
        default: j = check_row_(w, off, cols, n_terms, d, s, k0, LORA_DTYPE_BF16); break;
        }
        if (j >= 0) return i * cols + j;
    }
    return -1;
}

int64_t lora_merge_rows(void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols,
                        int n_terms, const double *const *d, const double *scales, int write) {
    if (rows <= 0 || cols <= 0) return -1;
    int64_t first = -1;
    const int nt = lora_call_threads(rows * cols * (int64_t)(n_terms + 1));
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi;
            lora_split(rows, omp_get_thread_num(), omp_get_num_threads(), 1, &lo, &hi);
            const int64_t mine = rows_(w, w_dtype, ldw, lo, hi, cols, n_terms, d, scales, write);
#pragma omp critical(lora_merge_first)
            if (mine >= 0 && (first < 0 || mine < first)) first = mine;
        }
        return first;
    }
#endif
    (void)nt;
    return rows_(w, w_dtype, ldw, 0, rows, cols, n_terms, d, scales, write);
}

double lora_abs_max(const void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols) {
    double m = 0.0;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            const double v = fabs((double)lora_load_f32(w, i * ldw + j, w_dtype));
            if (!(v <= m)) {
                m = v;
                if (m != m) return m;  /* NaN */
            }
        }
    return m;
}
