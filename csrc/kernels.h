/*
 * kernels.h - what the plan's runner and the per-ISA kernel files share: the
 * packed delta, the two kernel shapes, and the table one ISA fills (over the
 * two registries of formats.h).
 *
 * Element dtypes (LORA_DTYPES) are what x, out and merge targets are: f32,
 * f16, bf16.  Storage formats (LORA_FORMATS) are how a delta's factors sit in
 * memory: each is described by its values per block, its bytes per block and
 * the C type of one stored value, and read by the kernels through one helper
 * per ISA that loads a run of values as float32.  An element format (one
 * value a block) is its dtype stored as it is, under the same code; a block
 * format keeps a float16 scale per block of values beside them (lora_run.d).
 * A delta's A and B each have a format of their own.
 *
 * Packed storage (chosen at construction, see delta.c):
 *   a  = lora_a [rank, lda]  row-major, lda  = cols rounded up to 32, zero pad
 *   bt = lora_b^T [rank, ldb], ldb = rows rounded up to 32, zero pad
 *   (+ one 64-byte line more when that is a multiple of 256 elements, so rows
 *   do not alias in L1 and still start on a line)
 * so both hot loops stream unit-stride rows of 64-byte aligned memory: the
 * projection reads rows of A against x, the accumulation reads rows of B^T
 * (one per rank index) into a strip of outputs, and the token gather reads
 * rows of A into a strip of the embedding row.  Row lengths are multiples of
 * 32 values, so a block format's blocks (32 values or fewer, dividing 32)
 * never straddle two rows: value e of a factor has scale d[e / block].
 *
 * The two kernel shapes every ISA provides:
 *   project:    t[b*ldt + k] = sum_j A[k, j] * x_b[j]          k in [k0, k1)
 *               for A in storage format fa and x_b in activation dtype xt
 *               (both loaded as float32 in registers; compute float32)
 *   accumulate: out_b[i] += s_{q,b} * sum_k M_q[k, i] * u_q[b*ldu + k]
 *               for every term q in order, i in [i0, i1)
 *               (M = B^T for the B.y step, M = A for the gather; the scale
 *               multiplies the finished sum, as NumPy's out + s * ((x @ A.T)
 *               @ B.T) does).  The terms are the members of a stack: each
 *               adds into the running float32 value of out_b[i] in order, and
 *               a half-precision out is widened before the first and rounded
 *               to nearest even once after the last (a float32 out is simply
 *               updated term by term).  A strip of outputs stays in L1 across
 *               the terms, so out is read and written once per block.
 *               s_{q,b} == 0 leaves position b alone for that term.
 *               A term may hold M by output instead (by_row: M^T [outputs,
 *               ldm], as a caller-owned PEFT lora_B [out, r] is laid out):
 *               each output is then a dot product over k, with its own
 *               summation order written in the ISA file's header.
 * for nb <= LORA_NB positions at once, so one load of the adapter feeds nb
 * positions.  Each output element's summation order is fixed by the ISA file
 * alone (its header says which) and never depends on nb, on [k0, k1), on
 * [i0, i1) or on the dtypes of x and out: this is what makes every result
 * batch- and thread-invariant, and a half-precision out exactly the rounding
 * of what a float32 out would hold.  A format whose values load exactly as
 * float32 (every format here) is summed in float32's order unless the ISA
 * names it in its own_order mask, so its bits are those of a float32 factor
 * holding the same values.
 *
 * The kernel table.  An ISA file defines, inside its target region, these
 * static inline helpers (f: a compile-time LORA_FMT_*; xt, ot: LORA_DTYPE_*):
 *   project_(a, lda, cols, k0, k1, nb, xs, t, ldt, f, xt)
 *   accumulate_(terms, n_terms, i0, i1, nb, outs, obase, ot)
 *   load_run_(r, e, n, dst, f)   values e .. e + n of a factor as float32, exact
 *   widen_(src, n, dst, dt)       dt -> float32, exact    (dt, ot: not float32,
 *   narrow_(src, n, dst, ot)      float32 -> ot, nearest even  whose table entries copy)
 *   read_(buf, n)                 the benchmark's bandwidth probe
 *   peak_(n, flops)               the benchmark's compute probe
 *   merge_row_(...)               the merges' row kernel
 * where the parts that are the same logic on several ISAs come from headers
 * the ISA file includes inside its target region (each says what it needs):
 *   kernels_merge.h   merge_row_, portable C                  (every ISA)
 *   kernels_strip.h   accumulate_ over term_/term_rows_       (AVX2, AVX-512, NEON)
 *   kernels_read.h    read_, peak_ over a vector vocabulary   (AVX2, AVX-512, NEON)
 *   kernels_tails.h   the scalar tails, fma chains            (AVX2, NEON)
 *   kernels_pairs.h   project_ and term_: positions in pairs  (NEON)
 *   kernels_quads.h   term_: up to LORA_NB positions a tile   (AVX2, AVX-512)
 * while the tiles, their widths, loads and horizontal sums stay in the ISA
 * file, so a reader of one file sees the instructions it runs.  An ISA file's
 * own static helpers are named <op>_<shape>_<isa>_ (project_rows_avx2_,
 * term_tile_avx512_): the op, the tile they compute, the ISA; the helpers a
 * shared header calls (term_nb_, project_tile_ of kernels_pairs.h) keep the
 * names that header gives them.
 * and then one line, LORA_KERNEL_TABLE(isa, own_order), which generates the
 * entry points (this comment is where `grep` for their names should land):
 *   lora_project_<fmt>_<isa>     storage format fmt (LORA_FORMATS); the x
 *                                dtype is an argument, switched on once per
 *                                call, each case a project_ compiled for that
 *                                (fmt, xt) pair
 *   lora_load_<fmt>_<isa>        a run of a factor's values as float32
 *   lora_accumulate_<dt>_<isa>   out dtype dt (LORA_DTYPES)
 *   lora_widen_<dt>_<isa>, lora_narrow_<dt>_<isa>
 *   lora_merge_row_<isa>         (portable C, kernels_merge.h)
 *   lora_read_<isa>, lora_peak_<isa>
 * and the table `lora_kernels_<isa>` isa.c points at.
 */
#ifndef LORA_KERNELS_H
#define LORA_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "formats.h"

/* the x86 SIMD paths need GCC/Clang target attributes and <cpuid.h>; the
 * NEON path needs aarch64 (AdvSIMD is baseline there: no run-time check) and
 * GCC/Clang (__fp16, always_inline); everything else (MSVC, 32-bit ARM,
 * other CPUs) builds the portable path only */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define LORA_HAVE_X86 1
#endif
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define LORA_HAVE_NEON 1
#endif

#define LORA_NB 4          /* positions per kernel call (8 measured slower) */
#define LORA_PAD 32        /* lda / ldb are multiples of this (64 B for 16-bit, 128 B for f32) */
#define LORA_ALIGN 64
/* accumulate sums over the rank in blocks of this many terms: a chain from 0
 * inside each block, then the blocks' sums in order.  Rank <= 16 is one plain
 * chain; at rank 256 the rounding error drops about 4x against one chain,
 * which keeps high ranks within the accuracy rule (2x NumPy's error). */
#define LORA_KBLOCK 16
/* project sums a long row in blocks of this many columns: every lane's chain
 * starts from 0 in each block, each block's lanes go through the ISA's
 * horizontal sum, and the blocks' sums are added in order.  A row of at most
 * LORA_JBLOCK columns is one block (the order it always had).  On
 * rows of 14336-28672 columns (Llama-3-8B and Llama-2-70B down projections)
 * one chain a lane put the AVX2 and portable paths' error at 2.1-2.9x
 * NumPy's, past the accuracy rule (2x); a multiple of every path's vector
 * width and chunk, so the blocks' edges fall on whole vectors. */
#define LORA_JBLOCK 4096
/* outputs per strip in accumulate: the strip of nb positions (nb x 128
 * float32 = 2 KiB) stays in L1 while every term of a stack adds into it */
#define LORA_STRIP 128
/* a decode's (one position's) strip: 4 KiB of float32 outputs */
#define LORA_DECODE_STRIP 1024

/* one factor of a delta: rows of ld values in format fmt */
typedef struct {
    void *v;               /* the values, [n, ld] of the format's value type */
    uint16_t *d;           /* a block format's scales, [n * ld / block]; NULL otherwise */
    int64_t ld;            /* values per row (a multiple of 32 for a block format) */
    int fmt;               /* LORA_FMT_* */
    int by_row;            /* held the other way (a view's A^T or B, see lora_delta) */
} lora_factor;

static inline lora_run lora_run_of(const lora_factor *f) {
    lora_run r;
    r.v = f->v, r.d = f->d;
    return r;
}

struct lora_delta {
    int64_t rank, rows, cols;
    lora_factor a;         /* A [rank, a.ld]; a.by_row: A^T [cols, a.ld] */
    lora_factor bt;        /* B^T [rank, bt.ld]; bt.by_row: B [rows, bt.ld] */
    int owned;             /* a and bt are this delta's own packed copies (else the caller's) */
};

/* one term of an accumulate: a stack member's M, its u, its scales */
typedef struct {
    lora_run m;            /* M [kdim, ldm] (by_row: M^T [outputs, ldm]), storage format `fmt` */
    int64_t ldm, kdim;
    int fmt;
    int by_row;            /* M held by output: element (k, i) at m[i * ldm + k] */
    const float *u;        /* u[b*ldu + k] */
    int64_t ldu;
    float scale[LORA_NB];  /* per position; 0: the term adds nothing there */
    /* the runner's own fields (the kernels never read them): whether the term adds
     * anything to its block (a row-factor member at scale 0 adds nothing but its
     * factor), its epilogue kind (lora.h's LORA_EPI_*) and that epilogue's data per
     * position (NULL: nothing to do there; see blocks.c) */
    int active;
    int epilogue;
    const float *epi[LORA_NB];
} lora_term;

/* t[b*ldt + k] for k in [k0, k1), b < nb: x_b = xs[b] in dtype xt (see the top) */
typedef void (*lora_project_fn)(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                                int nb, const void *const *xs, int xt, float *t, int64_t ldt);
/* the terms into outputs [i0, i1) of nb positions, output i of position b at
 * outs[b] + (i - obase) elements */
typedef void (*lora_accumulate_fn)(const lora_term *terms, int n_terms, int64_t i0, int64_t i1,
                                   int nb, void *const *outs, int64_t obase);
/* dst[k] = value e + k of a factor as float32 for k < n (exact) */
typedef void (*lora_load_fn)(lora_run r, int64_t e, int64_t n, float *dst);
typedef double (*lora_read_fn)(const float *buf, int64_t n);
/* n steps of independent FMA chains, no memory; *flops = the float32 flops done */
typedef double (*lora_peak_fn)(int64_t n, int64_t *flops);
/* dst[i] = src[i] as float32 for i < n (exact: every f16/bf16 value is a float32) */
typedef void (*lora_widen_fn)(const void *src, int64_t n, float *dst);
/* dst[i] = src[i] rounded to nearest even into the dtype for i < n (NaN stays
 * NaN, overflow gives inf: lora_f32_to_f16 / lora_f32_to_bf16; float32: a copy) */
typedef void (*lora_narrow_fn)(const float *src, int64_t n, void *dst);
/* merges: acc[j] += s * sum_k b[k] * a[k * lda + j] for j < n <= LORA_MERGE_CHUNK,
 * in float64; see kernels_merge.h */
typedef void (*lora_merge_row_fn)(const double *b, int64_t rank, const double *a, int64_t lda,
                                  int64_t n, double s, double *acc);

typedef struct {
    const char *name;
    lora_project_fn project[LORA_FMT_COUNT];          /* [A's format]; the x dtype an argument */
    lora_load_fn load[LORA_FMT_COUNT];                /* [format] */
    lora_accumulate_fn accumulate[LORA_DTYPE_COUNT];  /* [out dtype] */
    lora_widen_fn widen[LORA_DTYPE_COUNT];            /* [dtype] */
    lora_narrow_fn narrow[LORA_DTYPE_COUNT];          /* [dtype] */
    lora_merge_row_fn merge_row;
    lora_read_fn read;
    lora_peak_fn peak;
    /* bit 1 << format: this ISA sums that storage format in another order than
     * float32, so a float32 copy would change the bits (the own_order argument
     * of LORA_KERNEL_TABLE; the plan never widens such a factor: LORA_WIDEN_MIN) */
    unsigned own_order;
} lora_kernel_table;

extern const lora_kernel_table lora_kernels_scalar;
#if defined(LORA_HAVE_X86)
extern const lora_kernel_table lora_kernels_avx2;
extern const lora_kernel_table lora_kernels_avx512;
#endif
#if defined(LORA_HAVE_NEON)
extern const lora_kernel_table lora_kernels_neon;
#endif

/* The entry points and the table of one ISA, from its static inline helpers
 * (see the comment at the top).  Expanded inside the ISA's target region.
 * The x dtype of project is a switch over the dtype registry in one inlined
 * helper per ISA (the C preprocessor cannot expand one list inside itself,
 * so the format x dtype product is a list of functions times a switch), each
 * case a project_ compiled for its (format, x dtype) pair. */
#define LORA_PROJECT_CASE_(FMT, XT, XNAME, XBYTES, XBITS)                                       \
    case XT: project_(a, lda, cols, k0, k1, nb, xs, t, ldt, FMT, XT); break;
#define LORA_PROJECT_FN_(ISA, FMT, NAME, BLOCK, BYTES, VALUE, WORK)                             \
    static void lora_project_##NAME##_##ISA(lora_run a, int64_t lda, int64_t cols, int64_t k0, \
                                            int64_t k1, int nb, const void *const *xs, int xt, \
                                            float *t, int64_t ldt) {                           \
        lora_project_x_##ISA(a, lda, cols, k0, k1, nb, xs, xt, t, ldt, FMT);                   \
    }
#define LORA_LOAD_FN_(ISA, FMT, NAME, BLOCK, BYTES, VALUE, WORK)                                \
    static void lora_load_##NAME##_##ISA(lora_run r, int64_t e, int64_t n, float *dst) {       \
        if (FMT == LORA_FMT_F32) memcpy(dst, (const float *)r.v + e, (size_t)n * sizeof(float)); \
        else load_run_(r, e, n, dst, FMT);                                                     \
    }
#define LORA_ACCUMULATE_FN_(ISA, OT, NAME, BYTES, BITS)                                         \
    static void lora_accumulate_##NAME##_##ISA(const lora_term *terms, int n_terms, int64_t i0, \
                                               int64_t i1, int nb, void *const *outs,          \
                                               int64_t obase) {                                \
        accumulate_(terms, n_terms, i0, i1, nb, outs, obase, OT);                              \
    }
/* float32 widens and narrows by a copy, the same on every ISA: the ISA's
 * widen_ and narrow_ see the other dtypes only */
#define LORA_WIDEN_FN_(ISA, DT, NAME, BYTES, BITS)                                              \
    static void lora_widen_##NAME##_##ISA(const void *src, int64_t n, float *dst) {            \
        if (DT == LORA_DTYPE_F32) memcpy(dst, src, (size_t)n * sizeof(float));                 \
        else widen_(src, n, dst, DT);                                                          \
    }
#define LORA_NARROW_FN_(ISA, OT, NAME, BYTES, BITS)                                             \
    static void lora_narrow_##NAME##_##ISA(const float *src, int64_t n, void *dst) {           \
        if (OT == LORA_DTYPE_F32) memcpy(dst, src, (size_t)n * sizeof(float));                 \
        else narrow_(src, n, dst, OT);                                                         \
    }
/* designated initializers of the tables: [code] = lora_<family>_<name>_<isa> */
#define LORA_PROJECT_AT_(ISA, CODE, NAME, BLOCK, BYTES, VALUE, WORK) [CODE] = lora_project_##NAME##_##ISA,
#define LORA_LOAD_AT_(ISA, CODE, NAME, BLOCK, BYTES, VALUE, WORK) [CODE] = lora_load_##NAME##_##ISA,
#define LORA_ACCUMULATE_AT_(ISA, CODE, NAME, BYTES, BITS) [CODE] = lora_accumulate_##NAME##_##ISA,
#define LORA_WIDEN_AT_(ISA, CODE, NAME, BYTES, BITS) [CODE] = lora_widen_##NAME##_##ISA,
#define LORA_NARROW_AT_(ISA, CODE, NAME, BYTES, BITS) [CODE] = lora_narrow_##NAME##_##ISA,
/* the merges' row kernel (portable C, kernels_merge.h) */
#define LORA_MERGE_CHUNK 512
#define LORA_MERGE_FN_(ISA)                                                                     \
    static void lora_merge_row_##ISA(const double *b, int64_t rank, const double *a,           \
                                     int64_t lda, int64_t n, double s, double *acc) {          \
        merge_row_(b, rank, a, lda, n, s, acc);                                                \
    }
/* OWN_ORDER: the storage formats this ISA sums in an order of its own, as a
 * mask of 1u << LORA_FMT_* (0u: none); see lora_kernel_table.own_order. */
#define LORA_KERNEL_TABLE(ISA, OWN_ORDER)                                                       \
    LORA_INLINE void lora_project_x_##ISA(lora_run a, int64_t lda, int64_t cols, int64_t k0,    \
                                          int64_t k1, int nb, const void *const *xs, int xt,   \
                                          float *t, int64_t ldt, const int fmt) {              \
        switch (xt) { LORA_DTYPES(LORA_PROJECT_CASE_, fmt) }                                   \
    }                                                                                          \
    LORA_FORMATS(LORA_PROJECT_FN_, ISA)                                                        \
    LORA_FORMATS(LORA_LOAD_FN_, ISA)                                                           \
    LORA_DTYPES(LORA_ACCUMULATE_FN_, ISA)                                                      \
    LORA_DTYPES(LORA_WIDEN_FN_, ISA)                                                           \
    LORA_DTYPES(LORA_NARROW_FN_, ISA)                                                          \
    LORA_MERGE_FN_(ISA)                                                                        \
    static double lora_read_##ISA(const float *buf, int64_t n) { return read_(buf, n); }       \
    static double lora_peak_##ISA(int64_t n, int64_t *flops) { return peak_(n, flops); }       \
    const lora_kernel_table lora_kernels_##ISA = {                                             \
        #ISA,                                                                                  \
        {LORA_FORMATS(LORA_PROJECT_AT_, ISA)},                                                 \
        {LORA_FORMATS(LORA_LOAD_AT_, ISA)},                                                    \
        {LORA_DTYPES(LORA_ACCUMULATE_AT_, ISA)},                                               \
        {LORA_DTYPES(LORA_WIDEN_AT_, ISA)},                                                    \
        {LORA_DTYPES(LORA_NARROW_AT_, ISA)},                                                   \
        lora_merge_row_##ISA,                                                                  \
        lora_read_##ISA,                                                                       \
        lora_peak_##ISA,                                                                       \
        OWN_ORDER,                                                                             \
    };


#endif /* LORA_KERNELS_H */
