/*
 * dora.c - DoRA's base statistics and row factors (lora.h): the float64
 * numbers from which the norm of every row of W + s B A follows for any
 * scale s without another pass over W.
 *
 *   |W_i + s (B A)_i|^2 = |W_i|^2 + 2 s <b_i, (W A^T)_i> + s^2 b_i^T (A A^T) b_i
 *
 * lora_dora_stats reads the base once (any layout, through element strides)
 * and keeps |W_i|^2, W A^T [n, r] and A A^T [r, r]; lora_dora_factor turns
 * them into the norm and the row factor m / norm for one scale in O(n r^2).
 * An embedding table's DoRA norm is per column, over the vocab: the same
 * algebra on E^T with P = B^T and Q = A^T (by_col).  Every sum runs over its
 * index in ascending order; threads split rows (or the Gram's rows), never a
 * sum, so the results do not depend on the thread count.  Portable C: the
 * statistics are made once per base, the factor once per scale.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* rows of the base per step of the statistics: one pass over k reads a
 * strip of this many rows (consecutive in memory for a transposed base) */
#define DORA_ROWS 16

/* element (t, j) of P [r, k] and (i, t) of Q [n, r], from the delta's storage:
 * by_col 0: P = A, Q = B; by_col 1: P = B^T, Q = A^T */
static double p_at_(const lora_delta *d, int by_col, int64_t t, int64_t j) {
    const lora_factor *f = by_col ? &d->bt : &d->a;
    return lora_run_load(lora_run_of(f), f->by_row ? j * f->ld + t : t * f->ld + j, f->fmt);
}

static double q_at_(const lora_delta *d, int by_col, int64_t i, int64_t t) {
    return p_at_(d, !by_col, t, i);
}

int lora_dora_stats(const lora_delta *d, int by_col, const void *w, int w_dtype, int64_t ld_i,
                    int64_t ld_k, double *sq, double *vp, double *gram) {
    if (!d) return LORA_ERR_ARG;
    if (!lora_dtype_valid(w_dtype)) return LORA_ERR_DTYPE;
    if (ld_i < 0 || ld_k < 0 || (uintptr_t)w % lora_dtype_size(w_dtype)) return LORA_ERR_ARG;
    const int64_t r = d->rank;
    const int64_t n = by_col ? d->cols : d->rows, k = by_col ? d->rows : d->cols;
    /* P^T [k, r] in float64, so the inner loop over t is unit-stride */
    double *pt = (double *)malloc((size_t)(k * r) * sizeof(double));
    if (!pt) return LORA_ERR_NOMEM;
    for (int64_t j = 0; j < k; j++)
        for (int64_t t = 0; t < r; t++) pt[j * r + t] = p_at_(d, by_col, t, j);
    const int64_t nblk = (n + DORA_ROWS - 1) / DORA_ROWS;
    const int nt = lora_call_threads(n * k * (r + 1), 0);
#ifndef _OPENMP
    (void)nt; /* a serial build: one thread */
#endif
    int st = LORA_OK;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
        /* each row's sums, from 0, over j ascending */
        double *acc = (double *)malloc((size_t)(DORA_ROWS * (r + 1)) * sizeof(double));
        if (!acc) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            st = LORA_ERR_NOMEM;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t blk = 0; blk < nblk; blk++) {
            if (!acc) continue;
            const int64_t i0 = blk * DORA_ROWS;
            const int nr = (int)(n - i0 < DORA_ROWS ? n - i0 : DORA_ROWS);
            for (int64_t z = 0; z < (int64_t)DORA_ROWS * (r + 1); z++) acc[z] = 0.0;
            for (int64_t j = 0; j < k; j++) {
                const double *pj = pt + j * r;
                for (int ii = 0; ii < nr; ii++) {
                    const double v = lora_load_f32(w, (i0 + ii) * ld_i + j * ld_k, w_dtype);
                    double *a = acc + ii * (r + 1);
                    a[r] += v * v;
                    for (int64_t t = 0; t < r; t++) a[t] += v * pj[t];
                }
            }
            for (int ii = 0; ii < nr; ii++) {
                const double *a = acc + ii * (r + 1);
                sq[i0 + ii] = a[r];
                for (int64_t t = 0; t < r; t++) vp[(i0 + ii) * r + t] = a[t];
            }
        }
        free(acc);
        /* the Gram: rows of it per thread */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < r; t++) {
            for (int64_t u = 0; u < r; u++) {
                double s = 0.0;
                for (int64_t j = 0; j < k; j++) s += pt[j * r + t] * pt[j * r + u];
                gram[t * r + u] = s;
            }
        }
    }
    free(pt);
    return st;
}

int lora_dora_factor(const lora_delta *d, int by_col, const double *sq, const double *vp,
                     const double *gram, const float *magnitude, double s, float *g, float *norm,
                     int64_t *bad) {
    if (bad) *bad = -1;
    if (!d) return LORA_ERR_ARG;
    const int64_t r = d->rank, n = by_col ? d->cols : d->rows;
    const int nt = lora_call_threads(n * r * (r + 2), 0);
#ifndef _OPENMP
    (void)nt;
#endif
    int64_t first_bad = n;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static) reduction(min : first_bad)
#endif
    for (int64_t i = 0; i < n; i++) {
        double cross = 0.0, quad = 0.0; /* <q_i, vp_i> and q_i^T G q_i */
        for (int64_t t = 0; t < r; t++) {
            const double qt = q_at_(d, by_col, i, t);
            cross += qt * vp[i * r + t];
            double row = 0.0;
            for (int64_t u = 0; u < r; u++) row += gram[t * r + u] * q_at_(d, by_col, i, u);
            quad += qt * row;
        }
        const double n2 = sq[i] + 2.0 * s * cross + s * s * quad;
        const double nrm = sqrt(n2 > 0.0 ? n2 : 0.0);
        if (!(nrm > 0.0) || !isfinite(nrm)) {
            if (i < first_bad) first_bad = i;
            continue;
        }
        norm[i] = (float)nrm;
        g[i] = (float)((double)magnitude[i] / nrm);
        if (!isfinite(g[i]) && i < first_bad) first_bad = i; /* a norm too small for float32 */
    }
    if (first_bad < n) {
        if (bad) *bad = first_bad;
        return LORA_ERR_NORM;
    }
    return LORA_OK;
}
