/*
 * lora.h - the C API of lora-kernels, and the cffi cdef (_cffi_build.py reads the
 * part between the LORA_CDEF markers, so this header is the one truth).
 *
 * The operation: out[b, :] += s * B (A x[b, :]) with A = lora_a [rank, cols],
 * B = lora_b [rows, rank], both held by an opaque lora_delta in one storage
 * dtype (float32, float16 or bfloat16), x and out in any of the three, and
 * everything computed in float32.
 *
 * Every entry point that computes (apply, merge, abs-max) validates what it
 * can see (dtype codes, sizes, overlap of x and out, ids in range) before its
 * first write and returns a LORA_ERR_* status, its results going through
 * out-parameters; the constructors return NULL for anything they refuse; C
 * never aborts.  Threads split outputs, never one sum, so the bits of every
 * output element depend only on the ISA path and the storage dtype.
 */
#ifndef LORA_H
#define LORA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* LORA_CDEF_BEGIN */
typedef struct lora_delta lora_delta;

/* status codes */
#define LORA_OK 0
#define LORA_ERR_NOMEM 1     /* an allocation failed (delta storage, bank scratch) */
#define LORA_ERR_ARG 2       /* a size or leading dimension that cannot be right */
#define LORA_ERR_OVERLAP 3   /* the bytes of x and out intersect */
#define LORA_ERR_INDEX 4     /* a token id out of [0, rows), or an expert id out of
                              [-1, n_experts); *bad = its position */
#define LORA_ERR_ADAPTER 5   /* an adapter id out of [-1, n_entries) (experts: n_adapters);
                              *bad = its position */
#define LORA_ERR_ALIGN 6     /* x or out not 4-byte aligned (ids: 8), which C may not read */
#define LORA_ERR_SCALE 7     /* an effective scale that is not finite in float32 */
#define LORA_ERR_DTYPE 8     /* an unknown dtype code */
#define LORA_ERR_NORM 9      /* a DoRA row whose norm is 0 (or not finite); *bad = the row */

/* dtypes, of storage and of activations: the codes 0 .. LORA_DTYPE_COUNT - 1
 * (the C side's list of them, with sizes and names, is LORA_DTYPES in kernels.h) */
#define LORA_DTYPE_F32 0
#define LORA_DTYPE_F16 1
#define LORA_DTYPE_BF16 2
#define LORA_DTYPE_COUNT 3

/* ISA paths, lowest first */
#define LORA_ISA_SCALAR 0
#define LORA_ISA_AVX2 1
#define LORA_ISA_AVX512 2
#define LORA_ISA_NEON 3
#define LORA_ISA_COUNT 4

/* why the path in use was chosen (lora_isa_source) */
#define LORA_ISA_FROM_FLAGS 0   /* the widest path the CPU's feature bits allow */
#define LORA_ISA_FROM_TABLE 1   /* a measured CPU model's row named a narrower one */
#define LORA_ISA_FROM_CALLER 2  /* lora_set_isa (LORA_ISA, set_isa) */

/* --- ISA choice and build facts (isa.c) ---------------------------------- */
int lora_isa_supported(int isa);        /* 1 when this CPU and build can run `isa` */
int lora_best_isa(void);                /* the flags rule: the widest supported path */
int lora_get_isa(void);                 /* the path in use */
int lora_set_isa(int isa);              /* LORA_OK, or LORA_ERR_ARG when unsupported */
int lora_isa_source(void);              /* LORA_ISA_FROM_* of the path in use */
/* this CPU's cpuid vendor (vendor: 13 chars), family and model (extended
 * parts added) and stepping; 1 when read, 0 elsewhere (aarch64: "", -1s) */
int lora_cpu_id(char *vendor, int *family, int *model, int *stepping);
/* the path the load-time choice runs on a CPU with this id and flags rule
 * (the choice itself calls it): the CPU table's path for a measured model,
 * never above flags_best, else flags_best; *name / *evidence (when not NULL)
 * = the table row's, or NULL for a CPU without one */
int lora_isa_for_cpu(const char *vendor, int family, int model, int flags_best,
                     const char **name, const char **evidence);
const char *lora_compiler(void);        /* the compiler that built the extension */
/* LORA_JBLOCK (kernels.h): the projection sums a row in blocks of this many columns */
int64_t lora_project_column_block(void);

/* --- threads (team.c) ----------------------------------------------------- */
int lora_openmp(void);                  /* 1 when built with OpenMP */
void lora_set_num_threads(int n);       /* n >= 1: a process-wide cap; 0 removes it */
int lora_get_num_threads(void);         /* min(cap, omp_get_max_threads()) right now */
int lora_probe_threads(void);           /* team size a call would run with right now */
int lora_fork_releases_pool(void);      /* 1 when fork() releases the OpenMP pool first */
/* the adaptive team policy (team.c): a call of `work` multiply-adds opens a
 * team only from lora_team_min_work() (from lora_team_min_work_past_l2() when
 * the `bytes` it reads (adapter factors, x and out) exceed one core's L2 cache,
 * lora_team_l2_bytes(), 0 when unknown; 0 bytes: not counted) and while no
 * back-off is running; every team call reports its wall time and its threads'
 * summed compute time */
int64_t lora_team_min_work(void);         /* the CPU table's floor for this core, or the default */
int64_t lora_team_default_min_work(void); /* the floor on a core without a measured one */
int64_t lora_team_floor_for_cpu(const char *vendor, int family, int model); /* 0: none */
void lora_team_set_min_work(int64_t floor); /* measurements and tests; <= 0: this core's again */
int64_t lora_team_min_work_past_l2(void);
int64_t lora_team_l2_bytes(void);
int lora_call_threads(int64_t work, int64_t bytes); /* threads such a call would use now */
void lora_team_report(double wall, double busy);
double lora_team_backoff(void);          /* seconds of one-thread calls left (0: none) */
void lora_team_stats(int64_t *calls, int64_t *lost);
void lora_team_reset(void);              /* forget the back-off and the counts (tests) */

/* --- deltas --------------------------------------------------------------- */
/* a: rank x cols values, b: rows x rank values, row-major, in the storage
 * dtype's bits (float, or uint16 for float16/bfloat16).  Copied into aligned,
 * packed storage.  NULL when out of memory or a dimension is < 1. */
lora_delta *lora_delta_new(int dtype, int64_t rank, int64_t rows, int64_t cols,
                           const void *a, const void *b);
/* A delta over the caller's memory, not copied: A as rows of [rank, lda] (a_by_row: A^T as
 * rows of [cols, lda]), B as B^T rows of [rank, ldb] (b_by_row: B as rows of [rows, ldb]),
 * values in the storage dtype's bits.  The caller keeps that memory alive while calls use
 * the view; writes to it are seen by the next call.  A view with a_by_row serves the row
 * gathers only (LORA_ERR_ARG elsewhere).  NULL when out of memory or a size is invalid. */
lora_delta *lora_delta_view(int dtype, int64_t rank, int64_t rows, int64_t cols, const void *a,
                            int64_t lda, int a_by_row, const void *b, int64_t ldb, int b_by_row);
/* frees the delta (a view: only its handle, never the caller's memory) */
void lora_delta_free(lora_delta *d);
/* copies the stored values back out, in the layout lora_delta_new took */
void lora_delta_export(const lora_delta *d, void *a, void *b);

/* Activations (x, out) may be float32, float16 or bfloat16 (the LORA_DTYPE_*
 * codes), independently of the delta's storage dtype and of each other.
 * Compute is float32: x is widened exactly; a half-precision out element is
 * widened, updated by every delta of its entry in order, and rounded once to
 * nearest even.  ldx / ldo are leading dimensions in elements of x / out. */

/* decode: out[rows] += scale * B (A x[cols]) */
int lora_add(const lora_delta *d, float scale, const void *x, int x_dtype, void *out,
             int out_dtype);

/* prefill: out[b*ldo + i] += scale * (B A x[b*ldx + :])[i], b < batch */
int lora_add_batch(const lora_delta *d, float scale, int64_t batch, const void *x, int x_dtype,
                   int64_t ldx, void *out, int out_dtype, int64_t ldo);

/* the same two, for callers that hold addresses as integers (a torch tensor's
 * data_ptr()): no pointer object to build per call */
int lora_add_at(const lora_delta *d, float scale, intptr_t x, int x_dtype, intptr_t out,
                int out_dtype);
int lora_add_batch_at(const lora_delta *d, float scale, int64_t batch, intptr_t x, int x_dtype,
                      int64_t ldx, intptr_t out, int out_dtype, int64_t ldo);

/* gather: out[i*ldo + j] += scale * (B[ids[i], :] A)[j], i < n */
int lora_add_rows(const lora_delta *d, float scale, int64_t n, const int64_t *ids, void *out,
                  int out_dtype, int64_t ldo, int64_t *bad);

/* Stacks and banks.  Entry e is deltas[first[e] .. first[e+1]), applied in
 * order in one pass (x read once per block of positions, each out element
 * rounded once); scales[q] is delta q's effective scale.  Position b uses
 * entry entry_ids[b / ids_every] (-1 = none; entry_ids NULL = every position
 * uses entry 0).  pos_scales (NULL = none) multiplies the scales of position
 * b by pos_scales[b / ids_every]: delta q there uses
 * (float)(scales[q] * pos_scales[b / ids_every]), formed in double.  A delta
 * whose float32 scale is 0 adds nothing to that position; a position whose
 * multiplier is 0 is not touched.  Every delta is rows x cols.  A delta's
 * scale not finite in float32, a multiplier that is not finite, or a product
 * not finite in float32 is LORA_ERR_SCALE before anything is written, with
 * *bad the position (or -1 when the delta's own scale is at fault). */
int lora_apply_batch(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                     const double *scales, const int64_t *entry_ids, const double *pos_scales,
                     int64_t ids_every, int64_t rows, int64_t cols, int64_t batch,
                     const void *x, int x_dtype, int64_t ldx, void *out, int out_dtype,
                     int64_t ldo, int64_t *bad);
int lora_apply_rows(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                    const double *scales, const int64_t *entry_ids, const double *pos_scales,
                    int64_t ids_every, int64_t rows, int64_t cols, int64_t n, const int64_t *ids,
                    void *out, int out_dtype, int64_t ldo, int64_t *bad);

/* DoRA (weight-decomposed LoRA): the same two calls with a row factor per member.
 * factors[i * fac_stride + q] (fac_stride 0: factors[q] for every position) is
 * NULL for a plain member q, else the float32 row factor g of DoRA member q at
 * the positions of id i (i = b / ids_every): rows values (lora_apply_rows:
 * cols), for the scale that position uses.  A DoRA member scales the running
 * bias-free sum: out <- g * (out + s * B (A x)), in float32, members in
 * order, a half out rounded once after the last; at scale 0 (its own or a
 * position's multiplier) it still applies g, so a position of an entry with a
 * DoRA member is never skipped for a zero multiplier.  factors NULL: the
 * plain calls above, bit for bit.  The factors must not share bytes with out. */
int lora_apply_batch_dora(int64_t n_entries, const int64_t *first,
                          const lora_delta *const *deltas, const double *scales,
                          const int64_t *entry_ids, const double *pos_scales, int64_t ids_every,
                          int64_t rows, int64_t cols, int64_t batch, const void *x, int x_dtype,
                          int64_t ldx, void *out, int out_dtype, int64_t ldo,
                          const float *const *factors, int64_t fac_stride, int64_t *bad);
int lora_apply_rows_dora(int64_t n_entries, const int64_t *first,
                         const lora_delta *const *deltas, const double *scales,
                         const int64_t *entry_ids, const double *pos_scales, int64_t ids_every,
                         int64_t rows, int64_t cols, int64_t n, const int64_t *ids, void *out,
                         int out_dtype, int64_t ldo, const float *const *factors,
                         int64_t fac_stride, int64_t *bad);

/* DoRA statistics of a base V [n, k] (element (i, j) at w[i*ld_i + j*ld_k],
 * w_dtype; any layout) against P [r, k]: sq[i] = |V_i|^2, vp[i*r + t] =
 * <V_i, P_t>, gram[t*r + u] = <P_t, P_u>, all in float64, each a sum over j
 * in ascending order (threads split i and t, never a sum).  by_col 0 (a
 * Linear layer): V = W [rows, cols], P = A, the norm is per row; by_col 1 (an
 * embedding table E [rows = vocab, cols = dim]): V = E^T, P = B^T, the norm
 * is per column.  LORA_OK, LORA_ERR_DTYPE, LORA_ERR_ARG (a gather-only view,
 * a negative stride), LORA_ERR_NOMEM. */
int lora_dora_stats(const lora_delta *d, int by_col, const void *w, int w_dtype, int64_t ld_i,
                    int64_t ld_k, double *sq, double *vp, double *gram);
/* The row factor for effective scale s: |V_i + s (Q P)_i|^2 = sq[i] + 2 s <q_i,
 * vp_i> + s^2 q_i^T gram q_i with Q = B (by_col 1: A^T), in float64; norm[i] =
 * that norm and g[i] = magnitude[i] / norm, each rounded to float32 once.  A
 * norm that is 0 or not finite (or a g that is not finite in float32) is
 * LORA_ERR_NORM with *bad = its row (the first), g and norm then unspecified. */
int lora_dora_factor(const lora_delta *d, int by_col, const double *sq, const double *vp,
                     const double *gram, const float *magnitude, double s, float *g, float *norm,
                     int64_t *bad);

/* Mixtures of experts: n routed (token, slot) pairs, pair q through the
 * expert expert_ids[q] (-1 = none) of adapter adapter_ids[q / ids_every]
 * (-1 = none; adapter_ids NULL = adapter 0 everywhere).  The entry table is
 * lora_apply_batch's (first, deltas, scales); adapter a's experts are its
 * kernel entries starts[a] .. starts[a + 1) (starts: n_adapters + 1 values),
 * expert e being entry starts[a] + e, and an adapter with fewer than
 * n_experts entries (an empty slot) adds nothing.  Pair q reads x row
 * q / x_every (x_every = k: a token's k slots share its row; 1: a row per
 * pair) and adds into out row q: out[q*ldo + i] += s * (B_e A_e x[(q /
 * x_every)*ldx + :])[i], each row bit-identical to lora_add of that expert
 * alone.  pos_scales (NULL = none) is indexed like adapter_ids and means
 * what it means for lora_apply_batch.  Before anything is written: an
 * adapter id outside [-1, n_adapters) is LORA_ERR_ADAPTER (*bad = its index
 * in adapter_ids), an expert id outside [-1, n_experts) LORA_ERR_INDEX
 * (*bad = its pair), a scale as lora_apply_batch (*bad = its index in
 * pos_scales). */
int lora_apply_experts(int64_t n_entries, const int64_t *first, const lora_delta *const *deltas,
                       const double *scales, int64_t n_adapters, const int64_t *starts,
                       int64_t n_experts, const int64_t *adapter_ids, const double *pos_scales,
                       int64_t ids_every, const int64_t *expert_ids, int64_t x_every,
                       int64_t rows, int64_t cols, int64_t n, const void *x, int x_dtype,
                       int64_t ldx, void *out, int out_dtype, int64_t ldo, int64_t *bad);

/* Merges (merge_into / unmerge_from): w[i*ldw + j] becomes w + sum_t scales[t]
 * * (B_t @ A_t)[i, j], formed in double: each product over the rank in order
 * (a product, then a sum: no fma), scaled, added term by term in order, and
 * rounded once to nearest even into w_dtype (float16 / bfloat16 through a
 * round-to-odd float32).  a[t]: A_t [ranks[t], cols], b[t]: B_t [rows,
 * ranks[t]], both double row-major.  write == 0 only checks: *bad = the flat
 * index i*cols + j of the first element finite in w whose result is not, or
 * -1; write != 0 stores every result (*bad = -1).  Returns LORA_OK,
 * LORA_ERR_DTYPE, or LORA_ERR_ARG (a size < 1, ldw < cols, a rank < 1), with
 * nothing written on an error.  bad may be NULL. */
int lora_merge(void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols, int n_terms,
               const double *const *a, const double *const *b, const int64_t *ranks,
               const double *scales, int write, int64_t *bad);
/* *max = the largest |w| of a rows x cols w_dtype matrix (NaN when one is NaN);
 * LORA_OK, LORA_ERR_DTYPE, or LORA_ERR_ARG (a size < 1, ldw < cols) */
int lora_abs_max(const void *w, int w_dtype, int64_t ldw, int64_t rows, int64_t cols,
                 double *max);

/* benchmark helper: reads n floats reps times over nthreads threads with the
 * active ISA's widest loads; returns a checksum so nothing is optimised away */
double lora_bench_read(const float *buf, int64_t n, int64_t reps, int nthreads);
/* benchmark helper: reads the packed factors of n deltas delta by delta, in
 * the order their decode calls meet them (A, then B^T; a team of nthreads per
 * delta, meeting once in between, whatever size the delta), with the widest
 * loads and no arithmetic: what the memory system gives a decode sweep over
 * them.  Deltas over a caller's memory (views) are skipped; *bytes (may be
 * NULL) = the bytes read, padding included.  Returns a checksum. */
double lora_bench_read_deltas(const lora_delta *const *ds, int64_t n, int nthreads,
                              int64_t *bytes);
/* benchmark helper: n steps of independent float32 FMA chains (the active
 * ISA's widest vectors, no memory traffic) on each of nthreads threads;
 * *flops (may be NULL) = the flops done, over all threads.  Returns a
 * checksum (from about 30 steps on, each chain holds exactly 1). */
double lora_bench_fma(int64_t n, int nthreads, int64_t *flops);
/* LORA_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* LORA_H */
