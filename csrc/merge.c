/*
 * merge.c - merges (merge_into / unmerge_from): w + sum_t s_t * B_t @ A_t
 * formed in float64, rounded once into w's dtype, checked for overflow.
 *
 * One pass over w, a chunk of a row at a time, nothing materialised: widen w
 * (the active ISA's exact widening), add each term in order with the ISA's
 * merge_row kernel (the product over the rank in double, then scaled and
 * added: see kernels_merge.h), round once to nearest even (float16 and
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

typedef struct {
    int n_terms;
    const double *const *a;  /* a[t]: A_t [ranks[t], cols] */
    const double *const *b;  /* b[t]: B_t [rows, ranks[t]] */
    const int64_t *ranks;
    const double *scales;
} terms_;

/* rows [lo, hi): checked (the flat index of the first element finite in w
 * whose result is not, or -1) or written (every result stored; -1).  A
 * float32 w is read and written in place; any other dtype through the ISA's
 * exact widening and its rounding (a result is finite in w's dtype when its
 * rounding, widened back, is). */
static int64_t rows_(const lora_kernel_table *kt, void *w, int dtype, int64_t ldw, int64_t lo,
                     int64_t hi, int64_t cols, const terms_ *tm, int write) {
    float wf[MERGE_CHUNK], r[MERGE_CHUNK], back[MERGE_CHUNK];
    double acc[MERGE_CHUNK];
    float h[MERGE_CHUNK]; /* the rounded results, in w's dtype (at most 4 bytes each) */
    const size_t isz = lora_dtype_size(dtype);
    for (int64_t i = lo; i < hi; i++) {
        for (int64_t j0 = 0; j0 < cols; j0 += MERGE_CHUNK) {
            const int64_t n = cols - j0 < MERGE_CHUNK ? cols - j0 : MERGE_CHUNK;
            const int64_t off = i * ldw + j0;
            char *wp = (char *)w + (size_t)off * isz;
            const float *w0;
            if (dtype == LORA_DTYPE_F32) {
                w0 = (const float *)wp;
            } else {
                kt->widen[dtype](wp, n, wf);
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
                    memcpy(wp, r, (size_t)n * sizeof(float));
                    continue;
                }
                for (int64_t j = 0; j < n; j++)
                    if (!isfinite(r[j]) && isfinite(w0[j])) return i * cols + j0 + j;
                continue;
            }
            if (write) {
                kt->narrow[dtype](r, n, wp);
                continue;
            }
            kt->narrow[dtype](r, n, h);
            kt->widen[dtype](h, n, back);
            for (int64_t j = 0; j < n; j++)
                if (!isfinite(back[j]) && isfinite(w0[j])) return i * cols + j0 + j;
        }
    }
    return -1;
}

int lora_merge(void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols, int n_terms,
               const double *const *a, const double *const *b, const int64_t *ranks,
               const double *scales, int write, int64_t *bad) {
    if (bad) *bad = -1;
    if (!lora_dtype_valid(w_dtype)) return LORA_ERR_DTYPE;
    if (!w || !a || !b || !ranks || !scales || rows < 1 || cols < 1 || n_terms < 1 ||
        (rows > 1 && ldw < cols))
        return LORA_ERR_ARG;
    for (int t = 0; t < n_terms; t++)
        if (ranks[t] < 1 || !a[t] || !b[t]) return LORA_ERR_ARG;
    const lora_kernel_table *kt = lora_active_kernels();
    const terms_ tm = {n_terms, a, b, ranks, scales};
    int64_t work = 0;
    for (int t = 0; t < n_terms; t++) work += ranks[t];
    const int nt = lora_call_threads(rows * cols * work, 0);
    int64_t first = -1;
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi;
            lora_split(rows, omp_get_thread_num(), omp_get_num_threads(), 1, &lo, &hi);
            const int64_t mine = rows_(kt, w, w_dtype, ldw, lo, hi, cols, &tm, write);
#pragma omp critical(lora_merge_first)
            if (mine >= 0 && (first < 0 || mine < first)) first = mine;
        }
    } else
#endif
        first = rows_(kt, w, w_dtype, ldw, 0, rows, cols, &tm, write);
    (void)nt;
    if (bad) *bad = first;
    return LORA_OK;
}

/* The largest magnitude's bits in rows [lo, hi): for float32 and for the
 * 16-bit formats alike (IEEE-style: a sign bit on top), |x|'s bits (sign
 * cleared) order the values, inf above every finite value and every NaN above
 * inf; integer maxima vectorise.  By element size: */
LORA_DTYPES(LORA_SIZE_2_OR_4, merge_abs_max)
static uint32_t abs_max_bits_(const void *w, size_t isz, int64_t ldw, int64_t lo, int64_t hi,
                              int64_t cols) {
    uint32_t m = 0;
    for (int64_t i = lo; i < hi; i++) {
        if (isz == 4) {
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

int lora_abs_max(const void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols,
                 double *max) {
    if (max) *max = 0.0;
    if (!lora_dtype_valid(w_dtype)) return LORA_ERR_DTYPE;
    if (!w || !max || rows < 1 || cols < 1 || (rows > 1 && ldw < cols)) return LORA_ERR_ARG;
    const size_t isz = lora_dtype_size(w_dtype);
    uint32_t m = 0;
    const int nt = lora_call_threads(rows * cols / 4, 0);
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            int64_t lo, hi;
            lora_split(rows, omp_get_thread_num(), omp_get_num_threads(), 1, &lo, &hi);
            const uint32_t mine = abs_max_bits_(w, isz, ldw, lo, hi, cols);
#pragma omp critical(lora_abs_max)
            if (mine > m) m = mine;
        }
    } else
#endif
        m = abs_max_bits_(w, isz, ldw, 0, rows, cols);
    (void)nt;
    /* the value of those bits (NaN when a NaN was seen: its bits are the
     * largest), stored as the type lora_load_f32 reads them as */
    union { float f; uint16_t h; } v;
    if (isz == 4) memcpy(&v.f, &m, sizeof v.f);
    else v.h = (uint16_t)m;
    *max = (double)lora_load_f32(&v, 0, w_dtype);
    return LORA_OK;
}
