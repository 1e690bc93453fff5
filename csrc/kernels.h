/*
 * kernels.h - what the drivers and the per-ISA kernel files share: the packed
 * delta, the two kernel shapes, and the table one ISA fills.
 *
 * Packed storage (chosen at construction, see delta.c):
 *   a  = lora_a [rank, lda]  row-major, lda  = cols rounded up to 32, zero pad
 *   bt = lora_b^T [rank, ldb], ldb = rows rounded up to 32, zero pad
 *   (+ one 64-byte line more when that is a multiple of 256 elements, so rows
 *   do not alias in L1 and still start on a line)
 * so both hot loops stream unit-stride rows of 64-byte aligned memory: the
 * projection reads rows of A against x, the accumulation reads rows of B^T
 * (one per rank index) into a strip of outputs, and the token gather reads
 * rows of A into a strip of the embedding row.
 *
 * The two kernel shapes every ISA provides:
 *   project:    t[b*ldt + k] = sum_j A[k, j] * x_b[j]          k in [k0, k1)
 *               for A in storage dtype st and x_b in activation dtype xt
 *               (widened in registers; compute float32)
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
 * of what a float32 out would hold.
 *
 * The kernel table.  An ISA file defines, inside its target region, these
 * static inline helpers (dt, xt, ot: compile-time LORA_DTYPE_* constants):
 *   project_(a, lda, cols, k0, k1, nb, xs, t, ldt, dt, xt)
 *   accumulate_(terms, n_terms, i0, i1, nb, outs, ot)
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
 * file, so a reader of one file sees the instructions it runs.
 * and then one line, LORA_KERNEL_TABLE(isa, own_order), which generates, for
 * every dtype <dt> of LORA_DTYPES (f32, f16, bf16), the entry points (this
 * comment is where `grep` for their names should land):
 *   lora_project_<dt>_<isa>      storage dtype dt; the x dtype is an argument,
 *                                switched on once per call, each case a
 *                                project_ compiled for that (dt, xt) pair
 *   lora_accumulate_<dt>_<isa>   out dtype dt
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

#include "lora.h"

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

/* ------------------------------------------------------- the dtype registry
 * Every dtype a delta may store and x / out may have, once: its lora.h code,
 * its short name (the suffix of the entry points), its bytes per element and
 * the C type that holds its bits; X(A, code, name, bytes, bits_type), A
 * passed through.  lora.h defines the codes and LORA_DTYPE_COUNT (cffi reads
 * plain #defines, not this macro); the checks below stop the build when the
 * two disagree.  Every kernel table, entry point and switch over dtypes
 * derives from this list.  The few places that handle each dtype by hand (an
 * ISA file's vector loads and roundings) say LORA_DTYPES_HANDLED(n, where):
 * adding a dtype here stops the build at each of them until it learns the
 * new one (ggml checks GGML_TYPE_COUNT the same way).  The portable
 * conversions lora_<name>_to_f32 and lora_f32_to_<name> (below) exist for
 * every name. */
#define LORA_DTYPES(X, A)                                                                       \
    X(A, LORA_DTYPE_F32, f32, 4, float)                                                        \
    X(A, LORA_DTYPE_F16, f16, 2, uint16_t)                                                     \
    X(A, LORA_DTYPE_BF16, bf16, 2, uint16_t)

/* a compile-time check (C99: a negative array size) */
#define LORA_STATIC_ASSERT(cond, name) typedef char lora_static_assert_##name[(cond) ? 1 : -1]
#define LORA_DTYPES_HANDLED(n, where) LORA_STATIC_ASSERT((n) == LORA_DTYPE_COUNT, where)

/* the codes are 0 .. LORA_DTYPE_COUNT - 1 in the registry's order, and each
 * bits type is as wide as its dtype */
#define LORA_DTYPE_POS_(A, CODE, NAME, BYTES, BITS) lora_dtype_pos_##NAME##_,
enum { LORA_DTYPES(LORA_DTYPE_POS_, ) lora_dtype_listed_ };
#undef LORA_DTYPE_POS_
LORA_STATIC_ASSERT(lora_dtype_listed_ == LORA_DTYPE_COUNT, dtype_count_is_the_registry_length);
#define LORA_DTYPE_CHECK_(A, CODE, NAME, BYTES, BITS)                                           \
    LORA_STATIC_ASSERT(CODE == lora_dtype_pos_##NAME##_, dtype_code_of_##NAME);                \
    LORA_STATIC_ASSERT(sizeof(BITS) == BYTES, dtype_bits_of_##NAME);
LORA_DTYPES(LORA_DTYPE_CHECK_, )
#undef LORA_DTYPE_CHECK_

/* Code that handles dtypes by their element size (delta.c's transposition,
 * merge.c's abs max) knows 2 and 4 bytes: LORA_DTYPES(LORA_SIZE_2_OR_4,
 * where); there stops the build for a dtype of another size. */
#define LORA_SIZE_2_OR_4(WHERE, CODE, NAME, BYTES, BITS)                                        \
    LORA_STATIC_ASSERT(BYTES == 2 || BYTES == 4, WHERE##_knows_2_and_4_byte_dtypes_not_##NAME);

/* the one validity check of a dtype code */
static inline int lora_dtype_valid(int dtype) { return dtype >= 0 && dtype < LORA_DTYPE_COUNT; }

/* bytes per element (0 for a code that is not a dtype) */
static inline size_t lora_dtype_size(int dtype) {
    switch (dtype) {
#define LORA_DTYPE_SIZE_(A, CODE, NAME, BYTES, BITS) case CODE: return BYTES;
    LORA_DTYPES(LORA_DTYPE_SIZE_, )
#undef LORA_DTYPE_SIZE_
    }
    return 0;
}

/* A point no valid input reaches: a switch over the registry's codes after
 * the code was checked (lora_dtype_valid at the entry point or when the delta
 * was made).  It tells the compiler the switch is total, so it is compiled as
 * a plain n-way branch; UBSan (the sanitizer CI stage) reports any call that
 * reaches it. */
#if defined(__GNUC__) || defined(__clang__)
#define LORA_UNREACHABLE() __builtin_unreachable()
#elif defined(_MSC_VER)
#define LORA_UNREACHABLE() __assume(0)
#else
#define LORA_UNREACHABLE() ((void)0)
#endif

/* forced inlining where the compiler allows it (the generated table helpers) */
#if defined(__GNUC__) || defined(__clang__)
#define LORA_INLINE static inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define LORA_INLINE static __forceinline
#else
#define LORA_INLINE static inline
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

struct lora_delta {
    int dtype;
    int64_t rank, rows, cols;
    int64_t lda, ldb;      /* elements per row of a / bt */
    void *a;               /* [rank, lda]; a_by_row: A^T [cols, lda] */
    void *bt;              /* [rank, ldb]; b_by_row: B [rows, ldb] */
    int a_by_row, b_by_row;
    int owned;             /* a and bt are this delta's own packed copies (else the caller's) */
};

/* one term of an accumulate: a stack member's M, its u, its scales */
typedef struct {
    const void *m;         /* M [kdim, ldm] (by_row: M^T [outputs, ldm]), storage dtype `dtype` */
    int64_t ldm, kdim;
    int dtype;
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
typedef void (*lora_project_fn)(const void *a, int64_t lda, int64_t cols, int64_t k0,
                                int64_t k1, int nb, const void *const *xs, int xt, float *t,
                                int64_t ldt);
typedef void (*lora_accumulate_fn)(const lora_term *terms, int n_terms, int64_t i0, int64_t i1,
                                   int nb, void *const *outs);
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
    lora_project_fn project[LORA_DTYPE_COUNT];        /* [storage dtype]; the x dtype an argument */
    lora_accumulate_fn accumulate[LORA_DTYPE_COUNT];  /* [out dtype] */
    lora_widen_fn widen[LORA_DTYPE_COUNT];            /* [dtype] */
    lora_narrow_fn narrow[LORA_DTYPE_COUNT];          /* [dtype] */
    lora_merge_row_fn merge_row;
    lora_read_fn read;
    lora_peak_fn peak;
    /* bit 1 << dtype: this ISA sums that storage dtype in another order than
     * float32, so a float32 copy would change the bits (the own_order argument
     * of LORA_KERNEL_TABLE; the drivers never widen such a delta: LORA_WIDEN_MIN) */
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
 * The x dtype of project is a switch over the registry in one inlined helper
 * per ISA (the C preprocessor cannot expand one list inside itself, so the
 * storage x x product is a list of functions times a switch), each case a
 * project_ compiled for its (storage, x) pair. */
#define LORA_PROJECT_CASE_(DT, XT, XNAME, XBYTES, XBITS)                                        \
    case XT: project_(a, lda, cols, k0, k1, nb, xs, t, ldt, DT, XT); break;
#define LORA_PROJECT_FN_(ISA, DT, NAME, BYTES, BITS)                                            \
    static void lora_project_##NAME##_##ISA(const void *a, int64_t lda, int64_t cols,          \
                                            int64_t k0, int64_t k1, int nb,                    \
                                            const void *const *xs, int xt, float *t,           \
                                            int64_t ldt) {                                     \
        lora_project_x_##ISA(a, lda, cols, k0, k1, nb, xs, xt, t, ldt, DT);                    \
    }
#define LORA_ACCUMULATE_FN_(ISA, OT, NAME, BYTES, BITS)                                         \
    static void lora_accumulate_##NAME##_##ISA(const lora_term *terms, int n_terms, int64_t i0, \
                                               int64_t i1, int nb, void *const *outs) {        \
        accumulate_(terms, n_terms, i0, i1, nb, outs, OT);                                     \
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
#define LORA_PROJECT_AT_(ISA, CODE, NAME, BYTES, BITS) [CODE] = lora_project_##NAME##_##ISA,
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
/* OWN_ORDER: the storage dtypes this ISA sums in an order of its own, as a
 * mask of 1u << LORA_DTYPE_* (0u: none); see lora_kernel_table.own_order. */
#define LORA_KERNEL_TABLE(ISA, OWN_ORDER)                                                       \
    LORA_INLINE void lora_project_x_##ISA(const void *a, int64_t lda, int64_t cols, int64_t k0, \
                                          int64_t k1, int nb, const void *const *xs, int xt,   \
                                          float *t, int64_t ldt, const int dt) {               \
        switch (xt) { LORA_DTYPES(LORA_PROJECT_CASE_, dt) }                                    \
    }                                                                                          \
    LORA_DTYPES(LORA_PROJECT_FN_, ISA)                                                         \
    LORA_DTYPES(LORA_ACCUMULATE_FN_, ISA)                                                      \
    LORA_DTYPES(LORA_WIDEN_FN_, ISA)                                                           \
    LORA_DTYPES(LORA_NARROW_FN_, ISA)                                                          \
    LORA_MERGE_FN_(ISA)                                                                        \
    static double lora_read_##ISA(const float *buf, int64_t n) { return read_(buf, n); }       \
    static double lora_peak_##ISA(int64_t n, int64_t *flops) { return peak_(n, flops); }       \
    const lora_kernel_table lora_kernels_##ISA = {                                             \
        #ISA,                                                                                  \
        {LORA_DTYPES(LORA_PROJECT_AT_, ISA)},                                                  \
        {LORA_DTYPES(LORA_ACCUMULATE_AT_, ISA)},                                               \
        {LORA_DTYPES(LORA_WIDEN_AT_, ISA)},                                                    \
        {LORA_DTYPES(LORA_NARROW_AT_, ISA)},                                                   \
        lora_merge_row_##ISA,                                                                  \
        lora_read_##ISA,                                                                       \
        lora_peak_##ISA,                                                                       \
        OWN_ORDER,                                                                             \
    };


/* exact float16 -> float32 (portable; used off the hot vector loops) */
static inline float lora_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);                 /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);        /* normal */
    } else if (man == 0) {
        bits = sign;                                             /* +-0 */
    } else {                                                     /* subnormal */
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

static inline float lora_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* float32 -> bfloat16, round to nearest even; NaN stays NaN (quiet bit set),
 * overflow gives inf, as ml_dtypes' conversion does */
static inline uint16_t lora_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* float32 -> float16, round to nearest even (subnormals included); NaN stays
 * NaN, overflow gives inf, as NumPy's astype(float16) does */
static inline uint16_t lora_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    const uint32_t sign = (v.u >> 16) & 0x8000u, mag = v.u & 0x7fffffffu;
    if (mag > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((mag >> 13) & 0x1ffu));  /* nan */
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* >= 65520: rounds to inf */
    if (mag < 0x38800000u) {                                    /* below 2^-14: subnormal */
        if (mag < 0x33000000u) return (uint16_t)sign;           /* <= 2^-25: rounds to 0 */
        const uint32_t e = mag >> 23, man = (mag & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;                        /* 14..24 */
        uint32_t h = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((mag >> 13) - (112u << 10));
    const uint32_t rem = mag & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;     /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
}

/* float32 is its own conversion (so every registry name has both) */
static inline float lora_f32_to_f32(float f) { return f; }

/* element i of a dtype array, as float32 (exact); one test per registry dtype,
 * the code checked first (lora_dtype_valid), so none is left over */
static inline float lora_load_f32(const void *p, int64_t i, int dtype) {
#define LORA_LOAD_IF_(A, CODE, NAME, BYTES, BITS)                                               \
    if (dtype == CODE) return lora_##NAME##_to_f32(((const BITS *)p)[i]);
    LORA_DTYPES(LORA_LOAD_IF_, )
#undef LORA_LOAD_IF_
    LORA_UNREACHABLE();
    return 0.0f;
}

/* element i of a dtype array = v, rounded to nearest even */
static inline void lora_store_f32(void *p, int64_t i, float v, int dtype) {
#define LORA_STORE_IF_(A, CODE, NAME, BYTES, BITS)                                              \
    if (dtype == CODE) {                                                                       \
        ((BITS *)p)[i] = lora_f32_to_##NAME(v);                                                \
        return;                                                                                \
    }
    LORA_DTYPES(LORA_STORE_IF_, )
#undef LORA_STORE_IF_
    LORA_UNREACHABLE();
}

#endif /* LORA_KERNELS_H */
