/*
 * blocks.c - running a plan (drivers.h): its blocks of positions, each one
 * fused pass over its entry's members (t_q = A_q x for every member q, then
 * out += sum_q s_q B_q t_q into a strip of out that stays in L1; for the
 * gather, out += sum_q s_q B_q[id] A_q), on one thread or a team.  All of the
 * extension's OpenMP for the apply calls is here; the ISA files hold only
 * kernels.
 *
 * With many blocks, threads take whole blocks.  With few (decode, small
 * prefill) the whole team works on each block: threads split the rank
 * outputs of every A_q x, meet at one barrier, then split the rows of out
 * (the gather splits its columns and needs no barrier).  Either way a thread
 * computes whole output elements with the ISA file's one summation order, so
 * the bits never depend on the thread count, the batch or the position's
 * place in it.  Whether a call opens a team at all is team.c's policy; every
 * team call reports its wall time and its threads' compute time to it.
 */
#include <stdlib.h>

#include "drivers.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* per-thread scratch (rank-sized t, member terms) lives on the stack up to this */
#define LORA_STACK_RANK 512
#define LORA_STACK_TERMS 16

/* per-thread scratch: t for every member's rank outputs, and the terms */
typedef struct {
    float *t;                   /* LORA_NB x max_rank_sum */
    lora_term *terms;           /* max_members */
    const lora_delta **which;   /* terms[i] belongs to which[i] */
} scratch_;

static void block_of_(const lora_plan *p, int64_t blk, int64_t *start, int *nb, int64_t *entry) {
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

/* The accumulate of a block whose entry holds a DoRA member, in portable C
 * around the ISA's own kernels (so every path runs it, and plain members keep
 * their bits): each member in order adds its term through the ISA's float32
 * accumulate (the same order as inside a stack), and a DoRA member then
 * multiplies the running value by its row factor, one float32 product per
 * element.  A float32 out is updated where it is, member by member over the
 * whole range; a half out is widened into an L1 strip (the ISA's widen_),
 * updated there and rounded back once (the ISA's narrow_), a term's M then
 * shifted to the strip, whose outputs the kernel sees as 0 .. n - 1 (an order
 * that never depends on [i0, i1)). */
static void dora_accumulate_(const lora_plan *p, const lora_term *terms, int n_terms,
                             int64_t i0, int64_t i1, int nb, void *const *outs) {
    const lora_kernel_table *kt = p->kt;
    const int ot = p->out_dtype;
    const size_t osz = lora_dtype_size(ot);
    const int f32 = ot == LORA_DTYPE_F32;
    if (f32) {
        /* a float32 out is updated where it is, member by member over the whole range (each
         * element sees the same operations in the same order as in strips) */
        for (int q = 0; q < n_terms; q++) {
            const lora_term *tm = &terms[q];
            if (tm->active) kt->accumulate[LORA_DTYPE_F32](tm, 1, i0, i1, nb, outs);
            for (int b = 0; b < nb; b++) {
                if (!tm->g[b]) continue;
                float *v = (float *)outs[b];
                const float *g = tm->g[b];
                for (int64_t k = i0; k < i1; k++) v[k] = v[k] * g[k];
            }
        }
        return;
    }
    float strip[LORA_NB][LORA_STRIP];
    float *so[LORA_NB];
    for (int64_t i = i0; i < i1; i += LORA_STRIP) {
        const int64_t n = i1 - i < LORA_STRIP ? i1 - i : LORA_STRIP;
        for (int b = 0; b < nb; b++) {
            so[b] = strip[b];
            kt->widen[ot]((const char *)outs[b] + i * osz, n, strip[b]);
        }
        for (int q = 0; q < n_terms; q++) {
            const lora_term *tm = &terms[q];
            if (tm->active) {
                lora_term at = *tm;
                const int64_t shift = tm->by_row ? i * tm->ldm : i;
                at.m = (const char *)tm->m + (size_t)shift * lora_dtype_size(tm->dtype);
                kt->accumulate[LORA_DTYPE_F32](&at, 1, 0, n, nb, (void *const *)so);
            }
            for (int b = 0; b < nb; b++) {
                if (!tm->g[b]) continue;
                const float *g = tm->g[b] + i;
                float *v = so[b];
                for (int64_t k = 0; k < n; k++) v[k] = v[k] * g[k];
            }
        }
        for (int b = 0; b < nb; b++) kt->narrow[ot](strip[b], n, (char *)outs[b] + i * osz);
    }
}

/* the accumulate of one block into outputs [i0, i1): the ISA's, or the DoRA one */
static void accumulate_(const lora_plan *p, const lora_term *terms, int n_terms, int dora,
                        int64_t i0, int64_t i1, int nb, void *const *outs) {
    if (dora) dora_accumulate_(p, terms, n_terms, i0, i1, nb, outs);
    else p->kt->accumulate[p->out_dtype](terms, n_terms, i0, i1, nb, outs);
}

/* One block of positions through every member of its entry, fused, on the
 * threads tid of nt that share `t` (nt = 1: alone, no barrier).  `last`: no
 * block follows, so the region's own closing barrier suffices. */
static void run_block_(const lora_plan *p, int64_t blk, const scratch_ *sc, int tid, int nt,
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
        else xs[b] = p->x + (size_t)(pos / p->x_every * p->ldx) * xsz;
        mul[b] = p->pos_scales ? p->pos_scales[pos / p->every] : 1.0;
    }
    /* the members that add anything to this block, with their scales (and the
     * DoRA members at scale 0, which add nothing but still apply their row factor) */
    int n_terms = 0, dora = 0;
    int64_t off = 0;
    for (int64_t q = p->first[entry]; q < p->first[entry + 1]; q++) {
        lora_term *tm = &sc->terms[n_terms];
        int any = 0, has_g = 0;
        for (int b = 0; b < LORA_NB; b++) {
            /* formed in double, rounded once (never the multiplier first) */
            tm->scale[b] = b < nb ? (float)(p->scales[q] * mul[b]) : 0.0f;
            any |= tm->scale[b] != 0.0f;
            tm->g[b] = NULL;
            if (b < nb && p->factors) {
                const int64_t pos = p->order ? p->order[start + b] : start + b;
                tm->g[b] = lora_factor_of(p, pos, q);
                has_g |= tm->g[b] != NULL;
            }
        }
        dora |= has_g;
        tm->active = any;
        if (!any && !has_g) continue; /* a zero scale skips the delta before any arithmetic */
        if (!any) {
            n_terms++;
            continue;
        }
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
            if (!sc->terms[q].active) continue;
            const lora_delta *d = sc->which[q];
            float *u = (float *)sc->terms[q].u;
            for (int b = 0; b < nb; b++)
                for (int64_t k = 0; k < d->rank; k++)
                    u[b * d->rank + k] = lora_load_f32(
                        d->bt, d->b_by_row ? tok[b] * d->ldb + k : k * d->ldb + tok[b], d->dtype);
        }
        lora_split(p->cols, tid, nt, 16, &lo, &hi);
        if (lo < hi) accumulate_(p, sc->terms, n_terms, dora, lo, hi, nb, outs);
        return;
    }
    for (int q = 0; q < n_terms; q++) {
        if (!sc->terms[q].active) continue;
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
    if (lo < hi) accumulate_(p, sc->terms, n_terms, dora, lo, hi, nb, outs);
#ifdef _OPENMP
    /* t is reused by the next block: wait until every thread is done with it */
    if (nt > 1 && !last) {
        const double w0 = lora_now();
#pragma omp barrier
        *waited += lora_now() - w0;
    }
#endif
}

int lora_run_plan(const lora_plan *p, int gather) {
    if (p->nblk == 0) return LORA_OK;
    /* multiply-adds, to decide whether a team is worth waking, and the bytes a
     * call reads: the largest entry's factors, x and out (a gather reads a few
     * rows of B: not counted) */
    int64_t work = 0, bytes = 0;
    for (int64_t e = 0; e < p->n_entries; e++) {
        int64_t per = 0, per_bytes = 0;
        for (int64_t q = p->first[e]; q < p->first[e + 1]; q++) {
            const lora_delta *d = p->deltas[q];
            per += d->rank * (gather ? p->cols : p->rows + p->cols);
            per_bytes += d->rank * (p->rows + p->cols) * (int64_t)lora_dtype_size(d->dtype);
        }
        if (per > work) work = per;
        if (per_bytes > bytes) bytes = per_bytes;
    }
    work *= p->n;
    bytes += p->n * (p->cols * (int64_t)lora_dtype_size(p->x_dtype) +
                     p->rows * (int64_t)lora_dtype_size(p->out_dtype));
    /* a team on few blocks meets at barriers in every block: it must pay per block */
    const int nmax = lora_get_num_threads();
    const int nt = lora_call_threads(p->nblk >= 2 * (int64_t)nmax ? work : work / p->nblk,
                                     gather ? 0 : bytes);

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
