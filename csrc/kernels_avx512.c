/*
 * kernels_avx512.c - the AVX-512 path (Skylake-SP and later, Zen 4).
 *
 * Required features: AVX512F, AVX512BW + AVX512VL (16-bit masked loads for
 * the half-precision tails), FMA, F16C (isa.c checks all of them).
 * Instructions: vfmadd231ps on 16-lane zmm registers; float16 storage is
 * widened with vcvtph2ps; Q8_0 storage 16 biased bytes a broadcast load, set
 * into the bits of 1.0f by one vpshufb and made d * q by one vfmsub (exact;
 * formats.h), or, where the CPU table says so (Zen 4), sign-extended, converted
 * and multiplied by d (q8_0_f32x16_: the same values); bfloat16 storage 32 values per 64-byte load, split
 * into its even- and odd-indexed values by two vpshufb (exact, port 5, off
 * the FMA port; see bf16_even_f32x16_), or with vpmovzxwd + vpslld 16 for
 * 16-value tiles, tails and by-row terms.  Packed rows start on 64-byte lines
 * (delta.c), so the 64-byte loads never split one.
 *
 * Summation order (one per output element, shared by decode, batch, stack
 * and bank, for every x and out dtype):
 *   project     t[k] = ((r_0 + r_1) + r_2) ..., one r_m per column block m
 *               (the whole vectors in [m, m+1) x LORA_JBLOCK; the masked last
 *               vector joins the last block; a row of up to 4096 columns is
 *               one block, t[k] = r_0), r_m = hsum16(lanes); hsum16 is
 *               the halving tree written out in hsum_f32x16_: s8_i = l_i +
 *               l_(i+8), s4_i = s8_i + s8_(i+4), then (s4_0 + s4_2) +
 *               (s4_1 + s4_3) (the tree GCC's _mm512_reduce_add_ps uses;
 *               written out so that no compiler picks another).  Lane l is an fma-chain from 0 over the block's
 *               columns j ascending,
 *                 float32/float16/Q8_0 A: j = l (mod 16), the last partial
 *                   16 columns loaded with a mask (masked-off lanes add 0*0);
 *                 bfloat16 A: the j with floor(j / 2) = l (mod 16), i.e.
 *                   32c + 2l then 32c + 2l + 1 for c = 0, 1, ...; the last
 *                   partial 32 columns loaded with a mask (masked-off lanes
 *                   add 0*0).  So a bf16 delta is never run as a float32
 *                   copy on this path (LORA_OWN_ORDER below).
 *   accumulate  (every storage dtype; a bf16 tile of 32c outputs keeps output
 *               i + 2l in even lane l, i + 2l + 1 in odd lane l until the
 *               store, which changes no arithmetic)
 *               out[i] = out[i] + ((blk_0 + blk_1) + blk_2 ...), blk_m =
 *               fma-chain from 0 over k in [16m, 16m+16) ascending of
 *               M[k,i]*u[k] (LORA_KBLOCK), then out[i] = fma(total, s,
 *               out[i]) (one rounding); the tail is the same in masked lanes.
 *   by_row      (a term held by output, a caller's lora_B [out, r]) out[i] =
 *               fma(total, s, out[i]), total = hsum16x16_'s tree over lanes
 *               l = fma-chain over k = l (mod 16) ascending (last chunk masked).
 * Tail strategy: masked loads and stores, no scalar tail.
 * Accumulators: up to 16 zmm chains per tile (FMA latency 4 x 2 ports needs
 * 8): project tiles are nr ranks x nb positions with nr = 8 for nb <= 2 and
 * 4 for nb <= 4, so one A load feeds nb positions and one x load nr ranks;
 * accumulate tiles are nv row vectors x nb positions, nv * nb = 8 block
 * chains (each with its running total over rank blocks); a decode (nb = 1)
 * instead walks one vector of outputs (two for a bfloat16 M) through every
 * row of a rank block before the next (term_decode_avx512_), the same chains.
 * Project walks columns in 512-wide chunks so the nb x rows stay in L1
 * across rank tiles (see project_nb_avx512_).
 */
#include "kernels.h"

#if defined(LORA_HAVE_X86)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#endif

#define INLINE_ static inline __attribute__((always_inline))

/* The loads and the rounding (narrow_f32x16_, narrow_) below know float32,
 * float16 and bfloat16, the last one in each being bfloat16. */
LORA_DTYPES_HANDLED(3, avx512_loads_and_roundings_know_f32_f16_bf16);

/* 16 float16 / bfloat16 values as float32 (exact) */
INLINE_ __m512 widen_f32x16_(__m256i h, const int dt) {
    if (dt == LORA_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE_ __m512 load_f32x16_(const void *p, int64_t i, const int dt) {
    if (dt == LORA_DTYPE_F32) return _mm512_loadu_ps((const float *)p + i);
    return widen_f32x16_(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)), dt);
}

INLINE_ __m512 load_masked_f32x16_(const void *p, int64_t i, __mmask16 mask, const int dt) {
    if (dt == LORA_DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    return widen_f32x16_(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i), dt);
}

INLINE_ __mmask16 tail_mask_(int64_t n) { return (__mmask16)((1u << n) - 1u); }

/* The sum of 16 lanes by a fixed tree (the header's hsum16): halves of 256,
 * 128, 64 and 32 bits, each add written out.  Clang lowers
 * _mm512_reduce_add_ps as a reassociable reduction, free to pick its own tree;
 * this one is the same on every compiler. */
INLINE_ float hsum_f32x16_(__m512 v) {
    const __m256 hi_f32x8 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8_f32x8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi_f32x8);
    const __m128 s4_f32x4 = _mm_add_ps(_mm256_castps256_ps128(s8_f32x8),
                                       _mm256_extractf128_ps(s8_f32x8, 1));
    const __m128 s2_f32x4 = _mm_add_ps(s4_f32x4, _mm_movehl_ps(s4_f32x4, s4_f32x4));
    return _mm_cvtss_f32(_mm_add_ss(s2_f32x4, _mm_shuffle_ps(s2_f32x4, s2_f32x4, 1)));
}

/* A run of a factor's values as float32 (exact): 16 of them, the same under
 * a mask, and the raw 32 values of a 64-byte load (bfloat16's pair order,
 * bf16_even/odd_f32x16_).  The one place this file reads a storage format; an
 * element format is its dtype's values; a Q8_0 value is d * q, built from its
 * biased byte as formats.h describes (the product of an 8-bit integer and a
 * float16 is exact in float32), so a Q8_0 factor is summed in float32's
 * order.  Runs start at
 * multiples of 16 (rows are multiples of 32 long, tiles and thread splits
 * step by 16), so 16 values never straddle two blocks: one scale a vector. */
LORA_FORMATS_HANDLED(4, avx512_run_loads_know_f32_f16_bf16_q8_0);

/* a Q8_0 factor's format code in the hot loops: LORA_FMT_Q8_0, or Q8_0_CVT_ where the CPU
 * table builds its values by conversion (see q8_0_f32x16_) */
#define Q8_0_CVT_ (LORA_FMT_Q8_0 | 0x40)
LORA_STATIC_ASSERT(Q8_0_CVT_ >= LORA_FMT_COUNT, q8_0_cvt_code_is_no_format);
INLINE_ int q8_(const int f) { return f == LORA_FMT_Q8_0 || f == Q8_0_CVT_; }

/* The two constants of formats.h's biased load from float16 scales d widened to float32:
 * D = d 2^15 and C = D + D 2^-8 (both exact), lane for lane */
INLINE_ void q8_0_big_off_f32x16_(__m512 d_f32x16, __m512 *big_f32x16, __m512 *off_f32x16) {
    *big_f32x16 = _mm512_mul_ps(d_f32x16, _mm512_set1_ps(32768.0f));
    *off_f32x16 = _mm512_fmadd_ps(*big_f32x16, _mm512_set1_ps(1.0f / 256.0f), *big_f32x16);
}
/* the same for one block's scale, broadcast */
INLINE_ void q8_0_big_off_(uint16_t d, __m512 *big_f32x16, __m512 *off_f32x16) {
    q8_0_big_off_f32x16_(_mm512_cvtph_ps(_mm256_set1_epi16((short)d)), big_f32x16, off_f32x16);
}

/* 16 Q8_0 values from 16 stored bytes (broadcast to every 128-bit block of raw), as
 * formats.h builds them: vpshufb sets byte l into bits 8..15 of lane l, merged into the bits
 * of 1.0f (lane l reads 1 + b 2^-15), and one fused multiply-subtract gives q d exactly.
 * Two uops a vector where sign extension, int-to-float and the scale's multiply take three
 * (one of them on port 5 beside the FMAs); `mask` zeroes the lanes it leaves out. */
INLINE_ __m512 q8_0_values_f32x16_(__m512i raw_u8x16x4, __m512 big_f32x16, __m512 off_f32x16, __mmask16 mask) {
    const __m512i idx = _mm512_set_epi32(0x0f00, 0x0e00, 0x0d00, 0x0c00, 0x0b00, 0x0a00, 0x0900, 0x0800,
                                         0x0700, 0x0600, 0x0500, 0x0400, 0x0300, 0x0200, 0x0100, 0x0000);
    const __m512i one = _mm512_set1_epi32(0x3f800000);
    const __m512 v = _mm512_castsi512_ps(_mm512_mask_shuffle_epi8(one, (__mmask64)0x2222222222222222ull,
                                                                  raw_u8x16x4, idx));
    return mask == (__mmask16)0xffff ? _mm512_fmsub_ps(v, big_f32x16, off_f32x16)
                                     : _mm512_maskz_fmsub_ps(mask, v, big_f32x16, off_f32x16);
}

INLINE_ __m512 run_f32x16_(lora_run r, int64_t e, const int f) {
    if (q8_(f)) {
        __m512 big_f32x16, off_f32x16;
        q8_0_big_off_(r.d[e >> 5], &big_f32x16, &off_f32x16);
        const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)((const uint8_t *)r.v + e)));
        return q8_0_values_f32x16_(raw, big_f32x16, off_f32x16, (__mmask16)0xffff);
    }
    return load_f32x16_(r.v, e, f);
}

/* The hot loops build Q8_0 values one of two ways, the same values bit for bit (both exact):
 *   shuffle  formats.h's biased load, one vpshufb and one vfmsub a vector (above): two uops
 *            where Intel's 512-bit ports are wide (a 2-vCPU Sapphire Rapids class Xeon ran a
 *            hot decode at 0.72-0.78x bfloat16's time this way);
 *   cvt      sign extension (vpmovsxbd of the bytes less their bias), int-to-float and a
 *            multiply by d: one more uop, but on AMD Zen 4, which runs a 512-bit op as two
 *            256-bit halves, the shuffle and the fmsub queue behind the FMAs on the same
 *            pipes, and the cvt build ran the hot B loop 1.40x faster (0.80 against 1.12 ns
 *            a vector of 16, four chains, 16 x 4096 values in L2: benchmarks/q8_0_widen.c,
 *            docs/performance.md).
 * The CPU table (isa.c, lora_q8_0_widening) picks one per core; the hot loops take it as
 * their format code: LORA_FMT_Q8_0 for shuffle, Q8_0_CVT_ (this file's own code) for cvt,
 * dispatched once a term or a projection (term_nb_, project_).  Off the hot loops (tails of
 * run_*, by-row terms, loads) a Q8_0 value is always built the shuffle way. */

/* 16 Q8_0 values from their 16 stored bytes, the cvt way: the bias off, sign extension,
 * int-to-float, times d (d_f32x16); `mask` zeroes the lanes it leaves out */
INLINE_ __m512 q8_0_cvt_values_f32x16_(__m128i b_u8x16, __m512 d_f32x16, __mmask16 mask) {
    const __m512i q_i32x16 = _mm512_cvtepi8_epi32(_mm_xor_si128(b_u8x16, _mm_set1_epi8((char)LORA_Q8_0_BIAS)));
    return mask == (__mmask16)0xffff ? _mm512_mul_ps(_mm512_cvtepi32_ps(q_i32x16), d_f32x16)
                                     : _mm512_maskz_mul_ps(mask, _mm512_cvtepi32_ps(q_i32x16), d_f32x16);
}

/* The hot loops' Q8_0 load: 16 values from q (a multiple of 16 into its row), their block's
 * constants already float32 (q8_0_scales_ widens a tile's scales once, so each vector pays
 * broadcasts from L1 instead of converting the float16): D and C for shuffle, d (big) for cvt */
INLINE_ __m512 q8_0_f32x16_(const uint8_t *q, __m512 big_f32x16, __m512 off_f32x16, const int f) {
    const __m128i b_u8x16 = _mm_loadu_si128((const __m128i *)q);
    if (f == Q8_0_CVT_) return q8_0_cvt_values_f32x16_(b_u8x16, big_f32x16, (__mmask16)0xffff);
    return q8_0_values_f32x16_(_mm512_broadcast_i32x4(b_u8x16), big_f32x16, off_f32x16, (__mmask16)0xffff);
}
/* the same under a mask (the lanes left out read as 0; no byte past them is read) */
INLINE_ __m512 q8_0_masked_f32x16_(const uint8_t *q, __m512 big_f32x16, __m512 off_f32x16, __mmask16 mask,
                                   const int f) {
    const __m128i b_u8x16 = _mm_maskz_loadu_epi8(mask, q);
    if (f == Q8_0_CVT_) return q8_0_cvt_values_f32x16_(b_u8x16, big_f32x16, mask);
    return q8_0_values_f32x16_(_mm512_broadcast_i32x4(b_u8x16), big_f32x16, off_f32x16, mask);
}

/* The block constants of n consecutive Q8_0 blocks from block b0 of a factor for build f: D
 * and C (q8_0_big_off_) for shuffle, d widened to float32 in big for cvt (off unused); big and
 * off hold n rounded up to 16 */
INLINE_ void q8_0_scales_(lora_run r, int64_t b0, int64_t n, float *big, float *off, const int f) {
    for (int64_t s = 0; s < n; s += 16) {
        const __mmask16 m = n - s >= 16 ? (__mmask16)0xffff : tail_mask_(n - s);
        const __m512 d_f32x16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, r.d + b0 + s));
        if (f == Q8_0_CVT_) {
            _mm512_storeu_ps(big + s, d_f32x16);
            continue;
        }
        __m512 big_f32x16, off_f32x16;
        q8_0_big_off_f32x16_(d_f32x16, &big_f32x16, &off_f32x16);
        _mm512_storeu_ps(big + s, big_f32x16);
        _mm512_storeu_ps(off + s, off_f32x16);
    }
}

/* block blk's C broadcast for build f (cvt has none: q8_0_scales_ leaves off unwritten) */
INLINE_ __m512 q8_0_off_(const float *off, int64_t blk, const int f) {
    return f == Q8_0_CVT_ ? _mm512_setzero_ps() : _mm512_set1_ps(off[blk]);
}

INLINE_ __m512 run_masked_f32x16_(lora_run r, int64_t e, __mmask16 mask, const int f) {
    if (q8_(f)) {
        __m512 big_f32x16, off_f32x16;
        q8_0_big_off_(r.d[e >> 5], &big_f32x16, &off_f32x16);
        return q8_0_masked_f32x16_((const uint8_t *)r.v + e, big_f32x16, off_f32x16, mask, LORA_FMT_Q8_0);
    }
    return load_masked_f32x16_(r.v, e, mask, f);
}

/* 32 bfloat16 values from value e (whole, or those under a mask) */
INLINE_ __m512i run_bf16x32_(lora_run r, int64_t e) {
    return _mm512_loadu_si512((const uint16_t *)r.v + e);
}
INLINE_ __m512i run_masked_bf16x32_(lora_run r, int64_t e, __mmask32 mask) {
    return _mm512_maskz_loadu_epi16(mask, (const uint16_t *)r.v + e);
}

/* 32 bfloat16 values in one zmm, widened exactly in one uop per 16: moving
 * the low half of each 32-bit lane up 16 bits gives the even-indexed values
 * as float32, clearing the low half the odd-indexed ones (lane l: values 2l
 * and 2l + 1).  Each is one vpshufb (byte shuffle, a 0xff index writes a
 * zero): it runs on port 5, where vpslld on zmm would take port 0 from the
 * FMAs (the only 512-bit FMA port on a part with one FMA unit, like the Ice
 * Lake we measure on).  Against vpmovzxwd + vpslld per 16 values this halves
 * the widening uops and takes them all off the FMA port. */
INLINE_ __m512 bf16_even_f32x16_(__m512i raw_bf16x32) {
    /* lane l of each 128-bit block: bytes [zero, zero, 4l, 4l + 1] */
    const __m512i idx = _mm512_broadcast_i32x4(_mm_setr_epi32(0x0100ffff, 0x0504ffff, 0x0908ffff, 0x0d0cffff));
    return _mm512_castsi512_ps(_mm512_shuffle_epi8(raw_bf16x32, idx));
}
INLINE_ __m512 bf16_odd_f32x16_(__m512i raw_bf16x32) {
    /* lane l of each 128-bit block: bytes [zero, zero, 4l + 2, 4l + 3] */
    const __m512i idx = _mm512_broadcast_i32x4(_mm_setr_epi32(0x0302ffff, 0x0706ffff, 0x0b0affff, 0x0f0effff));
    return _mm512_castsi512_ps(_mm512_shuffle_epi8(raw_bf16x32, idx));
}

/* even/odd lanes (e[l] = value 2l, o[l] = value 2l + 1) back to order:
 * values 0..15 (lo) and 16..31 (hi) */
INLINE_ __m512 interleave_lo_f32x16_(__m512 even_f32x16, __m512 odd_f32x16) {
    const __m512i idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    return _mm512_permutex2var_ps(even_f32x16, idx, odd_f32x16);
}
INLINE_ __m512 interleave_hi_f32x16_(__m512 even_f32x16, __m512 odd_f32x16) {
    const __m512i idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    return _mm512_permutex2var_ps(even_f32x16, idx, odd_f32x16);
}

/* columns j .. j + 32 of one position's x as its even- and odd-indexed
 * values (even[l] = x[j + 2l], odd[l] = x[j + 2l + 1]), to meet the lanes
 * of a bfloat16 A row widened by bf16_even/odd_f32x16_; columns outside
 * `mask` read as 0.  A bfloat16 x splits like A; float32 and float16 x are
 * put in place by two permutes, paid once per x per tile and shared by the
 * tile's nr ranks. */
INLINE_ void load_x_pairs_(const void *x, int64_t j, __mmask32 mask, const int full, const int xt,
                           __m512 *even_f32x16, __m512 *odd_f32x16) {
    if (xt == LORA_DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)x + j;
        const __m512i raw_bf16x32 = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p);
        *even_f32x16 = bf16_even_f32x16_(raw_bf16x32);
        *odd_f32x16 = bf16_odd_f32x16_(raw_bf16x32);
        return;
    }
    const __mmask16 lo_mask = (__mmask16)mask, hi_mask = (__mmask16)(mask >> 16);
    const __m512 lo_f32x16 = full ? load_f32x16_(x, j, xt) : load_masked_f32x16_(x, j, lo_mask, xt);
    const __m512 hi_f32x16 = full ? load_f32x16_(x, j + 16, xt)
                                  : load_masked_f32x16_(x, j + 16, hi_mask, xt);
    const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    *even_f32x16 = _mm512_permutex2var_ps(lo_f32x16, even_idx, hi_f32x16);
    *odd_f32x16 = _mm512_permutex2var_ps(lo_f32x16, odd_idx, hi_f32x16);
}

/* Project.  Ranks are taken KGROUP_ at a time; for each, the columns are
 * walked in chunks of CHUNK_, and within a chunk every tile of nr ranks x nb
 * positions reads the same nb x-chunks, which stay in L1 (4 x 2 KiB) while A
 * streams from L2 once per block instead of x once per rank tile.  (Measured
 * on Sapphire Rapids, 512 x 4096 rank 16, one thread: 1295 us against
 * 1565 us without chunks; 8-position blocks and packing x into a panel were
 * both slower.)  A tile's lane accumulators live in `state` between chunks:
 * chunk edges are multiples of 16, so each lane still sums its j = l (mod 16)
 * terms in ascending j, as the header says. */
#define CHUNK_ 512
#define KGROUP_ 32

/* nr ranks x nb positions (nr * nb <= 16) over columns [j0, j1) (whole
 * vectors); accumulators in state[r*nb + b] */
INLINE_ void project_chunk_avx512_(lora_run a, int64_t lda, int64_t k, int64_t j0, int64_t j1,
                           const int nr, const int nb, const void *const *xs, __m512 *state,
                           const int f, const int xt) {
    __m512 acc_f32x16[16];
    for (int i = 0; i < nr * nb; i++) acc_f32x16[i] = state[i];
    if (f == LORA_DTYPE_BF16) {
        /* 32 columns per A load: lane l adds column j + 2l, then j + 2l + 1 */
        for (int64_t j = j0; j < j1; j += 32) {
            __m512 x_even_f32x16[4], x_odd_f32x16[4];
            for (int b = 0; b < nb; b++)
                load_x_pairs_(xs[b], j, 0, 1, xt, &x_even_f32x16[b], &x_odd_f32x16[b]);
            for (int r = 0; r < nr; r++) {
                const __m512i a_bf16x32 = run_bf16x32_(a, (k + r) * lda + j);
                const __m512 a_even_f32x16 = bf16_even_f32x16_(a_bf16x32);
                const __m512 a_odd_f32x16 = bf16_odd_f32x16_(a_bf16x32);
                for (int b = 0; b < nb; b++) {
                    __m512 acc = acc_f32x16[r * nb + b];
                    acc = _mm512_fmadd_ps(a_even_f32x16, x_even_f32x16[b], acc);
                    acc_f32x16[r * nb + b] = _mm512_fmadd_ps(a_odd_f32x16, x_odd_f32x16[b], acc);
                }
            }
        }
        for (int i = 0; i < nr * nb; i++) state[i] = acc_f32x16[i];
        return;
    }
    if (q8_(f)) {
        /* the tile's rows' D and C over the chunk, widened once (j0 is a multiple of 32: chunks
         * start at multiples of CHUNK_ within column blocks of LORA_JBLOCK); a block's two
         * vectors in one step, so each row broadcasts its D and C once a block.  Lane l still
         * adds column j + l before j + 16 + l: each chain's order is the float32 path's. */
        float big[8][CHUNK_ / 32 + 16] __attribute__((aligned(64)));
        float off[8][CHUNK_ / 32 + 16] __attribute__((aligned(64)));
        for (int r = 0; r < nr; r++) q8_0_scales_(a, ((k + r) * lda + j0) / 32, (j1 - j0 + 31) / 32, big[r], off[r], f);
        int64_t j = j0;
        for (; j + 32 <= j1; j += 32) {
            __m512 x_lo_f32x16[4], x_hi_f32x16[4];
            for (int b = 0; b < nb; b++) {
                x_lo_f32x16[b] = load_f32x16_(xs[b], j, xt);
                x_hi_f32x16[b] = load_f32x16_(xs[b], j + 16, xt);
            }
            for (int r = 0; r < nr; r++) {
                const uint8_t *q = (const uint8_t *)a.v + (k + r) * lda + j;
                const __m512 big_f32x16 = _mm512_set1_ps(big[r][(j - j0) >> 5]);
                const __m512 off_f32x16 = q8_0_off_(off[r], (j - j0) >> 5, f);
                const __m512 lo_f32x16 = q8_0_f32x16_(q, big_f32x16, off_f32x16, f);
                const __m512 hi_f32x16 = q8_0_f32x16_(q + 16, big_f32x16, off_f32x16, f);
                for (int b = 0; b < nb; b++) {
                    const __m512 lo_sum_f32x16 = _mm512_fmadd_ps(lo_f32x16, x_lo_f32x16[b], acc_f32x16[r * nb + b]);
                    acc_f32x16[r * nb + b] = _mm512_fmadd_ps(hi_f32x16, x_hi_f32x16[b], lo_sum_f32x16);
                }
            }
        }
        if (j < j1) { /* a chunk of whole vectors ends 16 into a block */
            __m512 x_f32x16[4];
            for (int b = 0; b < nb; b++) x_f32x16[b] = load_f32x16_(xs[b], j, xt);
            for (int r = 0; r < nr; r++) {
                const __m512 a_f32x16 = q8_0_f32x16_((const uint8_t *)a.v + (k + r) * lda + j,
                                                     _mm512_set1_ps(big[r][(j - j0) >> 5]),
                                                     q8_0_off_(off[r], (j - j0) >> 5, f), f);
                for (int b = 0; b < nb; b++)
                    acc_f32x16[r * nb + b] = _mm512_fmadd_ps(a_f32x16, x_f32x16[b], acc_f32x16[r * nb + b]);
            }
        }
        for (int i = 0; i < nr * nb; i++) state[i] = acc_f32x16[i];
        return;
    }
    for (int64_t j = j0; j < j1; j += 16) {
        __m512 x_f32x16[8];
        for (int b = 0; b < nb; b++) x_f32x16[b] = load_f32x16_(xs[b], j, xt);
        for (int r = 0; r < nr; r++) {
            const __m512 a_f32x16 = run_f32x16_(a, (k + r) * lda + j, f);
            for (int b = 0; b < nb; b++)
                acc_f32x16[r * nb + b] = _mm512_fmadd_ps(a_f32x16, x_f32x16[b], acc_f32x16[r * nb + b]);
        }
    }
    for (int i = 0; i < nr * nb; i++) state[i] = acc_f32x16[i];
}

/* ranks kg .. kg+kn over the whole-vector columns [j0, j1), in chunks of CHUNK_.  Called from
 * one place only: a second inlined copy (a separate loop for one-block rows) made GCC keep the
 * AVX2 file's tile chains in memory, 10 % more instructions on a 512-position prefill */
INLINE_ void project_span_avx512_(lora_run a, int64_t lda, int64_t kg, int kn, int64_t j0, int64_t j1,
                           const int nr, const int nb, const void *const *xs, __m512 *state,
                           const int f, const int xt) {
    for (int64_t c0 = j0; c0 < j1; c0 += CHUNK_) {
        const int64_t c1 = c0 + CHUNK_ < j1 ? c0 + CHUNK_ : j1;
        int k = 0;
        for (; k + nr <= kn; k += nr)
            project_chunk_avx512_(a, lda, kg + k, c0, c1, nr, nb, xs, state + k * nb, f, xt);
        for (; k < kn; k++) project_chunk_avx512_(a, lda, kg + k, c0, c1, 1, nb, xs, state + k * nb, f, xt);
    }
}

INLINE_ void project_nb_avx512_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                         const int nb, const void *const *xs, float *t, int64_t ldt,
                         const int f, const int xt) {
    /* nr * nb <= 16 accumulators (+ nb x vectors + 1 A vector <= 32 zmm) */
    const int nr = nb <= 2 ? 8 : 4;
    __m512 state[KGROUP_ * LORA_NB]; /* the current column block's chains */
    /* whole vectors: 16 columns, or 32 for bfloat16 A (see project_chunk_avx512_) */
    const int64_t body = cols & ~(int64_t)(f == LORA_DTYPE_BF16 ? 31 : 15);
    for (int64_t kg = k0; kg < k1; kg += KGROUP_) {
        const int kn = (int)(k1 - kg < KGROUP_ ? k1 - kg : KGROUP_);
        for (int i = 0; i < kn * nb; i++) state[i] = _mm512_setzero_ps();
        int blocks = 0; /* column blocks (LORA_JBLOCK) finished: their sums are in t */
        for (int64_t jb = 0; jb < body; jb += LORA_JBLOCK) { /* one call site: see above */
            const int64_t je = jb + LORA_JBLOCK < body ? jb + LORA_JBLOCK : body;
            project_span_avx512_(a, lda, kg, kn, jb, je, nr, nb, xs, state, f, xt);
            if (je < body) { /* a block ends and another follows: its sum joins t */
                for (int k = 0; k < kn; k++)
                    for (int b = 0; b < nb; b++) {
                        float *tk = &t[b * ldt + kg + k];
                        const float sum = hsum_f32x16_(state[k * nb + b]);
                        *tk = blocks ? *tk + sum : sum;
                        state[k * nb + b] = _mm512_setzero_ps();
                    }
                blocks++;
            }
        }
        if (f == LORA_DTYPE_BF16) {
            /* the last partial 32 columns, masked: lanes past cols add 0 * 0 */
            const __mmask32 mask = (__mmask32)((1ull << (cols - body)) - 1u);
            __m512 x_even_f32x16[4], x_odd_f32x16[4];
            for (int b = 0; b < 4; b++) x_even_f32x16[b] = x_odd_f32x16[b] = _mm512_setzero_ps();
            for (int b = 0; b < nb && body < cols; b++)
                load_x_pairs_(xs[b], body, mask, 0, xt, &x_even_f32x16[b], &x_odd_f32x16[b]);
            for (int k = 0; k < kn; k++) {
                __m512 a_even_f32x16 = _mm512_setzero_ps(), a_odd_f32x16 = a_even_f32x16;
                if (body < cols) {
                    const __m512i a_bf16x32 = run_masked_bf16x32_(a, (kg + k) * lda + body, mask);
                    a_even_f32x16 = bf16_even_f32x16_(a_bf16x32);
                    a_odd_f32x16 = bf16_odd_f32x16_(a_bf16x32);
                }
                for (int b = 0; b < nb; b++) {
                    __m512 acc_f32x16 = state[k * nb + b];
                    if (body < cols) {
                        acc_f32x16 = _mm512_fmadd_ps(a_even_f32x16, x_even_f32x16[b], acc_f32x16);
                        acc_f32x16 = _mm512_fmadd_ps(a_odd_f32x16, x_odd_f32x16[b], acc_f32x16);
                    }
                    const float sum = hsum_f32x16_(acc_f32x16);
                    t[b * ldt + kg + k] = blocks ? t[b * ldt + kg + k] + sum : sum;
                }
            }
            continue;
        }
        const __mmask16 mask = tail_mask_(cols - body);
        for (int k = 0; k < kn; k++) {
            const __m512 a_f32x16 = body < cols ? run_masked_f32x16_(a, (kg + k) * lda + body, mask, f)
                                                : _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m512 acc_f32x16 = state[k * nb + b];
                if (body < cols)
                    acc_f32x16 = _mm512_fmadd_ps(a_f32x16, load_masked_f32x16_(xs[b], body, mask, xt),
                                                 acc_f32x16);
                const float sum = hsum_f32x16_(acc_f32x16);
                t[b * ldt + kg + k] = blocks ? t[b * ldt + kg + k] + sum : sum;
            }
        }
    }
}

INLINE_ void project_f_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                        int nb, const void *const *xs, float *t, int64_t ldt, const int f,
                        const int xt) {
    switch (nb) {  /* constant nb lets the compiler keep every accumulator in a register */
    case 1: project_nb_avx512_(a, lda, cols, k0, k1, 1, xs, t, ldt, f, xt); break;
    case 2: project_nb_avx512_(a, lda, cols, k0, k1, 2, xs, t, ldt, f, xt); break;
    case 3: project_nb_avx512_(a, lda, cols, k0, k1, 3, xs, t, ldt, f, xt); break;
    default: project_nb_avx512_(a, lda, cols, k0, k1, 4, xs, t, ldt, f, xt); break;
    }
}

/* whether a term or projection of format f builds its Q8_0 values the cvt way right now */
INLINE_ int q8_0_cvt_now_(const int f) {
    return f == LORA_FMT_Q8_0 && lora_q8_0_widening() == LORA_Q8_0_WIDEN_CVT;
}

/* project_f_ with a Q8_0 A built the CPU table's way (q8_0_f32x16_) */
INLINE_ void project_(lora_run a, int64_t lda, int64_t cols, int64_t k0, int64_t k1,
                      int nb, const void *const *xs, float *t, int64_t ldt, const int f,
                      const int xt) {
    if (q8_0_cvt_now_(f))
        project_f_(a, lda, cols, k0, k1, nb, xs, t, ldt, Q8_0_CVT_, xt);
    else
        project_f_(a, lda, cols, k0, k1, nb, xs, t, ldt, f, xt);
}

/* outputs i .. i + 16*nv of nb positions (the last vector masked by `last`),
 * output i living at outs[b][i - obase]; nv * nb <= 8 block sums + 8 running
 * totals + nv + 1 operands <= 25 zmm, or, when the rank fits one block
 * (one_block: kdim <= LORA_KBLOCK, the common case), nv * nb <= 16 sums and
 * no totals: the same arithmetic, since the first block's sum is the total */
INLINE_ void term_tile_avx512_(lora_run m, int64_t ldm, int64_t kdim, int64_t i, const int nv,
                        __mmask16 last, const int nb, const float *u, int64_t ldu,
                        const float *scale, float *const *outs, int64_t obase, const int f,
                        const int one_block) {
    /* bfloat16 whole tiles (nv even, no mask) widen 32 outputs per load */
    const int pairs = f == LORA_DTYPE_BF16 && nv % 2 == 0;
    __m512 total_f32x16[16], block_f32x16[16];
    for (int q = 0; q < nv * nb; q++) total_f32x16[q] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
        const int64_t k1 = one_block ? kdim : k0 + LORA_KBLOCK < kdim ? k0 + LORA_KBLOCK : kdim;
        for (int q = 0; q < nv * nb; q++) block_f32x16[q] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            __m512 m_f32x16[8];
            if (pairs) {
                /* m_f32x16[2p] holds outputs i + 32p + 2l, m_f32x16[2p + 1] outputs
                 * i + 32p + 2l + 1: each output still meets its own M[k, i] * u[k]
                 * chain, only in another lane (put back in order at the store) */
                for (int p = 0; p < nv / 2; p++) {
                    const __m512i raw_bf16x32 =
                        run_bf16x32_(m, k * ldm + i + 32 * p);
                    m_f32x16[2 * p] = bf16_even_f32x16_(raw_bf16x32);
                    m_f32x16[2 * p + 1] = bf16_odd_f32x16_(raw_bf16x32);
                }
            } else { /* (a Q8_0 M never comes here: term_nb_ walks it) */
                for (int v = 0; v < nv; v++)
                    m_f32x16[v] = v == nv - 1 ? run_masked_f32x16_(m, k * ldm + i + 16 * v, last, f)
                                              : run_f32x16_(m, k * ldm + i + 16 * v, f);
            }
            for (int b = 0; b < nb; b++) {
                const __m512 u_f32x16 = _mm512_set1_ps(u[b * ldu + k]);
                for (int v = 0; v < nv; v++)
                    block_f32x16[v * nb + b] =
                        _mm512_fmadd_ps(m_f32x16[v], u_f32x16, block_f32x16[v * nb + b]);
            }
        }
        if (one_block) {
            for (int q = 0; q < nv * nb; q++) total_f32x16[q] = block_f32x16[q];
            break;
        }
        for (int q = 0; q < nv * nb; q++)
            total_f32x16[q] = k0 == 0 ? block_f32x16[q] : _mm512_add_ps(total_f32x16[q], block_f32x16[q]);
    }
    if (pairs) {
        /* even/odd lanes back to output order, once per tile rather than per k */
        for (int p = 0; p < nv / 2; p++)
            for (int b = 0; b < nb; b++) {
                const __m512 even_f32x16 = total_f32x16[2 * p * nb + b];
                const __m512 odd_f32x16 = total_f32x16[(2 * p + 1) * nb + b];
                total_f32x16[2 * p * nb + b] = interleave_lo_f32x16_(even_f32x16, odd_f32x16);
                total_f32x16[(2 * p + 1) * nb + b] = interleave_hi_f32x16_(even_f32x16, odd_f32x16);
            }
    }
    for (int b = 0; b < nb; b++) {
        if (scale[b] == 0.0f) continue;
        for (int v = 0; v < nv; v++) {
            float *o = outs[b] + (i - obase) + 16 * v;
            const __mmask16 mask = v == nv - 1 ? last : (__mmask16)0xffff;
            const __m512 sum = _mm512_fmadd_ps(total_f32x16[v * nb + b], _mm512_set1_ps(scale[b]),
                                               _mm512_maskz_loadu_ps(mask, o));
            _mm512_mask_storeu_ps(o, mask, sum);
        }
    }
}

/* A finished chain of 16 outputs from output i: into the strip of totals (set at k0 = 0,
 * added to after) when there is one, else out = fma(chain, s, out) under mask */
INLINE_ void term_put_avx512_(__m512 acc_f32x16, int64_t i, int64_t i_start, int64_t k0, float *total,
                              float *out, int64_t obase, __m512 s_f32x16, __mmask16 mask) {
    if (total) {
        float *t = total + (i - i_start);
        _mm512_store_ps(t, k0 == 0 ? acc_f32x16 : _mm512_add_ps(_mm512_load_ps(t), acc_f32x16));
        return;
    }
    float *o = out + (i - obase);
    _mm512_mask_storeu_ps(o, mask, _mm512_fmadd_ps(acc_f32x16, s_f32x16, _mm512_maskz_loadu_ps(mask, o)));
}

#define Q8_0_STRIP_BLOCKS_ (LORA_DECODE_STRIP / 32 + 17)
/* A Q8_0 decode asks for each row's line this many bytes ahead of the one it reads: on a Zen 4
 * a model sweep of q8_0 deltas from memory took 0.72x (0.68-0.92) of its time without it, paired
 * in one process (build_ab.py, 9 rounds); decodes from L2 unchanged (0.99-1.01).  Sixteen rows
 * of one-byte values move 64 outputs a line, and half the bytes of bfloat16 left the hardware
 * prefetchers too few misses a row to run ahead of the arithmetic. */
#define Q8_0_DECODE_AHEAD_ 512

/* term_block_avx512_'s outputs [i, i1), a vector of 16 at a time (the last one masked), each
 * with its whole chain over the block's kn ranks; a Q8_0 M's D and C are big/off[k][(i - ib) / 32] */
INLINE_ void term_vecs_avx512_(lora_run m, int64_t ldm, int64_t k0, const int kn, int64_t i, int64_t i1,
                               const __m512 *u_f32x16, __m512 s_f32x16, float *out, int64_t obase,
                               float *total, int64_t i_start, const int f, int64_t ib,
                               const float (*big)[Q8_0_STRIP_BLOCKS_], const float (*off)[Q8_0_STRIP_BLOCKS_]) {
    for (; i < i1; i += 16) {
        const int full = i + 16 <= i1;
        const __mmask16 mask = full ? (__mmask16)0xffff : tail_mask_(i1 - i);
        __m512 acc_f32x16 = _mm512_setzero_ps();
        for (int k = 0; k < kn; k++) {
            const int64_t e = (k0 + k) * ldm + i;
            const __m512 m_f32x16 =
                !full ? run_masked_f32x16_(m, e, mask, f)
                : q8_(f) ? q8_0_f32x16_((const uint8_t *)m.v + e, _mm512_set1_ps(big[k][(i - ib) >> 5]),
                                        q8_0_off_(off[k], (i - ib) >> 5, f), f)
                : run_f32x16_(m, e, f);
            acc_f32x16 = _mm512_fmadd_ps(m_f32x16, u_f32x16[k], acc_f32x16);
        }
        term_put_avx512_(acc_f32x16, i, i_start, k0, total, out, obase, s_f32x16, mask);
    }
}

/* term_block_avx512_'s Q8_0 outputs [i, i + 32 nblk): nblk whole blocks from output i (a
 * multiple of 32), 2 nblk independent chains over the block's kn ranks (each output's chain
 * unchanged), each pair sharing its block's constants big/off[k][(i - ib) / 32 + h].  Four
 * chains a step (nblk 2) where two left a Zen 4's FMA latency exposed (the cvt build's hot B
 * loop took 1.05 ns a vector on two chains, 0.80 on four: benchmarks/q8_0_widen.c); one line
 * of each row a step, and that row's line Q8_0_DECODE_AHEAD_ bytes on asked for. */
INLINE_ void term_q8_0_blocks_avx512_(lora_run m, int64_t ldm, int64_t k0, const int kn, int64_t i, int64_t ib,
                                      const __m512 *u_f32x16, __m512 s_f32x16, float *out, int64_t obase,
                                      float *total, int64_t i_start, const int f,
                                      const float (*big)[Q8_0_STRIP_BLOCKS_],
                                      const float (*off)[Q8_0_STRIP_BLOCKS_], const int nblk) {
    __m512 acc_f32x16[4];
    for (int v = 0; v < 2 * nblk; v++) acc_f32x16[v] = _mm512_setzero_ps();
    const int64_t blk = (i - ib) >> 5;
    for (int k = 0; k < kn; k++) {
        const uint8_t *q = (const uint8_t *)m.v + (k0 + k) * ldm + i;
        if (i + Q8_0_DECODE_AHEAD_ < ldm) _mm_prefetch((const char *)q + Q8_0_DECODE_AHEAD_, _MM_HINT_T0);
        for (int h = 0; h < nblk; h++) {
            const __m512 big_f32x16 = _mm512_set1_ps(big[k][blk + h]);
            const __m512 off_f32x16 = q8_0_off_(off[k], blk + h, f);
            acc_f32x16[2 * h] = _mm512_fmadd_ps(q8_0_f32x16_(q + 32 * h, big_f32x16, off_f32x16, f),
                                                u_f32x16[k], acc_f32x16[2 * h]);
            acc_f32x16[2 * h + 1] = _mm512_fmadd_ps(q8_0_f32x16_(q + 32 * h + 16, big_f32x16, off_f32x16, f),
                                                    u_f32x16[k], acc_f32x16[2 * h + 1]);
        }
    }
    for (int v = 0; v < 2 * nblk; v++)
        term_put_avx512_(acc_f32x16[v], i + 16 * v, i_start, k0, total, out, obase, s_f32x16, (__mmask16)0xffff);
}

/* A decode's outputs [i, i1) (output i at out[i - obase]) from one rank
 * block of kn ranks of M starting at row k0 (u_f32x16: the block's u
 * broadcast): each vector of 16 outputs (32 for a bfloat16 M, its even and
 * odd lanes as in term_tile_avx512_; 32 for a Q8_0 M, two vectors' chains side
 * by side) takes its whole chain before the next.  With
 * `total` NULL the block is the whole rank and out = fma(chain, s, out);
 * otherwise the chain goes to total[] (out's strip: set at k0 = 0, added to
 * after).  kn is a constant where it can be (term_block_any_avx512_), so each M
 * load is its own instruction stepping one line a vector, which the
 * hardware prefetchers follow. */
INLINE_ void term_block_avx512_(lora_run m, int64_t ldm, int64_t k0, const int kn, int64_t i,
                           int64_t i1, const __m512 *u_f32x16, __m512 s_f32x16, float *out,
                           int64_t obase, float *total, const int f) {
    const int64_t i_start = i;
    /* Q8_0: the block's rows' scales over [i, i1), widened once (rows are 32-value blocks
     * from output i & ~31; i is a multiple of 16 and i1 - i at most a decode strip) */
    float big[LORA_KBLOCK][Q8_0_STRIP_BLOCKS_] __attribute__((aligned(64)));
    float off[LORA_KBLOCK][Q8_0_STRIP_BLOCKS_] __attribute__((aligned(64)));
    const int64_t ib = i & ~(int64_t)31;
    const float (*big_c)[Q8_0_STRIP_BLOCKS_] = (const float (*)[Q8_0_STRIP_BLOCKS_])big;
    const float (*off_c)[Q8_0_STRIP_BLOCKS_] = (const float (*)[Q8_0_STRIP_BLOCKS_])off;
    if (q8_(f))
        for (int k = 0; k < kn; k++)
            q8_0_scales_(m, ((k0 + k) * ldm + ib) / 32, (i1 - ib + 31) / 32, big[k], off[k], f);
    if (f == LORA_DTYPE_BF16) {
        for (; i + 32 <= i1; i += 32) {
            __m512 even_f32x16 = _mm512_setzero_ps(), odd_f32x16 = _mm512_setzero_ps();
            for (int k = 0; k < kn; k++) {
                const __m512i raw_bf16x32 = run_bf16x32_(m, (k0 + k) * ldm + i);
                even_f32x16 = _mm512_fmadd_ps(bf16_even_f32x16_(raw_bf16x32), u_f32x16[k], even_f32x16);
                odd_f32x16 = _mm512_fmadd_ps(bf16_odd_f32x16_(raw_bf16x32), u_f32x16[k], odd_f32x16);
            }
            const __m512 lo_f32x16 = interleave_lo_f32x16_(even_f32x16, odd_f32x16);
            const __m512 hi_f32x16 = interleave_hi_f32x16_(even_f32x16, odd_f32x16);
            if (total) {
                float *t = total + (i - i_start);
                _mm512_store_ps(t, k0 == 0 ? lo_f32x16 : _mm512_add_ps(_mm512_load_ps(t), lo_f32x16));
                _mm512_store_ps(t + 16, k0 == 0 ? hi_f32x16 : _mm512_add_ps(_mm512_load_ps(t + 16), hi_f32x16));
                continue;
            }
            float *o = out + (i - obase);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(lo_f32x16, s_f32x16, _mm512_loadu_ps(o)));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(hi_f32x16, s_f32x16, _mm512_loadu_ps(o + 16)));
        }
    }
    if (q8_(f)) {
        /* two whole blocks (64 outputs) a step, then one block of 32 (term_q8_0_blocks_avx512_).
         * A first vector 16 into a block goes alone. */
        const int64_t first = (i & 31) && i + 16 <= i1 ? i + 16 : i;
        term_vecs_avx512_(m, ldm, k0, kn, i, first, u_f32x16, s_f32x16, out, obase, total, i_start, f, ib,
                          big_c, off_c);
        for (i = first; i + 64 <= i1; i += 64)
            term_q8_0_blocks_avx512_(m, ldm, k0, kn, i, ib, u_f32x16, s_f32x16, out, obase, total, i_start, f,
                                     big_c, off_c, 2);
        if (i + 32 <= i1) {
            term_q8_0_blocks_avx512_(m, ldm, k0, kn, i, ib, u_f32x16, s_f32x16, out, obase, total, i_start, f,
                                     big_c, off_c, 1);
            i += 32;
        }
    }
    term_vecs_avx512_(m, ldm, k0, kn, i, i1, u_f32x16, s_f32x16, out, obase, total, i_start, f, ib,
                      big_c, off_c);
}

/* term_block_avx512_ with kn a constant for the common ranks */
#define TERM_KN_CASE_(KN) \
    case KN: term_block_avx512_(m, ldm, k0, KN, i0, i1, u_f32x16, s_f32x16, out, obase, total, f); break;
INLINE_ void term_block_any_avx512_(lora_run m, int64_t ldm, int64_t k0, int kn, int64_t i0,
                               int64_t i1, const __m512 *u_f32x16, __m512 s_f32x16, float *out,
                               int64_t obase, float *total, const int f) {
    switch (kn) {
    TERM_KN_CASE_(16) TERM_KN_CASE_(8) TERM_KN_CASE_(4)
    default: term_block_avx512_(m, ldm, k0, kn, i0, i1, u_f32x16, s_f32x16, out, obase, total, f); break;
    }
}
#undef TERM_KN_CASE_

/* One term of a decode (one position) over outputs [i0, i1), output i at
 * outs[0][i - obase].  term_tile_avx512_'s 128-output tiles ask for 512 bytes of one
 * M row after another; here every vector of outputs walks all the rows of a
 * rank block, one line of each, in order.  On a decode whose factors come
 * from memory, as in a model's decode step, that reads faster (a cold Zen 4
 * decode: 0.78-0.90x the tiles' time), and as fast where M sits in L2
 * (docs/performance.md, "The decode accumulate").  The arithmetic is
 * term_tile_avx512_'s: blk_m chains from 0 over k ascending, total = (blk_0 + blk_1)
 * + ..., out = fma(total, s, out); past one rank block the running totals
 * wait in a strip in L1. */
#define DECODE_STRIP_ 1024
/* out[j] = fma(total[j], s, out[j]) for j < n: a strip of finished totals (64-byte aligned)
 * into its outputs, the last vector masked */
INLINE_ void totals_put_avx512_(const float *total, int64_t n, __m512 s_f32x16, float *out) {
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mask = j + 16 <= n ? (__mmask16)0xffff : tail_mask_(n - j);
        _mm512_mask_storeu_ps(out + j, mask, _mm512_fmadd_ps(_mm512_load_ps(total + j), s_f32x16,
                                                             _mm512_maskz_loadu_ps(mask, out + j)));
    }
}
INLINE_ void term_decode_avx512_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                          const float *u, float s, float *out, int64_t obase, const int f) {
    if (s == 0.0f) return; /* as term_tile_avx512_: a zero scale writes nothing */
    const __m512 s_f32x16 = _mm512_set1_ps(s);
    __m512 u_f32x16[LORA_KBLOCK];
    if (kdim <= LORA_KBLOCK) {
        for (int64_t k = 0; k < kdim; k++) u_f32x16[k] = _mm512_set1_ps(u[k]);
        term_block_any_avx512_(m, ldm, 0, (int)kdim, i0, i1, u_f32x16, s_f32x16, out, obase, NULL, f);
        return;
    }
    float total[DECODE_STRIP_] __attribute__((aligned(64)));
    for (int64_t i = i0; i < i1; i += DECODE_STRIP_) {
        const int64_t n = i1 - i < DECODE_STRIP_ ? i1 - i : DECODE_STRIP_;
        for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
            const int kn = (int)(kdim - k0 < LORA_KBLOCK ? kdim - k0 : LORA_KBLOCK);
            for (int k = 0; k < kn; k++) u_f32x16[k] = _mm512_set1_ps(u[k0 + k]);
            term_block_any_avx512_(m, ldm, k0, kn, i, i + n, u_f32x16, s_f32x16, out, obase, total, f);
        }
        totals_put_avx512_(total, n, s_f32x16, out + (i - obase));
    }
}

/* The decode walk for nb positions (2 .. LORA_NB) of a Q8_0 M, outputs [i, i1) of one rank
 * block of kn ranks from row k0: each 32 outputs build their values once a rank and feed one
 * pair of chains per position (u[b * ldu + k] broadcast), which are term_tile_avx512_'s chains
 * (from 0 over the block's ranks in order); the rows' scales are widened once for the range.
 * total NULL: the block is the whole rank, and out_b = fma(chain, s_b, out_b) where s_b is not
 * 0; otherwise position b's chains go to its strip total[b] (set at k0 = 0, added to after). */
#define WALK_STRIP_ (DECODE_STRIP_ / LORA_NB)
INLINE_ void term_walk_block_avx512_(lora_run m, int64_t ldm, int64_t k0, const int kn, int64_t i, int64_t i1,
                                     const int nb, const float *u, int64_t ldu, const float *scale,
                                     float *const *outs, int64_t obase, float (*total)[WALK_STRIP_], const int f) {
    const int64_t i_start = i, ib = i & ~(int64_t)31;
    /* i1 - i <= WALK_STRIP_: at most WALK_STRIP_ / 32 + 1 blocks, written 16 at a time */
    float big[LORA_KBLOCK][WALK_STRIP_ / 32 + 16] __attribute__((aligned(64)));
    float off[LORA_KBLOCK][WALK_STRIP_ / 32 + 16] __attribute__((aligned(64)));
    for (int k = 0; k < kn; k++) q8_0_scales_(m, ((k0 + k) * ldm + ib) / 32, (i1 - ib + 31) / 32, big[k], off[k], f);
    /* the rows' next range (the next strip's call reads it): strips of a batch ask for a few
     * lines of each row, too few for the hardware prefetchers to follow from memory */
    for (int k = 0; k < kn; k++)
        for (int64_t e = i1; e < i1 + (i1 - i_start) && e < ldm; e += 64)
            _mm_prefetch((const char *)m.v + (k0 + k) * ldm + e, _MM_HINT_T0);
    __m512 s_f32x16[LORA_NB];
    for (int b = 0; b < nb; b++) s_f32x16[b] = _mm512_set1_ps(scale[b]);
    while (i < i1) {
        /* whole blocks of 32 outputs two vectors a step; a vector 16 into a block, or the last
         * (masked) one, alone */
        const int pair = !(i & 31) && i + 32 <= i1;
        const int full = i + 16 <= i1;
        const __mmask16 mask = full ? (__mmask16)0xffff : tail_mask_(i1 - i);
        const int64_t blk = (i - ib) >> 5;
        __m512 lo_f32x16[LORA_NB], hi_f32x16[LORA_NB];
        for (int b = 0; b < nb; b++) lo_f32x16[b] = hi_f32x16[b] = _mm512_setzero_ps();
        for (int k = 0; k < kn; k++) {
            const uint8_t *q = (const uint8_t *)m.v + (k0 + k) * ldm + i;
            const __m512 big_f32x16 = _mm512_set1_ps(big[k][blk]), off_f32x16 = q8_0_off_(off[k], blk, f);
            const __m512 lo_m_f32x16 = full ? q8_0_f32x16_(q, big_f32x16, off_f32x16, f)
                                            : q8_0_masked_f32x16_(q, big_f32x16, off_f32x16, mask, f);
            if (pair) {
                const __m512 hi_m_f32x16 = q8_0_f32x16_(q + 16, big_f32x16, off_f32x16, f);
                for (int b = 0; b < nb; b++) {
                    const __m512 u_f32x16 = _mm512_set1_ps(u[b * ldu + k0 + k]);
                    lo_f32x16[b] = _mm512_fmadd_ps(lo_m_f32x16, u_f32x16, lo_f32x16[b]);
                    hi_f32x16[b] = _mm512_fmadd_ps(hi_m_f32x16, u_f32x16, hi_f32x16[b]);
                }
            } else {
                for (int b = 0; b < nb; b++)
                    lo_f32x16[b] = _mm512_fmadd_ps(lo_m_f32x16, _mm512_set1_ps(u[b * ldu + k0 + k]), lo_f32x16[b]);
            }
        }
        for (int b = 0; b < nb; b++) {
            if (!total && scale[b] == 0.0f) continue; /* as term_tile_avx512_: nothing written */
            float *tb = total ? total[b] : NULL;
            term_put_avx512_(lo_f32x16[b], i, i_start, k0, tb, outs[b], obase, s_f32x16[b], mask);
            if (pair)
                term_put_avx512_(hi_f32x16[b], i + 16, i_start, k0, tb, outs[b], obase, s_f32x16[b], mask);
        }
        i += pair ? 32 : 16;
    }
}

/* term_walk_block_avx512_ with kn a constant for the common ranks */
#define WALK_KN_CASE_(KN) \
    case KN: term_walk_block_avx512_(m, ldm, k0, KN, i0, i1, nb, u, ldu, scale, outs, obase, total, f); break;
INLINE_ void term_walk_block_any_avx512_(lora_run m, int64_t ldm, int64_t k0, int kn, int64_t i0, int64_t i1,
                                         const int nb, const float *u, int64_t ldu, const float *scale,
                                         float *const *outs, int64_t obase, float (*total)[WALK_STRIP_],
                                         const int f) {
    switch (kn) {
    WALK_KN_CASE_(16) WALK_KN_CASE_(8)
    default: term_walk_block_avx512_(m, ldm, k0, kn, i0, i1, nb, u, ldu, scale, outs, obase, total, f); break;
    }
}
#undef WALK_KN_CASE_

/* One Q8_0 term of nb positions (2 .. LORA_NB) over outputs [i0, i1) by the walk: term_tile_avx512_'s
 * tiles widen a row's scales for every tile and ask for one row's 64 or 128 bytes after
 * another, which the hardware prefetchers follow poorly from memory; the walk reads every row
 * of a rank block in step.  The arithmetic is the tiles': past one rank block, total =
 * (blk_0 + blk_1) + ..., out = fma(total, s, out), the totals waiting in strips in L1. */
INLINE_ void term_walk_nb_avx512_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1, const int nb,
                                  const float *u, int64_t ldu, const float *scale, float *const *outs,
                                  int64_t obase, const int f) {
    float total[LORA_NB][WALK_STRIP_] __attribute__((aligned(64)));
    for (int64_t i = i0; i < i1; i += WALK_STRIP_) {
        const int64_t n = i1 - i < WALK_STRIP_ ? i1 - i : WALK_STRIP_;
        if (kdim <= LORA_KBLOCK) {
            term_walk_block_any_avx512_(m, ldm, 0, (int)kdim, i, i + n, nb, u, ldu, scale, outs, obase, NULL, f);
            continue;
        }
        for (int64_t k0 = 0; k0 < kdim; k0 += LORA_KBLOCK) {
            const int kn = (int)(kdim - k0 < LORA_KBLOCK ? kdim - k0 : LORA_KBLOCK);
            term_walk_block_any_avx512_(m, ldm, k0, kn, i, i + n, nb, u, ldu, scale, outs, obase, total, f);
        }
        for (int b = 0; b < nb; b++)
            if (scale[b] != 0.0f) totals_put_avx512_(total[b], n, _mm512_set1_ps(scale[b]), outs[b] + (i - obase));
    }
}

INLINE_ void term_nb_f_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                        const int nb, const float *u, int64_t ldu, const float *scale,
                        float *const *outs, int64_t obase, const int f) {
    /* a decode walks M in order (term_decode_avx512_); past one rank block a half M keeps the
     * tiles, whose even/odd and per-16 widenings the walk's strip of totals slowed by
     * 19 % where M sits in L2 (bfloat16 rank 64), and a Q8_0 M walks (its tiles' per-row
     * scales took 1.6x the walk's time where M sits in L2, rank 32) */
    if (nb == 1 && (kdim <= LORA_KBLOCK || f == LORA_DTYPE_F32 || q8_(f))) {
        term_decode_avx512_(m, ldm, kdim, i0, i1, u, scale[0], outs[0], obase, f);
        return;
    }
    if (q8_(f)) {
        term_walk_nb_avx512_(m, ldm, kdim, i0, i1, nb, u, ldu, scale, outs, obase, f);
        return;
    }
    int64_t i = i0;
    if (kdim <= LORA_KBLOCK) {
        const int nv = nb <= 2 ? 8 : 4;
        for (; i + 16 * nv <= i1; i += 16 * nv)
            term_tile_avx512_(m, ldm, kdim, i, nv, (__mmask16)0xffff, nb, u, ldu, scale, outs, obase, f, 1);
    } else {
        const int nv = nb == 1 ? 8 : nb == 2 ? 4 : 2;
        for (; i + 16 * nv <= i1; i += 16 * nv)
            term_tile_avx512_(m, ldm, kdim, i, nv, (__mmask16)0xffff, nb, u, ldu, scale, outs, obase, f, 0);
    }
    for (; i + 16 <= i1; i += 16)
        term_tile_avx512_(m, ldm, kdim, i, 1, (__mmask16)0xffff, nb, u, ldu, scale, outs, obase, f, 0);
    if (i < i1)
        term_tile_avx512_(m, ldm, kdim, i, 1, tail_mask_(i1 - i), nb, u, ldu, scale, outs, obase, f, 0);
}

/* term_nb_f_ with a Q8_0 M built the CPU table's way (q8_0_f32x16_) */
INLINE_ void term_nb_(lora_run m, int64_t ldm, int64_t kdim, int64_t i0, int64_t i1,
                      const int nb, const float *u, int64_t ldu, const float *scale,
                      float *const *outs, int64_t obase, const int f) {
    if (q8_0_cvt_now_(f))
        term_nb_f_(m, ldm, kdim, i0, i1, nb, u, ldu, scale, outs, obase, Q8_0_CVT_);
    else
        term_nb_f_(m, ldm, kdim, i0, i1, nb, u, ldu, scale, outs, obase, f);
}

#include "kernels_quads.h"

/* [hsum(v0), ..., hsum(v15)] by a fixed tree: within each 128-bit block j of v_l,
 * blk_j = (e0+e2) + (e1+e3) (unpack, then shuffle_ps); then ((blk0+blk2) + (blk1+blk3))
 * (shuffle_f32x4 twice) */
INLINE_ __m512 hsum16x16_(const __m512 *v) {
    __m512 s[8], g[4];
    for (int p = 0; p < 8; p++)
        s[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]),
                             _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    for (int q = 0; q < 4; q++)
        g[q] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * q], s[2 * q + 1], 0x44),
                             _mm512_shuffle_ps(s[2 * q], s[2 * q + 1], 0xEE));
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(g[0], g[1], 0x44),
                                     _mm512_shuffle_f32x4(g[0], g[1], 0xEE));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(g[2], g[3], 0x44),
                                     _mm512_shuffle_f32x4(g[2], g[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

/* A term held by output (by_row): out[i] += s * dot(M^T[i, :], u) for i in [i0, i1), 16
 * rows at a time: row l's lanes are an fma chain over k = l (mod 16) ascending (the last
 * chunk masked), reduced by hsum16x16_; a row's bits do not depend on its tile. */
INLINE_ void term_rows_(const lora_term *tm, int64_t i0, int64_t i1, int nb, float *const *outs,
                        int64_t obase, const int f) {
    const int64_t kdim = tm->kdim, ldm = tm->ldm, body = kdim & ~(int64_t)15;
    const __mmask16 kmask = tail_mask_(kdim - body);
    for (int b = 0; b < nb; b++) {
        const float s = tm->scale[b];
        if (s == 0.0f) continue;
        const float *u = tm->u + b * tm->ldu;
        for (int64_t i = i0; i < i1; i += 16) {
            const int nrows = (int)(i1 - i < 16 ? i1 - i : 16);
            __m512 acc_f32x16[16];
            for (int l = 0; l < 16; l++) {
                __m512 a = _mm512_setzero_ps();
                if (l < nrows) {
                    const int64_t row = (i + l) * ldm;
                    for (int64_t k = 0; k < body; k += 16)
                        a = _mm512_fmadd_ps(run_f32x16_(tm->m, row + k, f), _mm512_loadu_ps(u + k), a);
                    if (body < kdim)
                        a = _mm512_fmadd_ps(run_masked_f32x16_(tm->m, row + body, kmask, f),
                                            _mm512_maskz_loadu_ps(kmask, u + body), a);
                }
                acc_f32x16[l] = a;
            }
            const __mmask16 rmask = tail_mask_(nrows);
            float *o = outs[b] + (i - obase);
            _mm512_mask_storeu_ps(o, rmask, _mm512_fmadd_ps(hsum16x16_(acc_f32x16), _mm512_set1_ps(s),
                                                            _mm512_maskz_loadu_ps(rmask, o)));
        }
    }
}

INLINE_ void widen_(const void *src, int64_t n, float *dst, const int dt) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_f32x16_(src, i, dt));
    if (i < n)
        _mm512_mask_storeu_ps(dst + i, tail_mask_(n - i),
                              load_masked_f32x16_(src, i, tail_mask_(n - i), dt));
}

/* 16 float32 -> float16 / bfloat16, round to nearest even (NaN stays NaN) */
INLINE_ __m256i narrow_f32x16_(__m512 v, const int ot) {
    if (ot == LORA_DTYPE_F16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

INLINE_ void narrow_(const float *src, int64_t n, void *dst, const int ot) {
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i), narrow_f32x16_(_mm512_loadu_ps(src + i), ot));
    if (i < n) {
        const __mmask16 mask = tail_mask_(n - i);
        _mm256_mask_storeu_epi16(d + i, mask, narrow_f32x16_(_mm512_maskz_loadu_ps(mask, src + i), ot));
    }
}

/* values e .. e + n of a factor as float32 (the table's load entry); a block format
 * by whole vectors from a multiple of 16, one value at a time before it */
INLINE_ void load_run_(lora_run r, int64_t e, int64_t n, float *dst, const int f) {
    if (lora_format_block(f) == 1) {
        widen_((const char *)r.v + e * (int64_t)lora_format_value_size(f), n, dst, f);
        return;
    }
    int64_t k = 0;
    for (; k < n && (e + k) % 16; k++) dst[k] = lora_run_load(r, e + k, f);
    for (; k + 16 <= n; k += 16) _mm512_storeu_ps(dst + k, run_f32x16_(r, e + k, f));
    if (k < n) _mm512_mask_storeu_ps(dst + k, tail_mask_(n - k), run_masked_f32x16_(r, e + k, tail_mask_(n - k), f));
}

/* a batch holding a Q8_0 term goes in strips of term_walk_nb_avx512_'s length */
#define Q8_0_BATCH_STRIP_ WALK_STRIP_
#include "kernels_strip.h"
#include "kernels_merge.h"

#define READ_F32V_ __m512
#define READ_LANES_ 16
#define read_zero_() _mm512_setzero_ps()
#define read_load_(p) _mm512_loadu_ps(p)
#define read_add_(a, b) _mm512_add_ps(a, b)
#define read_hsum_(v) hsum_f32x16_(v)
#define read_set1_(f) _mm512_set1_ps(f)
#define read_fma_(a, b, c) _mm512_fmadd_ps(a, b, c)
#include "kernels_read.h"

/* bfloat16 A is summed in even/odd column pairs (see the header), not in
 * float32's order: a float32 copy of a bf16 delta would change its bits */
LORA_KERNEL_TABLE(avx512, 1u << LORA_DTYPE_BF16)

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif /* LORA_HAVE_X86 */
