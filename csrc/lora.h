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

/* element dtypes: what x, out and merge targets are (the C side's list of
 * them, with sizes and names, is LORA_DTYPES in kernels.h) */
#define LORA_DTYPE_F32 0
#define LORA_DTYPE_F16 1
#define LORA_DTYPE_BF16 2
#define LORA_DTYPE_COUNT 3

/* storage formats: how a delta's factors are stored (LORA_FORMATS in
 * formats.h: values per block, bytes per block).  An element format stores
 * its dtype's values and shares its code.  LORA_FMT_Q8_0 is llama.cpp's Q8_0:
 * blocks of 32 int8 values q with one float16 scale d (value d * q, exact in
 * float32). */
#define LORA_FMT_F32 0
#define LORA_FMT_F16 1
#define LORA_FMT_BF16 2
#define LORA_FMT_Q8_0 3
#define LORA_FMT_COUNT 4

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
/* How the AVX-512 path's hot loops build Q8_0 values (the same bits either way; isa.c's
 * CPU table picks one per core): LORA_Q8_0_WIDEN_SHUFFLE (one byte shuffle into the bits of
 * 1.0f and one fused multiply-subtract, formats.h) or LORA_Q8_0_WIDEN_CVT (sign extension,
 * int-to-float, a multiply by the scale) */
#define LORA_Q8_0_WIDEN_SHUFFLE 0
#define LORA_Q8_0_WIDEN_CVT 1
int lora_q8_0_widening(void);           /* the build in use */
int lora_set_q8_0_widening(int w);      /* LORA_OK, or LORA_ERR_ARG for an unknown one */
/* the build the CPU table gives a CPU with this id (LORA_Q8_0_WIDEN_SHUFFLE without a row) */
int lora_q8_0_widening_for_cpu(const char *vendor, int family, int model);
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
/* A delta of its own storage: A in format a_fmt, B in format b_fmt.  An
 * element format is given as values in the format's bits (float, or uint16
 * for float16 and bfloat16), row-major: a = A [rank, cols], b = B [rows,
 * rank].  A block format (Q8_0) is given as llama.cpp's blocks (block_q8_0:
 * a little-endian float16 d, then 32 int8 q; 34 bytes) along A's rows and
 * along B's columns: a = rank rows of ceil(cols / 32) blocks, b = B^T, rank
 * rows of ceil(rows / 32) blocks; a row whose length is not a multiple of 32
 * ends in a short block (its q past the row are not read).  Copied into
 * aligned, packed storage.  NULL when out of memory, a format is unknown or a
 * dimension is < 1. */
lora_delta *lora_delta_new(int a_fmt, int b_fmt, int64_t rank, int64_t rows, int64_t cols,
                           const void *a, const void *b);
/* A delta over the caller's memory, not copied: A as rows of [rank, lda] (a_by_row: A^T as
 * rows of [cols, lda]), B as B^T rows of [rank, ldb] (b_by_row: B as rows of [rows, ldb]),
 * both in element format fmt.  The caller keeps that memory alive while calls use the view;
 * writes to it are seen by the next call.  A view with a_by_row serves the row gathers only
 * (LORA_ERR_ARG elsewhere).  NULL when out of memory, fmt is not an element format or a size
 * is invalid. */
lora_delta *lora_delta_view(int fmt, int64_t rank, int64_t rows, int64_t cols, const void *a,
                            int64_t lda, int a_by_row, const void *b, int64_t ldb, int b_by_row);
/* frees the delta (a view: only its handle, never the caller's memory) */
void lora_delta_free(lora_delta *d);
/* copies the stored values back out, in the layout lora_delta_new took (a
 * block format: its blocks, a short block's q past the row written as 0) */
void lora_delta_export(const lora_delta *d, void *a, void *b);
/* a delta's rank, rows and cols (each pointer may be NULL) */
void lora_delta_dims(const lora_delta *d, int64_t *rank, int64_t *rows, int64_t *cols);

/* --- applying deltas: one call ------------------------------------------------
 *
 * Every apply is one lora_call through lora_apply: an entry table, positions,
 * and the activations.  Entry e is the members deltas[first[e] .. first[e+1])
 * applied in order in one pass (x read once per block of positions, each out
 * element rounded once); scales[q] is member q's effective scale.  A LoraDelta
 * is a table of one entry of one member, a stack one entry of its members, a
 * bank one entry per slot.
 *
 * Positions: position b uses entry entry_ids[b / ids_every] (-1 = none;
 * entry_ids NULL = every position uses entry 0).  pos_scales (NULL = none)
 * multiplies the scales of position b by pos_scales[b / ids_every]: member q
 * there uses (float)(scales[q] * pos_scales[b / ids_every]), formed in double.
 * A member whose float32 scale is 0 adds nothing to that position; a position
 * whose multiplier is 0 is not touched (unless a member's epilogue acts at
 * scale 0, below).  Every member is rows x cols.  A member's scale not finite
 * in float32, a multiplier that is not finite, or a product not finite in
 * float32 is LORA_ERR_SCALE before anything is written, with *bad the index
 * into pos_scales (or -1 when the member's own scale is at fault).
 *
 * The ops:
 *   LORA_OP_PROJECT  out[b*ldo + i] += s * (B (A x[(b / x_every)*ldx + :]))[i],
 *                    b < n (a decode is n = 1, a prefill n positions);
 *   LORA_OP_ROWS     out[i*ldo + j] += s * (B[ids[i], :] A)[j], i < n (token
 *                    embedding rows); an id outside [0, rows) is
 *                    LORA_ERR_INDEX, *bad = its position;
 *   LORA_OP_EXPERTS  n routed (token, slot) pairs: pair q goes through expert
 *                    expert_ids[q] (-1 = none) of adapter entry_ids[q /
 *                    ids_every] (-1 = none; NULL = adapter 0), adapter a's
 *                    experts being the entries starts[a] .. starts[a + 1)
 *                    (starts: n_adapters + 1 values; an adapter with fewer than
 *                    n_experts entries, an empty slot, adds nothing); pair q
 *                    reads x row q / x_every (x_every = k: a token's k slots
 *                    share its row) and adds into out row q.  An adapter id
 *                    outside [-1, n_adapters) is LORA_ERR_ADAPTER (*bad = its
 *                    index in entry_ids), an expert id outside [-1, n_experts)
 *                    LORA_ERR_INDEX (*bad = its pair).
 * For PROJECT and ROWS an entry id outside [-1, n_entries) is LORA_ERR_ADAPTER
 * with *bad its index in entry_ids.
 *
 * Activations (x, out) may be float32, float16 or bfloat16 (the LORA_DTYPE_*
 * codes), independently of the deltas' storage and of each other.  Compute is
 * float32: x is widened exactly; a half-precision out element is widened,
 * updated by every member of its entry in order, and rounded once to nearest
 * even.  ldx / ldo are leading dimensions in elements of x / out.
 *
 * Epilogues: what a member does after its accumulate, a kind per member
 * (epilogues[q]; NULL = every member plain):
 *   LORA_EPI_PLAIN       out <- out + s B (A x)
 *   LORA_EPI_ROW_FACTOR  out <- g * (out + s B (A x)), g a float32 factor per
 *                        output element (DoRA's m / |W + s B A|): the running
 *                        bias-free sum of the members before it is scaled too.
 *                        It acts at scale 0 (g still applies), so a position
 *                        of an entry with such a member is never skipped for a
 *                        zero multiplier.
 * An epilogue's data for member q at the positions of id i (i = b /
 * ids_every) is epi_data[i * epi_stride + q] (epi_stride 0: epi_data[q] at
 * every position): rows floats for PROJECT and EXPERTS, cols for ROWS, NULL
 * for a plain member.  The data must not share bytes with out.
 *
 * Checked before the first write: dtype codes, leading dimensions,
 * alignment, the byte ranges of x and out (LORA_ERR_OVERLAP), every id and
 * scale.  Ids, scales and token ids that share bytes with out are copied
 * first.  Threads split outputs, never one sum, so the bits of every output
 * element depend only on the ISA path and the deltas' storage formats. */
#define LORA_OP_PROJECT 0
#define LORA_OP_ROWS 1
#define LORA_OP_EXPERTS 2

#define LORA_EPI_PLAIN 0
#define LORA_EPI_ROW_FACTOR 1
#define LORA_EPI_COUNT 2

typedef struct {
    int op;                           /* LORA_OP_* */
    /* the entry table */
    int64_t n_entries;
    const int64_t *first;             /* [n_entries + 1] */
    const lora_delta *const *deltas;  /* [first[n_entries]] members */
    const double *scales;             /* [members] effective scales */
    const uint8_t *epilogues;         /* [members] LORA_EPI_*, or NULL: all plain */
    const float *const *epi_data;     /* see above; NULL: no member has data */
    int64_t epi_stride;
    int64_t rows, cols;               /* every member's shape */
    /* positions */
    int64_t n;
    const int64_t *entry_ids;         /* NULL: entry (adapter) 0 everywhere */
    const double *pos_scales;         /* NULL: none */
    int64_t ids_every;                /* 0 or 1: an id per position */
    const int64_t *ids;               /* LORA_OP_ROWS: token ids [n] */
    int64_t n_adapters;               /* LORA_OP_EXPERTS: the routing */
    const int64_t *starts;
    int64_t n_experts;
    const int64_t *expert_ids;
    /* activations */
    const void *x;                    /* PROJECT, EXPERTS */
    int x_dtype;
    int64_t ldx;
    int64_t x_every;                  /* 0 or 1: an x row per position */
    void *out;
    int out_dtype;
    int64_t ldo;
    int64_t *bad;                     /* NULL, or where a refusal names its index (-1: none) */
} lora_call;

/* LORA_OK, or the LORA_ERR_* status of the first thing refused (nothing written then) */
int lora_apply(const lora_call *call);

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
