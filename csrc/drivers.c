/*
 * drivers.c - the OpenMP drivers behind every entry point: one plan of which
 * deltas meet which positions, cut into blocks, run on one thread or a team.
 * The ISA files hold only kernels; all threading is here.
 *
 * A call is a set of entries (a delta, a stack's members in order, or a
 * bank's slots) and positions.  Positions are cut into blocks of up to
 * LORA_NB of one entry (a bank groups positions by entry with a stable
 * counting sort, so each adapter's weights stream once per block); a block
 * is one fused pass over the entry's members: t_q = A_q x for every member
 * q, then out += sum_q s_q B_q t_q with every member adding, in order, into
 * a strip of out that stays in L1 (for the gather: out += sum_q s_q B_q[id]
 * A_q).  With many blocks, threads take whole blocks.  With few (decode,
 * small prefill) the whole team works on each block: threads split the rank
 * outputs of every A_q x, meet at one barrier, then split the rows of out
 * (the gather splits its columns and needs no barrier).  Either way a thread
 * computes whole output elements with the ISA file's one summation order, so
 * the bits never depend on the thread count, the batch or the position's
 * place in it.
 *
 * Whether a call opens a parallel region is team.c's team policy
 * (lora_call_threads: enough work, and no back-off after a team that did not
 * pay); a region's size is a num_threads() clause (never
 * omp_set_num_threads), so OMP_NUM_THREADS and threadpoolctl keep their
 * meaning; a child process after fork() runs serially.  Every team call
 * reports its wall time and its threads' compute time to that policy.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* per-thread scratch (rank-sized t, member terms) lives on the stack up to this */
#define LORA_STACK_RANK 512
#define LORA_STACK_TERMS 16
/* A half-precision delta serving at least this many positions of one prefill
 * call is widened to float32 once for the call (a vectorised copy of ~1 us per
 * 64 Ki values) and run through the float32 kernels: they follow the same
 * summation order on the same (exactly converted) values, so the bits do not
 * change, while the per-load conversion that would cost up to half of the
 * kernel's arithmetic is paid once instead of once per block.  (At 32
 * positions the copy's page faults cost more than it saved: measured.)  Not
 * for a dtype the ISA sums in an order of its own (kernel table's own_order:
 * AVX-512 bfloat16), whose bits a float32 copy would change. */
#define LORA_WIDEN_MIN 256
/* bank plans for batches up to this size live on the stack */
#define LORA_STACK_BATCH 256
#define LORA_STACK_PLAN (3 * (LORA_STACK_BATCH + 16) + 2) /* int64s: up to 16 entries */

/* the largest double whose float32 rounding is finite: FLT_MAX + half an ulp,
 * 0x1.ffffffp+127, written in decimal (exact: (2^25 - 1) * 2^103) because
 * MSVC's C compiler does not take hexadecimal float literals in every mode */
#define LORA_F32_LIMIT 340282356779733661637539395458142568448.0

static int finite_f32_(double v) { return fabs(v) < LORA_F32_LIMIT; } /* false for nan */

static int ranges_overlap_(const void *p, int64_t pbytes, const void *q, int64_t qbytes) {
    const char *a = (const char *)p, *b = (const char *)q;
    return a < b + qbytes && b < a + pbytes;
}

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
    int64_t max_rank_sum;       /* the largest sum of member ranks of one entry */
    int64_t max_members;
    /* prefill: x rows; gather: ids */
    const char *x;
    int x_dtype;
    int64_t ldx;
    const int64_t *ids;
    char *out;
    int out_dtype;
    int64_t ldo;
} plan_;

/* per-thread scratch: t for every member's rank outputs, and the terms */
typedef struct {
    float *t;                   /* LORA_NB x max_rank_sum */
    lora_term *terms;           /* max_members */
    const lora_delta **which;   /* terms[i] belongs to which[i] */
} scratch_;

static void block_of_(const plan_ *p, int64_t blk, int64_t *start, int *nb, int64_t *entry) {
    if (p->blk_start) {
        *start = p->blk_start[blk];
        *nb = (int)(p->blk_start[blk + 1] - *start);
        *entry = p->blk_entry[blk];
    } else {
        *start = blk * LORA_NB;
        *nb = (int)(p->n - *start < LORA_NB ? p->n - *start : LORA_NB);
        *entry = 0;
    }
}

/* One block of positions through every member of its entry, fused, on the
 * threads tid of nt that share `t` (nt = 1: alone, no barrier).  `last`: no
 * block follows, so the region's own closing barrier suffices. */
static void run_block_(const plan_ *p, int64_t blk, const scratch_ *sc, int tid, int nt,
                       int gather, int last, double *waited) {
#ifndef _OPENMP
    (void)last, (void)waited; /* only a team waits at barriers */
#endif
    int64_t start, entry;
    int nb;
    block_of_(p, blk, &start, &nb, &entry);
    const void *xs[LORA_NB];
    void *outs[LORA_NB];
    int64_t tok[LORA_NB];
    double mul[LORA_NB];
    const size_t xsz = lora_dtype_size(p->x_dtype), osz = lora_dtype_size(p->out_dtype);
    for (int b = 0; b < nb; b++) {
        const int64_t pos = p->order ? p->order[start + b] : start + b;
        outs[b] = p->out + (size_t)(pos * p->ldo) * osz;
        if (gather) tok[b] = p->ids[pos];
        else xs[b] = p->x + (size_t)(pos * p->ldx) * xsz;
        mul[b] = p->pos_scales ? p->pos_scales[pos / p->every] : 1.0;
    }
    /* the members that add anything to this block, with their scales */
    int n_terms = 0;
    int64_t off = 0;
    for (int64_t q = p->first[entry]; q < p->first[entry + 1]; q++) {
        lora_term *tm = &sc->terms[n_terms];
        int any = 0;
        for (int b = 0; b < LORA_NB; b++) {
            /* formed in double, rounded once (never the multiplier first) */
            tm->scale[b] = b < nb ? (float)(p->scales[q] * mul[b]) : 0.0f;
            any |= tm->scale[b] != 0.0f;
        }
        if (!any) continue; /* a zero scale skips the delta before any arithmetic */
        const lora_delta *d = p->deltas[q];
        tm->m = gather ? d->a : d->bt;
        tm->ldm = gather ? d->lda : d->ldb;
        tm->by_row = gather ? d->a_by_row : d->b_by_row;
        tm->kdim = d->rank;
        tm->dtype = d->dtype;
        tm->u = sc->t + off;
        tm->ldu = d->rank;
        sc->which[n_terms] = d;
        off += (int64_t)nb * d->rank;
        n_terms++;
    }
    if (n_terms == 0) return;
    int64_t lo, hi;
    if (gather) {
        /* u_q = B_q[tok, :]; every thread builds its own u and owns its columns */
        for (int q = 0; q < n_terms; q++) {
            const lora_delta *d = sc->which[q];
            float *u = (float *)sc->terms[q].u;
            for (int b = 0; b < nb; b++)
                for (int64_t k = 0; k < d->rank; k++)
                    u[b * d->rank + k] = lora_load_f32(
                        d->bt, d->b_by_row ? tok[b] * d->ldb + k : k * d->ldb + tok[b], d->dtype);
        }
        lora_split(p->cols, tid, nt, 16, &lo, &hi);
        if (lo < hi) p->kt->accumulate[p->out_dtype](sc->terms, n_terms, lo, hi, nb, outs);
        return;
    }
    for (int q = 0; q < n_terms; q++) {
        const lora_delta *d = sc->which[q];
        lora_split(d->rank, tid, nt, 1, &lo, &hi);
        if (lo < hi)
            p->kt->project[d->dtype](d->a, d->lda, d->cols, lo, hi, nb, xs, p->x_dtype,
                                     (float *)sc->terms[q].u, d->rank);
    }
#ifdef _OPENMP
    if (nt > 1) {
        const double w0 = lora_now();
#pragma omp barrier
        *waited += lora_now() - w0;
    }
#endif
    lora_split(p->rows, tid, nt, 16, &lo, &hi);
    if (lo < hi) p->kt->accumulate[p->out_dtype](sc->terms, n_terms, lo, hi, nb, outs);
#ifdef _OPENMP
    /* t is reused by the next block: wait until every thread is done with it */
    if (nt > 1 && !last) {
        const double w0 = lora_now();
#pragma omp barrier
        *waited += lora_now() - w0;
    }
#endif
}

/* Run every block of the plan; returns a LORA_* status. */
static int run_plan_(const plan_ *p, int gather) {
    if (p->nblk == 0) return LORA_OK;
    /* multiply-adds, to decide whether a team is worth waking */
    int64_t work = 0;
    for (int64_t e = 0; e < p->n_entries; e++) {
        int64_t per = 0;
        for (int64_t q = p->first[e]; q < p->first[e + 1]; q++)
            per += p->deltas[q]->rank * (gather ? p->cols : p->rows + p->cols);
        if (per > work) work = per;
    }
    work *= p->n;
    /* a team on few blocks meets at barriers in every block: it must pay per block */
    const int nmax = lora_get_num_threads();
    const int nt = lora_call_threads(p->nblk >= 2 * (int64_t)nmax ? work : work / p->nblk);

    const int64_t t_per = (int64_t)LORA_NB * p->max_rank_sum;
    const int by_block = p->nblk >= 2 * (int64_t)nt; /* threads take whole blocks */
    /* one t per thread, except a team on one prefill block, which shares t */
    const int64_t n_t = (by_block || gather) ? nt : 1;
    const int64_t n_terms = p->max_members > 0 ? p->max_members : 1;
    float stack_t[LORA_NB * LORA_STACK_RANK];
    lora_term stack_terms[LORA_STACK_TERMS];
    const lora_delta *stack_which[LORA_STACK_TERMS];
    float *t = stack_t;
    lora_term *terms = stack_terms;
    const lora_delta **which = stack_which;
    void *heap = NULL;
    if (t_per * n_t > LORA_NB * LORA_STACK_RANK || n_terms * nt > LORA_STACK_TERMS) {
        const size_t bytes = (size_t)(n_terms * nt) * (sizeof(lora_term) + sizeof(void *)) +
                             (size_t)(t_per * n_t) * sizeof(float);
        heap = malloc(bytes);
        if (!heap) return LORA_ERR_NOMEM;
        terms = (lora_term *)heap;
        which = (const lora_delta **)(terms + n_terms * nt);
        t = (float *)(which + n_terms * nt);
    }

    if (nt == 1) {
        const scratch_ sc = {t, terms, which};
        double none = 0.0;
        for (int64_t blk = 0; blk < p->nblk; blk++)
            run_block_(p, blk, &sc, 0, 1, gather, 1, &none);
    }
#ifdef _OPENMP
    else {
        /* busy: the threads' summed compute time, about what one thread needs */
        const double t0 = lora_now();
        double busy = 0.0;
#pragma omp parallel num_threads(nt) reduction(+ : busy)
        {
            const double s = lora_now();
            double waited = 0.0;
            const int tid = omp_get_thread_num(), team = omp_get_num_threads();
            if (by_block) {
                const scratch_ sc = {t + t_per * tid, terms + n_terms * tid, which + n_terms * tid};
#pragma omp for schedule(dynamic, 1) nowait
                for (int64_t blk = 0; blk < p->nblk; blk++)
                    run_block_(p, blk, &sc, 0, 1, gather, 1, &waited);
            } else {
                const scratch_ sc = {gather ? t + t_per * tid : t, terms + n_terms * tid,
                                     which + n_terms * tid};
                for (int64_t blk = 0; blk < p->nblk; blk++)
                    run_block_(p, blk, &sc, tid, team, gather, blk + 1 == p->nblk, &waited);
            }
            busy += lora_now() - s - waited;
        }
        lora_team_report(lora_now() - t0, busy);
    }
#endif
    free(heap);
    return LORA_OK;
}

/* the entry position b runs, or -1: no adapter, an empty entry, or a zero multiplier */
static int64_t entry_of_(const plan_ *p, const int64_t *entry_ids, int64_t b) {
    const int64_t i = b / p->every, e = entry_ids ? entry_ids[i] : 0;
    if (e < 0 || p->first[e + 1] == p->first[e]) return -1;
    if (p->pos_scales && p->pos_scales[i] == 0.0) return -1;
    return e;
}

/* Fill the plan's position order and blocks for a bank call: positions
 * grouped by entry (a stable counting sort, so each adapter's weights are
 * streamed once per block of LORA_NB positions; a block never straddles two
 * entries, since each entry's blocks step from its own start); -1, empty
 * entries and positions whose multiplier is 0 left out.  `buf` holds
 * 3 * (batch + n_entries) + 2 int64s. */
static void plan_bank_(plan_ *p, const int64_t *entry_ids, int64_t batch, int64_t *buf) {
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

/* Swap each half-precision delta that serves >= LORA_WIDEN_MIN positions of
 * this call for a float32 copy (see LORA_WIDEN_MIN).  On LORA_OK the caller
 * frees *wide (and each wide[q].a) and *use. */
static int widen_plan_(plan_ *p, lora_delta **wide, const lora_delta ***use) {
    const int64_t nd = p->n_entries > 0 ? p->first[p->n_entries] : 0;
    if (p->n < LORA_WIDEN_MIN || nd == 0) return LORA_OK;
    int any = 0;
    for (int64_t q = 0; q < nd; q++) any |= p->deltas[q]->dtype != LORA_DTYPE_F32;
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
    *wide = (lora_delta *)calloc((size_t)nd, sizeof **wide);
    *use = (const lora_delta **)malloc((size_t)nd * sizeof **use);
    int st = (*wide && *use) ? LORA_OK : LORA_ERR_NOMEM;
    for (int64_t e = 0; st == LORA_OK && e < p->n_entries; e++) {
        for (int64_t q = p->first[e]; q < p->first[e + 1]; q++) {
            const lora_delta *d = p->deltas[q];
            (*use)[q] = d;
            if (d->dtype == LORA_DTYPE_F32 || !d->owned || count[e] < LORA_WIDEN_MIN ||
                p->scales[q] == 0.0 || (p->kt->own_order >> d->dtype & 1u))
                continue;
            const int64_t na = d->rank * d->lda, nb = d->rank * d->ldb;
            float *buf = (float *)lora_aligned_alloc((size_t)(na + nb) * sizeof(float));
            if (!buf) {
                st = LORA_ERR_NOMEM;
                break;
            }
            lora_delta *w = &(*wide)[q];
            *w = *d;
            w->dtype = LORA_DTYPE_F32;
            w->a = buf, w->bt = buf + na;
            p->kt->widen[d->dtype](d->a, na, (float *)w->a);
            p->kt->widen[d->dtype](d->bt, nb, (float *)w->bt);
            (*use)[q] = w;
        }
    }
    if (count != count_stack) free(count);
    if (st == LORA_OK) p->deltas = *use;
    return st;
}

/* ------------------------------------------------------------ entry points */

/* Shared checks and set-up of every driver; returns a status, and on LORA_OK
 * a plan whose bank buffer (if any) the caller frees.  Everything that can
 * refuse the call is checked here, before the first write. */
static int plan_call_(plan_ *p, int64_t n_entries, const int64_t *first,
                      const lora_delta *const *deltas, const double *scales,
                      const int64_t *entry_ids, const double *pos_scales, int64_t every,
                      int64_t rows, int64_t cols, int64_t n, void *out, int out_dtype,
                      int64_t ldo, int64_t *bad, int64_t *stack_buf, int64_t **heap_buf) {
    *heap_buf = NULL;
    if (bad) *bad = -1;
    if (n_entries < 1 || rows < 1 || cols < 1 || n < 0 || every < 1) return LORA_ERR_ARG;
    memset(p, 0, sizeof *p);
    p->kt = lora_active_kernels();
    p->n_entries = n_entries, p->first = first, p->deltas = deltas, p->scales = scales;
    p->rows = rows, p->cols = cols;
    p->pos_scales = pos_scales, p->every = every;
    p->out = (char *)out, p->out_dtype = out_dtype, p->ldo = ldo;
    for (int64_t q = 0; q < first[n_entries]; q++) {
        const lora_delta *d = deltas[q];
        if (!d || d->rows != rows || d->cols != cols) return LORA_ERR_ARG;
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
                if (bad) *bad = i;
                return LORA_ERR_ADAPTER;
            }
        }
    }
    if (pos_scales) {
        /* a multiplier must be finite, and every scale a position will use (its
         * product with each delta's scale) finite in float32 */
        for (int64_t i = 0; i < n_ids; i++) {
            const int64_t e = entry_ids ? entry_ids[i] : 0;
            int ok = isfinite(pos_scales[i]);
            for (int64_t q = e >= 0 ? first[e] : 0; ok && e >= 0 && q < first[e + 1]; q++)
                ok = finite_f32_(scales[q] * pos_scales[i]);
            if (!ok) {
                if (bad) *bad = i;
                return LORA_ERR_SCALE;
            }
        }
    }
    if (n == 0 || first[n_entries] == 0) return LORA_OK;
    int any = 0; /* all scales 0: nothing to do, not even waking a team */
    for (int64_t q = 0; q < first[n_entries]; q++) any |= (float)scales[q] != 0.0f;
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
    if (!*p || bytes <= 0 || out_bytes <= 0 || !ranges_overlap_(*p, bytes, out, out_bytes))
        return LORA_OK;
    *own = malloc((size_t)bytes);
    if (!*own) return LORA_ERR_NOMEM;
    memcpy(*own, *p, (size_t)bytes);
    *p = *own;
    return LORA_OK;
}

/* private copies of entry_ids, pos_scales (and the gather's token ids) that alias out */
static int unalias_(const void *out, int64_t out_bytes, int64_t n, int64_t every,
                    const int64_t **entry_ids, const double **pos_scales, const int64_t **ids,
                    void *own[3]) {
    const int64_t n_ids = every > 0 ? (n + every - 1) / every : 0;
    int st = private_copy_(out, out_bytes, (const void **)entry_ids, n_ids * 8, &own[0]);
    if (st == LORA_OK)
        st = private_copy_(out, out_bytes, (const void **)pos_scales, n_ids * 8, &own[1]);
    if (st == LORA_OK && ids) st = private_copy_(out, out_bytes, (const void **)ids, n * 8, &own[2]);
    return st;
}

int lora_apply_batch(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                     const double *scales, const int64_t *entry_ids, const double *pos_scales,
                     int64_t ids_every, int64_t rows, int64_t cols, int64_t batch,
                     const void *x, int x_dtype, int64_t ldx, void *out, int out_dtype,
                     int64_t ldo, int64_t *bad) {
    if (!lora_dtype_valid(x_dtype) || !lora_dtype_valid(out_dtype)) return LORA_ERR_DTYPE;
    const size_t xsz = lora_dtype_size(x_dtype), osz = lora_dtype_size(out_dtype);
    if (batch > 1 && (ldx < cols || ldo < rows)) return LORA_ERR_ARG;
    if ((uintptr_t)x % xsz || (uintptr_t)out % osz) return LORA_ERR_ALIGN;
    if (batch > 0 && ranges_overlap_(x, (int64_t)(((batch - 1) * ldx + cols) * xsz), out,
                                     (int64_t)(((batch - 1) * ldo + rows) * osz)))
        return LORA_ERR_OVERLAP;
    if ((uintptr_t)entry_ids % sizeof(int64_t) || (uintptr_t)pos_scales % sizeof(double))
        return LORA_ERR_ALIGN;
    for (int64_t q = 0; n_entries > 0 && q < first[n_entries]; q++)
        if (deltas[q] && deltas[q]->a_by_row) return LORA_ERR_ARG; /* a gather-only view */
    void *own[3] = {NULL, NULL, NULL};
    plan_ p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf = NULL;
    int st = unalias_(out, batch > 0 ? (int64_t)(((batch - 1) * ldo + rows) * osz) : 0, batch,
                      ids_every, &entry_ids, &pos_scales, NULL, own);
    if (st == LORA_OK)
        st = plan_call_(&p, n_entries, first, deltas, scales, entry_ids, pos_scales, ids_every,
                        rows, cols, batch, out, out_dtype, ldo, bad, stack_buf, &heap_buf);
    if (st == LORA_OK) {
        p.x = (const char *)x, p.x_dtype = x_dtype, p.ldx = ldx;
        lora_delta *wide = NULL;
        const lora_delta **use = NULL;
        st = widen_plan_(&p, &wide, &use);
        if (st == LORA_OK) st = run_plan_(&p, 0);
        if (wide)
            for (int64_t q = 0; q < first[n_entries]; q++)
                if (wide[q].a) lora_aligned_free(wide[q].a);
        free(wide);
        free(use);
    }
    free(heap_buf);
    for (int k = 0; k < 3; k++) free(own[k]);
    return st;
}

int lora_apply_rows(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                    const double *scales, const int64_t *entry_ids, const double *pos_scales,
                    int64_t ids_every, int64_t rows, int64_t cols, int64_t n, const int64_t *ids,
                    void *out, int out_dtype, int64_t ldo, int64_t *bad) {
    if (!lora_dtype_valid(out_dtype)) return LORA_ERR_DTYPE;
    if (n > 1 && ldo < cols) return LORA_ERR_ARG;
    if ((uintptr_t)out % lora_dtype_size(out_dtype) || (uintptr_t)ids % sizeof(int64_t) ||
        (uintptr_t)entry_ids % sizeof(int64_t) || (uintptr_t)pos_scales % sizeof(double))
        return LORA_ERR_ALIGN;
    void *own[3] = {NULL, NULL, NULL};
    plan_ p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf = NULL;
    int st = unalias_(out, n > 0 ? (int64_t)(((n - 1) * ldo + cols) * lora_dtype_size(out_dtype)) : 0,
                      n, ids_every, &entry_ids, &pos_scales, &ids, own);
    if (st == LORA_OK)
        st = plan_call_(&p, n_entries, first, deltas, scales, entry_ids, pos_scales, ids_every,
                        rows, cols, n, out, out_dtype, ldo, bad, stack_buf, &heap_buf);
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
        st = run_plan_(&p, 1);
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
