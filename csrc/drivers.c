/*
 * drivers.c - the entry points behind lora.h's apply calls: each checks the
 * arguments only it can see (dtype codes, leading dimensions, alignment,
 * overlap of x and out), makes the call's plan (plan.c) and runs it
 * (blocks.c).  See drivers.h for how the three files share a plan.
 *
 * A call is a set of entries (a delta, a stack's members in order, or a
 * bank's slots) and positions.  Positions are cut into blocks of up to
 * LORA_NB of one entry (a bank groups positions by entry first); a block is
 * one fused pass over the entry's members, every output element computed
 * whole by one thread with the ISA file's one summation order.
 */
#include <stdlib.h>

#include "drivers.h"

int lora_check_apply(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                     const void *x, int x_dtype, int64_t ldx, int64_t n_x, int64_t cols,
                     const void *out, int out_dtype, int64_t ldo, int64_t n_out, int64_t rows) {
    if (!lora_dtype_valid(x_dtype) || !lora_dtype_valid(out_dtype)) return LORA_ERR_DTYPE;
    const size_t xsz = lora_dtype_size(x_dtype), osz = lora_dtype_size(out_dtype);
    if ((n_x > 1 && ldx < cols) || (n_out > 1 && ldo < rows)) return LORA_ERR_ARG;
    if ((uintptr_t)x % xsz || (uintptr_t)out % osz) return LORA_ERR_ALIGN;
    if (n_x > 0 && n_out > 0 &&
        lora_ranges_overlap(x, (int64_t)(((n_x - 1) * ldx + cols) * xsz), out,
                            (int64_t)(((n_out - 1) * ldo + rows) * osz)))
        return LORA_ERR_OVERLAP;
    for (int64_t q = 0; n_entries > 0 && q < first[n_entries]; q++)
        if (deltas[q] && deltas[q]->a_by_row) return LORA_ERR_ARG; /* a gather-only view */
    return LORA_OK;
}

int lora_apply_batch(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                     const double *scales, const int64_t *entry_ids, const double *pos_scales,
                     int64_t ids_every, int64_t rows, int64_t cols, int64_t batch,
                     const void *x, int x_dtype, int64_t ldx, void *out, int out_dtype,
                     int64_t ldo, int64_t *bad) {
    return lora_apply_batch_dora(n_entries, first, deltas, scales, entry_ids, pos_scales,
                                 ids_every, rows, cols, batch, x, x_dtype, ldx, out, out_dtype,
                                 ldo, NULL, 0, bad);
}

int lora_apply_batch_dora(int64_t n_entries, const int64_t *first,
                          const lora_delta *const *deltas, const double *scales,
                          const int64_t *entry_ids, const double *pos_scales, int64_t ids_every,
                          int64_t rows, int64_t cols, int64_t batch, const void *x, int x_dtype,
                          int64_t ldx, void *out, int out_dtype, int64_t ldo,
                          const float *const *factors, int64_t fac_stride, int64_t *bad) {
    int st = lora_check_apply(n_entries, first, deltas, x, x_dtype, ldx, batch, cols, out,
                              out_dtype, ldo, batch, rows);
    if (st != LORA_OK) return st;
    if ((uintptr_t)entry_ids % sizeof(int64_t) || (uintptr_t)pos_scales % sizeof(double))
        return LORA_ERR_ALIGN;
    const size_t osz = lora_dtype_size(out_dtype);
    void *own[3] = {NULL, NULL, NULL};
    lora_plan p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf = NULL;
    st = lora_unalias(out, batch > 0 ? (int64_t)(((batch - 1) * ldo + rows) * osz) : 0, batch,
                      ids_every, &entry_ids, &pos_scales, NULL, own);
    if (st == LORA_OK)
        st = lora_plan_call(&p, n_entries, first, deltas, scales, entry_ids, pos_scales,
                            ids_every, rows, cols, batch, out, out_dtype, ldo, factors,
                            fac_stride, bad, stack_buf, &heap_buf);
    if (st == LORA_OK) st = lora_run_projections(&p, x, x_dtype, ldx, 1);
    free(heap_buf);
    for (int k = 0; k < 3; k++) free(own[k]);
    return st;
}

int lora_run_projections(lora_plan *p, const void *x, int x_dtype, int64_t ldx, int64_t x_every) {
    p->x = (const char *)x, p->x_dtype = x_dtype, p->ldx = ldx, p->x_every = x_every;
    lora_widened wide;
    int st = lora_plan_widen(p, &wide);
    if (st == LORA_OK) st = lora_run_plan(p, 0);
    lora_widened_free(&wide);
    return st;
}

int lora_apply_rows(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                    const double *scales, const int64_t *entry_ids, const double *pos_scales,
                    int64_t ids_every, int64_t rows, int64_t cols, int64_t n, const int64_t *ids,
                    void *out, int out_dtype, int64_t ldo, int64_t *bad) {
    return lora_apply_rows_dora(n_entries, first, deltas, scales, entry_ids, pos_scales,
                                ids_every, rows, cols, n, ids, out, out_dtype, ldo, NULL, 0, bad);
}

int lora_apply_rows_dora(int64_t n_entries, const int64_t *first,
                         const lora_delta *const *deltas, const double *scales,
                         const int64_t *entry_ids, const double *pos_scales, int64_t ids_every,
                         int64_t rows, int64_t cols, int64_t n, const int64_t *ids, void *out,
                         int out_dtype, int64_t ldo, const float *const *factors,
                         int64_t fac_stride, int64_t *bad) {
    if (!lora_dtype_valid(out_dtype)) return LORA_ERR_DTYPE;
    if (n > 1 && ldo < cols) return LORA_ERR_ARG;
    if ((uintptr_t)out % lora_dtype_size(out_dtype) || (uintptr_t)ids % sizeof(int64_t) ||
        (uintptr_t)entry_ids % sizeof(int64_t) || (uintptr_t)pos_scales % sizeof(double))
        return LORA_ERR_ALIGN;
    void *own[3] = {NULL, NULL, NULL};
    lora_plan p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf = NULL;
    const size_t osz = lora_dtype_size(out_dtype);
    const int64_t out_bytes = n > 0 ? (int64_t)(((n - 1) * ldo + cols) * osz) : 0;
    int st = lora_unalias(out, out_bytes, n, ids_every, &entry_ids, &pos_scales, &ids, own);
    if (st == LORA_OK)
        st = lora_plan_call(&p, n_entries, first, deltas, scales, entry_ids, pos_scales,
                            ids_every, rows, cols, n, out, out_dtype, ldo, factors, fac_stride,
                            bad, stack_buf, &heap_buf);
    if (st == LORA_OK) {
        for (int64_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= rows) {
                if (bad) *bad = i;
                st = LORA_ERR_INDEX;
                break;
            }
        }
    }
    if (st == LORA_OK) {
        p.ids = ids;
        st = lora_run_plan(&p, 1);
    }
    free(heap_buf);
    for (int k = 0; k < 3; k++) free(own[k]);
    return st;
}

int lora_add_batch(const lora_delta *d, float scale, int64_t batch, const void *x, int x_dtype,
                   int64_t ldx, void *out, int out_dtype, int64_t ldo) {
    static const int64_t first[2] = {0, 1};
    if (!d) return LORA_ERR_ARG;
    const double s = scale;
    return lora_apply_batch(1, first, &d, &s, NULL, NULL, 1, d->rows, d->cols, batch, x, x_dtype,
                            ldx, out, out_dtype, ldo, NULL);
}

int lora_add(const lora_delta *d, float scale, const void *x, int x_dtype, void *out,
             int out_dtype) {
    if (!d) return LORA_ERR_ARG;
    return lora_add_batch(d, scale, 1, x, x_dtype, d->cols, out, out_dtype, d->rows);
}

int lora_add_at(const lora_delta *d, float scale, intptr_t x, int x_dtype, intptr_t out,
                int out_dtype) {
    return lora_add(d, scale, (const void *)x, x_dtype, (void *)out, out_dtype);
}

int lora_add_batch_at(const lora_delta *d, float scale, int64_t batch, intptr_t x, int x_dtype,
                      int64_t ldx, intptr_t out, int out_dtype, int64_t ldo) {
    return lora_add_batch(d, scale, batch, (const void *)x, x_dtype, ldx, (void *)out, out_dtype,
                          ldo);
}

int lora_add_rows(const lora_delta *d, float scale, int64_t n, const int64_t *ids, void *out,
                  int out_dtype, int64_t ldo, int64_t *bad) {
    static const int64_t first[2] = {0, 1};
    if (!d) return LORA_ERR_ARG;
    const double s = scale;
    return lora_apply_rows(1, first, &d, &s, NULL, NULL, 1, d->rows, d->cols, n, ids, out,
                           out_dtype, ldo, bad);
}
