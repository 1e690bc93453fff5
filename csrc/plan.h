/*
 * plan.h - the plan of one lora_apply call: which members, which positions
 * in which order, cut into blocks.  apply.c checks a call's activations and
 * asks for a plan; plan.c makes it (the checks that can refuse a call, the
 * bank's grouping of positions by entry, the float32 widening of
 * half-precision deltas); experts.c routes (token, slot) pairs into one;
 * blocks.c runs it (blocks of positions through their entry's members, on
 * one thread or a team).  The calls go one way: apply.c -> experts.c ->
 * plan.c, blocks.c.
 *
 * A new op takes the same path: its routing into the same plan (positions in
 * an order, cut into blocks that never straddle two entries), and blocks.c
 * unchanged where a block is still "every member of one entry on up to
 * LORA_NB positions".  What one member adds is the kernels' business
 * (lora_term in kernels.h, applied in kernels_strip.h); what it does after
 * (its epilogue, lora.h's LORA_EPI_*) and which members a block skips (a
 * zero scale) are blocks.c's.
 */
#ifndef LORA_PLAN_H
#define LORA_PLAN_H

#include "internal.h"

/* bank plans for batches up to this size live on the stack */
#define LORA_STACK_BATCH 256
#define LORA_STACK_PLAN (3 * (LORA_STACK_BATCH + 16) + 2) /* int64s: up to 16 entries */

/* One call's work, shared by every op: which members, which positions. */
typedef struct {
    const lora_kernel_table *kt;
    int64_t n_entries;
    const int64_t *first;
    const lora_delta *const *deltas;
    const double *scales;       /* effective scale per member */
    int64_t rows, cols;
    /* positions: order[] (NULL = 0..n-1), cut into blocks; blk_start NULL =
     * uniform blocks of LORA_NB positions, all of entry 0 */
    int64_t n;
    const int64_t *order;
    const int64_t *blk_start;
    const int64_t *blk_entry;
    int64_t nblk;
    const double *pos_scales;   /* NULL or a multiplier per id */
    int64_t every;              /* position b's id is b / every */
    /* epilogues (lora.h): a kind per member (NULL: all plain) and their data,
     * per id i and member q epi_data[i * epi_stride + q] */
    const uint8_t *epilogues;
    const float *const *epi_data;
    int64_t epi_stride;
    int64_t max_rank_sum;       /* the largest sum of member ranks of one entry */
    int64_t max_members;
    /* LORA_OP_PROJECT / EXPERTS: x rows (position b reads row b / x_every: a
     * mixture of experts' token row shared by its slots; 1 everywhere else);
     * LORA_OP_ROWS: the token ids */
    const char *x;
    int x_dtype;
    int64_t ldx;
    int64_t x_every;
    const int64_t *ids;
    char *out;
    int out_dtype;
    int64_t ldo;
} lora_plan;

static inline int lora_ranges_overlap(const void *p, int64_t pbytes, const void *q,
                                      int64_t qbytes) {
    const char *a = (const char *)p, *b = (const char *)q;
    return a < b + qbytes && b < a + pbytes;
}

/* the kind of member q's epilogue */
static inline int lora_epilogue_of(const lora_plan *p, int64_t q) {
    return p->epilogues ? p->epilogues[q] : LORA_EPI_PLAIN;
}

/* member q's epilogue data at position b (NULL: a plain member, or none) */
static inline const float *lora_epi_data_of(const lora_plan *p, int64_t b, int64_t q) {
    if (!p->epi_data || lora_epilogue_of(p, q) == LORA_EPI_PLAIN) return NULL;
    return p->epi_data[b / p->every * p->epi_stride + q];
}

/* --- plan.c */

/* The checks and set-up every op shares: returns a status, and on LORA_OK a
 * plan whose bank buffer (if any, *heap_buf) the caller frees.  Everything
 * that can refuse the call's table, ids and scales is checked here, before
 * the first write; positions run entry_ids (or ids resolved by the op's
 * routing) with `every` positions per id. */
int lora_plan_call(lora_plan *p, const lora_call *c, const int64_t *entry_ids,
                   const double *pos_scales, int64_t every, int64_t *stack_buf,
                   int64_t **heap_buf);

/* private copies (own[0..2], freed by the caller) of entry_ids, pos_scales and
 * the gather's token ids where they share bytes with out */
int lora_unalias(const void *out, int64_t out_bytes, int64_t n, int64_t every,
                 const int64_t **entry_ids, const double **pos_scales, const int64_t **ids,
                 void *own[3]);

/* the float32 copies a prefill plan runs instead of some half-precision
 * deltas (see LORA_WIDEN_MIN in plan.c) */
typedef struct {
    lora_delta *wide;         /* [n], a zeroed slot where a delta is used as it is */
    const lora_delta **use;   /* [n]: the plan's deltas from now on */
    int64_t n;
} lora_widened;
/* on LORA_OK p->deltas may point at w->use; lora_widened_free(w) in any case */
int lora_plan_widen(lora_plan *p, lora_widened *w);
void lora_widened_free(lora_widened *w);

/* --- blocks.c */

/* run every block of the plan (gather: the token gather, else a projection);
 * returns a LORA_* status */
int lora_run_plan(const lora_plan *p, int gather);

/* Run a planned projection on x: position b reads row b / x_every, ldx
 * elements apart; half-precision deltas widened for the call where that pays
 * (lora_plan_widen).  A LORA_* status. */
int lora_run_projections(lora_plan *p, const void *x, int x_dtype, int64_t ldx, int64_t x_every);

/* --- experts.c */

/* LORA_OP_EXPERTS after apply.c's checks of the activations: the routing
 * checked and resolved into a plan, then run */
int lora_apply_experts_(const lora_call *c);

#endif /* LORA_PLAN_H */
