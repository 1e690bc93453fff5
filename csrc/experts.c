/*
 * experts.c - mixtures of experts (lora.h, LORA_OP_EXPERTS): the (token,
 * slot) pairs a router chose, each through its own expert's delta, in one
 * call.  Pair p routes to expert expert_ids[p] of adapter
 * entry_ids[p / ids_every]; that expert is one kernel entry of the call's
 * entry table (entry starts[adapter] + expert), so the rest is a bank call:
 * the plan (plan.c) groups the pairs by kernel entry with the bank's stable
 * counting sort and cuts them into blocks of up to LORA_NB pairs of one
 * expert, and blocks.c runs them (threads take whole blocks: a decode's k
 * experts are k blocks).  Each expert's A and B therefore stream once per
 * block, and every pair's row is computed by the same project / accumulate
 * kernels as the expert's delta alone, so its bits equal a decode of that expert on that
 * row whatever the routing, the batch or the thread count.
 *
 * The one thing a bank call does not have is the x row divisor: with
 * x_every = k, pair p reads x row p / k (the gate / up projection, where a
 * token's k slots share its hidden state); x_every = 1 gives one x row per
 * pair (the down projection, or flattened, expert-sorted pairs).
 *
 * Everything the caller passes is read, checked and resolved into a private
 * per-pair entry array (and per-pair multipliers) before the first write, so
 * ids that share memory with out cannot change under the kernels.
 */
#include <stdlib.h>

#include "plan.h"

/* calls of up to this many pairs resolve their routing on the stack (no
 * allocation on the decode path) */
#define LORA_STACK_PAIRS 256

int lora_apply_experts_(const lora_call *c) {
    const int64_t n = c->n, n_adapters = c->n_adapters, n_experts = c->n_experts;
    const int64_t ids_every = c->ids_every > 1 ? c->ids_every : 1;
    const int64_t *starts = c->starts, *adapter_ids = c->entry_ids, *expert_ids = c->expert_ids;
    const double *pos_scales = c->pos_scales;
    if (c->n_entries < 1 || n_adapters < 1 || n_experts < 1 || !c->first || !c->deltas ||
        !c->scales || !starts || (n > 0 && !expert_ids) || c->epi_stride != 0)
        return LORA_ERR_ARG;
    if (starts[0] < 0 || starts[n_adapters] > c->n_entries) return LORA_ERR_ARG;
    for (int64_t a = 0; a < n_adapters; a++)
        if (starts[a + 1] < starts[a]) return LORA_ERR_ARG;
    if ((uintptr_t)expert_ids % sizeof(int64_t)) return LORA_ERR_ALIGN;

    /* every id, before anything else reads them */
    const int64_t n_ids = n > 0 ? (n - 1) / ids_every + 1 : 0;
    for (int64_t i = 0; adapter_ids && i < n_ids; i++) {
        if (adapter_ids[i] < -1 || adapter_ids[i] >= n_adapters) {
            if (c->bad) *c->bad = i;
            return LORA_ERR_ADAPTER;
        }
    }
    for (int64_t q = 0; q < n; q++) {
        if (expert_ids[q] < -1 || expert_ids[q] >= n_experts) {
            if (c->bad) *c->bad = q;
            return LORA_ERR_INDEX;
        }
    }
    if (n == 0) return LORA_OK;

    /* the kernel entry of each pair (-1: no expert, no adapter, or an adapter
     * slot holding no experts), and its multiplier */
    int64_t entry_stack[LORA_STACK_PAIRS];
    double mul_stack[LORA_STACK_PAIRS];
    int64_t *entry = entry_stack;
    double *mul = pos_scales ? mul_stack : NULL;
    void *heap = NULL;
    if (n > LORA_STACK_PAIRS) {
        heap = malloc((size_t)n * (sizeof(int64_t) + (pos_scales ? sizeof(double) : 0)));
        if (!heap) return LORA_ERR_NOMEM;
        entry = (int64_t *)heap;
        if (pos_scales) mul = (double *)(entry + n);
    }
    for (int64_t q = 0; q < n; q++) {
        const int64_t a = adapter_ids ? adapter_ids[q / ids_every] : 0, e = expert_ids[q];
        entry[q] = (a < 0 || e < 0 || starts[a + 1] - starts[a] < n_experts) ? -1 : starts[a] + e;
        if (mul) mul[q] = pos_scales[q / ids_every];
    }

    lora_plan p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf = NULL;
    int st = lora_plan_call(&p, c, entry, mul, 1, stack_buf, &heap_buf);
    if (st == LORA_ERR_SCALE && c->bad && *c->bad >= 0) *c->bad /= ids_every; /* the caller's index */
    if (st == LORA_OK)
        st = lora_run_projections(&p, c->x, c->x_dtype, c->ldx, c->x_every > 1 ? c->x_every : 1);
    free(heap_buf);
    free(heap);
    return st;
}
