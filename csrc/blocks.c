/*
 * blocks.c - running a plan (plan.h): its blocks of positions, each one
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
 * place in it.  Blocks of an entry whose factors overflow the L2 run in groups
 * (group_size_) that read each factor once for all of them; the order in
 * which a group's blocks and strips run changes no element's arithmetic.
 * Whether a call opens a team at all is team.c's policy; every team call
 * reports its wall time and its threads' compute time to it.
 */
#include <stdlib.h>

#include "plan.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* per-thread scratch (rank-sized t, member terms) lives on the stack up to this */
#define LORA_STACK_T 4096
#define LORA_STACK_TERMS 64
/* consecutive blocks of one entry that go through its members together: each
 * member's A_q is read once for the group's projections, and each strip of
 * every B_q once for the group's accumulates, instead of once per block (at
 * most; see group_size_) */
#define LORA_GROUP 8
/* a group's accumulates go over out in strips of this many outputs: every
 * block's strip, then the next (128 measured slower: four times the calls) */
#define LORA_GROUP_STRIP 512

/* per-thread scratch, one slot per block of a group: t for every member's
 * rank outputs, the terms, and the deltas they belong to */
typedef struct {
    float *t;                   /* slot g at t + g * t_per (LORA_NB x max_rank_sum) */
    lora_term *terms;           /* slot g at terms + g * m_per (max_members) */
    const lora_delta **which;   /* terms[i] belongs to which[i] */
    int64_t t_per, m_per;
} scratch_;

/* one block of a group, ready to run */
typedef struct {
    int nb, n_terms, epi;
    const void *xs[LORA_NB];
    void *outs[LORA_NB];
    lora_term *terms;
    const lora_delta **which;
} block_;

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

/* What a member's epilogue does to the running float32 values v[0 .. n) of
 * one position, outputs i .. i + n of its data e (lora.h's LORA_EPI_*): the
 * one place a kind of epilogue is written.  One float32 product per element
 * for a row factor. */
static void epilogue_(int kind, const float *e, int64_t i, int64_t n, float *v) {
    switch (kind) {
    case LORA_EPI_ROW_FACTOR:
        for (int64_t k = 0; k < n; k++) v[k] = v[k] * e[i + k];
        break;
    default: /* LORA_EPI_PLAIN: nothing after the accumulate */
        break;
    }
}

/* The accumulate of a block whose entry holds a member with an epilogue, in
 * portable C around the ISA's own kernels (so every path runs it, and plain
 * members keep their bits): each member in order adds its term through the
 * ISA's float32 accumulate (the same order as inside a stack), and then its
 * epilogue acts on the running value.  A float32 out is updated where it is,
 * member by member over the whole range; a half out is widened into an L1
 * strip (the ISA's widen_), updated there and rounded back once (the ISA's
 * narrow_), a term's M then shifted to the strip, whose outputs the kernel
 * sees as 0 .. n - 1 (an order that never depends on [i0, i1)). */
static void epilogue_accumulate_(const lora_plan *p, const lora_term *terms, int n_terms,
                                 int64_t i0, int64_t i1, int nb, void *const *outs) {
    const lora_kernel_table *kt = p->kt;
    const int ot = p->out_dtype;
    const size_t osz = lora_dtype_size(ot);
    if (ot == LORA_DTYPE_F32) {
        /* a float32 out is updated where it is, member by member over the whole range (each
         * element sees the same operations in the same order as in strips) */
        for (int q = 0; q < n_terms; q++) {
            const lora_term *tm = &terms[q];
            if (tm->active) kt->accumulate[LORA_DTYPE_F32](tm, 1, i0, i1, nb, outs, 0);
            for (int b = 0; b < nb; b++)
                if (tm->epi[b]) epilogue_(tm->epilogue, tm->epi[b], i0, i1 - i0, (float *)outs[b] + i0);
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
                kt->accumulate[LORA_DTYPE_F32](tm, 1, i, i + n, nb, (void *const *)so, i);
            }
            for (int b = 0; b < nb; b++)
                if (tm->epi[b]) epilogue_(tm->epilogue, tm->epi[b], i, n, so[b]);
        }
        for (int b = 0; b < nb; b++) kt->narrow[ot](strip[b], n, (char *)outs[b] + i * osz);
    }
}

/* the accumulate of one block into outputs [i0, i1): the ISA's, or with epilogues */
static void accumulate_(const lora_plan *p, const lora_term *terms, int n_terms, int epi,
                        int64_t i0, int64_t i1, int nb, void *const *outs) {
    if (epi) epilogue_accumulate_(p, terms, n_terms, i0, i1, nb, outs);
    else p->kt->accumulate[p->out_dtype](terms, n_terms, i0, i1, nb, outs, 0);
}

/* Block blk's positions and the terms of its entry's members into bk, with
 * their t in slot g of the scratch; the gather's u (B_q's rows of the tokens)
 * is built here too. */
static void prepare_block_(const lora_plan *p, int64_t blk, const scratch_ *sc, int g, int gather,
                           block_ *bk) {
    int64_t start, entry;
    int nb;
    block_of_(p, blk, &start, &nb, &entry);
    int64_t tok[LORA_NB];
    double mul[LORA_NB];
    const size_t xsz = lora_dtype_size(p->x_dtype), osz = lora_dtype_size(p->out_dtype);
    for (int b = 0; b < nb; b++) {
        const int64_t pos = p->order ? p->order[start + b] : start + b;
        bk->outs[b] = p->out + (size_t)(pos * p->ldo) * osz;
        if (gather) tok[b] = p->ids[pos];
        else bk->xs[b] = p->x + (size_t)(pos / p->x_every * p->ldx) * xsz;
        mul[b] = p->pos_scales ? p->pos_scales[pos / p->every] : 1.0;
    }
    lora_term *terms = sc->terms + g * sc->m_per;
    const lora_delta **which = sc->which + g * sc->m_per;
    float *t = sc->t + g * sc->t_per;
    /* the members that add anything to this block, with their scales (and the
     * members whose epilogue acts at scale 0: they add nothing but their epilogue) */
    int n_terms = 0, epi = 0;
    int64_t off = 0;
    for (int64_t q = p->first[entry]; q < p->first[entry + 1]; q++) {
        lora_term *tm = &terms[n_terms];
        int any = 0, has_epi = 0;
        tm->epilogue = lora_epilogue_of(p, q);
        for (int b = 0; b < LORA_NB; b++) {
            /* formed in double, rounded once (never the multiplier first) */
            tm->scale[b] = b < nb ? (float)(p->scales[q] * mul[b]) : 0.0f;
            any |= tm->scale[b] != 0.0f;
            tm->epi[b] = NULL;
            if (b < nb && p->epi_data) {
                const int64_t pos = p->order ? p->order[start + b] : start + b;
                tm->epi[b] = lora_epi_data_of(p, pos, q);
                has_epi |= tm->epi[b] != NULL;
            }
        }
        epi |= has_epi;
        tm->active = any;
        if (!any && !has_epi) continue; /* a zero scale skips the delta before any arithmetic */
        if (!any) {
            n_terms++;
            continue;
        }
        const lora_delta *d = p->deltas[q];
        const lora_factor *mf = gather ? &d->a : &d->bt;
        tm->m = lora_run_of(mf);
        tm->ldm = mf->ld;
        tm->by_row = mf->by_row;
        tm->kdim = d->rank;
        tm->fmt = mf->fmt;
        tm->u = t + off;
        tm->ldu = d->rank;
        which[n_terms] = d;
        off += (int64_t)nb * d->rank;
        n_terms++;
    }
    bk->nb = nb;
    bk->n_terms = n_terms;
    bk->epi = epi;
    bk->terms = terms;
    bk->which = which;
    if (!gather) return;
    /* u_q = B_q[tok, :]; every thread builds its own u and owns its columns */
    for (int q = 0; q < n_terms; q++) {
        if (!terms[q].active) continue;
        const lora_delta *d = which[q];
        float *u = (float *)terms[q].u;
        for (int b = 0; b < nb; b++)
            for (int64_t k = 0; k < d->rank; k++)
                u[b * d->rank + k] = lora_run_load(
                    lora_run_of(&d->bt), d->bt.by_row ? tok[b] * d->bt.ld + k : k * d->bt.ld + tok[b],
                    d->bt.fmt);
    }
}

/* ng consecutive blocks of one entry (a gather: one block) through every member
 * of the entry, fused, on the threads tid of nt that share the scratch's t
 * (nt = 1: alone, no barrier).  The projections go member by member, each
 * A_q over every block of the group; the accumulates strip by strip, each
 * strip of out through every block (every member's B_q strip read once for
 * the group).  The order in which blocks and strips run changes no output
 * element's arithmetic.  `last`: no group follows, so the region's own
 * closing barrier suffices. */
static void run_group_(const lora_plan *p, int64_t blk0, int ng, const scratch_ *sc, int tid,
                       int nt, int gather, int last, double *waited) {
#ifndef _OPENMP
    (void)last, (void)waited; /* only a team waits at barriers */
#endif
    block_ bk[LORA_GROUP];
    int any = 0, most = 0;
    for (int g = 0; g < ng; g++) {
        prepare_block_(p, blk0 + g, sc, g, gather, &bk[g]);
        any |= bk[g].n_terms;
        if (bk[g].n_terms > most) most = bk[g].n_terms;
    }
    if (!any) return;
    int64_t lo, hi;
    if (gather) {
        lora_split(p->cols, tid, nt, 16, &lo, &hi);
        if (lo < hi) accumulate_(p, bk[0].terms, bk[0].n_terms, bk[0].epi, lo, hi, bk[0].nb, bk[0].outs);
        return;
    }
    for (int q = 0; q < most; q++)
        for (int g = 0; g < ng; g++) {
            if (q >= bk[g].n_terms || !bk[g].terms[q].active) continue;
            const lora_delta *d = bk[g].which[q];
            lora_split(d->rank, tid, nt, 1, &lo, &hi);
            if (lo < hi)
                p->kt->project[d->a.fmt](lora_run_of(&d->a), d->a.ld, d->cols, lo, hi, bk[g].nb, bk[g].xs,
                                         p->x_dtype, (float *)bk[g].terms[q].u, d->rank);
        }
#ifdef _OPENMP
    if (nt > 1) {
        const double w0 = lora_now();
#pragma omp barrier
        *waited += lora_now() - w0;
    }
#endif
    lora_split(p->rows, tid, nt, 16, &lo, &hi);
    const int64_t strip = ng > 1 ? LORA_GROUP_STRIP : (hi > lo ? hi - lo : 1);
    for (int64_t i = lo; i < hi; i += strip)
        for (int g = 0; g < ng; g++)
            if (bk[g].n_terms)
                accumulate_(p, bk[g].terms, bk[g].n_terms, bk[g].epi, i,
                            i + strip < hi ? i + strip : hi, bk[g].nb, bk[g].outs);
#ifdef _OPENMP
    /* t is reused by the next group: wait until every thread is done with it */
    if (nt > 1 && !last) {
        const double w0 = lora_now();
#pragma omp barrier
        *waited += lora_now() - w0;
    }
#endif
}

static int64_t entry_of_(const lora_plan *p, int64_t blk) {
    return p->blk_entry ? p->blk_entry[blk] : 0;
}

/* Blocks [b0, b1) in groups: runs of one entry, at most g_max blocks each */
static void run_blocks_(const lora_plan *p, int64_t b0, int64_t b1, int g_max, const scratch_ *sc,
                        int tid, int nt, int gather, int last, double *waited) {
    for (int64_t s = b0; s < b1;) {
        int64_t e = s + 1;
        while (e < b1 && e - s < g_max && entry_of_(p, e) == entry_of_(p, s)) e++;
        run_group_(p, s, (int)(e - s), sc, tid, nt, gather, last && e == b1, waited);
        s = e;
    }
}

/* How many blocks go through the members together.  Only an entry whose
 * factors (f_bytes, the largest entry's) overflow half of one core's L2 gains:
 * its blocks would each re-read them from L3, where a group reads them once
 * (rank 64 at 4096 x 4096, a 4 x r16 stack); smaller factors stay in L2
 * anyway, and there the group's short strips of out only cost.  A group
 * re-reads its blocks' x once per member, so their x stay within a quarter of
 * the L2 (next to A_q); threads that take whole groups keep four groups each
 * for the balance; a gather's blocks share nothing (one block). */
static int group_size_(const lora_plan *p, int gather, int by_block, int nt, int64_t f_bytes) {
    const int64_t l2 = lora_team_l2_bytes();
    const int64_t cache = l2 > 0 ? l2 : (int64_t)256 << 10; /* unknown: the smallest L2s */
    if (gather || 2 * f_bytes <= cache) return 1;
    int64_t g = LORA_GROUP;
    const int64_t x_blk = (int64_t)LORA_NB * p->cols * (int64_t)lora_dtype_size(p->x_dtype);
    if (x_blk * g > cache / 4) g = cache / 4 / x_blk;
    if (by_block && g > p->nblk / (4 * (int64_t)nt)) g = p->nblk / (4 * (int64_t)nt);
    if (g > p->nblk) g = p->nblk;
    return g < 1 ? 1 : (int)g;
}

int lora_run_plan(const lora_plan *p, int gather) {
    if (p->nblk == 0) return LORA_OK;
    /* multiply-adds (weighted by their formats' work), to decide whether a team
     * is worth waking, and the bytes a call reads: the largest entry's
     * factors, x and out (a gather reads a few rows of B: not counted) */
    int64_t work = 0, bytes = 0;
    for (int64_t e = 0; e < p->n_entries; e++) {
        int64_t per = 0, per_bytes = 0;
        for (int64_t q = p->first[e]; q < p->first[e + 1]; q++) {
            const lora_delta *d = p->deltas[q];
            const int64_t a_work = p->cols * lora_format_work(d->a.fmt);
            per += d->rank * (gather ? a_work : a_work + p->rows * lora_format_work(d->bt.fmt));
            per_bytes += d->rank * (lora_format_bytes(d->bt.fmt, p->rows) +
                                    lora_format_bytes(d->a.fmt, p->cols));
        }
        if (per > work) work = per;
        if (per_bytes > bytes) bytes = per_bytes;
    }
    work *= p->n;
    const int64_t f_bytes = bytes;
    bytes += p->n * (p->cols * (int64_t)lora_dtype_size(p->x_dtype) +
                     p->rows * (int64_t)lora_dtype_size(p->out_dtype));
    /* a team on few blocks meets at barriers in every group: it must pay per group */
    const int nmax = lora_get_num_threads();
    const int g_team = p->blk_entry ? 1 : group_size_(p, gather, 0, nmax, f_bytes);
    const int64_t syncs = (p->nblk + g_team - 1) / g_team;
    const int nt = lora_call_threads(p->nblk >= 2 * (int64_t)nmax ? work : work / syncs,
                                     gather ? 0 : bytes);

    const int by_block = p->nblk >= 2 * (int64_t)nt; /* threads take whole groups */
    const int g_max = group_size_(p, gather, by_block, nt, f_bytes);
    const int64_t t_per = (int64_t)LORA_NB * p->max_rank_sum;
    const int64_t m_per = p->max_members > 0 ? p->max_members : 1;
    /* one t per thread, except a team on few prefill blocks, which shares t */
    const int64_t n_t = (by_block || gather) ? nt : 1;
    const int64_t t_all = t_per * g_max * n_t, m_all = m_per * g_max * nt;
    float stack_t[LORA_STACK_T];
    lora_term stack_terms[LORA_STACK_TERMS];
    const lora_delta *stack_which[LORA_STACK_TERMS];
    float *t = stack_t;
    lora_term *terms = stack_terms;
    const lora_delta **which = stack_which;
    void *heap = NULL;
    if (t_all > LORA_STACK_T || m_all > LORA_STACK_TERMS) {
        const size_t bytes = (size_t)m_all * (sizeof(lora_term) + sizeof(void *)) +
                             (size_t)t_all * sizeof(float);
        heap = malloc(bytes);
        if (!heap) return LORA_ERR_NOMEM;
        terms = (lora_term *)heap;
        which = (const lora_delta **)(terms + m_all);
        t = (float *)(which + m_all);
    }

    if (nt == 1) {
        const scratch_ sc = {t, terms, which, t_per, m_per};
        double none = 0.0;
        run_blocks_(p, 0, p->nblk, g_max, &sc, 0, 1, gather, 1, &none);
    }
#ifdef _OPENMP
    else {
        /* busy: the threads' summed compute time, about what one thread needs */
        const double t0 = lora_now();
        double busy = 0.0;
        const int64_t n_groups = (p->nblk + g_max - 1) / g_max;
#pragma omp parallel num_threads(nt) reduction(+ : busy)
        {
            const double s = lora_now();
            double waited = 0.0;
            const int tid = omp_get_thread_num(), team = omp_get_num_threads();
            const int64_t mine = m_per * g_max * tid;
            if (by_block) {
                const scratch_ sc = {t + t_per * g_max * tid, terms + mine, which + mine, t_per, m_per};
#pragma omp for schedule(dynamic, 1) nowait
                for (int64_t c = 0; c < n_groups; c++) {
                    const int64_t b1 = (c + 1) * g_max < p->nblk ? (c + 1) * g_max : p->nblk;
                    run_blocks_(p, c * g_max, b1, g_max, &sc, 0, 1, gather, 1, &waited);
                }
            } else {
                const scratch_ sc = {gather ? t + t_per * g_max * tid : t, terms + mine, which + mine,
                                     t_per, m_per};
                run_blocks_(p, 0, p->nblk, g_max, &sc, tid, team, gather, 1, &waited);
            }
            busy += lora_now() - s - waited;
        }
        lora_team_report(lora_now() - t0, busy);
    }
#endif
    free(heap);
    return LORA_OK;
}

int lora_run_projections(lora_plan *p, const void *x, int x_dtype, int64_t ldx, int64_t x_every) {
    p->x = (const char *)x, p->x_dtype = x_dtype, p->ldx = ldx, p->x_every = x_every;
    lora_widened wide;
    int st = lora_plan_widen(p, &wide);
    if (st == LORA_OK) st = lora_run_plan(p, 0);
    lora_widened_free(&wide);
    return st;
}
