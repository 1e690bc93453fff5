/*
 * merge.c - merges (merge_into / unmerge_from): w + sum_t s_t * B_t @ A_t
 * formed in float64, rounded once into w's dtype, checked for overflow.
 *
 * One pass over w, a chunk of a row at a time, nothing materialised: widen w
 * (the active ISA's exact widening), add each term in order with the ISA's
 * merge_row kernel (the product over the rank in double, then scaled and
 * added: see LORA_MERGE_FN_), round once to nearest even (float16 and
 * bfloat16 through a round-to-odd float32, then the ISA's narrowing, so
 * nothing is rounded twice), and find the first element that was finite in w
 * and is not now.  Threads split rows, so the bits never depend on them, nor
 * on the ISA path.
 */
#include <math.h>
#include <string.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* elements of a row handled per step (small stack buffers) */
#define MERGE_CHUNK LORA_MERGE_CHUNK

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

typedef struct {
    int n_terms;
    const double *const *a;  /* a[t]: A_t [ranks[t], cols] */
    const double *const *b;  /* b[t]: B_t [rows, ranks[t]] */
    const int64_t *ranks;
    const double *scales;
} terms_;

/* rows [lo, hi): checked (the flat index of the first element finite in w
 * whose result is not, or -1) or written (every result stored; -1) */
static int64_t rows_(const lora_kernel_table *kt, void *w, int dtype, int64_t ldw, int64_t lo,
                     int64_t hi, int64_t cols, const terms_ *tm, int write) {
    float wf[MERGE_CHUNK], r[MERGE_CHUNK];
    double acc[MERGE_CHUNK];
    uint16_t h[MERGE_CHUNK];
    for (int64_t i = lo; i < hi; i++) {
        for (int64_t j0 = 0; j0 < cols; j0 += MERGE_CHUNK) {
            const int64_t n = cols - j0 < MERGE_CHUNK ? cols - j0 : MERGE_CHUNK;
            const int64_t off = i * ldw + j0;
            const float *w0;
            if (dtype == LORA_DTYPE_F32) {
                w0 = (const float *)w + off;
            } else {
                kt->widen[dtype]((const uint16_t *)w + off, n, wf);
                w0 = wf;
            }
            for (int64_t j = 0; j < n; j++) acc[j] = (double)w0[j];
            for (int t = 0; t < tm->n_terms; t++) {
                const int64_t rank = tm->ranks[t];
                kt->merge_row(tm->b[t] + i * rank, rank, tm->a[t] + j0, cols, n, tm->scales[t],
                              acc);
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

int64_t lora_merge(void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols, int n_terms,
                   const double *const *a, const double *const *b, const int64_t *ranks,
                   const double *scales, int write) {
    if (rows <= 0 || cols <= 0 || n_terms <= 0 || !lora_dtype_valid(w_dtype))
        return -1;
    for (int t = 0; t < n_terms; t++)
        if (ranks[t] < 1) return -1;
    const lora_kernel_table *kt = lora_active_kernels();
    const terms_ tm = {n_terms, a, b, ranks, scales};
    int64_t work = 0;
    for (int t = 0; t < n_terms; t++) work += ranks[t];
    const int nt = lora_call_threads(rows * cols * work);
#ifdef _OPENMP
    if (nt > 1) {
        int64_t first = -1;
#pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi;
            lora_split(rows, omp_get_thread_num(), omp_get_num_threads(), 1, &lo, &hi);
            const int64_t mine = rows_(kt, w, w_dtype, ldw, lo, hi, cols, &tm, write);
#pragma omp critical(lora_merge_first)
            if (mine >= 0 && (first < 0 || mine < first)) first = mine;
        }
        return first;
    }
#endif
    (void)nt;
    return rows_(kt, w, w_dtype, ldw, 0, rows, cols, &tm, write);
}

/* the largest magnitude's bits in rows [lo, hi): for float32 and for the 16-bit
 * formats alike, |x|'s bits (sign cleared) order the values, inf above every
 * finite value and every NaN above inf; integer maxima vectorise */
static uint32_t abs_max_bits_(const void *w, int dtype, int64_t ldw, int64_t lo, int64_t hi,
                              int64_t cols) {
    uint32_t m = 0;
    for (int64_t i = lo; i < hi; i++) {
        if (dtype == LORA_DTYPE_F32) {
            const uint32_t *v = (const uint32_t *)w + i * ldw;
            for (int64_t j = 0; j < cols; j++) {
                const uint32_t u = v[j] & 0x7fffffffu;
                m = u > m ? u : m;
            }
        } else {
            const uint16_t *v = (const uint16_t *)w + i * ldw;
            uint16_t m16 = 0;
            for (int64_t j = 0; j < cols; j++) {
                const uint16_t u = (uint16_t)(v[j] & 0x7fffu);
                m16 = u > m16 ? u : m16;
            }
            m = m16 > m ? m16 : m;
        }
    }
    return m;
}

double lora_abs_max(const void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0 || !lora_dtype_valid(w_dtype)) return 0.0;
    uint32_t m = 0;
    const int nt = lora_call_threads(rows * cols / 4);
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi;
            lora_split(rows, omp_get_thread_num(), omp_get_num_threads(), 1, &lo, &hi);
            const uint32_t mine = abs_max_bits_(w, w_dtype, ldw, lo, hi, cols);
#pragma omp critical(lora_abs_max)
            if (mine > m) m = mine;
        }
    } else
#endif
        m = abs_max_bits_(w, w_dtype, ldw, 0, rows, cols);
    (void)nt;
    const uint16_t m16 = (uint16_t)m;
    /* NaN when a NaN was seen (its bits are the largest) */
    return w_dtype == LORA_DTYPE_F32 ? (double)lora_load_f32(&m, 0, LORA_DTYPE_F32)
                                     : (double)lora_load_f32(&m16, 0, w_dtype);
}
