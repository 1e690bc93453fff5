/*
 * apply.c - lora_apply, the one entry point of every apply (lora.h): it
 * checks what only it can see (the op, dtype codes, leading dimensions,
 * alignment, overlap of x and out), makes the call's plan (plan.c; the
 * routing of experts.c for LORA_OP_EXPERTS) and runs it (blocks.c).  See
 * plan.h for how the files share a plan.
 *
 * A call is an entry table (a delta, a stack's members in order, a bank's
 * slots) and positions.  Positions are cut into blocks of up to LORA_NB of
 * one entry (a bank groups positions by entry first); a block is one fused
 * pass over the entry's members, every output element computed whole by one
 * thread with the ISA file's one summation order.
 */
#include <stdlib.h>

#include "plan.h"

/* The checks of the activations: the dtype codes, leading dimensions (n_x
 * rows of x, n_out of out), alignment, the byte ranges of x and out
 * (LORA_ERR_OVERLAP), and no gather-only view among the deltas of a
 * projection.  LORA_OK or the status to return. */
static int check_activations_(const lora_call *c, int64_t n_x) {
    const int64_t n = c->n, rows = c->rows, cols = c->cols;
    if (!lora_dtype_valid(c->out_dtype)) return LORA_ERR_DTYPE;
    const size_t osz = lora_dtype_size(c->out_dtype);
    if ((uintptr_t)c->out % osz || (uintptr_t)c->entry_ids % sizeof(int64_t) ||
        (uintptr_t)c->pos_scales % sizeof(double))
        return LORA_ERR_ALIGN;
    if (c->op == LORA_OP_ROWS) {
        if (n > 1 && c->ldo < cols) return LORA_ERR_ARG;
        if ((uintptr_t)c->ids % sizeof(int64_t)) return LORA_ERR_ALIGN;
        if (n > 0 && !c->ids) return LORA_ERR_ARG;
        return LORA_OK;
    }
    if (!lora_dtype_valid(c->x_dtype)) return LORA_ERR_DTYPE;
    const size_t xsz = lora_dtype_size(c->x_dtype);
    if ((n_x > 1 && c->ldx < cols) || (n > 1 && c->ldo < rows)) return LORA_ERR_ARG;
    if ((uintptr_t)c->x % xsz) return LORA_ERR_ALIGN;
    if (n_x > 0 && n > 0 &&
        lora_ranges_overlap(c->x, (int64_t)(((n_x - 1) * c->ldx + cols) * xsz), c->out,
                            (int64_t)(((n - 1) * c->ldo + rows) * osz)))
        return LORA_ERR_OVERLAP;
    for (int64_t q = 0; c->n_entries > 0 && c->first && q < c->first[c->n_entries]; q++)
        if (c->deltas[q] && c->deltas[q]->a.by_row) return LORA_ERR_ARG; /* a gather-only view */
    return LORA_OK;
}

/* LORA_OP_PROJECT and LORA_OP_ROWS: the plan over the entry ids, then its run */
static int apply_entries_(const lora_call *c, int64_t every) {
    const int rows_op = c->op == LORA_OP_ROWS;
    const int64_t n = c->n, width = rows_op ? c->cols : c->rows;
    const int64_t out_bytes =
        n > 0 ? (int64_t)(((n - 1) * c->ldo + width) * lora_dtype_size(c->out_dtype)) : 0;
    const int64_t *entry_ids = c->entry_ids, *ids = c->ids;
    const double *pos_scales = c->pos_scales;
    void *own[3] = {NULL, NULL, NULL};
    lora_plan p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf = NULL;
    int st = lora_unalias(c->out, out_bytes, n, every, &entry_ids, &pos_scales,
                          rows_op ? &ids : NULL, own);
    if (st == LORA_OK)
        st = lora_plan_call(&p, c, entry_ids, pos_scales, every, stack_buf, &heap_buf);
    if (st == LORA_OK && rows_op) {
        for (int64_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= c->rows) {
                if (c->bad) *c->bad = i;
                st = LORA_ERR_INDEX;
                break;
            }
        }
        if (st == LORA_OK) {
            p.ids = ids;
            st = lora_run_plan(&p, 1);
        }
    } else if (st == LORA_OK) {
        st = lora_run_projections(&p, c->x, c->x_dtype, c->ldx, c->x_every > 1 ? c->x_every : 1);
    }
    free(heap_buf);
    for (int k = 0; k < 3; k++) free(own[k]);
    return st;
}

int lora_apply(const lora_call *c) {
    if (!c) return LORA_ERR_ARG;
    if (c->bad) *c->bad = -1;
    if (c->op < LORA_OP_PROJECT || c->op > LORA_OP_EXPERTS || c->n < 0 || c->ids_every < 0 ||
        c->x_every < 0)
        return LORA_ERR_ARG;
    const int64_t every = c->ids_every > 1 ? c->ids_every : 1;
    const int64_t x_every = c->x_every > 1 ? c->x_every : 1;
    const int64_t n_x = c->n > 0 ? (c->n - 1) / x_every + 1 : 0;
    int st = check_activations_(c, n_x);
    if (st != LORA_OK) return st;
    if (c->op == LORA_OP_EXPERTS) return lora_apply_experts_(c);
    return apply_entries_(c, every);
}
