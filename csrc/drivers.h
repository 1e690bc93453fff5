/*
 * drivers.h - what the drivers' three files share: the plan of one call.
 * plan.c makes it (the checks that can refuse a call, the bank's grouping of
 * positions by entry, the float32 widening of half-precision deltas),
 * blocks.c runs it (blocks of positions through their entry's members, on
 * one thread or a team), and drivers.c holds the entry points of lora.h,
 * which check their own arguments and tie the two together.
 *
 * A new driver family takes the same path: its entry point, its planning
 * into the same plan (positions in an order, cut into blocks that never
 * straddle two entries), and blocks.c unchanged where a block is still "every
 * member of one entry on up to LORA_NB positions".  experts.c is one: a
 * mixture of experts resolves each (token, slot) pair to a kernel entry (its
 * adapter's expert), lets plan_bank_'s stable counting sort group the pairs
 * by expert, and reads x row q / x_every for pair q (a token's row shared by
 * its slots).  What one member adds is the kernels' business (lora_term in
 * kernels.h, applied in kernels_strip.h); which members a block skips (a zero
 * scale) is run_block_'s, in blocks.c.
 */
#ifndef LORA_DRIVERS_H
#define LORA_DRIVERS_H

#include "internal.h"

/* bank plans for batches up to this size live on the stack */
#define LORA_STACK_BATCH 256
#define LORA_STACK_PLAN (3 * (LORA_STACK_BATCH + 16) + 2) /* int64s: up to 16 entries */

/* One call's work, shared by every driver: which deltas, which positions. */
typedef struct {
    const lora_kernel_table *kt;
    int64_t n_entries;
    const int64_t *first;
    const lora_delta *const *deltas;
    const double *scales;       /* effective scale per delta */
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
    /* DoRA row factors (lora.h, lora_apply_batch_dora): NULL, or per id i and
     * member q factors[i * fac_stride + q], NULL for a plain member */
    const float *const *factors;
    int64_t fac_stride;
    int64_t max_rank_sum;       /* the largest sum of member ranks of one entry */
    int64_t max_members;
    /* prefill: x rows (position b reads row b / x_every: a mixture of experts'
     * token row shared by its slots; 1 everywhere else); gather: ids */
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

/* --- drivers.c */

/* The checks of an apply call's activations that only its entry point can
 * see: the dtype codes, leading dimensions (n_x rows of x, n_out of out),
 * alignment, the byte ranges of x and out (LORA_ERR_OVERLAP), and no
 * gather-only view among the deltas.  LORA_OK or the status to return. */
int lora_check_apply(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                     const void *x, int x_dtype, int64_t ldx, int64_t n_x, int64_t cols,
                     const void *out, int out_dtype, int64_t ldo, int64_t n_out, int64_t rows);

/* Run a planned projection call (lora_plan_call made p) on x: position b reads row
 * b / x_every, ldx elements apart; half-precision deltas widened for the call where that pays
 * (lora_plan_widen).  A LORA_* status. */
int lora_run_projections(lora_plan *p, const void *x, int x_dtype, int64_t ldx, int64_t x_every);

/* --- plan.c */

/* The checks and set-up every driver shares: returns a status, and on
 * LORA_OK a plan whose bank buffer (if any, *heap_buf) the caller frees.
 * Everything that can refuse the call is checked here, before the first
 * write. */
int lora_plan_call(lora_plan *p, int64_t n_entries, const int64_t *first,
                   const lora_delta *const *deltas, const double *scales,
                   const int64_t *entry_ids, const double *pos_scales, int64_t every,
                   int64_t rows, int64_t cols, int64_t n, void *out, int out_dtype, int64_t ldo,
                   const float *const *factors, int64_t fac_stride, int64_t *bad,
                   int64_t *stack_buf, int64_t **heap_buf);

/* member q's row factor at position b (NULL: a plain member, or no factors) */
static inline const float *lora_factor_of(const lora_plan *p, int64_t b, int64_t q) {
    return p->factors ? p->factors[b / p->every * p->fac_stride + q] : NULL;
}

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

/* run every block of the plan (gather: the token gather, else a prefill);
 * returns a LORA_* status */
int lora_run_plan(const lora_plan *p, int gather);

#endif /* LORA_DRIVERS_H */
