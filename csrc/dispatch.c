/*
 * dispatch.c - CPU detection, the kernel-pointer table, delta packing and the
 * OpenMP drivers.  The ISA files hold only kernels; all threading is here.
 *
 * Threading model.  Positions are cut into blocks of up to LORA_NB; a block
 * is one project + accumulate (t = A x, out += s * B t) or, for the gather,
 * one accumulate of A (out += s * B[id] A).  With many blocks, threads take whole blocks.  With
 * few (decode, small prefill) the whole team works on each block: threads
 * split the rank outputs of A.x, meet at a barrier, then split the rows of
 * B.y (the gather splits its columns and needs no barrier).  Either way a
 * thread computes whole output elements with the ISA file's one summation
 * order, so the bits never depend on the thread count or the batch.
 * Parallel regions open only above LORA_PAR_MIN_WORK multiply-adds, with a
 * num_threads() clause (never omp_set_num_threads), so OMP_NUM_THREADS and
 * threadpoolctl keep their meaning; a child process after fork() runs
 * serially, since a GNU OpenMP pool does not survive fork().
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(LORA_HAVE_X86)
#include <cpuid.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#endif

/* Below this many multiply-adds a call stays on the calling thread: waking a
 * team and its barriers cost ~2-3 us on a 2-vCPU VM, so a 4096 x 4096 rank-8
 * decode (2^16) ran 4.1 us on one thread against 4.8 us on two (bench); at
 * rank 16 (2^17) the two are even, and above it the team wins. */
#define LORA_PAR_MIN_WORK ((int64_t)1 << 17)
/* rank-sized scratch lives on the stack up to this rank (x LORA_NB floats) */
#define LORA_STACK_RANK 512
/* A half-precision delta serving at least this many positions of one prefill
 * call is widened to float32 once for the call (a vectorised copy of ~1 us per
 * 64 Ki values) and run through the float32 kernels: they follow the same
 * summation order on the same (exactly converted) values, so the bits do not
 * change, while the per-load conversion that would cost up to half of the
 * kernel's arithmetic is paid once instead of once per block.  (At 32
 * positions the copy's page faults cost more than it saved: measured.) */
#define LORA_WIDEN_MIN 256
/* bank plans for batches up to this size live on the stack */
#define LORA_STACK_BATCH 256
#define LORA_STACK_PLAN (3 * (LORA_STACK_BATCH + 16) + 2) /* int64s: up to 16 entries */

static const lora_kernel_table *g_kt = &lora_kernels_scalar;
static int g_isa = LORA_ISA_SCALAR;
static volatile int g_thread_cap = 0; /* 0 = none; set from Python, read per call */
static volatile int g_forked = 0;     /* set in a child after fork() */

/* ---------------------------------------------------------------- runtime */

#if !defined(_WIN32)
static void lora_after_fork_child_(void) { g_forked = 1; }
#endif

#if defined(__GNUC__) || defined(__clang__)
__attribute__((constructor))
#endif
static void lora_init_(void) {
#if !defined(_WIN32)
    pthread_atfork(NULL, NULL, lora_after_fork_child_);
#endif
    g_isa = lora_best_isa();
    lora_set_isa(g_isa);
}

int lora_isa_supported(int isa) {
    if (isa == LORA_ISA_SCALAR) return 1;
#if defined(LORA_HAVE_X86)
    __builtin_cpu_init();
    unsigned eax, ebx, ecx, edx;
    const int f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    if (isa == LORA_ISA_AVX2) return avx2;
    if (isa == LORA_ISA_AVX512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

int lora_best_isa(void) {
    if (lora_isa_supported(LORA_ISA_AVX512)) return LORA_ISA_AVX512;
    if (lora_isa_supported(LORA_ISA_AVX2)) return LORA_ISA_AVX2;
    return LORA_ISA_SCALAR;
}

int lora_get_isa(void) { return g_isa; }

int lora_set_isa(int isa) {
    if (!lora_isa_supported(isa)) return LORA_ERR_ARG;
    switch (isa) {
#if defined(LORA_HAVE_X86)
    case LORA_ISA_AVX512: g_kt = &lora_kernels_avx512; break;
    case LORA_ISA_AVX2: g_kt = &lora_kernels_avx2; break;
#endif
    default: g_kt = &lora_kernels_scalar; break;
    }
    g_isa = isa;
    return LORA_OK;
}

int lora_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void lora_set_num_threads(int n) { g_thread_cap = n > 0 ? n : 0; }

int lora_get_num_threads(void) {
#ifdef _OPENMP
    if (g_forked) return 1;
    int n = omp_get_max_threads();
    const int limit = omp_get_thread_limit(); /* OMP_THREAD_LIMIT caps every team */
    if (limit > 0 && limit < n) n = limit;
    const int cap = g_thread_cap;
    if (cap > 0 && cap < n) n = cap;
    return n < 1 ? 1 : n;
#else
    return 1;
#endif
}

int lora_probe_threads(void) {
    int team = 1;
#ifdef _OPENMP
    const int nt = lora_get_num_threads();
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
#pragma omp single
            team = omp_get_num_threads();
        }
    }
#endif
    return team;
}

const char *lora_compiler(void) {
#if defined(__clang__)
    return "clang " __clang_version__;
#elif defined(__GNUC__)
    return "gcc " __VERSION__;
#elif defined(_MSC_VER)
    return "msvc";
#else
    return "unknown";
#endif
}

/* ----------------------------------------------------------------- deltas */

static void *aligned_alloc_(size_t bytes) {
    if (bytes == 0) bytes = LORA_ALIGN;
#if defined(_WIN32)
    return _aligned_malloc(bytes, LORA_ALIGN);
#else
    void *p = NULL;
    return posix_memalign(&p, LORA_ALIGN, bytes) == 0 ? p : NULL;
#endif
}

static void aligned_free_(void *p) {
#if defined(_WIN32)
    _aligned_free(p);
#else
    free(p);
#endif
}

static int64_t round_up_(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Row length of packed A / B^T: a multiple of LORA_PAD, nudged off multiples
 * of 256 elements.  Rows 4 KiB apart (cols = 4096 in float32) all map to the
 * same L1 set, and a project tile reads up to 8 such rows at once (the
 * accumulate reads one row per rank index): the nudge spreads them over sets. */
static int64_t packed_ld_(int64_t n) {
    const int64_t ld = round_up_(n, LORA_PAD);
    return ld % 256 == 0 ? ld + 16 : ld;
}

lora_delta *lora_delta_new(int dtype, int64_t rank, int64_t rows, int64_t cols, const void *a,
                           const void *b) {
    if (dtype < LORA_DTYPE_F32 || dtype > LORA_DTYPE_BF16 || rank < 1 || rows < 1 || cols < 1)
        return NULL;
    /* every byte count below must fit: keep each factor under 2^40 and the
     * products under 2^62 */
    const int64_t lim = (int64_t)1 << 40;
    if (rank > lim || rows > lim || cols > lim) return NULL;
    const int64_t lda = packed_ld_(cols), ldb = packed_ld_(rows);
    const size_t isz = lora_dtype_size(dtype);
    if (rank > ((int64_t)1 << 62) / (lda > ldb ? lda : ldb) / 4) return NULL;
    lora_delta *d = (lora_delta *)calloc(1, sizeof *d);
    if (!d) return NULL;
    d->dtype = dtype;
    d->rank = rank, d->rows = rows, d->cols = cols, d->lda = lda, d->ldb = ldb;
    d->a = aligned_alloc_((size_t)(rank * lda) * isz);
    d->bt = aligned_alloc_((size_t)(rank * ldb) * isz);
    if (!d->a || !d->bt) {
        lora_delta_free(d);
        return NULL;
    }
    memset(d->a, 0, (size_t)(rank * lda) * isz);
    memset(d->bt, 0, (size_t)(rank * ldb) * isz);
    for (int64_t k = 0; k < rank; k++)
        memcpy((char *)d->a + (size_t)(k * lda) * isz, (const char *)a + (size_t)(k * cols) * isz,
               (size_t)cols * isz);
    /* B [rows, rank] -> B^T [rank, ldb]: one unit-stride row per rank index */
    if (isz == 4) {
        const uint32_t *src = (const uint32_t *)b;
        uint32_t *dst = (uint32_t *)d->bt;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t k = 0; k < rank; k++) dst[k * ldb + i] = src[i * rank + k];
    } else {
        const uint16_t *src = (const uint16_t *)b;
        uint16_t *dst = (uint16_t *)d->bt;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t k = 0; k < rank; k++) dst[k * ldb + i] = src[i * rank + k];
    }
    return d;
}

void lora_delta_free(lora_delta *d) {
    if (!d) return;
    aligned_free_(d->a);
    aligned_free_(d->bt);
    free(d);
}

void lora_delta_export(const lora_delta *d, void *a, void *b) {
    const size_t isz = lora_dtype_size(d->dtype);
    for (int64_t k = 0; k < d->rank; k++)
        memcpy((char *)a + (size_t)(k * d->cols) * isz, (const char *)d->a + (size_t)(k * d->lda) * isz,
               (size_t)d->cols * isz);
    for (int64_t i = 0; i < d->rows; i++)
        for (int64_t k = 0; k < d->rank; k++)
            memcpy((char *)b + (size_t)(i * d->rank + k) * isz,
                   (const char *)d->bt + (size_t)(k * d->ldb + i) * isz, isz);
}

/* ---------------------------------------------------------------- drivers */

/* [lo, hi) of n items for thread tid of nt, boundaries on multiples of `align` */
static void split_(int64_t n, int tid, int nt, int64_t align, int64_t *lo, int64_t *hi) {
    const int64_t units = (n + align - 1) / align;
    const int64_t per = units / nt, extra = units % nt;
    const int64_t u0 = tid * per + (tid < extra ? tid : extra);
    const int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
    *lo = u0 * align < n ? u0 * align : n;
    *hi = u1 * align < n ? u1 * align : n;
}

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
    const float *scales;
    int64_t rows, cols;
    /* positions: order[] (NULL = 0..n-1), cut into blocks; blk_start NULL =
     * uniform blocks of LORA_NB positions, all of entry 0 */
    int64_t n;
    const int64_t *order;
    const int64_t *blk_start;
    const int64_t *blk_entry;
    int64_t nblk;
    int64_t max_rank;
    /* prefill: x rows; gather: ids */
    const float *x;
    int64_t ldx;
    const int64_t *ids;
    float *out;
    int64_t ldo;
} plan_;

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

static int64_t position_(const plan_ *p, int64_t idx) { return p->order ? p->order[idx] : idx; }

/* One block of positions through every delta of its entry, on the threads
 * tid of nt that share `t` (nt = 1: alone, no barrier).  t: nb x max_rank.
 * `last`: no block follows, so the region's own closing barrier suffices. */
static void run_block_(const plan_ *p, int64_t blk, float *t, int tid, int nt, int gather,
                       int last) {
    int64_t start, entry;
    int nb;
    block_of_(p, blk, &start, &nb, &entry);
    const float *xs[LORA_NB];
    float *outs[LORA_NB];
    int64_t tok[LORA_NB];
    for (int b = 0; b < nb; b++) {
        const int64_t pos = position_(p, start + b);
        outs[b] = p->out + pos * p->ldo;
        if (gather) tok[b] = p->ids[pos];
        else xs[b] = p->x + pos * p->ldx;
    }
    for (int64_t q = p->first[entry]; q < p->first[entry + 1]; q++) {
        const float s = p->scales[q];
        if (s == 0.0f) continue; /* a zero scale skips the delta before any arithmetic */
        const lora_delta *d = p->deltas[q];
        const int64_t r = d->rank;
        int64_t lo, hi;
        if (gather) {
            /* u = B[tok, :]; every thread builds its own u and owns its columns */
            for (int b = 0; b < nb; b++)
                for (int64_t k = 0; k < r; k++)
                    t[b * r + k] = lora_load_f32(d->bt, k * d->ldb + tok[b], d->dtype);
            split_(d->cols, tid, nt, 16, &lo, &hi);
            if (lo < hi) p->kt->accumulate[d->dtype](d->a, d->lda, r, lo, hi, nb, t, r, s, outs);
            continue;
        }
        split_(r, tid, nt, 1, &lo, &hi);
        if (lo < hi) p->kt->project[d->dtype](d->a, d->lda, d->cols, lo, hi, nb, xs, t, r);
#ifdef _OPENMP
        if (nt > 1) {
#pragma omp barrier
        }
#endif
        split_(d->rows, tid, nt, 16, &lo, &hi);
        if (lo < hi) p->kt->accumulate[d->dtype](d->bt, d->ldb, r, lo, hi, nb, t, r, s, outs);
#ifdef _OPENMP
        /* t is reused by the next delta or block: wait until every thread is done with it */
        if (nt > 1 && !(last && q + 1 == p->first[entry + 1])) {
#pragma omp barrier
        }
#endif
    }
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
    int any = 0; /* all scales 0: nothing to do, not even waking a team */
    for (int64_t q = 0; q < p->first[p->n_entries]; q++) any |= p->scales[q] != 0.0f;
    if (!any) return LORA_OK;
    int nt = lora_get_num_threads();
    if (work < LORA_PAR_MIN_WORK) nt = 1;

    const int64_t per_thread = (int64_t)LORA_NB * p->max_rank;
    const int by_block = p->nblk >= 2 * (int64_t)nt; /* threads take whole blocks */
    /* one scratch per thread, except a team on one prefill block, which shares t */
    const int64_t n_scratch = (by_block || gather) ? nt : 1;
    float stack_scratch[LORA_NB * LORA_STACK_RANK];
    float *heap = NULL, *scratch = stack_scratch;
    if (per_thread * n_scratch > LORA_NB * LORA_STACK_RANK) {
        heap = (float *)malloc((size_t)(per_thread * n_scratch) * sizeof(float));
        if (!heap) return LORA_ERR_NOMEM;
        scratch = heap;
    }

    if (nt == 1) {
        for (int64_t blk = 0; blk < p->nblk; blk++) run_block_(p, blk, scratch, 0, 1, gather, 1);
    }
#ifdef _OPENMP
    else if (by_block) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
        for (int64_t blk = 0; blk < p->nblk; blk++)
            run_block_(p, blk, scratch + per_thread * omp_get_thread_num(), 0, 1, gather, 1);
    } else {
#pragma omp parallel num_threads(nt)
        {
            const int tid = omp_get_thread_num(), team = omp_get_num_threads();
            float *t = gather ? scratch + per_thread * tid : scratch;
            for (int64_t blk = 0; blk < p->nblk; blk++)
                run_block_(p, blk, t, tid, team, gather, blk + 1 == p->nblk);
        }
    }
#endif
    free(heap);
    return LORA_OK;
}

/* Fill the plan's position order and blocks for a bank call: positions
 * grouped by entry (a stable counting sort, so each adapter's weights are
 * streamed once per block of LORA_NB positions; a block never straddles two
 * entries, since each entry's blocks step from its own start), -1 and empty
 * entries left out.  `buf` holds 3 * (batch + n_entries) + 2 int64s. */
static void plan_bank_(plan_ *p, const int64_t *entry_ids, int64_t batch, int64_t *buf) {
    const int64_t ne = p->n_entries;
    int64_t *order = buf, *blk_start = order + batch, *blk_entry = blk_start + batch + ne + 1;
    int64_t *cursor = blk_entry + batch + ne;
    for (int64_t e = 0; e <= ne; e++) cursor[e] = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t e = entry_ids[b];
        if (e >= 0 && p->first[e + 1] > p->first[e]) cursor[e + 1]++;
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
        const int64_t e = entry_ids[b];
        if (e >= 0 && p->first[e + 1] > p->first[e]) order[cursor[e]++] = b;
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
            if (d->dtype == LORA_DTYPE_F32 || count[e] < LORA_WIDEN_MIN || p->scales[q] == 0.0f)
                continue;
            const int64_t na = d->rank * d->lda, nb = d->rank * d->ldb;
            float *buf = (float *)aligned_alloc_((size_t)(na + nb) * sizeof(float));
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

/* Shared checks and set-up of the bank/stack drivers; returns a status, and
 * on LORA_OK a plan whose bank buffer (if any) the caller frees. */
static int plan_call_(plan_ *p, int64_t n_entries, const int64_t *first,
                      const lora_delta *const *deltas, const float *scales,
                      const int64_t *entry_ids, int64_t rows, int64_t cols, int64_t n,
                      void *out, int64_t ldo, int64_t *bad, int64_t *stack_buf,
                      int64_t **heap_buf) {
    *heap_buf = NULL;
    if (n_entries < 1 || rows < 1 || cols < 1 || n < 0) return LORA_ERR_ARG;
    memset(p, 0, sizeof *p);
    p->kt = g_kt;
    p->n_entries = n_entries, p->first = first, p->deltas = deltas, p->scales = scales;
    p->rows = rows, p->cols = cols;
    p->out = (float *)out, p->ldo = ldo;
    for (int64_t q = 0; q < first[n_entries]; q++) {
        const lora_delta *d = deltas[q];
        if (!d || d->rows != rows || d->cols != cols) return LORA_ERR_ARG;
        if (!(scales[q] - scales[q] == 0.0f)) return LORA_ERR_SCALE; /* inf or nan */
        if (d->rank > p->max_rank) p->max_rank = d->rank;
    }
    if (entry_ids) {
        for (int64_t b = 0; b < n; b++) {
            if (entry_ids[b] < -1 || entry_ids[b] >= n_entries) {
                if (bad) *bad = b;
                return LORA_ERR_ADAPTER;
            }
        }
    }
    if (n == 0 || first[n_entries] == 0) return LORA_OK;
    if (entry_ids) {
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

int lora_apply_batch(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                     const float *scales, const int64_t *entry_ids, int64_t rows, int64_t cols,
                     int64_t batch, const void *x, int64_t ldx, void *out, int64_t ldo,
                     int64_t *bad) {
    if (batch > 1 && (ldx < cols || ldo < rows)) return LORA_ERR_ARG;
    if (((uintptr_t)x | (uintptr_t)out) % sizeof(float)) return LORA_ERR_ALIGN;
    if (batch > 0 && ranges_overlap_(x, ((batch - 1) * ldx + cols) * 4, out,
                                     ((batch - 1) * ldo + rows) * 4))
        return LORA_ERR_OVERLAP;
    if ((uintptr_t)entry_ids % sizeof(int64_t)) return LORA_ERR_ALIGN;
    plan_ p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf;
    int st = plan_call_(&p, n_entries, first, deltas, scales, entry_ids, rows, cols, batch, out,
                        ldo, bad, stack_buf, &heap_buf);
    if (st == LORA_OK) {
        p.x = (const float *)x, p.ldx = ldx;
        lora_delta *wide = NULL;
        const lora_delta **use = NULL;
        st = widen_plan_(&p, &wide, &use);
        if (st == LORA_OK) st = run_plan_(&p, 0);
        if (wide)
            for (int64_t q = 0; q < first[n_entries]; q++)
                if (wide[q].a) aligned_free_(wide[q].a);
        free(wide);
        free(use);
    }
    free(heap_buf);
    return st;
}

int lora_apply_rows(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                    const float *scales, const int64_t *entry_ids, int64_t rows, int64_t cols,
                    int64_t n, const int64_t *ids, void *out, int64_t ldo, int64_t *bad) {
    if (n > 1 && ldo < cols) return LORA_ERR_ARG;
    if ((uintptr_t)out % sizeof(float) || (uintptr_t)ids % sizeof(int64_t) ||
        (uintptr_t)entry_ids % sizeof(int64_t))
        return LORA_ERR_ALIGN;
    plan_ p;
    int64_t stack_buf[LORA_STACK_PLAN], *heap_buf;
    int st = plan_call_(&p, n_entries, first, deltas, scales, entry_ids, rows, cols, n, out, ldo,
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
        st = run_plan_(&p, 1);
    }
    free(heap_buf);
    return st;
}

int lora_add_batch(const lora_delta *d, float scale, int64_t batch, const void *x, int64_t ldx,
                   void *out, int64_t ldo) {
    static const int64_t first[2] = {0, 1};
    if (!d) return LORA_ERR_ARG;
    return lora_apply_batch(1, first, &d, &scale, NULL, d->rows, d->cols, batch, x, ldx, out, ldo,
                            NULL);
}

int lora_add(const lora_delta *d, float scale, const void *x, void *out) {
    if (!d) return LORA_ERR_ARG;
    return lora_add_batch(d, scale, 1, x, d->cols, out, d->rows);
}

int lora_add_rows(const lora_delta *d, float scale, int64_t n, const int64_t *ids, void *out,
                  int64_t ldo, int64_t *bad) {
    static const int64_t first[2] = {0, 1};
    if (!d) return LORA_ERR_ARG;
    return lora_apply_rows(1, first, &d, &scale, NULL, d->rows, d->cols, n, ids, out, ldo, bad);
}

double lora_bench_read(const float *buf, int64_t n, int64_t reps, int nthreads) {
    double total = 0.0;
    const lora_read_fn read = g_kt->read;
    if (nthreads < 1 || g_forked) nthreads = 1;
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
        {
            int64_t lo, hi;
            split_(n, omp_get_thread_num(), omp_get_num_threads(), 16, &lo, &hi);
            for (int64_t r = 0; r < reps; r++) total += read(buf + lo, hi - lo);
        }
        return total;
    }
#endif
    for (int64_t r = 0; r < reps; r++) total += read(buf, n);
    return total;
}
