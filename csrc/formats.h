/*
 * formats.h - the two registries, each fact once: the element dtypes (what x,
 * out and merge targets are: LORA_DTYPES) and the storage formats of a
 * delta's factors (LORA_FORMATS: values per block, bytes per block, the C
 * type of a stored value), with the portable conversions and readers built on
 * them.  Everything that switches over dtypes or formats derives from these
 * lists; the few places that handle each one by hand say so with
 * LORA_DTYPES_HANDLED / LORA_FORMATS_HANDLED, which stop the build when a
 * registry grows until they learn the new entry (ggml checks GGML_TYPE_COUNT
 * the same way).  docs/internals.md lists the files a new format touches.
 */
#ifndef LORA_FORMATS_H
#define LORA_FORMATS_H

#include <stddef.h>
#include <stdint.h>

#include "lora.h"

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

/* Code that handles dtypes by their element size (merge.c's abs max) knows 2
 * and 4 bytes: LORA_DTYPES(LORA_SIZE_2_OR_4, where); there stops the build for
 * a dtype of another size. */
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

/* ------------------------------------------------------- the format registry
 * Every storage format of a delta's factors, once: its lora.h code, its short
 * name (the suffix of the entry points), its values per block, its bytes per
 * block (a block format's scale included), the C type of one stored value and
 * the work of one multiply-add on its values against float32's 1, for the team
 * policy (below); X(A, code, name, block, block_bytes, value_type, work), A
 * passed through.  Every
 * kernel table entry and switch over formats derives from this list; the
 * places that handle each format by hand (an ISA file's run loaders, delta.c's
 * packing) say LORA_FORMATS_HANDLED(n, where), so a new format stops the
 * build at each of them until it learns it (ggml's type traits are the model).
 * An element format has block 1 and the code of its dtype (checked below),
 * which lets a kernel load x and a factor with one vocabulary. */
#define LORA_FORMATS(X, A)                                                                      \
    X(A, LORA_FMT_F32, f32, 1, 4, float, 1)                                                    \
    X(A, LORA_FMT_F16, f16, 1, 2, uint16_t, 1)                                                 \
    X(A, LORA_FMT_BF16, bf16, 1, 2, uint16_t, 1)                                               \
    X(A, LORA_FMT_Q8_0, q8_0, 32, 34, uint8_t, 1)

#define LORA_FORMATS_HANDLED(n, where) LORA_STATIC_ASSERT((n) == LORA_FMT_COUNT, where)

#define LORA_FMT_POS_(A, CODE, NAME, BLOCK, BYTES, VALUE, WORK) lora_fmt_pos_##NAME##_,
enum { LORA_FORMATS(LORA_FMT_POS_, ) lora_fmt_listed_ };
#undef LORA_FMT_POS_
LORA_STATIC_ASSERT(lora_fmt_listed_ == LORA_FMT_COUNT, format_count_is_the_registry_length);
/* the codes in order; the block divides 32 (the packed row length's unit); an element
 * format's block is its one value */
#define LORA_FMT_CHECK_(A, CODE, NAME, BLOCK, BYTES, VALUE, WORK)                              \
    LORA_STATIC_ASSERT(CODE == lora_fmt_pos_##NAME##_, format_code_of_##NAME);                 \
    LORA_STATIC_ASSERT(32 % (BLOCK) == 0, format_block_divides_32_##NAME);                     \
    LORA_STATIC_ASSERT((BLOCK) > 1 || (BYTES) == sizeof(VALUE), format_element_size_##NAME);   \
    LORA_STATIC_ASSERT((BLOCK) == 1 || (BYTES) == (BLOCK) * sizeof(VALUE) + 2,                 \
                       format_block_is_values_and_a_float16_scale_##NAME);
LORA_FORMATS(LORA_FMT_CHECK_, )
#undef LORA_FMT_CHECK_
/* the element formats are their dtypes, code for code */
LORA_STATIC_ASSERT(LORA_FMT_F32 == LORA_DTYPE_F32 && LORA_FMT_F16 == LORA_DTYPE_F16 &&
                       LORA_FMT_BF16 == LORA_DTYPE_BF16, element_formats_share_dtype_codes);

static inline int lora_format_valid(int fmt) { return fmt >= 0 && fmt < LORA_FMT_COUNT; }

/* values per block (1 for an element format; 0 for a code that is not a format) */
static inline int64_t lora_format_block(int fmt) {
    switch (fmt) {
#define LORA_FMT_BLOCK_(A, CODE, NAME, BLOCK, BYTES, VALUE, WORK) case CODE: return BLOCK;
    LORA_FORMATS(LORA_FMT_BLOCK_, )
#undef LORA_FMT_BLOCK_
    }
    return 0;
}

/* bytes of one stored value (the values array; a block format's scales apart) */
static inline size_t lora_format_value_size(int fmt) {
    switch (fmt) {
#define LORA_FMT_VALUE_(A, CODE, NAME, BLOCK, BYTES, VALUE, WORK) case CODE: return sizeof(VALUE);
    LORA_FORMATS(LORA_FMT_VALUE_, )
#undef LORA_FMT_VALUE_
    }
    return 0;
}

/* The team policy's weight of one multiply-add on a format's values, float32's
 * being 1 (team.c's floors are measured on float32 and bfloat16, whose hot
 * loops are one load or shuffle and one FMA a vector).  Q8_0 weighs as
 * float32: its hot loop is one byte shuffle, one fused multiply-subtract and
 * the FMA a vector (the biased load below), and on a 2-vCPU Intel Xeon
 * (Sapphire Rapids class) a hot 4096 x 4096 rank-16 decode took 1.3x the
 * bfloat16 time on one thread; weight 2 opened a team for it there that lost
 * to one thread (5.65 against 5.26 us, medians of 7 windows).  A format whose
 * widening costs more weighs more, so the team opens for smaller calls of it.
 * Threads never change the bits. */
static inline int64_t lora_format_work(int fmt) {
    switch (fmt) {
#define LORA_FMT_WORK_(A, CODE, NAME, BLOCK, BYTES, VALUE, WORK) case CODE: return WORK;
    LORA_FORMATS(LORA_FMT_WORK_, )
#undef LORA_FMT_WORK_
    }
    return 1;
}

/* the logical bytes of n values (a row) in a format: whole blocks, a short last block
 * counted as a block of its values and its scale */
static inline int64_t lora_format_bytes(int fmt, int64_t n) {
    switch (fmt) {
#define LORA_FMT_BYTES_(A, CODE, NAME, BLOCK, BYTES, VALUE, WORK)                              \
    case CODE: return (BLOCK) == 1 ? n * (BYTES) : n * (int64_t)sizeof(VALUE) + 2 * ((n + (BLOCK) - 1) / (BLOCK));
    LORA_FORMATS(LORA_FMT_BYTES_, )
#undef LORA_FMT_BYTES_
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

/* a factor's values as the kernels address them: value e is v[e] (an element
 * format) or v[e] * d[e / block] (a block format, d its float16 scales) */
typedef struct {
    const void *v;
    const uint16_t *d;
} lora_run;

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

/* Q8_0's values as a factor keeps them: each int8 q biased to the unsigned byte
 * b = q + 128 (q ^ 0x80; lora_delta_new takes and lora_delta_export gives
 * llama.cpp's int8 q).  The bias lets a vector path build a Q8_0 value in two
 * uops instead of four: one byte shuffle sets b into bits 8..15 of the float32
 * 1.0f, whose lane then reads 1 + b 2^-15 exactly, and one fused multiply-
 * subtract by two per-block constants, D = d 2^15 and C = D + D 2^-8, gives
 * (1 + b 2^-15) D - C = (b - 128) d = q d.  D and C are exact in float32 (d
 * is a float16: 11 significant bits, at least 2^-24, so D >= 2^-9 and C spans
 * 19 bits), and q d is exact in float32, so the fma returns q d itself: the
 * same value as sign extension, int-to-float and a multiply by d (the
 * portable reader below), bit for bit.  (That is the AVX-512 path's `shuffle`
 * build; where its 512-bit ops run as two halves, as on Zen 4, the CPU table
 * picks `cvt`, sign extension of b ^ 0x80: kernels_avx512.c, q8_0_f32x16_.) */
#define LORA_Q8_0_BIAS 0x80

/* the int8 q of stored Q8_0 value e (its bias taken off), for the scalar readers */
static inline int lora_q8_0_q(const void *v, int64_t e) { return (int)((const uint8_t *)v)[e] - LORA_Q8_0_BIAS; }

/* value e of a factor run in format fmt, as float32 (exact): the portable
 * reader for code off the hot vector loops (statistics, the gather's rows of
 * B, exports); one case per registry format, the code checked first */
LORA_FORMATS_HANDLED(4, lora_run_load_knows_f32_f16_bf16_q8_0);
static inline float lora_run_load(lora_run r, int64_t e, int fmt) {
    switch (fmt) {
    case LORA_FMT_F32: case LORA_FMT_F16: case LORA_FMT_BF16:
        return lora_load_f32(r.v, e, fmt); /* an element format: its dtype's value */
    case LORA_FMT_Q8_0:
        /* d * q: an 8-bit integer times a float16 is exact in float32 */
        return (float)lora_q8_0_q(r.v, e) * lora_f16_to_f32(r.d[e / 32]);
    }
    LORA_UNREACHABLE();
    return 0.0f;
}

#endif /* LORA_FORMATS_H */
