/*
 * plan.c - the plan of one call (plan.h): the checks that can refuse it,
 * all made before the first write; the bank's grouping of positions by entry
 * (a stable counting sort, so each adapter's weights stream once per block);
 * the float32 copies of half-precision deltas that serve many positions of
 * one prefill; and private copies of ids and scales that alias out.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"

/* A delta not stored in float32 serving at least this many positions of one
 * prefill call is widened to float32 once for the call (the ISA's run loader,
 * a vectorised copy of ~1 us per 64 Ki values) and run through the float32
 * kernels: they follow the same summation order on the same (exactly
 * converted) values, so the bits do not change, while the per-load
 * conversion that would cost up to half of the kernel's arithmetic is paid
 * once instead of once per block.  (At 32 positions the copy's page faults
 * cost more than it saved: measured.)  Not for a delta with a factor in a
 * format the ISA sums in an order of its own (kernel table's own_order:
 * AVX-512 bfloat16), whose bits a float32 copy would change. */
#define LORA_WIDEN_MIN 256

/* the largest double whose float32 rounding is finite: FLT_MAX + half an ulp,
 * 0x1.ffffffp+127, written in decimal (exact: (2^25 - 1) * 2^103) because
 * MSVC's C compiler does not take hexadecimal float literals in every mode */
#define LORA_F32_LIMIT 340282356779733661637539395458142568448.0

static int finite_f32_(double v) { return fabs(v) < LORA_F32_LIMIT; } /* false for nan */

/* the entry position b runs, or -1: no adapter, an empty entry, or a zero
 * multiplier on an entry none of whose members has an epilogue that acts at
 * scale 0 (a row factor still applies there) */
static int64_t entry_of_(const lora_plan *p, const int64_t *entry_ids, int64_t b) {
    const int64_t i = b / p->every, e = entry_ids ? entry_ids[i] : 0;
    if (e < 0 || p->first[e + 1] == p->first[e]) return -1;
    if (p->pos_scales && p->pos_scales[i] == 0.0) {
        for (int64_t q = p->first[e]; q < p->first[e + 1]; q++)
            if (lora_epi_data_of(p, b, q)) return e;
        return -1;
    }
    return e;
}

/* Fill the plan's position order and blocks for a bank call: positions
 * grouped by entry (a stable counting sort, so each adapter's weights are
 * streamed once per block of LORA_NB positions; a block never straddles two
 * entries, since each entry's blocks step from its own start); -1, empty
 * entries and positions whose multiplier is 0 left out.  `buf` holds
 * 3 * (batch + n_entries) + 2 int64s. */
static void plan_bank_(lora_plan *p, const int64_t *entry_ids, int64_t batch, int64_t *buf) {
    const int64_t ne = p->n_entries;
    int64_t *order = buf, *blk_start = order + batch, *blk_entry = blk_start + batch + ne + 1;
    int64_t *cursor = blk_entry + batch + ne;
    for (int64_t e = 0; e <= ne; e++) cursor[e] = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t e = entry_of_(p, entry_ids, b);
        if (e >= 0) cursor[e + 1]++;
    }
    for (int64_t e = 0; e < ne; e++) cursor[e + 1] += cursor[e];
    const int64_t n = cursor[ne];
    int64_t nblk = 0;
    for (int64_t e = 0; e < ne; e++)
        for (int64_t s = cursor[e]; s < cursor[e + 1]; s += LORA_NB) {
            blk_start[nblk] = s;
            blk_entry[nblk++] = e;
        }
    blk_start[nblk] = n;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t e = entry_of_(p, entry_ids, b);
        if (e >= 0) order[cursor[e]++] = b;
    }
    p->n = n, p->order = order, p->blk_start = blk_start, p->blk_entry = blk_entry, p->nblk = nblk;
}

/* a delta with a factor not in float32 */
static int narrow_delta_(const lora_delta *d) {
    return d->a.fmt != LORA_FMT_F32 || d->bt.fmt != LORA_FMT_F32;
}

/* Swap each delta not in float32 that serves >= LORA_WIDEN_MIN positions of
 * this call for a float32 copy (see LORA_WIDEN_MIN). */
int lora_plan_widen(lora_plan *p, lora_widened *w) {
    w->wide = NULL, w->use = NULL, w->n = 0;
    const int64_t nd = p->n_entries > 0 ? p->first[p->n_entries] : 0;
    if (p->n < LORA_WIDEN_MIN || nd == 0) return LORA_OK;
    int any = 0;
    for (int64_t q = 0; q < nd; q++) any |= narrow_delta_(p->deltas[q]);
    if (!any) return LORA_OK;
    /* positions per entry */
    int64_t count_stack[16], *count = count_stack;
    if (p->n_entries > 16 && !(count = (int64_t *)calloc((size_t)p->n_entries, sizeof *count)))
        return LORA_ERR_NOMEM;
    if (count == count_stack) memset(count_stack, 0, sizeof count_stack);
    if (p->blk_start) {
        for (int64_t k = 0; k < p->nblk; k++)
            count[p->blk_entry[k]] += p->blk_start[k + 1] - p->blk_start[k];
    } else {
        count[0] = p->n;
    }
    w->wide = (lora_delta *)calloc((size_t)nd, sizeof *w->wide);
    w->use = (const lora_delta **)malloc((size_t)nd * sizeof *w->use);
    w->n = nd;
    int st = (w->wide && w->use) ? LORA_OK : LORA_ERR_NOMEM;
    for (int64_t e = 0; st == LORA_OK && e < p->n_entries; e++) {
        for (int64_t q = p->first[e]; q < p->first[e + 1]; q++) {
            const lora_delta *d = p->deltas[q];
            w->use[q] = d;
            const unsigned own = p->kt->own_order;
            if (!narrow_delta_(d) || !d->owned || count[e] < LORA_WIDEN_MIN ||
                p->scales[q] == 0.0 || (own >> d->a.fmt & 1u) || (own >> d->bt.fmt & 1u))
                continue;
            const int64_t na = d->rank * d->a.ld, nb = d->rank * d->bt.ld;
            float *buf = (float *)lora_aligned_alloc((size_t)(na + nb) * sizeof(float));
            if (!buf) {
                st = LORA_ERR_NOMEM;
                break;
            }
            lora_delta *wd = &w->wide[q];
            *wd = *d;
            wd->a.v = buf, wd->bt.v = buf + na;
            wd->a.d = wd->bt.d = NULL;
            wd->a.fmt = wd->bt.fmt = LORA_FMT_F32;
            p->kt->load[d->a.fmt](lora_run_of(&d->a), 0, na, buf);
            p->kt->load[d->bt.fmt](lora_run_of(&d->bt), 0, nb, buf + na);
            w->use[q] = wd;
        }
    }
    if (count != count_stack) free(count);
    if (st == LORA_OK) p->deltas = w->use;
    return st;
}

void lora_widened_free(lora_widened *w) {
    if (w->wide)
        for (int64_t q = 0; q < w->n; q++)
            if (w->wide[q].a.v) lora_aligned_free(w->wide[q].a.v);
    free(w->wide);
    free(w->use);
    w->wide = NULL, w->use = NULL, w->n = 0;
}

int lora_plan_call(lora_plan *p, const lora_call *c, const int64_t *entry_ids,
                   const double *pos_scales, int64_t every, int64_t *stack_buf,
                   int64_t **heap_buf) {
    *heap_buf = NULL;
    const int64_t n_entries = c->n_entries, rows = c->rows, cols = c->cols, n = c->n;
    const int64_t *first = c->first;
    const lora_delta *const *deltas = c->deltas;
    const double *scales = c->scales;
    if (n_entries < 1 || rows < 1 || cols < 1 || n < 0 || every < 1 || !first || !deltas ||
        !scales)
        return LORA_ERR_ARG;
    memset(p, 0, sizeof *p);
    p->kt = lora_active_kernels();
    p->n_entries = n_entries, p->first = first, p->deltas = deltas, p->scales = scales;
    p->rows = rows, p->cols = cols;
    p->pos_scales = pos_scales, p->every = every;
    p->out = (char *)c->out, p->out_dtype = c->out_dtype, p->ldo = c->ldo;
    p->x_every = 1;
    p->epilogues = c->epilogues, p->epi_data = c->epi_data, p->epi_stride = c->epi_stride;
    if (c->epi_data && c->epi_stride < 0) return LORA_ERR_ARG;
    for (int64_t q = 0; q < first[n_entries]; q++) {
        const lora_delta *d = deltas[q];
        if (!d || d->rows != rows || d->cols != cols) return LORA_ERR_ARG;
        if (c->epilogues && c->epilogues[q] >= LORA_EPI_COUNT) return LORA_ERR_ARG;
        if (!finite_f32_(scales[q])) return LORA_ERR_SCALE;
    }
    for (int64_t e = 0; e < n_entries; e++) {
        int64_t sum = 0;
        for (int64_t q = first[e]; q < first[e + 1]; q++) sum += deltas[q]->rank;
        if (sum > p->max_rank_sum) p->max_rank_sum = sum;
        if (first[e + 1] - first[e] > p->max_members) p->max_members = first[e + 1] - first[e];
    }
    const int64_t n_ids = (n + every - 1) / every;
    if (entry_ids) {
        for (int64_t i = 0; i < n_ids; i++) {
            if (entry_ids[i] < -1 || entry_ids[i] >= n_entries) {
                if (c->bad) *c->bad = i;
                return LORA_ERR_ADAPTER;
            }
        }
    }
    if (pos_scales) {
        /* a multiplier must be finite, and every scale a position will use (its
         * product with each member's scale) finite in float32 */
        for (int64_t i = 0; i < n_ids; i++) {
            const int64_t e = entry_ids ? entry_ids[i] : 0;
            int ok = isfinite(pos_scales[i]);
            for (int64_t q = e >= 0 ? first[e] : 0; ok && e >= 0 && q < first[e + 1]; q++)
                ok = finite_f32_(scales[q] * pos_scales[i]);
            if (!ok) {
                if (c->bad) *c->bad = i;
                return LORA_ERR_SCALE;
            }
        }
    }
    if (n == 0 || first[n_entries] == 0) return LORA_OK;
    int any = 0; /* all scales 0 and no epilogue data: nothing to do, not even waking a team */
    for (int64_t q = 0; q < first[n_entries]; q++) any |= (float)scales[q] != 0.0f;
    if (p->epi_data) {
        const int64_t stride = p->epi_stride ? p->epi_stride : first[n_entries];
        const int64_t n_data = (p->epi_stride ? n_ids : 1) * stride;
        for (int64_t k = 0; !any && k < n_data; k++)
            any |= p->epi_data[k] != NULL && lora_epilogue_of(p, k % stride) != LORA_EPI_PLAIN;
    }
    if (!any) return LORA_OK;
    if (entry_ids || pos_scales) {
        const int64_t need = 3 * (n + n_entries) + 2;
        int64_t *buf = stack_buf;
        if (need > LORA_STACK_PLAN) {
            buf = *heap_buf = (int64_t *)malloc((size_t)need * sizeof(int64_t));
            if (!buf) return LORA_ERR_NOMEM;
        }
        plan_bank_(p, entry_ids, n, buf);
    } else {
        p->n = n;
        p->nblk = (n + LORA_NB - 1) / LORA_NB;
    }
    return LORA_OK;
}

/* The ids and scales are read while out is written: one that shares bytes with out (a view
 * of out's own memory) would change under the kernels, and a token id read after a write could
 * point anywhere.  Such an input is copied first; *p then points at the copy in *own, which
 * the caller frees.  (Never the case for well-formed calls: no cost then.) */
static int private_copy_(const void *out, int64_t out_bytes, const void **p, int64_t bytes,
                         void **own) {
    *own = NULL;
    if (!*p || bytes <= 0 || out_bytes <= 0 || !lora_ranges_overlap(*p, bytes, out, out_bytes))
        return LORA_OK;
    *own = malloc((size_t)bytes);
    if (!*own) return LORA_ERR_NOMEM;
    memcpy(*own, *p, (size_t)bytes);
    *p = *own;
    return LORA_OK;
}

/* private copies of entry_ids, pos_scales (and the gather's token ids) that alias out */
int lora_unalias(const void *out, int64_t out_bytes, int64_t n, int64_t every,
                 const int64_t **entry_ids, const double **pos_scales, const int64_t **ids,
                 void *own[3]) {
    const int64_t n_ids = every > 0 ? (n + every - 1) / every : 0;
    int st = private_copy_(out, out_bytes, (const void **)entry_ids, n_ids * 8, &own[0]);
    if (st == LORA_OK)
        st = private_copy_(out, out_bytes, (const void **)pos_scales, n_ids * 8, &own[1]);
    if (st == LORA_OK && ids)
        st = private_copy_(out, out_bytes, (const void **)ids, n * 8, &own[2]);
    return st;
}
