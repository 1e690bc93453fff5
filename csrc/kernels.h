/*
 * kernels.h - what dispatch.c and the per-ISA kernel files share: the packed
 * delta, the two kernel shapes, and the table one ISA fills.
 *
 * Packed storage (chosen at construction, see lora_delta_new):
 *   a  = lora_a [rank, lda]  row-major, lda  = cols rounded up to 32, zero pad
 *   bt = lora_b^T [rank, ldb], ldb = rows rounded up to 32, zero pad
 *   (+16 more when that is a multiple of 256, so rows do not alias in L1)
 * so both hot loops stream unit-stride rows of 64-byte aligned memory: the
 * projection reads rows of A against x, the accumulation reads rows of B^T
 * (one per rank index) into a strip of outputs, and the token gather reads
 * rows of A into a strip of the embedding row.
 *
 * The two kernel shapes every ISA provides, per storage dtype:
 *   project:    t[b*ldt + k] = sum_j A[k, j] * xs[b][j]       k in [k0, k1)
 *   accumulate: outs[b][i]  += scale * sum_k M[k, i] * u[b*ldu + k]   i in [i0, i1)
 *               (M = B^T for the B.y step, M = A for the gather; the scale
 *               multiplies the finished sum, as NumPy's out + s * ((x @ A.T)
 *               @ B.T) does, so half-precision products stay exact)
 * for nb <= LORA_NB positions at once, so one load of the adapter feeds nb
 * positions.  Each output element's summation order is fixed by the ISA file
 * alone (its header says which) and never depends on nb, on [k0, k1) or on
 * [i0, i1): this is what makes every result batch- and thread-invariant.
 */
#ifndef LORA_KERNELS_H
#define LORA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "lora.h"

/* the x86 SIMD paths need GCC/Clang target attributes and <cpuid.h>;
 * everything else (aarch64, MSVC) builds the portable path only */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define LORA_HAVE_X86 1
#endif

#define LORA_NB 4          /* positions per kernel call (8 measured slower) */
#define LORA_PAD 32        /* lda / ldb are multiples of this (64 B for 16-bit, 128 B for f32) */
#define LORA_ALIGN 64
/* accumulate sums over the rank in blocks of this many terms: a chain from 0
 * inside each block, then the blocks' sums in order.  Rank <= 16 is one plain
 * chain; at rank 256 the rounding error drops about 4x against one chain,
 * which keeps high ranks within SPEC's accuracy rule (2x NumPy's error). */
#define LORA_KBLOCK 16

struct lora_delta {
    int dtype;
    int64_t rank, rows, cols;
    int64_t lda, ldb;      /* elements per packed row of a / bt */
    void *a;               /* [rank, lda] */
    void *bt;              /* [rank, ldb] */
};

typedef void (*lora_project_fn)(const void *a, int64_t lda, int64_t cols,
                                int64_t k0, int64_t k1, int nb,
                                const float *const *xs, float *t, int64_t ldt);
typedef void (*lora_accumulate_fn)(const void *m, int64_t ldm, int64_t kdim,
                                   int64_t i0, int64_t i1, int nb,
                                   const float *u, int64_t ldu, float scale,
                                   float *const *outs);
typedef double (*lora_read_fn)(const float *buf, int64_t n);
/* dst[i] = src[i] as float32 for i < n (exact: every f16/bf16 value is a float32) */
typedef void (*lora_widen_fn)(const void *src, int64_t n, float *dst);

typedef struct {
    const char *name;
    lora_project_fn project[3];        /* indexed by LORA_DTYPE_* */
    lora_accumulate_fn accumulate[3];
    lora_read_fn read;
    lora_widen_fn widen[3];            /* [LORA_DTYPE_F32] unused */
} lora_kernel_table;

extern const lora_kernel_table lora_kernels_scalar;
#if defined(LORA_HAVE_X86)
extern const lora_kernel_table lora_kernels_avx2;
extern const lora_kernel_table lora_kernels_avx512;
#endif

static inline size_t lora_dtype_size(int dtype) { return dtype == LORA_DTYPE_F32 ? 4 : 2; }

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

/* element i of a storage-dtype array, as float32 */
static inline float lora_load_f32(const void *p, int64_t i, int dtype) {
    if (dtype == LORA_DTYPE_F32) return ((const float *)p)[i];
    if (dtype == LORA_DTYPE_F16) return lora_f16_to_f32(((const uint16_t *)p)[i]);
    return lora_bf16_to_f32(((const uint16_t *)p)[i]);
}

#endif /* LORA_KERNELS_H */
